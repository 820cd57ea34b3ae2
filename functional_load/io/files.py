"""File readers: boxes of tensors stored as file spans, copied into caller-owned byte buffers.

Strategies:

* ``pread`` (:class:`PreadReader`): positional reads (``preadv``) of exactly the box's byte runs,
  straight into the destination. A box made of many short runs (a row-parallel slice: one run
  per row) may be read as one sequential span and scattered when the span is at most
  ``max_over_read`` times the needed bytes; ``direct=True`` uses ``O_DIRECT``.
* ``mmap`` (:class:`MmapReader`): a read-only shared mapping per file; boxes are copied with
  numpy from the mapping (fastest when the file is in the page cache).
* ``eager`` (:class:`EagerReader`): each file read whole, sequentially, into memory once, boxes
  copied from there (for filesystems where random reads are slow).

Every reader counts the bytes it asks the OS for (into a shared :class:`Tally`), so tests can
prove what a rank touched, and re-checks each file's stamp before reading, so a file truncated
or replaced after planning is an error, never a crash or silently different bytes. They are
used through :func:`functional_load.io.reader_for`, which also serves pickles and pre-sharded
saves.
"""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np

from ..checkpoint import FileSpan, TensorInfo
from ..dtypes import itemsize
from ..errors import IntegrityError
from ..layout.segments import Box
from ..storage import Stamp, StoredPath
from ..storage.local import file_stamp
from .options import MiB, ReadOptions
from .runs import Run, box_runs, gather_runs, read_run

_ALIGN = 4096


class Tally:
    """Bytes read, counted from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n


def span_of(info: TensorInfo) -> FileSpan:
    location = info.location
    if not isinstance(location, FileSpan):
        raise TypeError(f"{info.name}: not stored as a file span ({type(location).__name__})")
    return location


class _Files:
    """Open files, checked against the size recorded when they were indexed."""

    def __init__(self, flags: int = 0, advice: int | None = None):
        self._fds: dict[StoredPath, int] = {}
        self._flags = flags
        self._advice = advice
        self._lock = threading.Lock()

    def fd(self, info: TensorInfo) -> int:
        span = span_of(info)
        fd = self._fds.get(span.file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(span.file)
                if fd is None:
                    try:
                        fd = os.open(span.file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | self._flags)
                    except FileNotFoundError:
                        raise IntegrityError(
                            f"{span.file}: disappeared after it was indexed (needed for tensor {info.name!r}); "
                            "re-plan the load once the checkpoint is stable"
                        ) from None
                    if self._advice is not None and hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, self._advice)
                    self._fds[span.file] = fd
        check_unchanged(span, file_stamp(os.fstat(fd)), info.name)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def check_unchanged(span: FileSpan, now: Stamp, name: str) -> None:
    """Refuse a file that is not the one indexed: shorter than tensor ``name``'s span, or (when
    the index recorded it) replaced, rewritten or resized since."""
    if now.size < span.offset + span.nbytes:
        raise IntegrityError(
            f"{span.file}: tensor {name!r} needs bytes up to {span.offset + span.nbytes}, but the file now has "
            f"{now.size}; it was truncated or replaced after it was indexed"
        )
    if span.stamp is not None and now != span.stamp:
        raise IntegrityError(
            f"{span.file}: changed after it was indexed ({now.change(span.stamp)}) while loading tensor "
            f"{name!r}; re-plan the load once the checkpoint is stable"
        )


def _resident(fd: int, offset: int) -> bool:
    """Whether the page at ``offset`` is in the page cache (a non-blocking read of one byte)."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return True
    try:
        return os.preadv(fd, [bytearray(1)], offset, flag) == 1
    except (BlockingIOError, OSError):
        return False


def _pread_full(fd: int, target: memoryview, offset: int, info: TensorInfo) -> int:
    """Fill ``target`` from ``offset``; short reads are legal, end of file is an error."""
    got = 0
    while got < target.nbytes:
        more = os.preadv(fd, [target[got:]], offset + got)
        if more == 0:
            raise IntegrityError(
                f"{span_of(info).file}: tensor {info.name!r} ends early: read {got} of {target.nbytes} bytes at offset "
                f"{offset}; the file was truncated or changed after it was indexed"
            )
        got += more
    return got


class PreadReader:
    """Positional reads into destination buffers; file descriptors per file, opened lazily.

    Exact reads go through a descriptor advised ``POSIX_FADV_RANDOM``, so the kernel reads what
    is asked and no readahead past a rank's slice. A box made of many short runs (a row-parallel
    slice) is read as sequential spans and scattered when ``max_over_read`` allows it. With
    ``adaptive=True`` (strategy ``auto``) a box of 64 runs or more goes by where the tensor is
    (probed with ``RWF_NOWAIT``): not in the page cache, one sequential pass beats a random read
    per row; in it, one strided copy out of a read-only mapping of the file beats a ``preadv`` per
    row (a row-parallel slice of Llama-2-7B's ``down_proj`` at tp 4 is 4,096 reads of 5.5 KB).

    ``bytes_read`` counts tensor bytes read (not headers). Safe to use from several threads.
    """

    def __init__(
        self, *, max_over_read: float = 1.0, direct: bool = False, chunk_bytes: int = 16 * MiB, adaptive: bool = False,
        tally: Tally | None = None,
    ) -> None:
        random = getattr(os, "POSIX_FADV_RANDOM", None)
        self._files = _Files(getattr(os, "O_DIRECT", 0) if direct else 0, None if direct else random)
        self._spans = _Files(0, getattr(os, "POSIX_FADV_SEQUENTIAL", None))
        self._direct = direct
        self._max_over_read = max_over_read
        self._chunk = chunk_bytes
        self.tally = tally or Tally()
        self._adaptive = adaptive

    @property
    def bytes_read(self) -> int:
        return self.tally.bytes

    def _count(self, n: int) -> None:
        self.tally.add(n)

    def read_into(self, info: TensorInfo, box: Box, out: memoryview) -> None:
        """Fill ``out`` (a writable, C-contiguous byte buffer of the box's size) with ``box`` of ``info``."""
        offsets, run = box_runs(info, box, out)
        if run == 0:
            return
        fd = self._files.fd(info)
        base = span_of(info).offset
        span = int(offsets[-1]) + run - int(offsets[0])
        if self._direct:
            self._read_direct(fd, info, offsets, run, out)
        elif len(offsets) > 1 and span <= self._max_over_read * run * len(offsets):
            self._read_span(self._spans.fd(info), info, offsets, run, out)
        elif self._adaptive and len(offsets) >= 64:  # many short runs: by where the tensor is
            if _resident(fd, base + int(offsets[len(offsets) // 2])):
                self._copy_mapped(fd, info, offsets, run, out)  # hot: one strided copy, not a read per row
            else:
                self._read_span(self._spans.fd(info), info, offsets, run, out)  # cold: one sequential pass
        else:
            position = 0
            for offset in offsets.tolist():
                position += _pread_full(fd, out[position : position + run], base + offset, info)
            self._count(position)

    @property
    def sequential(self) -> bool:
        """Whether :meth:`read_run` may be used (not with ``O_DIRECT``, whose buffers must be aligned)."""
        return not self._direct

    def read_run(self, run: Run) -> None:
        """One sequential run (see :mod:`.runs`), through the descriptor advised for sequential reads."""
        fd = self._spans.fd(run.info)

        def short(got: int) -> IntegrityError:
            return IntegrityError(
                f"{span_of(run.info).file}: tensors {', '.join(map(repr, list(dict.fromkeys(run.tensors))[:3]))} end early: read {got} of "
                f"{run.nbytes} bytes at offset {run.offset}; the file was truncated or changed after it was indexed"
            )

        self._count(read_run(fd, run, short))

    def _copy_mapped(self, fd: int, info: TensorInfo, offsets: np.ndarray, run: int, out: memoryview) -> None:
        """Copy the runs out of a read-only mapping of just their span, unmapped at once (the file's
        pages stay in the page cache, not in this process's resident set)."""
        first = span_of(info).offset + int(offsets[0])
        start = first // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(fd, first - start + int(offsets[-1] - offsets[0]) + run, prot=mmap.PROT_READ, offset=start)
        try:
            source = np.frombuffer(mapping, dtype=np.uint8)[first - start :]
            gather_runs(source, offsets, run, out)
            del source
        finally:
            mapping.close()
        self._count(run * len(offsets))

    def _read_span(self, fd: int, info: TensorInfo, offsets: np.ndarray, run: int, out: memoryview) -> None:
        """Read runs with equal gaps as big sequential chunks and scatter them (row-parallel slices)."""
        stride = int(offsets[1] - offsets[0]) if len(offsets) > 1 else run
        if not np.all(np.diff(offsets) == stride):
            for i, offset in enumerate(offsets.tolist()):
                self._count(_pread_full(fd, out[i * run : (i + 1) * run], span_of(info).offset + offset, info))
            return
        rows_per_chunk = max(1, self._chunk // stride)
        dest = np.frombuffer(out, dtype=np.uint8).reshape(len(offsets), run)
        scratch = np.empty(rows_per_chunk * stride, dtype=np.uint8)
        for first in range(0, len(offsets), rows_per_chunk):
            rows = min(rows_per_chunk, len(offsets) - first)
            length = (rows - 1) * stride + run
            view = memoryview(scratch.data)[:length]
            self._count(_pread_full(fd, view, span_of(info).offset + int(offsets[first]), info))
            strided = np.lib.stride_tricks.as_strided(scratch, shape=(rows, run), strides=(stride, 1))
            np.copyto(dest[first : first + rows], strided)

    def _read_direct(self, fd: int, info: TensorInfo, offsets: np.ndarray, run: int, out: memoryview) -> None:
        """O_DIRECT: read page-aligned ranges around each run into an aligned scratch buffer."""
        position = 0
        for offset in offsets.tolist():
            start = span_of(info).offset + offset
            lo, hi = start // _ALIGN * _ALIGN, -(-(start + run) // _ALIGN) * _ALIGN
            scratch = mmap.mmap(-1, hi - lo)
            try:
                view = memoryview(scratch)
                got = 0
                while got < hi - lo:
                    more = os.preadv(fd, [view[got:]], lo + got)
                    if more == 0:
                        break
                    got += more
                if got < start + run - lo:
                    raise IntegrityError(
                        f"{span_of(info).file}: tensor {info.name!r} ends early at offset {lo + got}; the file was truncated"
                    )
                self._count(got)
                out[position : position + run] = view[start - lo : start - lo + run]
                view.release()
            finally:
                scratch.close()
            position += run

    def close(self) -> None:
        self._files.close()
        self._spans.close()

    def __enter__(self) -> PreadReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MmapReader:
    """Copies boxes out of a read-only shared mapping of each file (numpy strided copies).

    ``bytes_read`` counts the bytes of the boxes copied; the kernel may fault in more (whole
    pages, readahead), which is why this strategy is for page-cache-hot files.
    """

    def __init__(self, tally: Tally | None = None) -> None:
        self._files = _Files()
        self._maps: dict[StoredPath, mmap.mmap] = {}
        self._lock = threading.Lock()
        self.tally = tally or Tally()

    @property
    def bytes_read(self) -> int:
        return self.tally.bytes

    def _source(self, info: TensorInfo) -> mmap.mmap | memoryview:
        fd = self._files.fd(info)
        span = span_of(info)
        with self._lock:
            m = self._maps.get(span.file)
            if m is None or len(m) < span.offset + span.nbytes:
                m = self._maps[span.file] = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            return m

    def _copied(self, nbytes: int) -> None:
        self.tally.add(nbytes)

    def read_into(self, info: TensorInfo, box: Box, out: memoryview) -> None:
        item = itemsize(info.dtype)
        span = span_of(info)
        source = np.frombuffer(self._source(info), dtype=np.uint8, count=span.nbytes, offset=span.offset)
        shape = info.shape or (1,)
        source = source.reshape(shape[:-1] + (shape[-1] * item,))
        last = (slice(box[-1][0] * item, box[-1][1] * item),) if box else (slice(None),)
        part = source[tuple(slice(a, b) for a, b in box[:-1]) + last]
        np.copyto(np.frombuffer(out, dtype=np.uint8).reshape(part.shape), part)
        self._copied(part.nbytes)

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the mapping goes when it does
                pass
        self._maps.clear()
        self._files.close()

    def __enter__(self) -> MmapReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EagerReader(MmapReader):
    """Reads each file whole, sequentially, on first use, then copies boxes from memory."""

    def __init__(self, block_size: int = 16 * MiB, tally: Tally | None = None) -> None:
        super().__init__(tally)
        self._block = block_size
        self._buffers: dict[StoredPath, memoryview] = {}

    def _source(self, info: TensorInfo) -> memoryview:
        path = span_of(info).file
        with self._lock:
            buffer = self._buffers.get(path)
        if buffer is None:
            fd = self._files.fd(info)
            size = os.fstat(fd).st_size
            buffer = memoryview(bytearray(size))
            done = 0
            while done < size:
                done += _pread_full(fd, buffer[done : min(size, done + self._block)], done, info)
            with self._lock:
                fresh = path not in self._buffers
                if fresh:
                    self._buffers[path] = buffer
                buffer = self._buffers[path]
            if fresh:
                self.tally.add(size)
        return buffer

    def _copied(self, nbytes: int) -> None:
        pass  # counted when the whole file was read

    def release(self, path: StoredPath) -> None:
        """Drop a file's buffer once nothing more is read from it."""
        with self._lock:
            self._buffers.pop(path, None)

    def close(self) -> None:
        self._buffers.clear()
        super().close()


FileReader = PreadReader | MmapReader


def file_reader(options: ReadOptions, tally: Tally) -> FileReader:
    """The file reader for ``options`` (``auto``: exact preads, with row-parallel slices read as
    sequential spans when ``max_over_read`` allows or when the tensor is not in the page cache)."""
    if options.strategy == "mmap":
        return MmapReader(tally)
    if options.strategy == "eager":
        return EagerReader(options.prefetch_block_size, tally)
    return PreadReader(max_over_read=options.max_over_read, direct=options.direct, adaptive=options.strategy == "auto", tally=tally)
