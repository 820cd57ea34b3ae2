"""Run a plan: allocate the rank's parameters once, fill them in place from the checkpoint.

This is the only stage that reads tensor data. All parameters live in one 64-byte-aligned
arena (so DLPack hands them to JAX without copies); its pages are faulted in by the reads, on
several threads at once. Copies run in file-offset order, in chunks of at most 16 MiB, on a few
threads; a copy whose destination slot is contiguous and of the checkpoint's dtype is read
straight into it, a cast or transpose goes through one box-sized temporary. Scales are read
and checked first; online quantization then handles one dense weight at a time.
"""

from __future__ import annotations

import mmap
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .checkpoint.read import EagerReader, Reader, ReadOptions, make_reader, should_prefetch
from .checkpoint.prefetch import Prefetcher
from .dtypes import to_torch, torch_itemsize, torch_name
from .errors import CheckpointError, IntegrityError
from .online import quantize_online
from .plan import Copy, ParamPlan, Plan
from .sharding import Box, box_volume, full_box

# Parameters that hold quantization scales: every element must be finite (and, for FP8/int8
# and KV-cache scales, positive).
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale", ".scales", ".q_scale", ".k_scale", ".v_scale", ".prob_scale")
ALIGN = 64
CHUNK_BYTES = 16 << 20  # copies larger than this are split, so several threads share a big tensor


def split_copy(copy: Copy, info: Any, chunk: int) -> list[Copy]:
    """``copy`` cut along the first dimension of its source box into pieces of about ``chunk``
    bytes (the matching destination rows follow: the same dimension, or the other one of a
    transposed 2-D block, after any leading slot dimension of an expert parameter)."""
    rows = copy.src[0][1] - copy.src[0][0] if copy.src else 0
    nbytes = box_volume(copy.src) * max(1, info.nbytes // max(1, box_volume(full_box(info.shape))))
    parts = min(rows, -(-nbytes // chunk)) if rows else 1
    if parts <= 1:
        return [copy]
    lead = len(copy.dst) - len(copy.src)
    dim = lead + (1 if copy.transpose else 0)
    (s0, s1), (d0, _) = copy.src[0], copy.dst[dim]
    cuts = [s0 + (s1 - s0) * i // parts for i in range(parts + 1)]
    return [
        Copy(
            copy.tensor,
            ((a, b),) + copy.src[1:],
            copy.dst[:dim] + ((d0 + a - s0, d0 + b - s0),) + copy.dst[dim + 1 :],
            copy.transpose,
        )
        for a, b in zip(cuts, cuts[1:])
        if b > a
    ]


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What a load did: seconds per stage, bytes read (and prefetched), bytes produced."""

    read_seconds: float
    transform_seconds: float
    bytes_read: int
    bytes_out: int
    prefetched: int = 0
    plan_seconds: float = 0.0

    def summary(self) -> str:
        def rate(n: int, s: float) -> str:
            return f"{n / s / 1e9:.2f} GB/s" if s > 0 else "-"

        return (
            f"plan {self.plan_seconds:.3f} s; read {self.bytes_read / 1e6:,.1f} MB in {self.read_seconds:.3f} s "
            f"({rate(self.bytes_read, self.read_seconds)}); transform {self.transform_seconds:.3f} s; "
            f"output {self.bytes_out / 1e6:,.1f} MB" + (f"; prefetched {self.prefetched / 1e6:,.1f} MB" if self.prefetched else "")
        )


class LoadedState(dict):  # type: ignore[type-arg]
    """The ``{name: tensor}`` a load returns, carrying the ``plan`` that made it, the output
    ``target`` layout and the load's ``stats``; otherwise a plain dict."""

    plan: Plan
    target: str
    stats: LoadStats | None

    def __init__(self, tensors: dict[str, Any], plan: Plan, target: str = "checkpoint", stats: LoadStats | None = None):
        super().__init__(tensors)
        self.plan = plan
        self.target = target
        self.stats = stats


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _bytes(tensor: Any) -> memoryview:
    """The memory of a contiguous CPU tensor as a writable byte buffer."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def allocate(specs: list[Any]) -> dict[str, Any]:
    """One arena for all ``specs``: each tensor starts on a 64-byte boundary. The arena is an
    anonymous mapping advised against transparent huge pages (much slower to fault on some VMs).
    Its pages are faulted in by the reads themselves, on several threads at once (measured faster
    here than pre-faulting it first with ``MADV_POPULATE_WRITE``, which runs serially)."""
    import torch

    offsets, total = {}, 0
    for spec in specs:
        offsets[spec.name] = total
        nbytes = box_volume(full_box(spec.local_shape)) * torch_itemsize(spec.dtype)
        total += -(-max(nbytes, 1) // ALIGN) * ALIGN
    if total == 0:
        return {}
    arena = mmap.mmap(-1, total)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            arena.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:
            pass
    memory = torch.frombuffer(arena, dtype=torch.uint8)
    out = {}
    for spec in specs:
        start = offsets[spec.name]
        nbytes = box_volume(full_box(spec.local_shape)) * torch_itemsize(spec.dtype)
        out[spec.name] = memory[start : start + nbytes].view(to_torch(spec.dtype)).view(spec.local_shape)
    return out


def _copy(plan: Plan, tensor: Any, copy: Copy, reader: Reader) -> None:
    """Fill one planned box of ``tensor``."""
    import torch

    info = plan.tensors[copy.tensor]
    dst = tensor[_index(copy.dst)]
    source_dtype = to_torch(torch_name(info.dtype))
    if not copy.transpose and source_dtype == tensor.dtype and dst.is_contiguous():
        reader.read_into(info, copy.src, _bytes(dst))
    else:
        tmp = torch.empty(tuple(b - a for a, b in copy.src), dtype=source_dtype)
        reader.read_into(info, copy.src, _bytes(tmp))
        dst.copy_((tmp.T if copy.transpose else tmp).reshape(dst.shape))


def _prepare(param: ParamPlan, tensor: Any) -> None:
    if param.fill is not None:
        tensor.fill_(param.fill)
    for box in param.zeros:
        tensor[_index(box)].zero_()


def _verify_shared(plan: Plan, param: ParamPlan, tensor: Any, reader: Reader) -> None:
    """Parts of a fused layer that must be identical (act-order ``g_idx``) are compared."""
    import torch

    for check in param.checks:
        info = plan.tensors[check.tensor]
        tmp = torch.empty(tuple(b - a for a, b in check.src), dtype=to_torch(torch_name(info.dtype)))
        reader.read_into(info, check.src, _bytes(tmp))
        if not torch.equal(tmp.to(tensor.dtype).reshape(-1), tensor[_index(check.dst)].reshape(-1)):
            raise CheckpointError(
                f"{param.spec.name}: checkpoint tensors {param.copies[0].tensor!r} and {check.tensor!r} (in "
                f"{info.file.name}) must be identical for the fused parameter, but differ"
            )


def _check_scale(plan: Plan, param: ParamPlan, tensor: Any) -> None:
    """A NaN, infinite, zero or negative scale would silently corrupt every dequantized weight.
    Integer group scales (GPTQ, AWQ, pack-quantized) only need to be finite: some producers
    (auto-round's symmetric GPTQ) store negative ones on purpose."""
    import torch

    values = tensor.float()
    scheme = plan.schemes.get(param.spec.module)
    signed = scheme is not None and scheme.format in ("pack", "gptq", "awq")
    bad = ~torch.isfinite(values) if signed else ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        sources = sorted({c.tensor for c in param.copies}) or ["(default)"]
        first = values[bad].flatten()[0].item()
        raise CheckpointError(
            f"{param.spec.name}: {int(bad.sum())} of {values.numel()} scale values are not finite"
            f"{'' if signed else ' and positive'} "
            f"(e.g. {first}); from checkpoint tensor(s) {sources} in "
            f"{sorted({plan.tensors[t].file.name for t in sources if t in plan.tensors})}. The checkpoint is corrupt "
            f"or was exported wrongly; re-export it"
        )


def load_param(plan: Plan, param: ParamPlan, reader: Reader, dtype: str | None = None) -> Any:
    """One parameter of the plan's rank as a fresh CPU torch tensor (``dtype``: override the
    parameter's own, for online quantization); scales are checked."""
    import torch

    if param.spec.derived:
        raise ValueError(f"{param.spec.name} is computed with its weight by online quantization, not loaded alone")
    tensor = torch.empty(param.spec.local_shape, dtype=to_torch(dtype or param.spec.dtype))
    _prepare(param, tensor)
    for copy in param.copies:
        _copy(plan, tensor, copy, reader)
    _verify_shared(plan, param, tensor, reader)
    if param.spec.name.endswith(SCALE_SUFFIXES) and param.copies:
        _check_scale(plan, param, tensor)
    return tensor


def execute(
    plan: Plan,
    *,
    reader: Reader | None = None,
    options: ReadOptions | None = None,
    progress: bool | None = None,
) -> LoadedState:
    """Materialise ``plan`` as rank-local CPU torch tensors, in the plan's parameter order.

    Tied aliases map to the very same tensor object as their canonical parameter.
    ``progress=None`` shows a bar when the plan reads more than a few files.
    """
    options = options or ReadOptions()
    own_reader = reader is None
    reader = reader or (plan.source() if plan.source is not None else make_reader(options))
    files = {info.file for info in plan.tensors.values()}
    bar = None
    if progress if progress is not None else len(files) > 4:
        from tqdm.auto import tqdm

        bar = tqdm(total=plan.bytes_to_read, unit="B", unit_scale=True, desc=f"rank {plan.parallel.rank} load")
    online = {p.spec.name for p in plan.params if _is_online_weight(plan, p)}
    fixed = [p for p in plan.params if not p.spec.derived and p.spec.name not in online]
    prefetch = should_prefetch(options, plan.model_dir, plan.bytes_to_read) and plan.source is None
    prefetcher = Prefetcher(plan, options) if prefetch else None
    start = time.perf_counter()
    try:
        out = allocate([p.spec for p in fixed])
        for param in fixed:
            _prepare(param, out[param.spec.name])
        # Scales first: small, and a bad one stops the load before the weights are read.
        scales = [p for p in fixed if p.spec.name.endswith(SCALE_SUFFIXES)]
        for param in scales:
            for copy in param.copies:
                _copy(plan, out[param.spec.name], copy, reader)
            if param.copies:  # a default (vLLM's -1.0 "absent" KV scale) is not checkpoint data
                _check_scale(plan, param, out[param.spec.name])
        jobs = sorted(
            (
                (p, piece)
                for p in fixed
                if not p.spec.name.endswith(SCALE_SUFFIXES)
                for c in p.copies
                for piece in split_copy(c, plan.tensors[c.tensor], CHUNK_BYTES)
            ),
            key=lambda job: (str(plan.tensors[job[1].tensor].file), plan.tensors[job[1].tensor].offset, job[1].src),
        )
        _run(plan, jobs, out, reader, options.threads, bar)
        for param in fixed:
            _verify_shared(plan, param, out[param.spec.name], reader)
        read_seconds = time.perf_counter() - start
        transform_start = time.perf_counter()
        for param in plan.params:  # online quantization: one dense weight at a time
            if param.spec.name in online:
                dense = load_param(plan, param, reader, dtype=plan.dtype)
                out.update(quantize_online(plan, param.spec.module, plan.schemes[param.spec.module], dense))
                del dense
        transform_seconds = time.perf_counter() - transform_start
        verify_unchanged(plan)
    finally:
        if bar is not None:
            bar.close()
        prefetched = prefetcher.stop() if prefetcher is not None else 0
        bytes_read = reader.bytes_read
        if own_reader:
            reader.close()
    state = {p.spec.name: out[p.spec.name] for p in plan.params}
    for alias, target in plan.aliases.items():
        state[alias] = state[target]
    out_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    stats = LoadStats(read_seconds, transform_seconds, bytes_read, out_bytes, prefetched)
    return LoadedState(state, plan, stats=stats)


def verify_unchanged(plan: Plan) -> None:
    """After reading: every file read is still the one indexed (an in-place rewrite during the
    load would otherwise go unnoticed)."""
    import os

    from .checkpoint.read import check_unchanged

    seen = set()
    for info in plan.tensors.values():
        if info.offset == -2:  # a virtual tensor of a pre-sharded save: its reader checks the rank files
            continue
        if info.file not in seen:
            seen.add(info.file)
            try:
                st = os.stat(info.file)
            except OSError as exc:
                raise IntegrityError(f"{info.file}: disappeared during the load ({exc})") from None
            check_unchanged(info, st)


def _is_online_weight(plan: Plan, param: ParamPlan) -> bool:
    scheme = plan.schemes.get(param.spec.module)
    return scheme is not None and scheme.online and param.spec.name.endswith(".weight")


def _run(plan: Plan, jobs: list[tuple[ParamPlan, Copy]], out: dict[str, Any], reader: Reader, threads: int, bar: Any) -> None:
    """Run copies in file order; with several threads, reads overlap (``preadv`` releases the GIL).
    An eager reader drops each file's buffer after its last copy."""
    remaining = Counter(str(plan.tensors[c.tensor].file) for _, c in jobs)

    def run(job: tuple[ParamPlan, Copy]) -> None:
        param, copy = job
        _copy(plan, out[param.spec.name], copy, reader)
        if bar is not None:
            bar.update(plan.copy_bytes(copy))

    def done(job: tuple[ParamPlan, Copy]) -> None:
        info = plan.tensors[job[1].tensor]
        remaining[str(info.file)] -= 1
        if isinstance(reader, EagerReader) and remaining[str(info.file)] == 0:
            reader.release(info.file)

    if threads <= 1 or len(jobs) < 2:
        for job in jobs:
            run(job)
            done(job)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="functional-load") as pool:
        for job, future in [(job, pool.submit(run, job)) for job in jobs]:
            future.result()
            done(job)
