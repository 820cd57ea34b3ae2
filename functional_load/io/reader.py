"""One reader for every consumer: boxes of checkpoint tensors, wherever their bytes are.

:func:`reader_for` gives execute, load_jax, verify and the CLI the same :class:`Reader`. It
serves each tensor according to its typed location: file spans through the file strategy of
the read options, pickle entries through ``torch.load(weights_only=True)``, and the tensors of a
pre-sharded save from the boxes stored in its rank files (themselves file spans). Bytes read
are counted in one place, from any thread; with ``verify_hashes`` every file whose checksum the
checkpoint records is hashed before its first read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..checkpoint import FileSpan, FileStamp, PickleEntry, SavedBoxes, SavedPiece, TensorInfo
from ..checkpoint.pickles import safe_torch_load
from ..dtypes import itemsize
from ..errors import IntegrityError, MissingFileError
from ..layout.segments import Box, box_volume, swap_last
from ..plan.plan import Plan
from ..storage import StoredPath, is_local, storage_for
from ..storage.local import file_stamp
from .files import FileReader, MmapReader, PreadReader, Tally, check_unchanged, file_reader
from .options import ReadOptions
from .ranges import StorageReader
from .runs import Run, byte_runs

if TYPE_CHECKING:
    import torch


def _intersect(box: Box, other: Box) -> Box | None:
    inter = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(box, other))
    return None if any(lo >= hi for lo, hi in inter) and box else inter


def _stored_box(piece: SavedPiece, inter: Box) -> Box:
    """Where ``inter`` (a box of the original tensor inside ``piece.src``) sits in the rank-file tensor."""
    rel = [(lo - s0, hi - s0) for (lo, hi), (s0, _) in zip(inter, piece.src)]
    if piece.transpose:
        rel = list(swap_last(tuple(rel)))
    lead = len(piece.dst) - len(rel)  # a per-expert matrix sits in one slot of a 3-D parameter
    return piece.dst[:lead] + tuple((d0 + lo, d0 + hi) for (lo, hi), (d0, _) in zip(rel, piece.dst[lead:]))


class Reader:
    """Copies a box of any checkpoint tensor into a caller-owned byte buffer; thread-safe."""

    def __init__(self, options: ReadOptions, checksums: Mapping[StoredPath, str] | None = None) -> None:
        self.options = options
        self.tally = Tally()
        self.files = file_reader(options, self.tally)  # local files
        self.remote = StorageReader(self.tally, options.request_cost)  # files of any other storage
        self._checksums = dict(checksums or {})
        self._verified: set[StoredPath] = set()
        self._pickles: dict[Path, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @property
    def bytes_read(self) -> int:
        return self.tally.bytes

    def read_into(self, info: TensorInfo, box: Box, out: memoryview) -> None:
        """Fill ``out`` (writable, C-contiguous, the box's size) with ``box`` of ``info``."""
        location = info.location
        if isinstance(location, FileSpan):
            self._verify(location.file)
            self._spans(location.file).read_into(info, box, out)
        elif isinstance(location, PickleEntry):
            self._read_pickle(info, location, box, out)
        else:
            self._read_saved(info, location, box, out)

    def _spans(self, file: StoredPath) -> FileReader | StorageReader:
        """The reader of ``file``'s spans: the local strategy, or its storage's ranged reads."""
        return self.files if is_local(file) else self.remote

    @property
    def sequential(self) -> bool:
        """Whether abutting direct copies may be read as sequential :class:`~.runs.Run` s."""
        return isinstance(self.files, PreadReader) and self.files.sequential

    def read_run(self, run: Run) -> None:
        """Fill a run's destinations (file spans only; see :attr:`sequential`)."""
        self._verify(run.info.file)
        reader = self._spans(run.info.file)
        if isinstance(reader, MmapReader):
            raise TypeError(f"sequential runs are read with pread, not {type(reader).__name__} (see Reader.sequential)")
        reader.read_run(run)

    def read_view(self, info: TensorInfo, view: tuple[tuple[int, ...], ...], box: Box, out: memoryview) -> None:
        """Fill ``out`` with ``box`` of ``info`` seen with each dimension split into axes (``view``:
        the axis sizes of each dimension, row-major; the box is over the axes). A file span reads
        exactly the box's byte runs; other locations read the box's bounding box in the tensor's
        own shape, then pick the box from it."""
        axes = tuple(n for dim in view for n in dim)
        if axes == info.shape:
            self.read_into(info, box, out)
        elif isinstance(info.location, FileSpan):
            self._verify(info.location.file)
            self._spans(info.location.file).read_into(dataclasses.replace(info, shape=axes), box, out)
        else:
            flat, at = [], 0
            for dim in view:  # each dimension's indices the box holds, row-major over its axes
                ranges = [np.arange(*box[at + j]) for j in range(len(dim))]
                strides = [int(np.prod(dim[j + 1 :])) for j in range(len(dim))]
                grid = np.zeros(1, dtype=np.int64)
                for r, stride in zip(ranges, strides):
                    grid = (grid[:, None] + r[None, :] * stride).reshape(-1)
                flat.append(grid)
                at += len(dim)
            outer = tuple((int(f.min()), int(f.max()) + 1) for f in flat)
            item = itemsize(info.dtype)
            chunk = np.empty(box_volume(outer) * item, dtype=np.uint8)
            self.read_into(info, outer, chunk.data.cast("B"))
            block = chunk.reshape(tuple(b - a for a, b in outer) + (item,))
            picked = block[np.ix_(*(f - lo for f, (lo, _) in zip(flat, outer)), np.arange(item))]
            np.copyto(np.frombuffer(out, dtype=np.uint8), picked.reshape(-1))

    def _verify(self, path: StoredPath) -> None:
        if not self.options.verify_hashes or path in self._verified or path not in self._checksums:
            return
        with self._lock:
            if path in self._verified:
                return
            storage, digest, at = storage_for(path), hashlib.sha256(), 0
            while block := storage.read(path, at, 16 << 20):
                digest.update(block)
                at += len(block)
            if digest.hexdigest() != self._checksums[path]:
                raise IntegrityError(f"{path}: SHA-256 differs from the manifest; the file is corrupt (bit flip?) or was replaced")
            self._verified.add(path)

    def _read_pickle(self, info: TensorInfo, entry: PickleEntry, box: Box, out: memoryview) -> None:
        import torch

        with self._lock:
            if entry.file not in self._pickles:
                _check_stamp(entry.file, entry.stamp, info.name)
                self._pickles[entry.file] = safe_torch_load(entry.file)
            tensor = self._pickles[entry.file][info.name]
        part = tensor[tuple(slice(a, b) for a, b in box)].contiguous()
        np.copyto(np.frombuffer(out, dtype=np.uint8), part.reshape(-1).view(torch.uint8).numpy())
        self.tally.add(part.numel() * part.element_size())

    def _read_saved(self, info: TensorInfo, saved: SavedBoxes, box: Box, out: memoryview) -> None:
        """Gather ``box`` of an original tensor from the stored boxes that cover it."""
        item = itemsize(info.dtype)
        shape = tuple(b - a for a, b in box) or (1,)
        target = np.frombuffer(out, dtype=np.uint8).reshape(shape + (item,))
        covered = 0
        for piece in saved.pieces:
            inter = _intersect(box, piece.src)
            if inter is None:
                continue
            stored = _stored_box(piece, inter)
            n = box_volume(stored)
            chunk = bytearray(n * item)
            self.read_into(piece.stored, stored, memoryview(chunk))
            lead = len(piece.dst) - len(inter)
            block = np.frombuffer(chunk, dtype=np.uint8).reshape(tuple(hi - lo for lo, hi in stored[lead:]) + (item,))
            if piece.transpose:
                block = block.swapaxes(-2, -3)  # the last two data dimensions (the last is the bytes)
            view = target[tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(inter, box))]
            view[...] = block.reshape(view.shape)
            covered += n
        if covered != box_volume(box):
            raise IntegrityError(
                f"{info.name}: the pre-sharded files hold {covered} of the {box_volume(box)} elements of box "
                f"{[list(b) for b in box]}; the save is incomplete for this layout"
            )

    def close(self) -> None:
        self.files.close()
        self.remote.close()
        self._pickles.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reader_for(plan: Plan, options: ReadOptions | None = None) -> Reader:
    """The reader of ``plan``'s tensors, whatever their locations (use it as a context manager)."""
    return Reader(options or ReadOptions(), dict(plan.checksums))


def _check_stamp(path: Path, stamp: FileStamp, name: str) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise IntegrityError(f"{path}: disappeared after it was indexed (needed for tensor {name!r})") from None
    check_unchanged(FileSpan(path, 0, 0, stamp), file_stamp(st), name)


def file_spans(info: TensorInfo, box: Box) -> list[tuple[StoredPath, int, int]]:
    """``(file, start, stop)`` byte ranges a read of ``box`` touches (for prefetching): the
    tensor's own span, or the stored spans of a pre-sharded save; none for a pickle."""
    location = info.location
    if isinstance(location, FileSpan):
        if box_volume(box) == 0:
            return []
        offsets, run = byte_runs(info.shape, box, itemsize(info.dtype))
        return [(location.file, location.offset + int(offsets[0]), location.offset + int(offsets[-1]) + run)]
    if isinstance(location, SavedBoxes):
        spans = []
        for piece in location.pieces:
            inter = _intersect(box, piece.src)
            if inter is not None:
                spans += file_spans(piece.stored, _stored_box(piece, inter))
        return spans
    return []


def verify_unchanged(plan: Plan) -> None:
    """After reading: every file read is still the one indexed (an in-place rewrite during the
    load would otherwise go unnoticed)."""
    seen: set[StoredPath] = set()

    def check(info: TensorInfo) -> None:
        location = info.location
        if isinstance(location, SavedBoxes):
            for piece in location.pieces:
                if piece.headers.opened(piece.file):
                    check(piece.stored)
            return
        if location.file in seen:
            return
        seen.add(location.file)
        if isinstance(location, FileSpan):
            try:
                stamp = storage_for(location.file).stamp(location.file)
            except (OSError, MissingFileError) as exc:
                raise IntegrityError(f"{location.file}: disappeared during the load ({exc})") from None
            check_unchanged(location, stamp, info.name)
        else:
            _check_stamp(location.file, location.stamp, info.name)

    for info in plan.tensors.values():
        check(info)
