"""Sequential runs: stretches of a file read with one ``preadv`` into many destinations.

A copy whose source box is one contiguous byte range of a tensor stored as a file span, and whose
destination is a contiguous slot of the same dtype (no cast, transpose, repeat or transform),
needs no staging buffer. Consecutive such copies whose byte ranges abut in the file (a rank file
of a pre-sharded save read at its saved layout, a tp-1 load, the experts an EP rank holds) are
joined into runs of at most ``limit`` bytes and ``MAX_VIEWS`` destinations; each run is one
``preadv`` system call (more only for short reads) through a descriptor advised
``POSIX_FADV_SEQUENTIAL``, so a cold file streams with the kernel's readahead, and the per-tensor
work of the hot path is one memoryview.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..checkpoint import FileSpan, TensorInfo
from ..dtypes import itemsize
from ..layout.segments import Box
from ..plan.plan import Copy, ParamPlan, Plan
from .options import RequestCost


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


def box_runs(info: TensorInfo, box: Box, out: memoryview) -> tuple[np.ndarray, int]:
    """:func:`byte_runs` of ``box`` of ``info``, checked against the size of ``out``."""
    offsets, run = byte_runs(info.shape, box, itemsize(info.dtype))
    if run * len(offsets) != out.nbytes:
        raise ValueError(f"{info.name}: buffer of {out.nbytes} bytes for a box of {run * len(offsets)} bytes")
    return offsets, run


def gather_runs(source: np.ndarray, offsets: np.ndarray, run: int, out: memoryview) -> None:
    """Copy the runs of ``source`` (bytes from the first run's start; ``offsets`` of the box, as
    :func:`byte_runs` gives them) into ``out``, one after another: one strided copy when the runs
    are evenly spaced (a row-parallel slice), else one copy per run."""
    dest = np.frombuffer(out, dtype=np.uint8).reshape(len(offsets), run)
    steps = np.diff(offsets)
    if len(offsets) == 1 or np.all(steps == steps[0]):
        stride = int(steps[0]) if len(steps) else run
        np.copyto(dest, np.lib.stride_tricks.as_strided(source, shape=dest.shape, strides=(stride, 1)))
    else:
        for i, offset in enumerate((offsets - offsets[0]).tolist()):
            dest[i] = source[offset : offset + run]


def merge_runs(offsets: np.ndarray, run: int, cost: RequestCost) -> list[tuple[int, int]]:
    """The ranged requests that read the runs at ``offsets`` (ascending, ``run`` bytes each) under
    ``cost``, as index ranges ``[i, j)``: one request of the bytes from ``offsets[i]`` to
    ``offsets[j - 1] + run``. Neighbouring runs share a request while the gap between them costs
    less to read than a request (:meth:`~.options.RequestCost.reads_through`) and the request
    stays within ``cost.chunk_bytes``; a run longer than that is a request of its own (the caller
    reads it in pieces of ``chunk_bytes``)."""
    count = len(offsets)
    if count == 0:
        return []
    if run > cost.chunk_bytes:
        return [(i, i + 1) for i in range(count)]
    gaps = np.diff(np.asarray(offsets, dtype=np.int64)) - run
    cheap = np.less(gaps / cost.bandwidth, cost.latency)  # RequestCost.reads_through, vectorized
    cuts = np.flatnonzero(~cheap) + 1
    ends = np.asarray(offsets, dtype=np.int64) + run
    out: list[tuple[int, int]] = []
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), count]):
        while lo < hi:  # cut a stretch of cheap gaps into requests of at most chunk_bytes
            j = lo + int(np.searchsorted(ends[lo:hi], int(offsets[lo]) + cost.chunk_bytes, side="right"))
            out.append((lo, max(j, lo + 1)))
            lo = max(j, lo + 1)
    return out


MAX_VIEWS = 512  # destinations per preadv call (Linux's IOV_MAX is 1024)


@dataclass(frozen=True, slots=True)
class Run:
    """``nbytes`` bytes of ``info``'s file from absolute ``offset``, into ``views`` in order."""

    info: TensorInfo  # the first tensor of the run: its file, stamp and name for errors
    offset: int
    views: tuple[memoryview, ...]
    nbytes: int
    tensors: tuple[str, ...]  # the checkpoint tensor of each view


Job = tuple[ParamPlan, Copy]


def file_range(plan: Plan, copy: Copy) -> tuple[int, int] | None:
    """The absolute ``[start, stop)`` bytes of ``copy``'s source when it is one contiguous range
    of a file span read as it is stored; None otherwise."""
    if not copy.plain:
        return None
    info = plan.tensors[copy.tensor]
    location = info.location
    if not isinstance(location, FileSpan):
        return None
    offsets, run = byte_runs(info.shape, copy.src, itemsize(info.dtype))
    if len(offsets) != 1 or run == 0:
        return None
    start = location.offset + int(offsets[0])
    return start, start + run


def join_runs(
    plan: Plan, jobs: Sequence[Job], destination: Callable[[Job], memoryview | None], limit: int
) -> list[Run | Job]:
    """``jobs`` (in file order) with every stretch of abutting direct copies joined into a
    :class:`Run`; ``destination(job)`` is the job's destination bytes when it can be read
    straight into them (contiguous, of the source dtype), else None."""
    out: list[Run | Job] = []
    pending: list[tuple[Job, int, int, memoryview]] = []

    def flush() -> None:
        if len(pending) == 1:
            out.append(pending[0][0])
        elif pending:
            first = pending[0]
            out.append(Run(
                plan.tensors[first[0][1].tensor], first[1], tuple(p[3] for p in pending), pending[-1][2] - first[1],
                tuple(p[0][1].tensor for p in pending),
            ))
        pending.clear()

    for job in jobs:
        span = file_range(plan, job[1])
        view = destination(job) if span is not None else None
        if span is None or view is None or view.nbytes != span[1] - span[0]:
            flush()
            out.append(job)
            continue
        if pending:
            last_file = plan.tensors[pending[-1][0][1].tensor].file
            joins = (
                plan.tensors[job[1].tensor].file == last_file
                and span[0] == pending[-1][2]
                and span[1] - pending[0][1] <= limit
                and len(pending) < MAX_VIEWS
            )
            if not joins:
                flush()
        pending.append((job, span[0], span[1], view))
    flush()
    return out


def read_run(fd: int, run: Run, short: Callable[[int], Exception]) -> int:
    """Fill ``run``'s views from ``fd``; ``short(got)`` is the error when the file ends early."""
    views = list(run.views)
    got, first = 0, 0
    while first < len(views):
        n = os.preadv(fd, views[first:], run.offset + got)
        if n == 0:
            raise short(got)
        got += n
        while first < len(views) and n >= views[first].nbytes:
            n -= views[first].nbytes
            first += 1
        if n:
            views[first] = views[first][n:]
    return got
