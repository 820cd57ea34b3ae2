"""Boxes of tensors in files that are not local, read through their storage's ranged reads.

:class:`StorageReader` serves :class:`~.reader.Reader` for every file a
:class:`~functional_load.storage.Storage` other than the local file system holds. A box is one
ranged read when its byte runs are one range, or when the range that spans them is at most
``max_over_read`` times the bytes needed (then the runs are scattered from it); otherwise one
read per run. Every read names the file's identity as it was indexed, so an object replaced
during the load is refused, never mixed with the old one. The ranged reads are counted
(:attr:`StorageReader.requests`: one request each, before any retry the storage makes).
"""

from __future__ import annotations

import threading

import numpy as np

from ..checkpoint import FileSpan, TensorInfo
from ..layout.segments import Box
from ..storage import storage_for
from .files import Tally, span_of
from .runs import Run, box_runs, gather_runs


class StorageReader:
    """Boxes of file spans through :func:`~functional_load.storage.storage_for`; thread-safe
    as far as the storages are."""

    def __init__(self, tally: Tally, max_over_read: float = 1.0) -> None:
        self.tally = tally
        self.requests = 0  # ranged reads asked of the storages
        self._max_over_read = max_over_read
        self._lock = threading.Lock()

    def _read(self, span: FileSpan, offset: int, out: memoryview) -> None:
        with self._lock:
            self.requests += 1
        self.tally.add(storage_for(span.file).read_into(span.file, span.offset + offset, out, span.stamp))

    def read_into(self, info: TensorInfo, box: Box, out: memoryview) -> None:
        """Fill ``out`` (writable, C-contiguous, the box's size) with ``box`` of ``info``."""
        offsets, run = box_runs(info, box, out)
        if run == 0:
            return
        span = span_of(info)
        first, stop = int(offsets[0]), int(offsets[-1]) + run
        if len(offsets) == 1:
            self._read(span, first, out)
        elif stop - first <= self._max_over_read * run * len(offsets):
            block = np.empty(stop - first, dtype=np.uint8)
            self._read(span, first, block.data)
            gather_runs(block, offsets, run, out)
        else:
            for i, offset in enumerate(offsets.tolist()):
                self._read(span, offset, out[i * run : (i + 1) * run])

    def read_run(self, run: Run) -> None:
        """One stretch of a file into several destinations: one ranged read, then scattered."""
        span = span_of(run.info)
        block = memoryview(bytearray(run.nbytes))
        self._read(span, run.offset - span.offset, block)
        at = 0
        for view in run.views:
            view[:] = block[at : at + view.nbytes]
            at += view.nbytes
