"""Prefetch: background threads warm the page cache with the byte ranges a plan will read.

Unlike vLLM's prefetch (whole files), only the rank's own ranges are read, as large sequential
blocks (adjacent or nearly adjacent ranges merged), in file-offset order, on a few threads. It
pays on network filesystems, where the main reads would otherwise wait on round trips.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ..plan.plan import Plan
from ..storage import StoredPath, is_local
from .options import ReadOptions
from .reader import file_spans

_GAP = 1 << 20  # ranges closer than this are read as one


def planned_ranges(plan: Plan) -> dict[StoredPath, list[tuple[int, int]]]:
    """Per local file, the merged ``(start, stop)`` byte ranges the plan reads."""
    spans: dict[StoredPath, list[tuple[int, int]]] = {}
    for param in plan.params:
        for copy in param.copies + param.checks:
            for path, start, stop in file_spans(plan.tensors[copy.tensor], copy.stored_src):
                if is_local(path):
                    spans.setdefault(path, []).append((start, stop))
    merged: dict[StoredPath, list[tuple[int, int]]] = {}
    for path, ranges in spans.items():
        out: list[tuple[int, int]] = []
        for start, stop in sorted(ranges):
            if out and start <= out[-1][1] + _GAP:
                out[-1] = (out[-1][0], max(out[-1][1], stop))
            else:
                out.append((start, stop))
        merged[path] = out
    return merged


class Prefetcher:
    """Starts reading at construction; :meth:`stop` cancels what has not started and returns
    the bytes prefetched. Failures are ignored: the main reads will report real problems."""

    def __init__(self, plan: Plan, options: ReadOptions):
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=options.prefetch_threads, thread_name_prefix="functional-load-prefetch")
        block = options.prefetch_block_size
        for path, ranges in planned_ranges(plan).items():
            for start, stop in ranges:
                for offset in range(start, stop, block):
                    self._pool.submit(self._read, path, offset, min(block, stop - offset))

    def _read(self, path: StoredPath, offset: int, length: int) -> None:
        if self._stop.is_set():
            return
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                got = len(os.pread(fd, length, offset))
            finally:
                os.close(fd)
        except OSError:
            return
        with self._lock:
            self.bytes += got

    def stop(self) -> int:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        return self.bytes
