"""Check a tensor-parallel load against its plan and the checkpoint, bit for bit, for every rank.

The check reads the checkpoint through the ``safetensors`` library (not through this package's
reader) and compares each rank's tensors with the checkpoint slices the plan names; it also
checks that the ranks together cover every element of every loaded checkpoint tensor, that
replicated parameters are identical on all ranks, and that padding rows are zero.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .api import Model, resolve_model_dir
from .api import plan as make_plan
from .checkpoint import FileSpan, PickleEntry, SavedBoxes, TensorInfo
from .checkpoint.pickles import safe_torch_load
from .errors import ConfigError
from .io import ReadOptions, execute, reader_for
from .layout.placement import Same
from .options import LoadOptions, resolve_options
from .plan import Plan
from .storage import StoredPath, is_local, read_all

if TYPE_CHECKING:
    import torch

State = dict[str, "torch.Tensor"]  # one rank's loaded tensors by name
Key = tuple[StoredPath, str]  # a checkpoint tensor: its file and name


@dataclass(frozen=True, slots=True)
class VerifyReport:
    tp_size: int
    plans: tuple[Plan, ...]
    bytes_read: tuple[int, ...]
    seconds: tuple[float, ...]
    checkpoint_bytes: int
    problems: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        lines = [f"tp={self.tp_size}: checkpoint tensors {self.checkpoint_bytes:,} bytes"]
        for plan, read, secs in zip(self.plans, self.bytes_read, self.seconds):
            share = read / self.checkpoint_bytes if self.checkpoint_bytes else 0.0
            lines.append(
                f"  rank {plan.parallel.rank}: read {read:,} bytes ({share:.1%} of the checkpoint) in {secs * 1e3:.1f} ms, "
                f"{len(plan.params)} parameters"
            )
        if self.ok:
            lines.append("verified against the plan: every rank equals the checkpoint slices its plan names, bit for bit; "
                         "ranks cover every element; replicated parameters identical; padding rows zero. This checks the "
                         "reads, not the spec: `functional-load check-spec` compares the layout with vLLM and a forward pass")
        else:
            lines.append(f"FAILED: {len(self.problems)} problems")
            lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def _bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def reference_tensor(info: TensorInfo, objects: dict[StoredPath, dict[str, torch.Tensor]] | None = None) -> torch.Tensor:
    """A checkpoint tensor read independently of this package's reader: with the safetensors
    library (a pre-sharded save's original tensors reassembled from its rank files' boxes), or
    ``torch.load`` for a pickle. A file of another storage (``s3://``) is fetched whole, once
    per ``objects`` cache, and parsed by the safetensors library."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load as load_bytes

    location = info.location
    if isinstance(location, FileSpan) and not is_local(location.file):
        cache = {} if objects is None else objects
        if location.file not in cache:
            cache[location.file] = load_bytes(read_all(location.file, "a file verify reads whole"))
        return cache[location.file][info.name]
    if isinstance(location, FileSpan):
        with safe_open(str(location.file), framework="pt") as f:
            return f.get_tensor(info.name)
    if isinstance(location, PickleEntry):
        return safe_torch_load(location.file)[info.name]
    if not isinstance(location, SavedBoxes):
        raise TypeError(f"{info.name}: no reference reader for a {type(location).__name__}")
    dtype = reference_tensor(location.pieces[0].stored, objects).dtype if location.pieces else torch.float32
    whole = torch.empty(info.shape, dtype=dtype)
    for piece in location.pieces:
        stored = reference_tensor(piece.stored, objects)[tuple(slice(a, b) for a, b in piece.dst)]
        lead = len(piece.dst) - len(piece.src)
        stored = stored.reshape(stored.shape[lead:]) if lead else stored
        whole[tuple(slice(a, b) for a, b in piece.src)] = stored.transpose(-1, -2) if piece.transpose else stored
    return whole


def verify_ranks(model_dir: Model, *, tp_size: int = 1, options: LoadOptions = LoadOptions(), **overrides: object) -> VerifyReport:
    """Plan and load every rank of ``tp_size`` and check what each rank read against its plan and
    the checkpoint (``model_dir`` may be a Hugging Face Hub repo id; ``options`` as for every
    entry point).

    This proves the reads: every rank holds exactly the checkpoint slices its plan names, bit
    for bit, read independently with the safetensors library. It does not prove the plan: a
    spec that shards a module the wrong way gives a plan that verifies. Whether the layout is
    vLLM's is what ``functional-load check-spec`` and the parity harness prove."""
    import torch

    opts = resolve_options(options, overrides)
    if opts.dummy:
        raise ConfigError("verify checks ranks against a checkpoint; load_format='dummy' reads none (plan or load it instead)")
    directory = resolve_model_dir(model_dir, opts.revision, opts.load_format, opts.allow_pickle)
    local = opts.replace(revision=None, read=ReadOptions(strategy="pread"))
    plans, states, reads, seconds = _load_ranks(directory, tp_size, local)

    problems: list[str] = []
    # keyed by file and name: a save reloaded at its saved layout reads each rank's own file,
    # whose tensors have the same names in every rank file
    infos = {(info.file, name): info for p in plans for name, info in p.tensors.items()}
    objects: dict[StoredPath, dict[str, torch.Tensor]] = {}  # files of another storage, fetched whole once
    reference = {key: reference_tensor(info, objects) for key, info in infos.items()}
    covered = {key: torch.zeros(info.shape, dtype=torch.bool) for key, info in infos.items()}
    for the_plan, state in zip(plans, states):
        problems += _rank_problems(the_plan, state, reference, covered)
    for (file, name), mask in covered.items():
        if not bool(mask.all()):
            problems.append(f"{name} ({file.name}): {int((~mask).sum())} elements are held by no rank")
    problems += _replicated_problems(plans, states)
    total = sum(info.nbytes for info in infos.values())
    return VerifyReport(tp_size, tuple(plans), tuple(reads), tuple(seconds), total, tuple(problems))


def _load_ranks(model_dir: StoredPath, tp_size: int, local: LoadOptions) -> tuple[list[Plan], list[State], list[int], list[float]]:
    """Plan and load each rank in turn; returns the plans, states, bytes read and seconds of every rank."""
    plans, states, reads, seconds = [], [], [], []
    for rank in range(tp_size):
        start = time.perf_counter()
        the_plan = make_plan(model_dir, tp_size=tp_size, rank=rank, options=local)
        with reader_for(the_plan, local.read) as reader:
            tensors, _ = execute(the_plan, reader=reader, progress=False)
            states.append(tensors)
            reads.append(reader.bytes_read)
        seconds.append(time.perf_counter() - start)
        plans.append(the_plan)
    return plans, states, reads, seconds


def _rank_problems(the_plan: Plan, state: State, reference: Mapping[Key, torch.Tensor], covered: Mapping[Key, torch.Tensor]) -> list[str]:
    """Where one rank differs from the checkpoint slices its plan names, unzeroed padding and untied
    aliases; marks in ``covered`` the checkpoint elements the rank holds."""
    import torch

    problems: list[str] = []
    rank = the_plan.parallel.rank
    for param in the_plan.params:
        tensor = state[param.spec.name]
        for copy in param.copies:
            dst = tensor[tuple(slice(a, b) for a, b in copy.dst)]
            key = (the_plan.tensors[copy.tensor].file, copy.tensor)
            src = copy.arrange(copy.take(reference[key]), tuple(dst.shape)).to(tensor.dtype)
            if not torch.equal(_bits(dst), _bits(src)):
                problems.append(f"rank {rank}: {param.spec.name}{list(copy.dst)} differs from {copy.tensor}{list(copy.src)}")
            copy.take(covered[key])[...] = True
        for box in param.zeros:
            if torch.count_nonzero(tensor[tuple(slice(a, b) for a, b in box)].float()):
                problems.append(f"rank {rank}: padding {list(box)} of {param.spec.name} is not zero")
    for alias, target in the_plan.aliases.items():
        if state[alias] is not state[target]:
            problems.append(f"rank {rank}: tied {alias} is not the same tensor as {target}")
    return problems


def _replicated_problems(plans: list[Plan], states: list[State]) -> list[str]:
    """Parameters placed the same on every rank that differ between rank 0 and another rank."""
    import torch

    problems = []
    for param in plans[0].params:
        if all(isinstance(p.param(param.spec.name).spec.placement(p.parallel), Same) for p in plans):
            first = _bits(states[0][param.spec.name])
            for state, the_plan in zip(states[1:], plans[1:]):
                if not torch.equal(first, _bits(state[param.spec.name])):
                    problems.append(f"replicated {param.spec.name} differs between rank 0 and rank {the_plan.parallel.rank}")
    return problems
