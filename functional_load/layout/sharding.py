"""Slice descriptors and the pure index maths behind them.

A :data:`Sharding` says how one parameter is spread over tensor-parallel ranks; the functions
here turn ``(sharding, tp_size, rank)`` into row ranges, with no tensor in sight. This is the
analogue of JAX's ``devices_indices_map``: descriptor first, bytes later.

Row ranges are half-open ``(start, stop)`` pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

from .errors import ConfigError, ShardingError

Range = tuple[int, int]
Box = tuple[Range, ...]
ShardId = Union[int, str]


@dataclass(frozen=True, slots=True)
class Segment:
    """A logical block along the split dimension: ``count`` units of ``unit`` rows each.

    ``count`` is what must divide over the ranks (attention heads, not rows). A segment marked
    ``replicate`` (KV heads) may have fewer units than ranks: then ``tp_size // count`` ranks
    share each unit, and rank ``r`` reads unit ``r // replicas`` (vLLM's ``num_kv_head_replicas``).
    """

    id: ShardId
    count: int
    unit: int = 1
    replicate: bool = False
    label: str = "rows"  # what a unit is, for error messages: "attention heads", "KV heads"...

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
class Replicated:
    """Every rank holds the whole tensor (norms, routers, biases of row-parallel layers)."""


@dataclass(frozen=True, slots=True)
class Split:
    """Split along ``dim`` over the ranks, segment by segment.

    One segment is a plain column (``dim=0``) or row (``dim=1``) split. Several segments are a
    merged or QKV parameter: each rank holds ``[seg0_r; seg1_r; ...]`` back to back.
    ``disable_tp`` keeps the segment structure but gives every rank everything (vLLM's
    ``disable_tp=True`` layers, e.g. DeepSeek's ``fused_qkv_a_proj``).
    """

    dim: int
    segments: tuple[Segment, ...]
    disable_tp: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        if not self.segments:
            raise ValueError("Split needs at least one segment")
        ids = [s.id for s in self.segments]
        if len(set(ids)) != len(ids):
            raise ValueError(f"Split segment ids must be unique, got {ids}")

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)


@dataclass(frozen=True, slots=True)
class VocabSplit:
    """Vocab-parallel embedding / LM head: pad the vocab to a multiple of ``padding``, then split
    dim 0 evenly; rows past the real vocab are zero (vLLM ``VocabParallelEmbedding``)."""

    vocab: int
    padding: int = 64
    dim: int = field(default=0, init=False)


@dataclass(frozen=True, slots=True)
class ExpertSplit:
    """A fused MoE parameter ``[E_local, ...]``: whole experts on dim 0, each expert's matrix
    sharded by ``inner`` (dims relative to one expert's matrix).

    Without expert parallelism every rank holds every expert, each TP-sharded by ``inner``; with
    it, experts are spread over the ranks (:func:`local_expert_slots`) and kept whole.
    """

    num_experts: int
    inner: Split


@dataclass(frozen=True, slots=True)
class Slots:
    """One scalar per logical shard of a fused linear (vLLM ``PerTensorScaleParameter``): slot
    ``i`` holds the scale of segment ``ids[i]``; a scale stored once for the fused tensor fills
    every slot. The same on every rank."""

    ids: tuple[ShardId, ...]


@dataclass(frozen=True, slots=True)
class Blocked:
    """A block-quantization scale whose dimension ``split.dim`` counts blocks of ``block``
    rows (or columns) of the weight split by ``split``. Each segment's local rows map to
    ``ceil(rows / block)`` scale rows, back to back."""

    split: Split
    block: int
    # Which block-shape check applies: "strict" (vLLM's validate_fp8_block_shape), "fp8" (vLLM's
    # fp8 config: as strict, but a merged layer with a partition off the block grid is let
    # through) or "none" (scales computed per rank while loading: online quantization).
    rule: str = "strict"

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ConfigError(f"block quantization needs a positive block size, got {self.block}; check config.json")
        if self.rule not in ("strict", "fp8", "none"):
            raise ValueError(f"Blocked.rule must be 'strict', 'fp8' or 'none', got {self.rule!r}")

    def check(self, tp_size: int) -> None:
        """vLLM's ``validate_fp8_block_shape``: at ``tp_size``, a row-parallel slice must be a
        whole number of blocks; so must every output partition of a column-parallel layer split
        over the ranks, or, unsplit, every partition of a merged layer but its last."""
        if self.rule == "none":
            return
        split, block = self.split, self.block
        tp = 1 if split.disable_tp else tp_size
        sizes = [p.dst[1] - p.dst[0] for p in split_pieces(split, tp, 0)]
        if split.dim == 1:
            if tp > 1 and sizes[0] % block:
                raise ShardingError(
                    f"Weight input_size_per_partition = {sizes[0]} is not divisible by weight quantization block_k = {block}."
                )
            return
        merged = len(sizes) > 1
        if self.rule == "fp8" and merged and any(n % block for n in sizes):
            return
        tp_split = tp > 1 and split.rows // sum(sizes) == tp
        for n in sizes if tp_split else sizes[:-1]:
            if n % block:
                raise ShardingError(f"Weight output_partition_size = {n} is not divisible by weight quantization block_n = {block}.")


@dataclass(frozen=True, slots=True)
class Shared:
    """A tensor that every part ``ids`` of a fused layer stores identically (GPTQ act-order
    ``g_idx`` of q/k/v, which share one input): the first part fills the parameter, every other
    part is read and checked equal. The same on every rank."""

    ids: tuple[ShardId, ...]


@dataclass(frozen=True, slots=True)
class Pick:
    """A tensor every part of a fused layer stores, of which vLLM keeps one: the part ``keep``
    fills the parameter, the others are not read (compressed-tensors ``weight_shape``, where
    vLLM keeps the last part it loads). The same on every rank."""

    ids: tuple[ShardId, ...]
    keep: ShardId


Sharding = Union[Replicated, Split, VocabSplit, ExpertSplit, Slots, Blocked, Shared, Pick]

PLACEMENTS = ("linear", "round_robin")


@dataclass(frozen=True, slots=True)
class Piece:
    """One segment's contribution to a rank: checkpoint rows ``src`` (relative to the start of the
    segment) land in local rows ``dst`` of the parameter."""

    segment: ShardId
    src: Range
    dst: Range


def divides(segment: Segment, tp_size: int) -> bool:
    """Whether ``segment`` can be spread over ``tp_size`` ranks."""
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
    per_rank = segment.count // tp_size * segment.unit
    return rank * per_rank, (rank + 1) * per_rank


def split_pieces(split: Split, tp_size: int, rank: int) -> tuple[Piece, ...]:
    """Where each segment's rows go on ``rank``: local rows are the segments back to back."""
    if split.disable_tp:
        tp_size, rank = 1, 0
    pieces, offset = [], 0
    for segment in split.segments:
        start, stop = segment_rows(segment, tp_size, rank)
        pieces.append(Piece(segment.id, (start, stop), (offset, offset + stop - start)))
        offset += stop - start
    return tuple(pieces)


def split_local_rows(split: Split, tp_size: int) -> int:
    """Rows a rank holds along the split dimension (the same on every rank)."""
    return sum(p.dst[1] - p.dst[0] for p in split_pieces(split, tp_size, 0))


def segment_offsets(split: Split) -> dict[ShardId, int]:
    """Start row of each segment inside a tensor that stores all segments fused (Phi-3 ``qkv_proj``)."""
    offsets, offset = {}, 0
    for segment in split.segments:
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


def compute_local_expert_ids(num_experts: int, ep_size: int, ep_rank: int, placement: str = "linear") -> tuple[int, ...]:
    """The expert ids ``ep_rank`` holds (vLLM ``compute_local_expert_ids`` / ``determine_expert_map``).

    ``linear``: contiguous blocks of ``E // ep``, the first ``E % ep`` ranks one more;
    ``round_robin``: ``ep_rank, ep_rank + ep, ...``. With more ranks than experts the ranks past
    the experts hold none (vLLM loads them with zero local experts).
    """
    if placement not in PLACEMENTS:
        raise ShardingError(f"unknown expert placement {placement!r}; use one of {PLACEMENTS}")
    if placement == "round_robin":
        return tuple(range(ep_rank, num_experts, ep_size))
    base, rem = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, rem)
    return tuple(range(start, start + base + (ep_rank < rem)))


def local_expert_slots(
    num_experts: int, ep_size: int, ep_rank: int, placement: str = "linear", redundant: int = 0
) -> tuple[int, ...]:
    """The logical expert loaded into each local slot, in slot order.

    With ``redundant`` extra physical experts, physical expert ``p`` holds logical expert
    ``p % num_experts`` (vLLM's ``phys2log``); the ``num_experts + redundant`` physical experts
    are what expert parallelism spreads.
    """
    physical = num_experts + redundant
    ids = compute_local_expert_ids(physical, ep_size, ep_rank, placement) if ep_size > 1 else tuple(range(physical))
    return tuple(p % num_experts for p in ids)


def blocked_pieces(blocked: Blocked, tp_size: int, rank: int, fused: bool) -> tuple[Piece, ...]:
    """Scale blocks ``rank`` reads (``src``, absolute in the checkpoint scale tensor when ``fused``,
    else relative to the segment) and where they go (``dst``).

    A rank's weight slice must start on a block boundary, or lie inside a single block (then the
    ranks sharing that block all keep its scale); otherwise its local blocks would not line up
    with the checkpoint's and the error says so, in vLLM's words.
    """
    split, block = blocked.split, blocked.block
    offsets = segment_offsets(split) if fused else {s.id: 0 for s in split.segments}
    pieces, dst = [], 0
    for piece in split_pieces(split, tp_size, rank):
        start, stop = offsets[piece.segment] + piece.src[0], offsets[piece.segment] + piece.src[1]
        local = piece.src[1] - piece.src[0]
        if start % block and start // block != (stop - 1) // block:
            what = "output_partition_size" if split.dim == 0 else "input_size_per_partition"
            letter = "n" if split.dim == 0 else "k"
            raise ShardingError(
                f"Weight {what} = {local} is not divisible by weight quantization block_{letter} = {block}: "
                f"at tp={tp_size}, rank {rank} holds rows {start}:{stop} of segment {piece.segment!r}, which start inside "
                f"a block and cross into the next, so no scale rows fit them; use a tp size that keeps "
                f"{letter}-slices block-aligned"
            )
        count = -(-local // block)
        pieces.append(Piece(piece.segment, (start // block, start // block + count), (dst, dst + count)))
        dst += count
    return tuple(pieces)
