"""The pure index maths of a target leaf: which source elements a box of the leaf needs.

A rule rearranges its source tensors einops-style (``"layer (n h) d -> d layer n h"``). Between
the two sides every dimension is a product of *axes* (``n``, ``h``...), and on each axis a rule
may take a slice or one index (``take``), permute rotary halves and pairs (``rotary``), repeat
every element (``repeat``, KV heads) and append zeros (``pad``, head_dim). A box of the target
leaf (a device's shard) is cut into axis boxes (:func:`split_range`), and each axis box maps back
to one box of the sources' axes (:meth:`Axis.read`) plus what to do with the block read:
exactly the elements it needs, except along a rotary axis, which is read whole. Functions here
see no tensor: they turn sizes into ranges, as :mod:`.segments` does for vLLM's layouts.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..errors import ConfigError
from .segments import Range

ROTARY = ("pairs", "halves")  # "pairs": HF's halves -> interleaved pairs; "halves": the inverse


def split_range(start: int, stop: int, sizes: tuple[int, ...]) -> list[tuple[Range, ...]]:
    """``[start, stop)`` of a dimension that merges axes of ``sizes`` (row-major) as axis boxes, in
    order: their union is the range, and each is one contiguous run of the merged index (every
    axis but the first of its run whole, or the outer ones single)."""
    if start >= stop:
        return []
    if len(sizes) == 1:
        return [((start, stop),)]
    inner = math.prod(sizes[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:
        return [((first, first + 1), *box) for box in split_range(start - first * inner, stop - first * inner, sizes[1:])]
    out: list[tuple[Range, ...]] = []
    whole_from, whole_to = first, last + 1
    if start % inner:
        out += [((first, first + 1), *box) for box in split_range(start % inner, inner, sizes[1:])]
        whole_from = first + 1
    tail = stop % inner
    if tail:
        whole_to = last
    if whole_to > whole_from:
        out.append(((whole_from, whole_to), *((0, n) for n in sizes[1:])))
    if tail:
        out += [((last, last + 1), *box) for box in split_range(0, tail, sizes[1:])]
    return out


@dataclass(frozen=True, slots=True)
class Step:
    """What happens along one axis of a block read: permute the rotary halves/pairs of the whole
    axis (``rotary``), repeat each element ``repeat`` times, keep ``length`` elements from
    ``skip``, append ``zeros``."""

    rotary: str | None
    repeat: int
    skip: int
    length: int
    zeros: int

    def identity(self, extent: int) -> bool:
        """Whether the step leaves an axis of ``extent`` elements as it is."""
        return self.rotary is None and self.repeat == 1 and self.skip == 0 and self.length == extent and not self.zeros


@dataclass(frozen=True, slots=True)
class AxisRead:
    """One axis of a block: read source elements ``src`` (absolute in the source's axis), then
    apply ``step`` (a rotary permutation reads the whole taken axis)."""

    src: Range
    step: Step


@dataclass(frozen=True, slots=True)
class Axis:
    """One axis of a rule: ``size`` elements in the source; ``take`` keeps one index (the axis
    is then not on the target side) or a range; ``rotary``, ``repeat`` and ``pad`` (the size on
    the target side, zeros past the data) act in that order."""

    name: str
    size: int
    take: int | Range | None = None
    rotary: str | None = None
    repeat: int = 1
    pad: int | None = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"axis {self.name!r} has size {self.size}; every axis needs at least one element")
        if isinstance(self.take, int) and not 0 <= self.take < self.size:
            raise ConfigError(f"axis {self.name!r}: take index {self.take} is outside its {self.size} elements")
        if isinstance(self.take, tuple) and not 0 <= self.take[0] < self.take[1] <= self.size:
            raise ConfigError(f"axis {self.name!r}: take range {self.take[0]}:{self.take[1]} is not inside its {self.size} elements")
        if self.rotary is not None and (self.rotary not in ROTARY or self.taken % 2):
            raise ConfigError(f"axis {self.name!r}: rotary {self.rotary!r} needs one of {ROTARY} over an even size, not {self.taken}")
        if self.repeat < 1:
            raise ConfigError(f"axis {self.name!r}: repeat {self.repeat} must be at least 1")
        if self.pad is not None and self.pad < self.taken * self.repeat:
            raise ConfigError(f"axis {self.name!r}: pad to {self.pad} is less than its {self.taken * self.repeat} elements")

    @property
    def dropped(self) -> bool:
        """One index is taken: the axis is not on the target side."""
        return isinstance(self.take, int)

    @property
    def offset(self) -> int:
        return self.take if isinstance(self.take, int) else self.take[0] if self.take else 0

    @property
    def taken(self) -> int:
        """Elements kept by ``take``."""
        if isinstance(self.take, int):
            return 1
        return self.take[1] - self.take[0] if self.take else self.size

    @property
    def real(self) -> int:
        """Elements on the target side that hold data (before the padding)."""
        return self.taken * self.repeat

    @property
    def out(self) -> int:
        """Elements on the target side."""
        return self.pad if self.pad is not None else self.real

    def read(self, wanted: Range) -> AxisRead | None:
        """How to make target elements ``wanted`` of this axis; None when they are all padding."""
        a, b = wanted
        stop = min(b, self.real)
        if a >= stop:
            return None
        r = self.repeat
        if self.rotary is not None:
            src, skip = (0, self.taken), a
        else:
            src, skip = (a // r, -(-stop // r)), a - (a // r) * r
        return AxisRead((src[0] + self.offset, src[1] + self.offset), Step(self.rotary, r, skip, stop - a, b - stop))


@dataclass(frozen=True, slots=True)
class Arrangement:
    """A rule's axes in source order and the target side's dimensions as groups of axis indices.

    ``axes[:stacked]`` enumerate source tensors (layers, experts, fused sources); the others are
    the axes of each source tensor, its dimensions grouped as ``source`` says."""

    axes: tuple[Axis, ...]
    source: tuple[tuple[int, ...], ...]  # each source tensor dimension: its axes (after the stacked ones)
    target: tuple[tuple[int, ...], ...]
    stacked: int = 0

    def __post_init__(self) -> None:
        rotary = [a.name for a in self.axes[: self.stacked] if a.rotary is not None]
        if rotary:
            raise ConfigError(f"axis {rotary[0]!r} enumerates source tensors; rotary permutes elements of a tensor's axis, not tensors")

    @property
    def shape(self) -> tuple[int, ...]:
        """The target leaf's shape."""
        return tuple(math.prod(self.axes[i].out for i in group) for group in self.target)

    @property
    def source_view(self) -> tuple[int, ...]:
        """A source tensor's shape as its axes (what a read sees)."""
        return tuple(self.axes[i].size for group in self.source for i in group)

    def boxes(self, index: tuple[Range, ...]) -> list[tuple[tuple[Range, ...], tuple[AxisRead | None, ...]]]:
        """The pieces of the target box ``index``: for each, its place (a box of the leaf,
        relative to ``index``'s start) and how each axis (in source order) is read, or None for
        every axis when the piece is all padding. A piece takes one element of every stacked
        axis: it reads one source tensor."""
        per_dim = []
        for (a, b), group in zip(index, self.target):
            sizes = tuple(self.axes[i].out for i in group)
            stacked = [j for j, i in enumerate(group) if i < self.stacked]
            per_dim.append([(a, one) for box in split_range(a, b, sizes) for one in _single(box, stacked)])
        out = []
        for combo in _product(per_dim):
            place, wanted = [], {}
            for (base, box), group in zip(combo, self.target):
                sizes = tuple(self.axes[i].out for i in group)
                first = sum(lo * math.prod(sizes[j + 1 :]) for j, (lo, _) in enumerate(box))
                volume = math.prod(hi - lo for lo, hi in box)
                place.append((first - base, first - base + volume))
                wanted.update({i: rng for i, rng in zip(group, box)})
            reads = tuple(
                (Axis.read(axis, wanted[i]) if i in wanted else AxisRead((axis.offset, axis.offset + 1), Step(None, 1, 0, 1, 0)))
                for i, axis in enumerate(self.axes)
            )
            out.append((tuple(place), reads if all(r is not None for r in reads) else tuple(None for _ in reads)))
        return out


def _single(box: tuple[Range, ...], stacked: list[int]) -> list[tuple[Range, ...]]:
    """``box`` (one contiguous run of its merged dimension) cut so that every position in
    ``stacked`` holds one element; every position before the last such one is cut into single
    elements too, so each cut is still one contiguous run."""
    last = max((j for j in stacked if box[j][1] - box[j][0] > 1), default=None)
    if last is None:
        return [box]
    heads = itertools.product(*(range(lo, hi) for lo, hi in box[: last + 1]))
    return [tuple((i, i + 1) for i in head) + box[last + 1 :] for head in heads]


def _product(lists: list[list[tuple[int, tuple[Range, ...]]]]) -> list[tuple[tuple[int, tuple[Range, ...]], ...]]:
    out: list[tuple[tuple[int, tuple[Range, ...]], ...]] = [()]
    for options in lists:
        out = [prefix + (item,) for prefix in out for item in options]
    return out


def view_to_dims(view: tuple[tuple[int, ...], ...], box: tuple[Range, ...]) -> tuple[tuple[Range, ...], list[list[int]]]:
    """A box over a tensor's axes (``view``: each dimension's axis sizes) as the bounding box in
    the tensor's own dimensions, and for each dimension the indices of the box inside it (in
    row-major order of its axes, relative to the bounding box's start)."""
    outer, picks, at = [], [], 0
    for sizes in view:
        ranges = box[at : at + len(sizes)]
        strides = [math.prod(sizes[j + 1 :]) for j in range(len(sizes))]
        flat = [0]
        for (lo, hi), stride in zip(ranges, strides):
            flat = [f + i * stride for f in flat for i in range(lo, hi)]
        outer.append((min(flat), max(flat) + 1))
        picks.append([f - min(flat) for f in flat])
        at += len(sizes)
    return tuple(outer), picks


def read_axes(reads: tuple[AxisRead | None, ...]) -> tuple[AxisRead, ...] | None:
    """How each axis of a piece is read, or None for a piece that is all padding
    (:meth:`Arrangement.boxes` gives None for every axis of such a piece)."""
    present = tuple(r for r in reads if r is not None)
    return present if len(present) == len(reads) else None
