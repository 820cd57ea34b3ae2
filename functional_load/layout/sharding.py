"""Slice descriptors: how one parameter is spread over the ranks, with the behaviour that follows.

Like JAX's ``NamedSharding``, each descriptor knows what it means for a rank: its local shape,
the slots that must be filled, which box of a checkpoint tensor lands where (:meth:`part`), the
local range of each fused segment, the dimension along which ranks differ, and its JSON form.
Nothing outside this module switches on the descriptor's type. Every value is validated when
it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError, ShardingError
from ..model.mapping import ShardId
from .parallel import Parallel
from .placement import Along, Placement, Same
from .segments import (
    STORED,
    Box,
    Piece,
    Range,
    Segment,
    VocabShard,
    full_box,
    grouped_runs,
    segment_offsets,
    segment_pieces,
    segment_width,
    vocab_shard,
    with_range,
)


@dataclass(frozen=True, slots=True)
class ExpertSlot:
    """What a local expert slot must be filled with: its ``segment`` (of a fused expert weight, or None)."""

    slot: int
    segment: Slot  # the inner parameter's slot


Slot = ShardId | ExpertSlot | None  # a key of what must be filled: a segment id, an expert slot's, or None (the whole)


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
    def segment_dim(self) -> int | None:
        """The dimension the fused segments (q, k, v; gate, up) are laid out along, or None: not
        where the parameter is split across ranks, which :meth:`placement` says."""
        return None

    def describe(self, slot: Slot, parallel: Parallel) -> str:
        return f"segment {slot!r}"

    def unit_rows(self, shard_id: ShardId | None) -> int:
        """Rows per unit (a head) of what ``shard_id`` fills, along the split dimension 0; 0 when
        rows are not split in units (a tensor whose rows cannot be permuted within a head)."""
        return 0

    def to_json(self) -> dict[str, object]:
        return {"kind": "replicated"}


@dataclass(frozen=True, slots=True)
class Replicated(Sharding):
    """Every rank holds the whole tensor (norms, routers, biases of row-parallel layers).

    ``squeeze``: the checkpoint may store the tensor with extra leading dimensions of size 1, which
    vLLM's loader squeezes away (ERNIE-4.5's ``moe_statics.e_score_correction_bias`` ``[1, E]``)."""

    squeeze: bool = False

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part | None:
        lead = len(found) - len(shape)
        if self.squeeze and lead > 0 and found[lead:] == shape and set(found[:lead]) == {1}:
            _no_expert(expert)
            _no_shard_id("replicated", shard_id)
            return Part(((full_box(found), full_box(shape), None),), (), found)
        return Sharding.part(self, shape, shard_id, expert, parallel, found)

    def to_json(self) -> dict[str, object]:
        return {"kind": "replicated", "squeeze": True} if self.squeeze else {"kind": "replicated"}


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
    # the checkpoint may store the tensor with extra dimensions of size 1, which vLLM's loader views
    # away (Kimi-Linear's A_log [1, 1, heads, 1] for a [heads] parameter)
    squeeze: bool = False

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
        if isinstance(shard_id, tuple):  # consecutive segments stored back to back in one tensor
            for one in shard_id:
                self.segment_ids(one)
            start = ids.index(shard_id[0]) if shard_id else -1
            if not shard_id or list(shard_id) != ids[start : start + len(shard_id)]:
                raise ShardingError(f"Shard id with multiple indices should be consecutive. Got shard id {shard_id}.")
            return list(shard_id)
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
        part = self._part(shape, shard_id, expert, parallel)
        if self.squeeze and found != part.expected and _ones_removed(found) == _ones_removed(part.expected):
            lift = lambda box: _unsqueeze_box(box, part.expected, found)
            return replace(part, pairs=tuple((lift(src), dst, slot) for src, dst, slot in part.pairs), expected=found)
        return part

    def _part(self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel) -> Part:
        _no_expert(expert)
        ids = self.segment_ids(shard_id)
        rows = sum(s.rows for s in self.segments if s.id in ids)
        expected = with_range(full_box(shape), self.dim, (0, rows))
        local = full_box(self.local_shape(shape, parallel))
        offsets = segment_offsets(self.segments if shard_id is None else tuple(s for s in self.segments if s.id in ids))
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
    def segment_dim(self) -> int | None:
        return self.dim

    def to_json(self) -> dict[str, object]:
        segments = [{"id": g.id, "count": g.count, "unit": g.unit, "replicate": g.replicate} for g in self.segments]
        out = {"kind": "split", "dim": self.dim, "segments": segments, "disable_tp": self.disable_tp, "stored": self.stored}
        return {**out, "squeeze": True} if self.squeeze else out


def _ones_removed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def _unsqueeze_box(box: Box, shape: tuple[int, ...], found: tuple[int, ...]) -> Box:
    """``box`` of a tensor of ``shape`` as a box of the same elements viewed as ``found`` (the
    same dimensions with size-1 ones added or removed)."""
    ranges = iter(r for r, n in zip(box, shape) if n != 1)
    return tuple((0, 1) if n == 1 else next(ranges) for n in found)


@dataclass(frozen=True, slots=True)
class VocabSplit(Sharding):
    """Vocab-parallel embedding / LM head: pad the vocab to a multiple of ``padding``, then split
    dim 0 evenly; rows past the real vocab are zero (vLLM ``VocabParallelEmbedding``)."""

    vocab: int
    padding: int = 64

    def __post_init__(self) -> None:
        if self.vocab < 0 or self.padding < 1:
            raise ConfigError(f"a vocabulary of {self.vocab} padded to multiples of {self.padding}: both must be positive")

    def shard(self, parallel: Parallel) -> VocabShard:
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

    def to_json(self) -> dict[str, object]:
        return {"kind": "vocab", "vocab": self.vocab, "padding": self.padding}
