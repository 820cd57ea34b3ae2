"""Slice descriptors: how one parameter is spread over the ranks, with the behaviour that follows.

Like JAX's ``NamedSharding``, each descriptor knows what it means for a rank: its local shape,
the slots that must be filled, which box of a checkpoint tensor lands where (:meth:`part`), the
local range of each fused segment, the dimension along which ranks differ, and its JSON form.
Nothing outside this module switches on the descriptor's type. Every value is validated when
it is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, ShardingError
from ..model.mapping import ShardId
from .parallel import Parallel
from .placement import Along, PerRank, Placement, Same
from .segments import (
    STORED,
    Box,
    Piece,
    Range,
    Segment,
    full_box,
    grouped_runs,
    segment_offsets,
    segment_pieces,
    segment_width,
    vocab_shard,
    with_range,
)

Slot = Any  # a key of what must be filled: a segment id, (expert slot, segment id) or None


@dataclass(frozen=True, slots=True)
class Part:
    """What one checkpoint tensor (for one shard id) gives one parameter on one rank.

    ``pairs``: ``(src box, dst box, slot)``, the source box in destination orientation;
    ``zeros``: local boxes that are zero (vocabulary padding); ``expected``: the checkpoint
    tensor's shape, in destination orientation; ``check``: several tensors store the same
    values (act-order ``g_idx``): the first fills the parameter, the others are compared;
    ``transpose``: the checkpoint stores the tensor with its last two dimensions swapped
    (input-major fused experts); ``repeat``: per dimension of the source box, how many
    destination elements each source element fills, the destination box taking the first of
    them (vLLM's refined FP8 MoE block scales)."""

    pairs: tuple[tuple[Box, Box, Slot], ...]
    zeros: tuple[Box, ...]
    expected: tuple[int, ...]
    check: bool = False  # the pairs fill the parameter only once; other tensors' are read and compared
    transpose: bool = False
    repeat: tuple[int, ...] = ()
    rotary: int = 0  # rows per head whose rotary pairs are de-interleaved on load (see plan.Copy)


def _no_shard_id(kind: str, shard_id: ShardId | None) -> None:
    if shard_id is not None:
        raise ShardingError(f"a {kind} parameter takes no shard id, got {shard_id!r}")


def _no_expert(expert: int | None) -> None:
    if expert is not None:
        raise ShardingError(f"a per-expert tensor (expert {expert}) maps to a parameter that holds no experts")


def _lead(repeat: tuple[int, ...]) -> tuple[int, ...]:
    """``repeat`` of an expert's tensor, with the expert dimension in front (kept as it is)."""
    return (1,) + repeat if repeat else ()


def _scalar(found: tuple[int, ...]) -> tuple[int, ...]:
    return found if found in ((), (1,)) else (1,)  # 0-dim and [1] scalars are interchangeable


@dataclass(frozen=True, slots=True)
class Sharding:
    """The base of every descriptor; its behaviour is that of a replicated parameter, which each
    kind overrides where it differs."""

    def local_shape(self, shape: tuple[int, ...], parallel: Parallel) -> tuple[int, ...]:
        return shape

    def slots(self, parallel: Parallel) -> list[Slot]:
        return [None]

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part | None:
        """What a checkpoint tensor of shape ``found`` (for ``shard_id``, or of one ``expert``)
        gives this parameter on this rank; None when the rank needs nothing of it."""
        _no_expert(expert)
        _no_shard_id("replicated", shard_id)
        expected = _scalar(found) if shape in ((), (1,)) else shape  # a scalar, stored 0-dim or [1]
        return Part(((full_box(expected), full_box(shape), None),), (), expected)

    def segment_ranges(self, shape: tuple[int, ...], parallel: Parallel) -> list[tuple[ShardId | None, Range]]:
        return [(None, (0, shape[0] if shape else 1))]

    def placement(self, parallel: Parallel) -> Placement:
        """Where the values live across the ranks: the same on every rank, split along a
        dimension, or different per rank (:mod:`.placement`)."""
        return Same()

    @property
    def split_dim(self) -> int | None:
        """The dimension the fused segments are laid out along (None: not split)."""
        return None

    def describe(self, slot: Slot, parallel: Parallel) -> str:
        return f"segment {slot!r}"

    def unit_rows(self, shard_id: ShardId | None) -> int:
        """Rows per unit (a head) of what ``shard_id`` fills, along the split dimension 0; 0 when
        rows are not split in units (a tensor whose rows cannot be permuted within a head)."""
        return 0

    def to_json(self) -> dict[str, Any]:
        return {"kind": "replicated"}


@dataclass(frozen=True, slots=True)
class Replicated(Sharding):
    """Every rank holds the whole tensor (norms, routers, biases of row-parallel layers)."""


@dataclass(frozen=True, slots=True)
class Split(Sharding):
    """Split along ``dim`` over the ranks, segment by segment.

    One segment is a plain column (``dim=0``) or row (``dim=1``) split. Several segments are a
    merged or QKV parameter: each rank holds ``[seg0_r; seg1_r; ...]`` back to back.
    ``disable_tp`` keeps the segment structure but gives every rank everything (vLLM's
    ``disable_tp=True`` layers, e.g. DeepSeek's ``fused_qkv_a_proj``).
    """

    dim: int
    segments: tuple[Segment, ...]
    disable_tp: bool = False
    stored: str = "concat"  # a tensor holding every segment orders them so on disk ("grouped": per KV group)

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        if self.stored not in STORED:
            raise ValueError(f"Split.stored must be one of {STORED}, got {self.stored!r}")
        if self.dim < 0 or not self.segments:
            raise ValueError(f"Split needs a dimension >= 0 and at least one segment, got {self.dim}, {self.segments}")
        ids = [s.id for s in self.segments]
        if len(set(ids)) != len(ids):
            raise ValueError(f"Split segment ids must be unique, got {ids}")

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    def tp(self, parallel: Parallel) -> tuple[int, int]:
        """(tp size, rank) this split is cut by: none for a ``disable_tp`` layer."""
        return (1, 0) if self.disable_tp else (parallel.tp_size, parallel.rank)

    def pieces(self, parallel: Parallel) -> tuple[Piece, ...]:
        """Each segment's checkpoint rows on this rank and where they go (raises when it does not divide)."""
        return segment_pieces(self.segments, *self.tp(parallel))

    def local_shape(self, shape: tuple[int, ...], parallel: Parallel) -> tuple[int, ...]:
        self.pieces(parallel)  # raises when a segment does not divide
        tp = self.tp(parallel)[0]
        rows = sum(segment_width(s, tp) for s in self.segments)
        return shape[: self.dim] + (rows,) + shape[self.dim + 1 :]

    def slots(self, parallel: Parallel) -> list[Slot]:
        return [s.id for s in self.segments]

    def segment_ids(self, shard_id: ShardId | None) -> list[ShardId]:
        """The segments a tensor with ``shard_id`` fills (all of them for ``None``: stored fused)."""
        ids = [s.id for s in self.segments]
        if shard_id is None:
            return ids
        if all(isinstance(i, str) for i in ids):  # QKV: vLLM's message
            if shard_id not in ids:
                raise ShardingError(f"shard id for a QKV parameter should be 'q', 'k', or 'v', got shard id {shard_id!r}")
            return [shard_id]
        if not isinstance(shard_id, int) or isinstance(shard_id, bool):
            raise ShardingError(f"shard id {shard_id!r} is not an int in [0, {len(ids) - 1}]")
        if not 0 <= shard_id < len(ids):
            raise ShardingError(f"shard id should be between 0 and {len(ids) - 1}. Got shard id {shard_id}.")
        return [shard_id]

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part:
        _no_expert(expert)
        ids = self.segment_ids(shard_id)
        rows = sum(s.rows for s in self.segments if s.id in ids)
        expected = with_range(full_box(shape), self.dim, (0, rows))
        local = full_box(self.local_shape(shape, parallel))
        offsets = segment_offsets(self.segments) if shard_id is None else {shard_id: 0}
        pieces = [p for p in self.pieces(parallel) if p.segment in ids]
        if shard_id is None and self.stored == "grouped":  # one pair per run of the rows as stored
            pairs = tuple(
                (with_range(expected, self.dim, (a, b)), with_range(local, self.dim, (p.dst[0] + off, p.dst[0] + off + b - a)), p.segment)
                for p in pieces
                for a, b, off in grouped_runs(self.segments, p.segment, *p.src)
            )
        else:
            pairs = tuple(
                (
                    with_range(expected, self.dim, (offsets[p.segment] + p.src[0], offsets[p.segment] + p.src[1])),
                    with_range(local, self.dim, p.dst),
                    p.segment,
                )
                for p in pieces
                if p.dst[1] > p.dst[0]
            )
        tp = self.tp(parallel)[0]
        widths = {s.id: segment_width(s, tp) for s in self.segments}
        zeros = tuple(
            with_range(local, self.dim, (p.dst[1], p.dst[0] + widths[p.segment]))
            for p in pieces
            if p.dst[1] - p.dst[0] < widths[p.segment]
        )
        return Part(pairs, zeros, tuple(b for _, b in expected))

    def segment_ranges(self, shape: tuple[int, ...], parallel: Parallel) -> list[tuple[ShardId | None, Range]]:
        return [(p.segment, p.dst) for p in self.pieces(parallel)]

    def unit_rows(self, shard_id: ShardId | None) -> int:
        units = {s.unit for s in self.segments if s.id in self.segment_ids(shard_id)}
        return units.pop() if self.dim == 0 and len(units) == 1 else 0

    def placement(self, parallel: Parallel) -> Placement:
        return Same() if self.disable_tp else Along(self.dim)

    @property
    def split_dim(self) -> int | None:
        return self.dim

    def to_json(self) -> dict[str, Any]:
        segments = [{"id": g.id, "count": g.count, "unit": g.unit, "replicate": g.replicate} for g in self.segments]
        return {"kind": "split", "dim": self.dim, "segments": segments, "disable_tp": self.disable_tp, "stored": self.stored}


@dataclass(frozen=True, slots=True)
class VocabSplit(Sharding):
    """Vocab-parallel embedding / LM head: pad the vocab to a multiple of ``padding``, then split
    dim 0 evenly; rows past the real vocab are zero (vLLM ``VocabParallelEmbedding``)."""

    vocab: int
    padding: int = 64

    def __post_init__(self) -> None:
        if self.vocab < 0 or self.padding < 1:
            raise ConfigError(f"a vocabulary of {self.vocab} padded to multiples of {self.padding}: both must be positive")

    def shard(self, parallel: Parallel) -> Any:
        return vocab_shard(self.vocab, parallel.tp_size, parallel.rank, padding=self.padding)

    def local_shape(self, shape: tuple[int, ...], parallel: Parallel) -> tuple[int, ...]:
        return (self.shard(parallel).per_partition,) + shape[1:]

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part:
        _no_expert(expert)
        _no_shard_id("vocab-parallel", shard_id)
        shard = self.shard(parallel)
        local, n = full_box(self.local_shape(shape, parallel)), shard.num_org
        pairs = ((with_range(full_box(shape), 0, shard.org), with_range(local, 0, (0, n)), None),) if n else ()
        zeros = (with_range(local, 0, (n, shard.per_partition)),) if n < shard.per_partition else ()
        return Part(pairs, zeros, shape)

    def placement(self, parallel: Parallel) -> Placement:
        return Along(0)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "vocab", "vocab": self.vocab, "padding": self.padding}


@dataclass(frozen=True, slots=True)
class ExpertSplit(Sharding):
    """A fused MoE parameter ``[E_local, ...]``: whole experts on dim 0, each expert's tensor
    described by ``inner`` (over the dimensions after the expert's).

    Without expert parallelism every rank holds every expert, each sharded by ``inner`` over the
    tensor-parallel ranks; with it, experts are spread over the ranks
    (:meth:`Parallel.expert_slots`) and kept whole. ``input_major``: a checkpoint tensor holding
    every expert at once stores each expert's matrix transposed (Llama 4, gpt-oss
    ``gate_up_proj [E, H, 2I]``); per-expert tensors are ``[out, in]`` as usual.
    """

    num_experts: int
    inner: Sharding
    input_major: bool = False

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ConfigError(f"an MoE layer needs at least one expert, got {self.num_experts}")

    def local_shape(self, shape: tuple[int, ...], parallel: Parallel) -> tuple[int, ...]:
        held = len(parallel.expert_slots(self.num_experts))
        return (held,) + self.inner.local_shape(shape[1:], parallel.expert_tp)

    def slots(self, parallel: Parallel) -> list[Slot]:
        held = parallel.expert_slots(self.num_experts)
        return [(s, seg) for s in range(len(held)) for seg in self.inner.slots(parallel.expert_tp)]

    def describe(self, slot: Slot, parallel: Parallel) -> str:
        s, segment = slot
        expert = parallel.expert_slots(self.num_experts)[s]
        return f"expert {expert}" + (f" ({segment})" if segment is not None else "")

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part | None:
        held = parallel.expert_slots(self.num_experts)
        inner_found = found[1:] if expert is None else found
        inner = self.inner.part(shape[1:], shard_id, None, parallel.expert_tp, inner_found)
        if inner is None:
            return None
        if expert is not None:  # one expert's tensor; None when no local slot holds it
            if not 0 <= expert < self.num_experts:
                raise ShardingError(f"expert {expert} is out of range; the config has {self.num_experts} experts")
            slots = [s for s, e in enumerate(held) if e == expert]
            pairs = tuple((src, ((s, s + 1),) + dst, (s, seg)) for s in slots for src, dst, seg in inner.pairs)
            zeros = tuple(((s, s + 1),) + z for s in slots for z in inner.zeros)
            return Part(pairs, zeros, inner.expected, inner.check, repeat=inner.repeat) if slots else None
        pairs = tuple(
            (((e, e + 1),) + src, ((s, s + 1),) + dst, (s, seg)) for s, e in enumerate(held) for src, dst, seg in inner.pairs
        )
        zeros = tuple(((s, s + 1),) + z for s in range(len(held)) for z in inner.zeros)
        expected = (self.num_experts,) + inner.expected
        return Part(pairs, zeros, expected, inner.check, transpose=self.input_major, repeat=_lead(inner.repeat))

    def placement(self, parallel: Parallel) -> Placement:
        if parallel.expert_parallel:
            return Along(0)
        return self.inner.placement(parallel.expert_tp).shifted(1)

    @property
    def split_dim(self) -> int | None:
        dim = self.inner.split_dim
        return None if dim is None else dim + 1

    def to_json(self) -> dict[str, Any]:
        return {"kind": "experts", "num_experts": self.num_experts, "inner": self.inner.to_json(), "input_major": self.input_major}


@dataclass(frozen=True, slots=True)
class FirstRank(Sharding):
    """A tensor the first tensor-parallel rank holds and every other rank holds as zeros (vLLM's
    gpt-oss ``w2_bias``, added once after the row-parallel reduction)."""

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part:
        _no_expert(expert)
        _no_shard_id("first-rank", shard_id)
        if parallel.rank == 0:
            return Part(((full_box(shape), full_box(shape), None),), (), shape)
        return Part((), (full_box(shape),), shape)

    def placement(self, parallel: Parallel) -> Placement:
        return PerRank() if parallel.tp_size > 1 else Same()

    def to_json(self) -> dict[str, Any]:
        return {"kind": "first_rank"}


@dataclass(frozen=True, slots=True)
class Grouped(Sharding):
    """A tensor the checkpoint stores with its last dimension as ``[n / size, size]`` (MXFP4's
    ``_blocks``: 16 bytes per 32-value block); ``inner`` describes the parameter, whose slices of
    that dimension must be whole groups."""

    inner: Sharding
    size: int

    def local_shape(self, shape: tuple[int, ...], parallel: Parallel) -> tuple[int, ...]:
        return self.inner.local_shape(shape, parallel)

    def slots(self, parallel: Parallel) -> list[Slot]:
        return self.inner.slots(parallel)

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part | None:
        part = self.inner.part(shape, shard_id, expert, parallel, found)
        if part is None:
            return None
        size = self.size

        def stored(box: Box) -> Box:
            (a, b) = box[-1]
            if a % size or b % size:
                raise ShardingError(f"a slice {a}:{b} of the last dimension is not made of whole groups of {size}")
            return box[:-1] + ((a // size, b // size), (0, size))

        pairs = tuple((stored(src), dst, slot) for src, dst, slot in part.pairs)
        expected = part.expected[:-1] + (part.expected[-1] // size, size)
        return Part(pairs, part.zeros, expected, part.check, part.transpose)

    def segment_ranges(self, shape: tuple[int, ...], parallel: Parallel) -> list[tuple[ShardId | None, Range]]:
        return self.inner.segment_ranges(shape, parallel)

    def placement(self, parallel: Parallel) -> Placement:
        return self.inner.placement(parallel)

    @property
    def split_dim(self) -> int | None:
        return self.inner.split_dim

    def to_json(self) -> dict[str, Any]:
        return {"kind": "grouped", "size": self.size, "inner": self.inner.to_json()}
