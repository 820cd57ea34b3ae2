"""Boxes of tensors in files that are not local, read through their storage's ranged reads.

:class:`StorageReader` serves :class:`~.reader.Reader` for every file a
:class:`~functional_load.storage.Storage` other than the local file system holds. Which ranged
requests read a box is a cost model (:class:`~.options.RequestCost`, from
:class:`~.options.ReadOptions`' ``request_latency``, ``link_bandwidth`` and ``request_bytes``):
the box's byte runs share a request while the gap between two of them costs less to read than
a new request, and no request is longer than ``chunk_bytes`` (:func:`~.runs.merge_runs`). A
request of one run (or a piece of one longer than a chunk) lands straight in the destination;
a request spanning several runs lands in a buffer of its own size (at most a chunk) and its runs
are scattered from there. Host memory beyond the destinations is thus at most one chunk per
request in flight (the load's threads: each reads one box at a time), never a whole object.

Every read names the file's identity as it was indexed, so an object replaced during the load
is refused, never mixed with the old one. Counted: the ranged requests (:attr:`requests`: one
each, before any retry the storage makes), the bytes fetched (into the shared tally) and the
bytes needed, whose difference is :attr:`over_read`.
"""

from __future__ import annotations

import threading

import numpy as np

from ..checkpoint import FileSpan, TensorInfo
from ..layout.segments import Box
from ..storage import storage_for
from .files import Tally, span_of
from .options import ReadOptions, RequestCost
from .runs import Run, box_runs, gather_runs, merge_runs


class StorageReader:
    """Boxes of file spans through :func:`~functional_load.storage.storage_for`, requests chosen
    by ``cost``; thread-safe as far as the storages are."""

    def __init__(self, tally: Tally, cost: RequestCost | None = None) -> None:
        self.tally = tally
        self.cost = cost or ReadOptions().request_cost
        self.requests = 0  # ranged reads asked of the storages
        self.needed = 0  # bytes of the boxes and runs read (the fetched bytes are the tally's)
        self.fetched = 0
        self._lock = threading.Lock()

    @property
    def over_read(self) -> int:
        """Bytes fetched that no destination needed (the gaps read through)."""
        return self.fetched - self.needed

    def _read(self, span: FileSpan, at: int, out: memoryview) -> None:
        """One ranged request: ``out.nbytes`` bytes of ``span``'s file from absolute offset ``at``."""
        with self._lock:
            self.requests += 1
            self.fetched += out.nbytes
        self.tally.add(storage_for(span.file).read_into(span.file, at, out, span.stamp))

    def _need(self, nbytes: int) -> None:
        with self._lock:
            self.needed += nbytes

    def _read_pieces(self, span: FileSpan, at: int, out: memoryview) -> None:
        """``out`` from absolute offset ``at``, in requests of at most a chunk, straight into it."""
        chunk = self.cost.chunk_bytes
        for start in range(0, out.nbytes, chunk):
            self._read(span, at + start, out[start : start + chunk])

    def read_into(self, info: TensorInfo, box: Box, out: memoryview) -> None:
        """Fill ``out`` (writable, C-contiguous, the box's size) with ``box`` of ``info``."""
        offsets, run = box_runs(info, box, out)
        if run == 0:
            return
        self._need(out.nbytes)
        span = span_of(info)
        base = span.offset
        for i, j in merge_runs(offsets, run, self.cost):
            first = base + int(offsets[i])
            if j - i == 1:
                self._read_pieces(span, first, out[i * run : (i + 1) * run])
                continue
            block = np.empty(int(offsets[j - 1]) + run + base - first, dtype=np.uint8)
            self._read(span, first, block.data)
            gather_runs(block, offsets[i:j], run, out[i * run : j * run])

    def read_run(self, run: Run) -> None:
        """One stretch of a file into several destinations (abutting), in requests of at most a
        chunk: a request inside one destination lands in it, one across several is scattered."""
        span = span_of(run.info)
        self._need(run.nbytes)
        chunk, stop = self.cost.chunk_bytes, run.offset + run.nbytes
        placed, at = [], run.offset
        for view in run.views:
            placed.append((at, view))
            at += view.nbytes
        for start in range(run.offset, stop, chunk):
            end = min(start + chunk, stop)
            parts = [(where, view) for where, view in placed if where < end and where + view.nbytes > start]
            if len(parts) == 1:
                where, view = parts[0]
                self._read(span, start, view[start - where : end - where])
                continue
            block = memoryview(bytearray(end - start))
            self._read(span, start, block)
            for where, view in parts:
                lo, hi = max(where, start), min(where + view.nbytes, end)
                view[lo - where : hi - where] = block[lo - start : hi - start]
