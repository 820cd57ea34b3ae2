"""Readers: the only code that touches tensor bytes.

A reader copies a box of a checkpoint tensor into a caller-owned byte buffer, reading exactly
the bytes of that box with positional reads (``preadv``): no mmap, no read-then-narrow.
Every reader counts the bytes it reads, so tests can prove what a rank touched.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from ..dtypes import itemsize
from ..errors import CheckpointError
from ..sharding import Box
from . import TensorInfo


def byte_runs(shape: tuple[int, ...], box: Box, item: int) -> tuple[np.ndarray, int]:
    """Offsets (relative to the tensor start) and common length of the contiguous byte runs
    that make up ``box`` of a row-major tensor of ``shape``, in row-major order of the box.

    The run spans the first dimension that the box does not fully cover, plus every dimension
    after it; dimensions before it are iterated. A dim-0 slice is one run; a dim-1 slice of a
    matrix is one run per row.
    """
    if not shape:
        return np.zeros(1, dtype=np.int64), item
    strides = [item * math.prod(shape[d + 1 :]) for d in range(len(shape))]
    split = 0
    for d in range(len(shape) - 1, -1, -1):
        if box[d] != (0, shape[d]):
            split = d
            break
    start, stop = box[split]
    run = (stop - start) * strides[split]
    offsets = np.array([start * strides[split]], dtype=np.int64)
    for d in range(split - 1, -1, -1):
        lo, hi = box[d]
        offsets = (np.arange(lo, hi, dtype=np.int64)[:, None] * strides[d] + offsets[None, :]).reshape(-1)
    return offsets, run


class PreadReader:
    """Positional reads into destination buffers; one file descriptor per file, opened lazily.

    ``bytes_read`` counts tensor bytes read (not headers).
    """

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return fd

    def read_into(self, info: TensorInfo, box: Box, out: memoryview) -> None:
        """Fill ``out`` (a writable, C-contiguous byte buffer of the box's size) with ``box`` of ``info``."""
        offsets, run = byte_runs(info.shape, box, itemsize(info.dtype))
        if run * len(offsets) != out.nbytes:
            raise ValueError(f"{info.name}: buffer of {out.nbytes} bytes for a box of {run * len(offsets)} bytes")
        if run == 0:
            return
        fd = self._fd(info.file)
        position = 0
        for offset in offsets.tolist():
            target = out[position : position + run]
            got = os.preadv(fd, [target], info.offset + offset)
            while 0 < got < run:  # short reads are legal; finish the run
                more = os.preadv(fd, [target[got:]], info.offset + offset + got)
                if more == 0:
                    break
                got += more
            if got != run:
                raise CheckpointError(
                    f"{info.file}: tensor {info.name!r} ends early: read {got} of {run} bytes at offset "
                    f"{info.offset + offset}; the file was truncated or changed after it was indexed"
                )
            position += run
        self.bytes_read += position

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> PreadReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

