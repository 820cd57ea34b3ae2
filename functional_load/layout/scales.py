"""Descriptors of quantization scales and other per-layer tensors of fused linears.

Per-tensor scale slots, block-scale grids that follow a weight's split, and tensors that every
part of a fused layer stores (kept once, or checked equal). Like :mod:`.sharding`, each knows
its local shape, slots, parts and JSON form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError, ShardingError
from ..model.mapping import ShardId
from .parallel import Parallel
from .placement import Along, Placement
from .segments import Box, Piece, Range, full_box, segment_offsets, with_range
from .sharding import Part, Sharding, Slot, Split, _no_expert, _scalar


@dataclass(frozen=True, slots=True)
class Slots(Sharding):
    """One scalar per logical shard of a fused linear (vLLM ``PerTensorScaleParameter``): slot
    ``i`` holds the scale of segment ``ids[i]``; a scale stored once for the fused tensor fills
    every slot. The same on every rank."""

    ids: tuple[ShardId, ...]

    def __post_init__(self) -> None:
        if not self.ids or len(set(self.ids)) != len(self.ids):
            raise ValueError(f"Slots needs unique ids, got {self.ids!r}")

    def local_shape(self, shape: tuple[int, ...], parallel: Parallel) -> tuple[int, ...]:
        return (len(self.ids),)

    def slots(self, parallel: Parallel) -> list[Slot]:
        return list(self.ids)

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part:
        _no_expert(expert)
        if shard_id is not None and shard_id not in self.ids:
            raise ShardingError(f"shard id {shard_id!r} is not one of its scale slots {list(self.ids)}")
        ids = self.ids if shard_id is None else (shard_id,)
        scalar = _scalar(found)
        pairs = tuple((full_box(scalar), ((i, i + 1),), slot) for i, slot in enumerate(self.ids) if slot in ids)
        return Part(pairs, (), scalar)

    def to_json(self) -> dict[str, object]:
        return {"kind": "slots", "ids": list(self.ids)}


@dataclass(frozen=True, slots=True)
class Shared(Slots):
    """A tensor that every part ``ids`` of a fused layer stores identically (GPTQ act-order
    ``g_idx`` of q/k/v, which share one input): the first part fills the parameter, every other
    part is read and checked equal. The same on every rank."""

    def local_shape(self, shape: tuple[int, ...], parallel: Parallel) -> tuple[int, ...]:
        return shape

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part:
        _no_expert(expert)
        if shard_id is not None and shard_id not in self.ids:
            raise ShardingError(f"shard id {shard_id!r} is not one of {list(self.ids)}")
        ids = self.ids if shard_id is None else (shard_id,)
        expected = _scalar(found) if shape in ((), (1,)) else shape  # a scalar, stored 0-dim or [1]
        return Part(tuple((full_box(expected), full_box(shape), i) for i in ids), (), expected, check=True)

    def to_json(self) -> dict[str, object]:
        return {"kind": "shared", "ids": list(self.ids)}


@dataclass(frozen=True, slots=True)
class Pick(Slots):
    """A tensor every part of a fused layer stores, of which vLLM keeps one: the part ``keep``
    fills the parameter, the others are not read (compressed-tensors ``weight_shape``, where
    vLLM keeps the last part it loads). The same on every rank."""

    keep: ShardId = 0

    def __post_init__(self) -> None:
        Slots.__post_init__(self)
        if self.keep not in self.ids:
            raise ValueError(f"Pick keeps {self.keep!r}, which is not one of {self.ids!r}")

    def local_shape(self, shape: tuple[int, ...], parallel: Parallel) -> tuple[int, ...]:
        return shape

    def slots(self, parallel: Parallel) -> list[Slot]:
        return [self.keep]

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part:
        _no_expert(expert)
        if shard_id is not None and shard_id not in self.ids:
            raise ShardingError(f"shard id {shard_id!r} is not one of {list(self.ids)}")
        keep = shard_id is None or shard_id == self.keep
        return Part(((full_box(shape), full_box(shape), self.keep),) if keep else (), (), shape)

    def to_json(self) -> dict[str, object]:
        return {"kind": "pick", "ids": list(self.ids), "keep": self.keep}




BLOCK_RULES = ("strict", "fp8", "none")


@dataclass(frozen=True, slots=True)
class Blocked(Sharding):
    """A block-quantization scale whose dimension ``split.dim`` counts blocks of ``block`` rows
    (or columns) of the weight split by ``split``. Each segment's local rows map to
    ``ceil(rows / block)`` scale rows, back to back.

    ``rule`` is the block-shape check that applies: ``"strict"`` (vLLM's
    ``validate_fp8_block_shape``), ``"fp8"`` (vLLM's fp8 config: as strict, but a merged layer
    with a partition off the block grid is let through) or ``"none"`` (scales computed per rank
    while loading: online quantization).
    """

    split: Split
    block: int
    rule: str = "strict"

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ConfigError(f"block quantization needs a positive block size, got {self.block!r}; check config.json")
        if self.rule not in BLOCK_RULES:
            raise ValueError(f"Blocked.rule must be one of {BLOCK_RULES}, got {self.rule!r}")

    def check(self, parallel: Parallel) -> None:
        """vLLM's ``validate_fp8_block_shape``: a row-parallel slice must be a whole number of
        blocks; so must every output partition of a column-parallel layer split over the ranks,
        or, unsplit, every partition of a merged layer but its last."""
        if self.rule == "none":
            return
        split, block = self.split, self.block
        tp = split.tp(parallel)[0]
        sizes = [p.dst[1] - p.dst[0] for p in split.pieces(parallel)]
        if split.dim == 1:
            if tp > 1 and sizes[0] % block:
                raise ShardingError(
                    f"Weight input_size_per_partition = {sizes[0]} is not divisible by weight quantization block_k = {block}."
                )
            return
        merged = len(sizes) > 1
        if self.rule == "fp8" and merged and any(n % block for n in sizes):
            return
        tp_split = tp > 1 and split.rows // max(1, sum(sizes)) == tp
        for n in sizes if tp_split else sizes[:-1]:
            if n % block:
                raise ShardingError(f"Weight output_partition_size = {n} is not divisible by weight quantization block_n = {block}.")

    def pieces(self, parallel: Parallel, fused: bool) -> tuple[Piece, ...]:
        """Scale blocks this rank reads (``src``, absolute in a fused scale tensor when ``fused``,
        else relative to the segment) and where they go (``dst``).

        A rank's weight slice must start on a block boundary, or lie inside a single block (then
        the ranks sharing that block all keep its scale); otherwise its local blocks would not
        line up with the checkpoint's and the error says so, in vLLM's words.
        """
        split, block = self.split, self.block
        offsets = segment_offsets(split.segments) if fused else {s.id: 0 for s in split.segments}
        pieces, dst = [], 0
        for piece in split.pieces(parallel):
            start, stop = offsets[piece.segment] + piece.src[0], offsets[piece.segment] + piece.src[1]
            local = piece.src[1] - piece.src[0]
            if start % block and start // block != (stop - 1) // block:
                what, letter = ("output_partition_size", "n") if split.dim == 0 else ("input_size_per_partition", "k")
                raise ShardingError(
                    f"Weight {what} = {local} is not divisible by weight quantization block_{letter} = {block}: "
                    f"at tp={parallel.tp_size}, rank {parallel.rank} holds rows {start}:{stop} of segment {piece.segment!r}, "
                    f"which start inside a block and cross into the next, so no scale rows fit them; use a tp size that "
                    f"keeps {letter}-slices block-aligned"
                )
            count = -(-local // block)
            pieces.append(Piece(piece.segment, (start // block, start // block + count), (dst, dst + count)))
            dst += count
        return tuple(pieces)

    def local_shape(self, shape: tuple[int, ...], parallel: Parallel) -> tuple[int, ...]:
        self.check(parallel)
        for other in range(parallel.tp_size):  # every rank accepts the split, or none does
            self.pieces(Parallel(parallel.tp_size, other), fused=False)
        rows = sum(p.dst[1] - p.dst[0] for p in self.pieces(parallel, fused=False))
        dim = self.split.dim
        return shape[:dim] + (rows,) + shape[dim + 1 :]

    def slots(self, parallel: Parallel) -> list[Slot]:
        return [s.id for s in self.split.segments]

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part:
        _no_expert(expert)
        split, dim = self.split, self.split.dim
        ids = split.segment_ids(shard_id)
        rows = sum(s.rows for s in split.segments if s.id in ids)
        expected = shape[:dim] + (-(-rows // self.block),) + shape[dim + 1 :]
        local = full_box(self.local_shape(shape, parallel))
        pairs = tuple(
            (with_range(full_box(expected), dim, p.src), with_range(local, dim, p.dst), p.segment)
            for p in self.pieces(parallel, fused=shard_id is None)
            if p.segment in ids
        )
        return Part(pairs, (), expected)

    def segment_ranges(self, shape: tuple[int, ...], parallel: Parallel) -> list[tuple[ShardId | None, Range]]:
        return [(p.segment, p.dst) for p in self.pieces(parallel, fused=False)]

    def placement(self, parallel: Parallel) -> Placement:
        return self.split.placement(parallel)

    @property
    def segment_dim(self) -> int | None:
        return self.split.dim

    def to_json(self) -> dict[str, object]:
        return {"kind": "blocked", "block": self.block, "rule": self.rule, "split": self.split.to_json()}


@dataclass(frozen=True, slots=True)
class ExpertBlocks(Sharding):
    """One expert's FP8 block scales under vLLM's fused-MoE rules: ``w13`` ``[2 * ceil(I / bn),
    ceil(H / bk)]`` (w1's blocks, then w3's) or, with ``down``, ``w2`` ``[ceil(H / bn), ceil(I / bk)]``,
    split with the expert's intermediate size ``I`` over the ranks.

    A rank's ``I / tp`` must be a whole number of blocks (``bn``; also ``bk`` when split), as
    vLLM's ``validate_fp8_block_shape_moe`` demands. vLLM's fp8 method (``refine``, not
    compressed-tensors') instead refines the grid to ``r = gcd(bn, bk, I / tp, H)`` when ``r >=
    32``: each checkpoint scale fills ``(bn / r) x (bk / r)`` cells (:attr:`Part.repeat`).
    """

    intermediate: int
    hidden: int
    block: tuple[int, int]
    down: bool = False
    refine: bool = False

    def grid(self, parallel: Parallel) -> tuple[int, int]:
        """The block shape of this rank's scales (the checkpoint's, or vLLM's refined one)."""
        tp = parallel.tp_size
        bn, bk = self.block
        local = self.intermediate // tp
        if local % bn == 0 and (tp == 1 or local % bk == 0):
            return bn, bk
        refined = math.gcd(bn, bk, local, self.hidden)
        if self.refine and refined >= 32:
            if self.intermediate % bn or self.hidden % bk:
                raise ShardingError(
                    f"FP8 MoE block scales refined to {refined}x{refined} need the expert sizes (intermediate "
                    f"{self.intermediate}, hidden {self.hidden}) to be whole {bn}x{bk} blocks"
                )
            return refined, refined
        if local % bn:
            raise ShardingError(
                f"The output_size of gate's and up's weight = {local} is not divisible by weight quantization block_n = {bn}."
            )
        raise ShardingError(f"The input_size of down's weight = {local} is not divisible by weight quantization block_k = {bk}.")

    def _ids(self) -> tuple[ShardId | None, ...]:
        return (None,) if self.down else ("w1", "w3")

    def local_shape(self, shape: tuple[int, ...], parallel: Parallel) -> tuple[int, ...]:
        rn, rk = self.grid(parallel)
        local = self.intermediate // parallel.tp_size
        if self.down:
            return (-(-self.hidden // rn), -(-local // rk))
        return (2 * -(-local // rn), -(-self.hidden // rk))

    def slots(self, parallel: Parallel) -> list[Slot]:
        return list(self._ids())

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part:
        _no_expert(expert)
        if shard_id is not None and shard_id not in self._ids():
            raise ShardingError(f"shard id {shard_id!r} is not one of {[i for i in self._ids() if i is not None]}")
        (bn, bk), (rn, rk) = self.block, self.grid(parallel)
        local = self.intermediate // parallel.tp_size
        start = parallel.rank * local
        pairs: tuple[tuple[Box, Box, Slot], ...]
        if self.down:  # rows: the whole hidden size; columns: this rank's intermediate columns
            rows = ((0, -(-self.hidden // bn)), (0, -(-self.hidden // rn)))
            pairs = tuple(
                (((0, rows[0][1]), src), ((0, rows[1][1]), dst), None)
                for src, dst in _refined_ranges(start // rk, -(-local // rk), bk // rk)
            )
            return Part(pairs, (), shape, repeat=_repeat(bn // rn, bk // rk))
        coarse_rows, fine_rows = -(-self.intermediate // bn), -(-local // rn)
        cols = ((0, -(-self.hidden // bk)), (0, -(-self.hidden // rk)))
        ids = self._ids() if shard_id is None else (shard_id,)
        pairs = tuple(
            (((offset + a, offset + b), cols[0]), ((i * fine_rows + c, i * fine_rows + d), cols[1]), seg)
            for i, seg in enumerate(self._ids())
            if seg in ids
            for offset in [coarse_rows * i if shard_id is None else 0]
            for (a, b), (c, d) in _refined_ranges(start // rn, fine_rows, bn // rn)
        )
        expected = (coarse_rows * len(ids), cols[0][1])
        return Part(pairs, (), expected, repeat=_repeat(bn // rn, bk // rk))

    def placement(self, parallel: Parallel) -> Placement:
        return Along(1 if self.down else 0)

    @property
    def segment_dim(self) -> int | None:
        return None

    def to_json(self) -> dict[str, object]:
        return {"kind": "expert_blocks", "intermediate": self.intermediate, "hidden": self.hidden,
                "block": list(self.block), "down": self.down, "refine": self.refine}


def _repeat(rows: int, cols: int) -> tuple[int, ...]:
    return () if rows == cols == 1 else (rows, cols)


def _refined_ranges(first: int, count: int, factor: int) -> list[tuple[Range, Range]]:
    """Fine cells ``first .. first + count`` (local ``0 .. count``) as (checkpoint cells, local
    cells) runs, where checkpoint cell ``j // factor`` fills fine cell ``j``: a run starting
    inside a checkpoint cell covers only the rest of that cell."""
    runs, j, end = [], first, first + count
    while j < end:
        stop = end if j % factor == 0 else min(end, (j // factor + 1) * factor)
        runs.append(((j // factor, -(-stop // factor)), (j - first, stop - first)))
        j = stop
    return runs

