"""The byte ranges a plan reads from object storage, and a source serving them from memory.

A load group (:mod:`.group`) needs, per process, the exact byte ranges its plan reads from files
that are not local: :func:`needed` walks the plan's copies (and the checks of shared tensors)
the way the reader will read them (a box's byte runs over the tensor's shape or its axes; a
quantized weight's bounding box and its scales' boxes; the stored pieces of a pre-sharded save)
and merges them into :data:`Intervals`, sorted, disjoint ``[start, stop)`` ranges per file.

:class:`Staged` holds the bytes of one process's ranges in one buffer; :class:`StagedReader`
serves the reader's boxes from it (a box outside it, which the walk above would have missed, is
read from the storage as usual and counted in :attr:`StagedReader.misses`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from ..checkpoint import FileSpan, SavedBoxes, TensorInfo
from ..dtypes import itemsize
from ..layout.axes import view_to_dims
from ..layout.segments import Box, box_volume
from ..plan.plan import Copy, Plan
from ..storage import Stamp, StoredPath, is_local
from .files import Tally, span_of
from .ranges import StorageReader
from .reader import _intersect, _stored_box
from .runs import Run, box_runs, byte_runs, gather_runs

Intervals: TypeAlias = "tuple[np.ndarray, np.ndarray]"  # sorted, disjoint, non-abutting [start, stop): int64 arrays


def merge(starts: np.ndarray, stops: np.ndarray) -> Intervals:
    """The union of ranges ``[starts[i], stops[i])`` (any order, overlapping or abutting) as :data:`Intervals`."""
    keep = stops > starts
    starts, stops = starts[keep].astype(np.int64), stops[keep].astype(np.int64)
    if not len(starts):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], np.maximum.accumulate(stops[order])
    first = np.flatnonzero(np.r_[True, starts[1:] > stops[:-1]])
    last = np.r_[first[1:] - 1, len(starts) - 1]
    return starts[first], stops[last]


def clip(ranges: Intervals, start: int, stop: int) -> Intervals:
    """The parts of ``ranges`` inside ``[start, stop)``."""
    starts, stops = ranges
    lo, hi = np.searchsorted(stops, start, "right"), np.searchsorted(starts, stop, "left")
    return np.maximum(starts[lo:hi], start), np.minimum(stops[lo:hi], stop)


def size(ranges: Intervals) -> int:
    return int((ranges[1] - ranges[0]).sum())


@dataclass(frozen=True, slots=True)
class Need:
    """What one process reads of one object: its identity when indexed, and the byte ranges."""

    file: StoredPath
    stamp: Stamp | None
    ranges: Intervals


def needed(plan: Plan) -> dict[str, Need]:
    """The byte ranges of every non-local file ``plan`` reads, by the file's URI."""
    runs: dict[str, list[tuple[np.ndarray, int]]] = defaultdict(list)
    spans: dict[str, FileSpan] = {}
    for param in plan.params:
        for copy in param.copies + param.checks:
            for info, box, shape in _boxes(plan, copy):
                for span, offsets, run in _spans(info, box, shape):
                    if not is_local(span.file):
                        runs[str(span.file)].append((offsets + span.offset, run))
                        spans.setdefault(str(span.file), span)
    out = {}
    for uri, found in runs.items():
        starts = np.concatenate([o for o, _ in found])
        stops = np.concatenate([o + r for o, r in found])
        out[uri] = Need(spans[uri].file, spans[uri].stamp, merge(starts, stops))
    return out


def _boxes(plan: Plan, copy: Copy) -> Iterator[tuple[TensorInfo, Box, tuple[int, ...]]]:
    """The (tensor, box, shape the box is over) reads of one copy, as :mod:`.copies` makes them."""
    info = plan.tensors[copy.tensor]
    if copy.dequantize is not None:
        outer = view_to_dims(copy.view or tuple((n,) for n in info.shape), copy.src)[0]
        yield info, outer, info.shape
        for suffix, name in copy.dequantize.scales:
            scale = plan.tensors[name]
            yield scale, copy.dequantize.format.scale_box(suffix, outer, scale.shape), scale.shape
    elif copy.view and isinstance(info.location, FileSpan):
        yield info, copy.src, tuple(n for dim in copy.view for n in dim)
    elif copy.view:
        yield info, view_to_dims(copy.view, copy.src)[0], info.shape
    else:
        yield info, copy.src, info.shape


def _spans(info: TensorInfo, box: Box, shape: tuple[int, ...]) -> Iterator[tuple[FileSpan, np.ndarray, int]]:
    """The file spans a read of ``box`` (over ``shape``) touches: (span, run offsets in it, run length)."""
    location = info.location
    if box_volume(box) == 0:
        return
    if isinstance(location, FileSpan):
        offsets, run = byte_runs(shape, box, itemsize(info.dtype))
        yield location, offsets, run
    elif isinstance(location, SavedBoxes):
        for piece in location.pieces:
            inter = _intersect(box, piece.src)
            if inter is not None:
                yield from _spans(piece.stored, _stored_box(piece, inter), piece.stored.shape)


class Staged:
    """The bytes of one process's needed ranges (:func:`needed`), each file's ranges one after
    another in one buffer, filled by :meth:`place_all` as they arrive."""

    def __init__(self, needs: dict[str, Intervals]) -> None:
        self._index: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        at = 0
        for uri, (starts, stops) in sorted(needs.items()):
            lengths = stops - starts
            self._index[uri] = (starts, stops, at + np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64))
            at += int(lengths.sum())
        self.buffer = np.empty(at, dtype=np.uint8)
        self.nbytes = at
        self.filled = 0

    def place_all(self, uri: str, starts: np.ndarray, stops: np.ndarray, data: np.ndarray, at: np.ndarray) -> None:
        """Store bytes ``[starts[i], stops[i])`` of ``uri`` (each inside one of its ranges) from ``data[at[i]:]``."""
        if not len(starts):
            return
        ranges, ends, bases = self._index[uri] if uri in self._index else (np.zeros(0, np.int64),) * 3
        which = np.searchsorted(ranges, starts, "right") - 1
        if (which < 0).any() or (stops > ends[np.maximum(which, 0)]).any():
            raise ValueError(f"{uri}: bytes the load group delivered are not all in ranges this process needs")
        buffer = self.buffer
        for to, src, n in zip((bases[which] + starts - ranges[which]).tolist(), at.tolist(), (stops - starts).tolist()):
            buffer[to : to + n] = data[src : src + n]
        self.filled += int((stops - starts).sum())

    def locate(self, uri: str, offsets: np.ndarray, run: int) -> np.ndarray | None:
        """Where runs of ``run`` bytes from file ``offsets`` are in :attr:`buffer`; None unless all are held."""
        if uri not in self._index:
            return None
        starts, stops, bases = self._index[uri]
        which = np.searchsorted(starts, offsets, "right") - 1
        if (which < 0).any() or (offsets + run > stops[np.maximum(which, 0)]).any():
            return None
        return bases[which] + (offsets - starts[which])


class StagedReader(StorageReader):
    """Boxes of non-local files served from a :class:`Staged` buffer (see the module)."""

    def __init__(self, tally: Tally, staged: Staged) -> None:
        super().__init__(tally)  # its own ranged reads (the default request cost) serve only the misses
        self.staged = staged
        self.misses = 0  # boxes read from the storage because the staged ranges lacked them

    def read_into(self, info: TensorInfo, box: Box, out: memoryview) -> None:
        offsets, run = box_runs(info, box, out)
        if run == 0:
            return
        span = span_of(info)
        at = self.staged.locate(str(span.file), offsets + span.offset, run)
        if at is None:
            self.misses += 1
            super().read_into(info, box, out)
            return
        gather_runs(self.staged.buffer[int(at[0]) :], at, run, out)

    def read_run(self, run: Run) -> None:
        span = span_of(run.info)
        at = self.staged.locate(str(span.file), np.array([run.offset], dtype=np.int64), run.nbytes)
        if at is None:
            self.misses += 1
            super().read_run(run)
            return
        position = int(at[0])
        for view in run.views:
            view[:] = self.staged.buffer[position : position + view.nbytes].data
            position += view.nbytes
