"""Boxes of tensors in files that are not local, read through their storage's ranged reads.

:class:`StorageReader` serves :class:`~.reader.Reader` for every file a
:class:`~functional_load.storage.Storage` other than the local file system holds. Which ranged
requests read a box is a cost model (:class:`~.options.RequestCost`, from
:class:`~.options.ReadOptions`' ``request_latency``, ``link_bandwidth`` and ``request_bytes``):
the box's byte runs share a request while the gap between two of them costs less to read than
a new request, and no request is longer than ``chunk_bytes`` (:func:`~.runs.merge_runs`). A
request of one run (or a piece of one longer than a chunk) lands straight in the destination;
a request spanning several runs lands in a buffer of its own size (at most a chunk) and its runs
are scattered from there. Every request goes through one pool of ``in_flight`` threads shared by
the load's threads, in windows of ``in_flight`` requests per box (a large tensor's chunks are
fetched side by side), so host memory beyond the destinations is at most ``in_flight`` chunks per
reading thread, never a whole object.

Every read names the file's identity as it was indexed, so an object replaced during the load
is refused, never mixed with the old one. Counted: the ranged requests (:attr:`requests`: one
each, before any retry the storage makes), the bytes fetched (into the shared tally) and the
bytes needed, whose difference is :attr:`over_read`.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

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
        self._pool: ThreadPoolExecutor | None = None  # the requests in flight, started on first use

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

    def _fetch(self, requests: list[tuple[FileSpan, int, memoryview]]) -> None:
        """The requests, through the pool shared by every thread of the load; the first failure is raised."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.cost.in_flight, thread_name_prefix="functional-load-request")
            pool = self._pool
        for future in [pool.submit(self._read, *request) for request in requests]:
            future.result()

    def _pieces(self, span: FileSpan, at: int, out: memoryview) -> list[tuple[FileSpan, int, memoryview]]:
        """Requests of at most a chunk filling ``out`` from absolute offset ``at``, straight into it."""
        chunk = self.cost.chunk_bytes
        return [(span, at + start, out[start : start + chunk]) for start in range(0, out.nbytes, chunk)]

    def read_into(self, info: TensorInfo, box: Box, out: memoryview) -> None:
        """Fill ``out`` (writable, C-contiguous, the box's size) with ``box`` of ``info``."""
        offsets, run = box_runs(info, box, out)
        if run == 0:
            return
        self._need(out.nbytes)
        span = span_of(info)
        base = span.offset
        requests: list[tuple[FileSpan, int, memoryview]] = []
        scatters: list[tuple[np.ndarray, int, int]] = []
        for i, j in merge_runs(offsets, run, self.cost):
            first = base + int(offsets[i])
            if j - i == 1:
                requests += self._pieces(span, first, out[i * run : (i + 1) * run])
            else:
                block = np.empty(int(offsets[j - 1]) + run + base - first, dtype=np.uint8)
                requests.append((span, first, block.data))
                scatters.append((block, i, j))
            if len(requests) >= self.cost.in_flight:  # a window: its buffers are scattered and freed
                self._fetch(requests)
                for block, a, b in scatters:
                    gather_runs(block, offsets[a:b], run, out[a * run : b * run])
                requests, scatters = [], []
        self._fetch(requests)
        for block, a, b in scatters:
            gather_runs(block, offsets[a:b], run, out[a * run : b * run])

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
        starts = range(run.offset, stop, chunk)
        for window in range(0, len(starts), self.cost.in_flight):
            requests, scatters = [], []
            for start in starts[window : window + self.cost.in_flight]:
                end = min(start + chunk, stop)
                parts = [(where, view) for where, view in placed if where < end and where + view.nbytes > start]
                if len(parts) == 1:
                    where, view = parts[0]
                    requests.append((span, start, view[start - where : end - where]))
                    continue
                block = memoryview(bytearray(end - start))
                requests.append((span, start, block))
                scatters.append((start, end, block, parts))
            self._fetch(requests)
            for start, end, block, parts in scatters:
                for where, view in parts:
                    lo, hi = max(where, start), min(where + view.nbytes, end)
                    view[lo - where : hi - where] = block[lo - start : hi - start]

    def close(self) -> None:
        """Stop the request threads (a later read starts them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
