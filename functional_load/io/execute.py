"""Run a plan: allocate the rank's parameters once, fill them in place from the checkpoint.

This is the only stage that reads tensor data, always through :func:`.reader.reader_for`. Scales
are read and checked first (a bad one stops the load before the weights are read); every other
copy runs in file-offset order, cut into pieces of at most 16 MiB, on a few threads. Weights
that a transform consumes as they are read (online quantization) are handed to ``consume`` one
at a time, so a load holds one dense weight at a time.
"""

from __future__ import annotations

import importlib
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from ..checkpoint import TensorInfo
from ..layout.segments import Box, box_volume, full_box
from ..plan.plan import Copy, ParamPlan, Plan
from ..storage import as_path, is_local
from .copies import copy_into, direct_bytes
from .files import EagerReader
from .fill import allocate, check_scale, is_scale, load_param, prepare, verify_shared
from .options import ReadOptions, should_prefetch
from .prefetch import Prefetcher
from .reader import Reader, reader_for, verify_unchanged
from .runs import Job, Run, join_runs

if TYPE_CHECKING:
    import torch
    from tqdm.auto import tqdm

CHUNK_BYTES = 16 << 20  # copies larger than this are split, so several threads share a big tensor
LONG_LOAD_BYTES = 2 << 30  # progress=None shows a bar only for loads that read at least this much

# (param plan, its dense rank-local weight) -> the tensors it becomes (online quantization)
Consume: TypeAlias = "Callable[[ParamPlan, torch.Tensor], dict[str, torch.Tensor]]"


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What a load did: seconds per stage, bytes read (and prefetched), bytes produced, and the
    ranged reads sent to a storage other than the local file system (``requests``: e.g. the GETs
    of an ``s3://`` load, before retries; ``over_read``: the bytes they fetched that no tensor
    needed, the gaps the cost model read through; ``bytes_read`` counts them)."""

    read_seconds: float
    transform_seconds: float
    bytes_read: int
    bytes_out: int
    prefetched: int = 0
    plan_seconds: float = 0.0
    requests: int = 0
    over_read: int = 0

    def summary(self) -> str:
        def rate(n: int, s: float) -> str:
            return f"{n / s / 1e9:.2f} GB/s" if s > 0 else "-"

        return (
            f"plan {self.plan_seconds:.3f} s; read {self.bytes_read / 1e6:,.1f} MB in {self.read_seconds:.3f} s "
            f"({rate(self.bytes_read, self.read_seconds)}); transform {self.transform_seconds:.3f} s; "
            f"output {self.bytes_out / 1e6:,.1f} MB" + (f"; prefetched {self.prefetched / 1e6:,.1f} MB" if self.prefetched else "")
            + (f"; {self.requests:,} ranged requests, {self.over_read / 1e6:,.1f} MB over-read" if self.requests else "")
        )


def show_progress(progress: bool | None, bytes_to_read: int) -> bool:
    """Library calls are quiet: a bar only when asked, or for a long load; ``TQDM_DISABLE`` wins."""
    if os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes"):
        return False
    return progress if progress is not None else bytes_to_read >= LONG_LOAD_BYTES


def _consumer(consume: Consume | None) -> Consume:
    if consume is None:
        raise ValueError("parameters marked consumed need a consume function")
    return consume


def execute(
    plan: Plan,
    options: ReadOptions | None = None,
    *,
    reader: Reader | None = None,
    progress: bool | None = None,
    consume: Consume | None = None,
    consumed: Callable[[ParamPlan], bool] = lambda param: False,
    into: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], LoadStats]:
    """Materialise ``plan`` as rank-local CPU torch tensors, in the plan's parameter order.

    Parameters for which ``consumed(param)`` is true are read one at a time as dense tensors of
    the plan's dtype and handed to ``consume``, whose outputs take their place (their derived
    companions, e.g. the scales of online quantization, come from it too). Tied aliases are the
    very same tensor object as their canonical parameter. ``into`` gives existing CPU tensors
    (contiguous, of the parameter's rank-local shape and dtype: the caller checks) that
    parameters are read into instead of fresh memory, e.g. a live vLLM model's parameters.
    """
    options = options or ReadOptions()
    own_reader = reader is None
    reader = reader or reader_for(plan, options)
    reads = plan.bytes_to_read > 0  # a dummy plan reads nothing (no bar, no look at the filesystem)
    bar = _progress_bar(plan, progress) if reads else None
    later = [p for p in plan.params if consume is not None and consumed(p)]
    skip = {p.spec.name for p in later}
    fixed = [p for p in plan.params if not p.spec.derived and p.spec.name not in skip]
    local = is_local(as_path(plan.model_dir))
    prefetcher = Prefetcher(plan, options) if reads and local and should_prefetch(options, plan.model_dir, plan.bytes_to_read) else None
    importlib.import_module("torch")  # before the clock: a first load's seconds of importing torch are not read time
    start = time.perf_counter()
    try:
        out = _allocate(fixed, into or {}, options.threads)
        _read_scales(plan, fixed, out, reader)
        # object storage: enough copies side by side to keep ``requests_in_flight`` requests busy
        threads = options.threads if local else max(options.threads, options.requests_in_flight)
        _run(plan, _units(plan, fixed, out, reader), out, reader, threads, bar)
        for param in fixed:
            verify_shared(plan, param, out[param.spec.name], reader)
        read_seconds = time.perf_counter() - start
        transform_start = time.perf_counter()
        for param in later:  # one dense weight at a time (``later`` is empty without ``consume``)
            dense = load_param(plan, param, reader, dtype=plan.dtype)
            out.update(_consumer(consume)(param, dense))
            del dense
        transform_seconds = time.perf_counter() - transform_start
        verify_unchanged(plan)
    finally:
        prefetched, bytes_read = _finish(bar, prefetcher, reader, own_reader)
        requests, over_read = reader.remote.requests, reader.remote.over_read
    state = {p.spec.name: out[p.spec.name] for p in plan.params}
    for alias, target in plan.aliases.items():
        state[alias] = state[target]
    out_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    return state, LoadStats(read_seconds, transform_seconds, bytes_read, out_bytes, prefetched, requests=requests, over_read=over_read)


def _progress_bar(plan: Plan, progress: bool | None) -> tqdm | None:
    """The load's progress bar, or None where ``progress`` (or its default for the load's size) says none."""
    if not show_progress(progress, plan.bytes_to_read):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=plan.bytes_to_read, unit="B", unit_scale=True, desc=f"rank {plan.parallel.rank} load")


def _allocate(fixed: list[ParamPlan], into: Mapping[str, torch.Tensor], threads: int) -> dict[str, torch.Tensor]:
    """The tensors of the ``fixed`` parameters, those of ``into`` or fresh ones, prepared."""
    out = allocate([p.spec for p in fixed if p.spec.name not in into])
    out.update({p.spec.name: into[p.spec.name] for p in fixed if p.spec.name in into})
    _prepare(fixed, out, threads)
    return out


def _read_scales(plan: Plan, fixed: list[ParamPlan], out: dict[str, torch.Tensor], reader: Reader) -> None:
    """Read and check the scales, before any weight: a bad one stops the load early."""
    for param in (p for p in fixed if is_scale(p)):
        for copy in param.copies:
            copy_into(plan.tensors, out[param.spec.name], copy, reader)
        check_scale(plan, param, out[param.spec.name])


def _units(plan: Plan, fixed: list[ParamPlan], out: dict[str, torch.Tensor], reader: Reader) -> list[Run | Job]:
    """Every other copy, cut into chunks, in file order; joined into runs for a sequential reader."""
    jobs = sorted(
        (
            (p, piece)
            for p in fixed
            if not is_scale(p)
            for c in p.copies
            for piece in c.split(_element_bytes(plan, c), CHUNK_BYTES)
        ),
        key=lambda job: _file_order(plan, job[1]),
    )
    units: list[Run | Job] = list(jobs)
    if reader.sequential:  # abutting direct copies: one preadv each stretch
        units = join_runs(plan, jobs, lambda job: direct_bytes(plan.tensors, out[job[0].spec.name], job[1]), CHUNK_BYTES)
    return units


def _finish(bar: tqdm | None, prefetcher: Prefetcher | None, reader: Reader, own_reader: bool) -> tuple[int, int]:
    """Close the bar, stop the prefetcher and close a reader of our own; returns the bytes prefetched and read."""
    if bar is not None:
        bar.close()
    prefetched = prefetcher.stop() if prefetcher is not None else 0
    bytes_read = reader.bytes_read
    if own_reader:
        reader.close()
    return prefetched, bytes_read


def _prepare(params: list[ParamPlan], out: dict[str, torch.Tensor], threads: int) -> None:
    """Defaults, padding and dummy values; dummy values (one generator per parameter, so the
    order does not matter) are drawn on ``threads`` threads."""
    if threads <= 1 or not any(p.dummy is not None for p in params):
        for param in params:
            prepare(param, out[param.spec.name])
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="functional-load-dummy") as pool:
        for future in [pool.submit(prepare, p, out[p.spec.name]) for p in params]:
            future.result()


def _element_bytes(plan: Plan, copy: Copy) -> int:
    info = plan.tensors[copy.tensor]
    return max(1, info.nbytes // max(1, box_volume(full_box(info.shape))))


def _file_order(plan: Plan, copy: Copy) -> tuple[str, int, Box]:
    info = plan.tensors[copy.tensor]
    return (str(info.file), getattr(info.location, "offset", 0), copy.src)


def _run(plan: Plan, units: list[Run | Job], out: dict[str, torch.Tensor], reader: Reader, threads: int, bar: tqdm | None) -> None:
    """Run copies (and sequential runs of them) in file order; with several threads, reads
    overlap (``preadv`` releases the GIL). An eager reader drops each file's buffer after its last copy."""
    remaining = Counter(str(_info(plan, u).file) for u in units)

    def run(unit: Run | Job) -> None:
        if isinstance(unit, Run):
            reader.read_run(unit)
            done = unit.nbytes
        else:
            param, copy = unit
            copy_into(plan.tensors, out[param.spec.name], copy, reader)
            done = plan.copy_bytes(copy)
        if bar is not None:
            bar.update(done)

    def finished(unit: Run | Job) -> None:
        info = _info(plan, unit)
        remaining[str(info.file)] -= 1
        if isinstance(reader.files, EagerReader) and remaining[str(info.file)] == 0:
            reader.files.release(info.file)

    if threads <= 1 or len(units) < 2:
        for unit in units:
            run(unit)
            finished(unit)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="functional-load") as pool:
        for unit, future in [(unit, pool.submit(run, unit)) for unit in units]:
            future.result()
            finished(unit)


def _info(plan: Plan, unit: Run | Job) -> TensorInfo:
    return unit.info if isinstance(unit, Run) else plan.tensors[unit[1].tensor]
