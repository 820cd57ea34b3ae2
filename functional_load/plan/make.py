"""The load plan: which bytes of which checkpoint tensor land in which slice of which parameter.

``make_plan(layout, checkpoint)`` is pure: it reads names, shapes and dtypes only. It validates
everything it can before a byte of tensor data is read and raises one :class:`PlanError`
listing every problem. The result is a plain value that prints, diffs and serialises to JSON.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from .checkpoint import Checkpoint, TensorInfo
from .dtypes import itemsize, torch_name
from .errors import PlanError, ShardingError
from .layout import Layout, ParamSpec, Parallel
from .mapping import map_name
from .quant.schemes import QuantScheme
from .sharding import (
    Pick,
    Replicated,
    Blocked,
    Box,
    ExpertSplit,
    Shared,
    Slots,
    blocked_pieces,
    ShardId,
    Split,
    VocabSplit,
    box_volume,
    boxes_overlap,
    full_box,
    segment_offsets,
    split_pieces,
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
    """How one parameter of one rank is filled: copies, plus boxes that are zero (vocab padding),
    or a default value when the checkpoint does not have it."""

    spec: ParamSpec
    copies: tuple[Copy, ...]
    zeros: tuple[Box, ...] = ()
    fill: float | None = None  # the whole parameter takes this value (a default, e.g. KV scale 1.0)
    checks: tuple[Copy, ...] = ()  # read and compared with what the copies wrote (Shared tensors)


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
    schemes: Mapping[str, QuantScheme] = field(default_factory=dict)  # quantized module -> scheme
    source: Any = None  # a reader factory when the bytes are not plain files (pickles, pre-sharded saves)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        object.__setattr__(self, "aliases", MappingProxyType(dict(self.aliases)))
        object.__setattr__(self, "schemes", MappingProxyType(dict(self.schemes)))

    def param(self, name: str) -> ParamPlan:
        """The plan of one parameter, by name (KeyError if the rank has no such parameter)."""
        for p in self.params:
            if p.spec.name == name:
                return p
        raise KeyError(name)

    def copy_bytes(self, copy: Copy) -> int:
        """Bytes of checkpoint data one copy reads."""
        info = self.tensors[copy.tensor]
        return box_volume(copy.src) * itemsize(info.dtype)

    @property
    def bytes_to_read(self) -> int:
        """Exact bytes of tensor data this rank reads from the checkpoint."""
        return sum(self.copy_bytes(c) for p in self.params for c in p.copies + p.checks)

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
            "expert_parallel": self.parallel.expert_parallel,
            "expert_placement": self.parallel.expert_placement,
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
                    "fill": p.fill,
                }
                for p in self.params
            ],
            "aliases": dict(self.aliases),
            "schemes": {m: {k: getattr(q, k) for k in q.__slots__} for m, q in self.schemes.items()},
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
            if p.fill is not None:
                rows.append((p.spec.name, _shape(p.spec.local_shape), f"(default {p.fill})", "", "0"))
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

    def split(x: Split) -> dict[str, Any]:
        segments = [{"id": g.id, "count": g.count, "unit": g.unit, "replicate": g.replicate} for g in x.segments]
        return {"kind": "split", "dim": x.dim, "segments": segments, "disable_tp": x.disable_tp}

    if isinstance(s, Split):
        return split(s)
    if isinstance(s, VocabSplit):
        return {"kind": "vocab", "vocab": s.vocab, "padding": s.padding}
    if isinstance(s, ExpertSplit):
        return {"kind": "experts", "num_experts": s.num_experts, "inner": split(s.inner)}
    if isinstance(s, (Slots, Shared)):
        return {"kind": type(s).__name__.lower(), "ids": list(s.ids)}
    if isinstance(s, Pick):
        return {"kind": "pick", "ids": list(s.ids), "keep": s.keep}
    if isinstance(s, Blocked):
        return {"kind": "blocked", "block": s.block, "split": split(s.split)}
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


@dataclass(frozen=True, slots=True)
class _Contribution:
    """What one checkpoint tensor (for one shard id) gives one parameter on one rank."""

    pairs: tuple[tuple[Box, Box, Any], ...]  # (src box in destination orientation, dst box, slot key)
    zeros: tuple[Box, ...]
    expected: tuple[int, ...]  # the checkpoint tensor's shape, in destination orientation


def _split_pairs(split: Split, shape: tuple[int, ...], local: Box, shard_id: ShardId | None, tp: int, rank: int, name: str):
    """(src, dst, segment id) of each segment a tensor fills; ``shard_id=None`` means all segments
    fused in one tensor, cut at the checkpoint's own offsets. Also the tensor's expected shape."""
    ids = _segment_ids(split, shard_id, name)
    by_id = {s.id: s for s in split.segments}
    rows = sum(by_id[i].rows for i in ids)
    expected = shape[: split.dim] + (rows,) + shape[split.dim + 1 :]
    offsets = segment_offsets(split) if shard_id is None else {shard_id: 0}
    pairs = []
    for piece in split_pieces(split, tp, rank):
        if piece.segment in ids:
            start = offsets[piece.segment]
            src = with_range(full_box(expected), split.dim, (start + piece.src[0], start + piece.src[1]))
            pairs.append((src, with_range(local, split.dim, piece.dst), piece.segment))
    return pairs, expected


def _blocked_pairs(blocked: Blocked, shape: tuple[int, ...], local: Box, shard_id: ShardId | None, tp: int, rank: int, name: str):
    """Like :func:`_split_pairs` for a block-scale tensor: rows counted in blocks."""
    split, dim = blocked.split, blocked.split.dim
    ids = _segment_ids(split, shard_id, name)
    rows = sum(s.rows for s in split.segments if s.id in ids)
    expected = shape[:dim] + (-(-rows // blocked.block),) + shape[dim + 1 :]
    pairs = [
        (with_range(full_box(expected), dim, p.src), with_range(local, dim, p.dst), p.segment)
        for p in blocked_pieces(blocked, tp, rank, fused=shard_id is None)
        if p.segment in ids
    ]
    return pairs, expected


def _contribution(
    spec: ParamSpec, shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
) -> _Contribution | None:
    """The boxes a checkpoint tensor (of shape ``found``) fills in ``spec`` on this rank; ``None``
    when this rank needs nothing from it (an expert that lives on another rank)."""
    sharding = spec.sharding
    local = full_box(spec.local_shape)
    scalar = found if found in ((), (1,)) else (1,)  # 0-dim and [1] scalars are interchangeable
    if isinstance(sharding, Shared):
        ids = list(sharding.ids) if shard_id is None else [shard_id]
        if shard_id is not None and shard_id not in sharding.ids:
            raise ShardingError(f"{spec.name}: shard id {shard_id!r} is not one of {list(sharding.ids)}")
        return _Contribution(tuple((full_box(spec.shape), local, i) for i in ids), (), spec.shape)
    if isinstance(sharding, Pick):
        if shard_id is not None and shard_id not in sharding.ids:
            raise ShardingError(f"{spec.name}: shard id {shard_id!r} is not one of {list(sharding.ids)}")
        keep = shard_id is None or shard_id == sharding.keep
        return _Contribution(((full_box(spec.shape), local, sharding.keep),) if keep else (), (), spec.shape)
    if isinstance(sharding, Slots):
        if shard_id is None:
            ids = list(sharding.ids)
        elif shard_id in sharding.ids:
            ids = [shard_id]
        else:
            raise ShardingError(f"{spec.name}: shard id {shard_id!r} is not one of its scale slots {list(sharding.ids)}")
        pairs = [(full_box(scalar), ((i, i + 1),), slot) for i, slot in enumerate(sharding.ids) if slot in ids]
        return _Contribution(tuple(pairs), (), scalar)
    if spec.shape in ((), (1,)) and isinstance(sharding, Replicated):  # a scalar, stored 0-dim or [1]
        if shard_id is not None:
            raise ShardingError(f"{spec.name}: a scalar parameter takes no shard id, got {shard_id!r}")
        return _Contribution(((full_box(scalar), local, None),), (), scalar)
    if isinstance(sharding, Blocked):
        tp, rank = (1, 0) if sharding.split.disable_tp else (parallel.tp_size, parallel.rank)
        pairs, expected = _blocked_pairs(sharding, spec.shape, local, shard_id, tp, rank, spec.name)
        return _Contribution(tuple(pairs), (), expected)
    if isinstance(sharding, ExpertSplit):
        slots = parallel.expert_slots(sharding.num_experts)
        tp, rank = parallel.expert_tp
        inner, expected = _split_pairs(sharding.inner, spec.shape[1:], local[1:], shard_id, tp, rank, spec.name)
        if expert is not None:  # one expert's matrix
            if not 0 <= expert < sharding.num_experts:
                raise ShardingError(f"{spec.name}: expert {expert} is out of range; the config has {sharding.num_experts} experts")
            pairs = [(src, ((s, s + 1),) + dst, (s, seg)) for s, e in enumerate(slots) if e == expert for src, dst, seg in inner]
            return _Contribution(tuple(pairs), (), expected) if pairs else None
        pairs = [(((e, e + 1),) + src, ((s, s + 1),) + dst, (s, seg)) for s, e in enumerate(slots) for src, dst, seg in inner]
        return _Contribution(tuple(pairs), (), (sharding.num_experts,) + expected)
    if expert is not None:
        raise ShardingError(f"{spec.name}: a per-expert tensor (expert {expert}) maps to a parameter that holds no experts")
    if isinstance(sharding, Split):
        pairs, expected = _split_pairs(sharding, spec.shape, local, shard_id, parallel.tp_size, parallel.rank, spec.name)
        return _Contribution(tuple(pairs), (), expected)
    if shard_id is not None:
        raise ShardingError(f"{spec.name}: a {type(sharding).__name__} parameter takes no shard id, got {shard_id!r}")
    if isinstance(sharding, VocabSplit):
        shard = vocab_shard(sharding.vocab, parallel.tp_size, parallel.rank, padding=sharding.padding)
        n = shard.num_org
        pairs = [(with_range(full_box(spec.shape), 0, shard.org), with_range(local, 0, (0, n)), None)] if n else []
        zeros = (with_range(local, 0, (n, shard.per_partition)),) if n < shard.per_partition else ()
        return _Contribution(tuple(pairs), zeros, spec.shape)
    return _Contribution(((full_box(spec.shape), local, None),), (), spec.shape)


def expected_slots(spec: ParamSpec, parallel: Parallel) -> list[Any]:
    """The slot keys that must all be filled for ``spec`` to be complete on this rank."""
    sharding = spec.sharding
    if isinstance(sharding, (Slots, Shared)):
        return list(sharding.ids)
    if isinstance(sharding, Pick):
        return [sharding.keep]
    if isinstance(sharding, Blocked):
        return [seg.id for seg in sharding.split.segments]
    if isinstance(sharding, ExpertSplit):
        slots = parallel.expert_slots(sharding.num_experts)
        return [(s, seg.id) for s in range(len(slots)) for seg in sharding.inner.segments]
    if isinstance(sharding, Split):
        return [seg.id for seg in sharding.segments]
    return [None]


def _describe_slot(spec: ParamSpec, slot: Any, parallel: Parallel) -> str:
    if isinstance(spec.sharding, ExpertSplit):
        s, seg = slot
        logical = parallel.expert_slots(spec.sharding.num_experts)[s]
        return f"expert {logical} ({seg})"
    return f"segment {slot!r}"


def _merge_expert_runs(copies: list[Copy]) -> list[Copy]:
    """Join copies of consecutive experts from a 3-D tensor into one box (fewer, longer reads)."""
    merged: list[Copy] = []
    for c in copies:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.tensor == c.tensor
            and len(c.src) == 3
            and last.src[1:] == c.src[1:]
            and last.dst[1:] == c.dst[1:]
            and last.src[0][1] == c.src[0][0]
            and last.dst[0][1] == c.dst[0][0]
        ):
            src = ((last.src[0][0], c.src[0][1]),) + c.src[1:]
            dst = ((last.dst[0][0], c.dst[0][1]),) + c.dst[1:]
            merged[-1] = Copy(c.tensor, src, dst, c.transpose)
        else:
            merged.append(c)
    return merged


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
    checks: dict[str, list[Copy]] = defaultdict(list)
    filled: dict[tuple[str, Any], str] = {}  # (parameter, slot) -> checkpoint tensor
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
                part = _contribution(spec, shard_id, mapped.expert, layout.parallel, info.shape)
            except ShardingError as exc:
                problems.append(f"checkpoint tensor {name!r} in {info.file.name}: {exc}")
                continue
            if part is None:
                dropped.append((name, f"expert {mapped.expert} is not held by rank {layout.parallel.rank}"))
                continue
            stored = tuple(reversed(part.expected)) if spec.transposed else part.expected
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
            # a vocabulary shard that is all padding takes nothing from the tensor but is complete
            keys = [(spec.name, slot) for _, _, slot in part.pairs] or [(spec.name, None)] * bool(part.zeros)
            clash = next((filled[k] for k in keys if k in filled), None)
            if clash is not None:
                problems.append(f"checkpoint tensors {clash!r} and {name!r} both fill parameter {spec.name}")
                continue
            filled.update({k: name for k in keys})
            for src, dst, _ in part.pairs:
                copy = Copy(name, tuple(reversed(src)) if spec.transposed else src, dst, spec.transposed)
                if isinstance(spec.sharding, Shared) and copies[spec.name]:
                    if copy != copies[spec.name][0]:
                        checks[spec.name].append(copy)
                else:
                    copies[spec.name].append(copy)
            zeros[spec.name].extend(part.zeros)
            used[name] = info

    missing, fills = [], {}
    for spec in params.values():
        wanted = expected_slots(spec, layout.parallel)
        absent = [slot for slot in wanted if (spec.name, slot) not in filled]
        if spec.derived or not wanted:  # nothing to fill (an EP rank past the experts holds none)
            continue
        if len(absent) == len(wanted) and spec.default is not None:
            fills[spec.name] = spec.default
        elif len(absent) == len(wanted):
            missing.append(spec.name)
        elif absent:
            present = sorted({filled[(spec.name, s)] for s in wanted if (spec.name, s) in filled})
            problems.append(
                f"{spec.name} is only partly initialized from checkpoint: "
                f"{_abbreviate([_describe_slot(spec, slot, layout.parallel) for slot in absent])} not found "
                f"(found: {_abbreviate(present, 3)})"
            )
        else:
            problem = _coverage_problem(spec, copies[spec.name], zeros[spec.name])
            if problem:
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
            ParamPlan(
                s,
                tuple(_merge_expert_runs(sorted(copies[s.name], key=lambda c: c.dst))),
                tuple(zeros[s.name]),
                fills.get(s.name),
                tuple(checks[s.name]),
            )
            for s in params.values()
        ),
        schemes=layout.schemes,
        tensors=used,
        aliases=layout.aliases,
        dropped=tuple(dropped),
    )


def _float_compatible(checkpoint_dtype: str, param_dtype: str) -> bool:
    source = torch_name(checkpoint_dtype)
    is_float = source.startswith(("float", "bfloat"))
    return is_float == param_dtype.startswith(("float", "bfloat")) or source == param_dtype


def _coverage_problem(spec: ParamSpec, copies: list[Copy], zeros: list[Box]) -> str | None:
    """A message when the boxes do not tile the rank-local parameter exactly once (every slot
    being filled should guarantee it; this guards the index maths itself)."""
    boxes = [c.dst for c in copies] + zeros
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if boxes_overlap(a, b):
                return f"{spec.name}: two checkpoint slices overlap in the rank-local parameter at {_slices(a)} and {_slices(b)}"
    covered, total = sum(box_volume(b) for b in boxes), box_volume(full_box(spec.local_shape))
    if covered != total:
        return f"{spec.name}: the planned slices cover {covered} of its {total} elements"
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
