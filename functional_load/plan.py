"""The load plan: which bytes of which checkpoint tensor land in which slice of which parameter.

``make_plan(layout, checkpoint)`` is pure: it reads names, shapes and dtypes only. It validates
everything it can before a byte of tensor data is read and raises one :class:`PlanError`
listing every problem. The result is a plain value that prints, diffs and serialises to JSON.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .checkpoint import Checkpoint, TensorInfo
from .dtypes import itemsize, torch_name
from .errors import PlanError, ShardingError
from .layout import Layout, ParamSpec, Parallel
from .mapping import map_name
from .sharding import (
    Box,
    Replicated,
    ShardId,
    Split,
    VocabSplit,
    box_volume,
    boxes_overlap,
    full_box,
    segment_offsets,
    segment_rows,
    vocab_shard,
    with_range,
)


@dataclass(frozen=True, slots=True)
class Copy:
    """Read box ``src`` of checkpoint tensor ``tensor`` (in its stored orientation) into box
    ``dst`` of the rank-local parameter, transposing a 2-D block when ``transpose``."""

    tensor: str
    src: Box
    dst: Box
    transpose: bool = False


@dataclass(frozen=True, slots=True)
class ParamPlan:
    """How one parameter of one rank is filled: copies, plus boxes that are zero (vocab padding)."""

    spec: ParamSpec
    copies: tuple[Copy, ...]
    zeros: tuple[Box, ...] = ()


@dataclass(frozen=True, slots=True)
class Plan:
    """A validated per-rank load plan. ``execute`` is the only thing that turns it into bytes."""

    model_dir: str
    arch: str
    parallel: Parallel
    dtype: str
    params: tuple[ParamPlan, ...]
    tensors: Mapping[str, TensorInfo]  # the checkpoint tensors this plan reads
    aliases: Mapping[str, str] = field(default_factory=dict)  # tied alias -> canonical parameter
    dropped: tuple[tuple[str, str], ...] = ()  # (checkpoint tensor, why it is not loaded)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        object.__setattr__(self, "aliases", MappingProxyType(dict(self.aliases)))

    def copy_bytes(self, copy: Copy) -> int:
        """Bytes of checkpoint data one copy reads."""
        info = self.tensors[copy.tensor]
        return box_volume(copy.src) * itemsize(info.dtype)

    @property
    def bytes_to_read(self) -> int:
        """Exact bytes of tensor data this rank reads from the checkpoint."""
        return sum(self.copy_bytes(c) for p in self.params for c in p.copies)

    @property
    def output_bytes(self) -> int:
        from .dtypes import torch_itemsize

        return sum(box_volume(full_box(p.spec.local_shape)) * torch_itemsize(p.spec.dtype) for p in self.params)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable description of the plan."""

        def box(b: Box) -> list[list[int]]:
            return [list(r) for r in b]

        return {
            "model_dir": self.model_dir,
            "arch": self.arch,
            "tp_size": self.parallel.tp_size,
            "rank": self.parallel.rank,
            "dtype": self.dtype,
            "bytes_to_read": self.bytes_to_read,
            "output_bytes": self.output_bytes,
            "params": [
                {
                    "name": p.spec.name,
                    "shape": list(p.spec.local_shape),
                    "global_shape": list(p.spec.shape),
                    "dtype": p.spec.dtype,
                    "sharding": _sharding_json(p.spec),
                    "copies": [
                        {
                            "tensor": c.tensor,
                            "file": self.tensors[c.tensor].file.name,
                            "src": box(c.src),
                            "dst": box(c.dst),
                            "transpose": c.transpose,
                            "bytes": self.copy_bytes(c),
                        }
                        for c in p.copies
                    ],
                    "zeros": [box(z) for z in p.zeros],
                }
                for p in self.params
            ],
            "aliases": dict(self.aliases),
            "dropped": [{"tensor": t, "reason": r} for t, r in self.dropped],
        }

    def table(self) -> str:
        """A readable per-rank table: parameter, local shape, source tensors and slices, bytes."""
        rows = [("parameter", "local shape", "source (file)", "src slice -> dst slice", "bytes")]
        for p in self.params:
            for i, c in enumerate(p.copies):
                rows.append(
                    (
                        p.spec.name if i == 0 else "",
                        _shape(p.spec.local_shape) if i == 0 else "",
                        f"{c.tensor} ({self.tensors[c.tensor].file.name})",
                        f"{_slices(c.src)}{'ᵀ' if c.transpose else ''} -> {_slices(c.dst)}",
                        f"{self.copy_bytes(c):,}",
                    )
                )
            for z in p.zeros:
                rows.append(("", "", "(zero padding)", f"-> {_slices(z)}", "0"))
        for alias, target in self.aliases.items():
            rows.append((alias, "", f"(same tensor as {target})", "", "0"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(
            f"rank {self.parallel.rank}/{self.parallel.tp_size}: {len(self.params)} parameters, "
            f"{self.bytes_to_read:,} bytes to read, {self.output_bytes:,} bytes out, {len(self.dropped)} tensors dropped"
        )
        return "\n".join(lines)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _slices(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def _sharding_json(spec: ParamSpec) -> dict[str, Any]:
    s = spec.sharding
    if isinstance(s, Split):
        return {
            "kind": "split",
            "dim": s.dim,
            "segments": [{"id": g.id, "count": g.count, "unit": g.unit, "replicate": g.replicate} for g in s.segments],
        }
    if isinstance(s, VocabSplit):
        return {"kind": "vocab", "vocab": s.vocab, "padding": s.padding}
    return {"kind": "replicated"}


def _segment_ids(split: Split, shard_id: ShardId | None, param: str) -> list[ShardId]:
    """Validate a shard id against a split parameter (vLLM's messages) and resolve the segments."""
    ids = [s.id for s in split.segments]
    if shard_id is None:
        return ids
    if all(isinstance(i, str) for i in ids):  # QKV
        if shard_id not in ids:
            raise ShardingError(
                f"{param}: shard id for a QKV parameter should be 'q', 'k', or 'v', got shard id {shard_id!r}"
            )
        return [shard_id]
    if not isinstance(shard_id, int) or isinstance(shard_id, bool):
        raise ShardingError(f"{param}: shard id {shard_id!r} is not an int in [0, {len(ids) - 1}]")
    if not 0 <= shard_id < len(ids):
        raise ShardingError(f"{param}: shard id should be between 0 and {len(ids) - 1}. Got shard id {shard_id}.")
    return [shard_id]


def _param_copies(spec: ParamSpec, info: TensorInfo, shard_id: ShardId | None, parallel: Parallel):
    """The copies (and zero boxes) one checkpoint tensor contributes to one parameter, plus the
    shape the checkpoint tensor must have. Slot keys identify what it fills, to catch duplicates."""
    tp, rank = parallel.tp_size, parallel.rank
    sharding = spec.sharding
    local = full_box(spec.local_shape)
    zeros: list[Box] = []
    if isinstance(sharding, Split):
        segment_ids = _segment_ids(sharding, shard_id, spec.name)
        by_id = {s.id: s for s in sharding.segments}
        fused_offsets = segment_offsets(sharding) if shard_id is None else {shard_id: 0}
        dst_offsets, offset = {}, 0
        for segment in sharding.segments:
            start, stop = segment_rows(segment, tp, rank)
            dst_offsets[segment.id] = offset
            offset += stop - start
        rows = sum(by_id[i].rows for i in segment_ids)
        expected = spec.shape[: sharding.dim] + (rows,) + spec.shape[sharding.dim + 1 :]
        pairs = []
        for i in segment_ids:
            start, stop = segment_rows(by_id[i], tp, rank)
            src = with_range(full_box(expected), sharding.dim, (fused_offsets[i] + start, fused_offsets[i] + stop))
            dst = with_range(local, sharding.dim, (dst_offsets[i], dst_offsets[i] + stop - start))
            pairs.append((src, dst))
        slots = [(spec.name, i) for i in segment_ids]
    else:
        if shard_id is not None:
            raise ShardingError(f"{spec.name}: a {type(sharding).__name__} parameter takes no shard id, got {shard_id!r}")
        expected = spec.shape
        if isinstance(sharding, VocabSplit):
            shard = vocab_shard(sharding.vocab, tp, rank, padding=sharding.padding)
            n = shard.num_org
            pairs = [
                (with_range(full_box(expected), 0, shard.org), with_range(local, 0, (0, n)))
            ] if n else []
            if n < shard.per_partition:
                zeros.append(with_range(local, 0, (n, shard.per_partition)))
        else:
            assert isinstance(sharding, Replicated)
            pairs = [(full_box(expected), local)]
        slots = [(spec.name, None)]
    stored = tuple(reversed(expected)) if spec.transposed else expected
    copies = [Copy(info.name, tuple(reversed(src)) if spec.transposed else src, dst, spec.transposed) for src, dst in pairs]
    return copies, zeros, stored, slots


def make_plan(layout: Layout, checkpoint: Checkpoint) -> Plan:
    """Route every checkpoint tensor to its parameter slices and validate the result.

    Raises one PlanError listing: checkpoint tensors with no destination, shape mismatches,
    tensors filling the same slot twice, parameters (or segments) not found in the checkpoint,
    and a tied alias whose canonical tensor is missing.
    """
    problems: list[str] = []
    dropped: list[tuple[str, str]] = []
    copies: dict[str, list[Copy]] = defaultdict(list)
    zeros: dict[str, list[Box]] = defaultdict(list)
    filled: dict[tuple[str, ShardId | None], str] = {}
    used: dict[str, TensorInfo] = {}
    params = layout.params

    for name, info in checkpoint.tensors.items():
        mapped = map_name(layout.mapping, name)
        if mapped is None:
            dropped.append((name, "dropped by a mapping rule (not a parameter, e.g. a rotary cache)"))
            continue
        if mapped.name in layout.aliases:
            dropped.append((name, f"tied: {mapped.name} is the same tensor as {layout.aliases[mapped.name]}"))
            continue
        spec = params.get(mapped.name)
        if spec is None:
            if mapped.name.endswith(".bias"):
                dropped.append((name, f"unexpected bias {mapped.name} (ignored, as vLLM does for GPTQ checkpoints)"))
            else:
                problems.append(_unexpected(name, info, mapped.name, layout))
            continue
        for shard_id in mapped.shard_ids or (None,):
            try:
                new, new_zeros, stored, slots = _param_copies(spec, info, shard_id, layout.parallel)
            except ShardingError as exc:
                problems.append(f"checkpoint tensor {name!r} in {info.file.name}: {exc}")
                continue
            if info.shape != stored:
                what = f" (shard {shard_id!r})" if shard_id is not None else ""
                problems.append(
                    f"checkpoint tensor {name!r} in {info.file.name} has shape {list(info.shape)}, expected "
                    f"{list(stored)} for parameter {spec.name}{what}; check config.json against the checkpoint"
                )
                continue
            if not _float_compatible(info.dtype, spec.dtype):
                problems.append(
                    f"checkpoint tensor {name!r} in {info.file.name} has dtype {info.dtype}, which cannot be cast "
                    f"to the parameter dtype {spec.dtype} of {spec.name}"
                )
                continue
            clash = [filled[s] for s in slots if s in filled] + [
                filled[k] for k in filled if k[0] == spec.name and (k[1] is None) != (slots[0][1] is None)
            ]
            if clash:
                problems.append(f"checkpoint tensors {clash[0]!r} and {name!r} both fill parameter {spec.name}")
                continue
            filled.update({s: name for s in slots})
            copies[spec.name].extend(new)
            zeros[spec.name].extend(new_zeros)
            used[name] = info

    missing = []
    for spec in params.values():
        problem = _coverage_problem(spec, copies[spec.name], zeros[spec.name])
        if problem == "missing":
            missing.append(spec.name)
        elif problem:
            problems.append(problem)
    for alias, target in layout.aliases.items():
        if target in params and target in missing:
            problems.append(
                f"{alias!r} is tied to {target!r}, but {target!r} was not found in the checkpoint, so the tied "
                f"weight would be uninitialized"
            )
    if missing:
        problems.append(
            f"Following weights were not initialized from checkpoint: {_abbreviate(missing)}; the checkpoint in "
            f"{checkpoint.directory} lacks them (wrong architecture, or an incomplete download?)"
        )
    if problems:
        raise PlanError(problems)

    return Plan(
        model_dir=str(checkpoint.directory),
        arch=layout.arch,
        parallel=layout.parallel,
        dtype=layout.dtype,
        params=tuple(
            ParamPlan(s, tuple(sorted(copies[s.name], key=lambda c: c.dst)), tuple(zeros[s.name])) for s in params.values()
        ),
        tensors=used,
        aliases=layout.aliases,
        dropped=tuple(dropped),
    )


def _float_compatible(checkpoint_dtype: str, param_dtype: str) -> bool:
    source = torch_name(checkpoint_dtype)
    is_float = source.startswith(("float", "bfloat"))
    return is_float == param_dtype.startswith(("float", "bfloat")) or source == param_dtype


def _coverage_problem(spec: ParamSpec, copies: list[Copy], zeros: list[Box]) -> str | None:
    """``"missing"`` when nothing fills the parameter, a message when it is partly filled or
    overfilled, ``None`` when every element is written exactly once."""
    boxes = [c.dst for c in copies] + zeros
    if not copies:
        return "missing"
    total = box_volume(full_box(spec.local_shape))
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if boxes_overlap(a, b):
                return f"{spec.name}: two checkpoint slices overlap in the rank-local parameter at {_slices(a)} and {_slices(b)}"
    covered = sum(box_volume(b) for b in boxes)
    if covered != total:
        have = sorted({c.tensor for c in copies})
        need = ""
        if isinstance(spec.sharding, Split) and len(spec.sharding.segments) > 1:
            need = f" (segments {[s.id for s in spec.sharding.segments]})"
        return (
            f"{spec.name} is only partly initialized from checkpoint: {covered} of {total} elements, from {have}; "
            f"a part of the fused parameter{need} is missing from the checkpoint"
        )
    return None


def _unexpected(name: str, info: TensorInfo, mapped: str, layout: Layout) -> str:
    """No destination: list the parameters under the longest prefix that exists, like vLLM."""
    parts = mapped.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:cut])
        near = sorted(p for p in layout.params if p.startswith(prefix + ".") or not prefix)
        if near:
            break
    target = f" (mapped to {mapped!r})" if mapped != name else ""
    return (
        f"checkpoint tensor {name!r} in {info.file.name}{target} has no destination in {layout.arch}; "
        f"parameters under {prefix or '<root>'!r}: {_abbreviate(near)}"
    )


def _abbreviate(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
