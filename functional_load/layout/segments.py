"""The pure index maths behind the slice descriptors: segments, vocabulary shards, boxes.

Functions here turn ``(sizes, tp_size, rank)`` into row ranges, with no tensor in sight: the
analogue of JAX's ``devices_indices_map``, descriptor first, bytes later. Ranges are half-open
``(start, stop)`` pairs; a box is one range per dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

from ..errors import ConfigError, ShardingError
from ..model.mapping import ShardId

Range = tuple[int, int]
Box = tuple[Range, ...]
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Segment:
    """A logical block along the split dimension: ``count`` units of ``unit`` rows each.

    ``count`` is what must divide over the ranks (attention heads, not rows). A segment marked
    ``replicate`` (KV heads) may have fewer units than ranks: then ``tp_size // count`` ranks
    share each unit, and rank ``r`` reads unit ``r // replicas`` (vLLM's ``num_kv_head_replicas``).
    An ``uneven`` segment needs no division: every rank allocates ``ceil(count / tp)`` units and
    reads its share in rank order, so the last ranks read fewer (the rest is zero): vLLM's MXFP4
    experts, split in whole 32-value blocks.
    """

    id: ShardId
    count: int
    unit: int = 1
    replicate: bool = False
    label: str = "rows"  # what a unit is, for error messages: "attention heads", "KV heads"...
    uneven: bool = False
    # with tp > 1, every rank allocates at least this many rows for the segment, its own rows first
    # and zeros after (Kimi-Linear's experts: min_moe_intermediate_per_partition)
    pad: int = 0

    def __post_init__(self) -> None:
        if self.count < 0 or self.unit < 1:
            # sizes come from config.json (e.g. a head_dim of hidden_size // heads that rounds to 0)
            raise ConfigError(
                f"segment {self.id!r} ({self.label}): count must be >= 0 and unit >= 1, got {self.count}, {self.unit}; "
                "check config.json"
            )

    @property
    def rows(self) -> int:
        """Rows of this segment in the checkpoint (unreplicated)."""
        return self.count * self.unit


@dataclass(frozen=True, slots=True)
class Piece:
    """One segment's contribution to a rank: checkpoint rows ``src`` (relative to the start of the
    segment, or of the fused tensor) land in local rows ``dst`` of the parameter."""

    segment: ShardId
    src: Range
    dst: Range


def divides(segment: Segment, tp_size: int) -> bool:
    """Whether ``segment`` can be spread over ``tp_size`` ranks."""
    if segment.uneven:
        return True
    if segment.replicate and 0 < segment.count < tp_size:
        return tp_size % segment.count == 0
    return segment.count % tp_size == 0


def valid_tp_sizes(segment: Segment, up_to: int = 64) -> list[int]:
    """The tp sizes up to ``up_to`` that ``segment`` divides over, for error messages."""
    return [tp for tp in range(1, up_to + 1) if divides(segment, tp)]


def segment_rows(segment: Segment, tp_size: int, rank: int) -> Range:
    """Checkpoint rows of ``segment`` (relative to its start) that ``rank`` holds.

    Raises ShardingError when the units neither divide over ``tp_size`` nor (for replicable
    segments) divide ``tp_size``.
    """
    if not divides(segment, tp_size):
        what = "be replicated over" if segment.replicate and segment.count < tp_size else "divide over"
        raise ShardingError(
            f"{segment.count} {segment.label} (segment {segment.id!r}) cannot {what} tp={tp_size}; "
            f"valid tp sizes: {valid_tp_sizes(segment)}"
        )
    if segment.replicate and 0 < segment.count < tp_size:
        replicas = tp_size // segment.count
        unit_index = rank // replicas
        return unit_index * segment.unit, (unit_index + 1) * segment.unit
    per_rank = _share(segment, tp_size)
    return min(rank * per_rank, segment.rows), min((rank + 1) * per_rank, segment.rows)


def _share(segment: Segment, tp_size: int) -> int:
    """Rows of ``segment`` each rank reads (the last ranks of an uneven one read fewer)."""
    if segment.replicate and 0 < segment.count < tp_size:
        return segment.unit
    if segment.uneven:
        return -(-segment.count // tp_size) * segment.unit
    return segment.count // tp_size * segment.unit


def segment_width(segment: Segment, tp_size: int) -> int:
    """Local rows every rank allocates for ``segment`` (an uneven one's last ranks pad with zeros;
    with ``pad`` and tp > 1, at least ``pad`` rows, zero past the rank's own)."""
    share = _share(segment, tp_size)
    return max(share, segment.pad) if segment.pad and tp_size > 1 else share


def segment_pieces(segments: tuple[Segment, ...], tp_size: int, rank: int) -> tuple[Piece, ...]:
    """Where each segment's rows go on ``rank``: local rows are the segments back to back, each
    :func:`segment_width` wide (an uneven segment's rows past its data are zero)."""
    pieces, offset = [], 0
    for segment in segments:
        start, stop = segment_rows(segment, tp_size, rank)
        pieces.append(Piece(segment.id, (start, stop), (offset, offset + stop - start)))
        offset += segment_width(segment, tp_size)
    return tuple(pieces)


def segment_offsets(segments: tuple[Segment, ...]) -> dict[ShardId, int]:
    """Start row of each segment inside a tensor that stores them fused (Phi-3 ``qkv_proj``)."""
    offsets, offset = {}, 0
    for segment in segments:
        offsets[segment.id] = offset
        offset += segment.rows
    return offsets


def pad_vocab_size(vocab: int, padding: int = 64) -> int:
    """``vocab`` rounded up to a multiple of ``padding``."""
    return -(-vocab // padding) * padding


@dataclass(frozen=True, slots=True)
class VocabShard:
    """One rank's part of a padded vocabulary (vLLM ``VocabParallelEmbeddingShardIndices``).

    ``org`` and ``added`` are the real token ids the rank holds (clamped to the vocab);
    ``padded_org`` and ``padded_added`` include the padding rows; ``per_partition`` is the number
    of rows of the rank-local parameter.
    """

    padded_org: Range
    padded_added: Range
    org: Range
    added: Range
    per_partition: int

    @property
    def num_org(self) -> int:
        return self.org[1] - self.org[0]

    @property
    def num_added(self) -> int:
        return self.added[1] - self.added[0]

    @property
    def num_org_padding(self) -> int:
        return self.padded_org[1] - self.padded_org[0] - self.num_org


def vocab_shard(org_vocab: int, tp_size: int, rank: int, *, padding: int = 64, added_vocab: int = 0) -> VocabShard:
    """The rows ``rank`` holds of a vocab of ``org_vocab + added_vocab`` ids (vLLM ``_get_indices``).

    Padding is to a multiple of ``padding`` (64 by default, not ``64 * tp``), so the padded size
    must still divide over ``tp_size``: e.g. 32000 over tp=3 does not; ``padding=lcm(64, 3)`` does.
    """
    org_padded = pad_vocab_size(org_vocab, padding)
    num_padded = pad_vocab_size(org_padded + added_vocab, padding)
    for total in (num_padded, org_padded):
        if total % tp_size:
            raise ShardingError(
                f"the padded vocabulary of {total} rows (vocab {org_vocab + added_vocab} padded to a multiple of "
                f"{padding}) does not divide over tp={tp_size}; use a tp size that divides {total}, or a padding "
                f"of lcm({padding}, {tp_size}) = {math.lcm(padding, tp_size)}"
            )
    per_org = org_padded // tp_size
    added_padded = num_padded - org_padded
    per_added = added_padded // tp_size
    padded_org = (rank * per_org, (rank + 1) * per_org)
    padded_added = (org_vocab + rank * per_added, org_vocab + (rank + 1) * per_added)
    total_vocab = org_vocab + added_vocab
    org = (min(padded_org[0], org_vocab), min(padded_org[1], org_vocab))
    added = (min(padded_added[0], total_vocab), min(padded_added[1], total_vocab))
    return VocabShard(padded_org, padded_added, org, added, num_padded // tp_size)


def box_volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def boxes_overlap(a: Box, b: Box) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def with_range(box: Box, dim: int, rng: Range) -> Box:
    """``box`` with dimension ``dim`` replaced by ``rng``."""
    return box[:dim] + (rng,) + box[dim + 1 :]


def swap_last(box: tuple[_T, ...]) -> tuple[_T, ...]:
    """``box`` (or a shape) with its last two dimensions swapped: a transposed matrix, or each
    expert's matrix of a 3-D tensor."""
    return box[:-2] + (box[-1], box[-2]) if len(box) >= 2 else box


STORED = ("concat", "grouped")  # how a fused QKV tensor orders its rows on disk


def grouped_runs(segments: tuple[Segment, ...], segment: ShardId, start: int, stop: int) -> list[tuple[int, int, int]]:
    """Rows ``[start, stop)`` of QKV segment ``segment`` (relative to it) of a tensor stored per KV
    group, ``[q heads of the group..., k, v]`` for each group (Falcon; Bloom, one group per head),
    as ``(stored start, stored stop, offset into [start, stop))`` runs, in order. vLLM regroups
    such a tensor to ``[q; k; v]`` before its QKV loader splits it (``falcon.py``, ``bloom.py``)."""
    q, k, v = segments
    if not (q.id, k.id, v.id) == ("q", "k", "v") or not q.unit == k.unit == v.unit or k.count < 1 or q.count % k.count:
        raise ConfigError(f"a QKV tensor stored per KV group needs q, k, v of one head size and whole groups, got {segments}")
    head, per = q.unit, q.count // k.count
    stride = (per + 2) * head
    runs, pos = [], start
    while pos < stop:
        index, within = divmod(pos, head)
        if segment == "q":
            group, slot = divmod(index, per)
            base, end = group * stride + slot * head, min(stop, (index + per - slot) * head)
        else:
            base, end = index * stride + (per if segment == "k" else per + 1) * head, min(stop, (index + 1) * head)
        runs.append((base + within, base + within + end - pos, pos - start))
        pos = end
    return runs
