"""What is on disk, from headers only: weight files, their tensors, and where each tensor's bytes are.

A tensor's bytes are in one of three places, a small tagged union (:data:`Location`):

* :class:`FileSpan`: a contiguous run of a safetensors file (or of a pre-sharded rank file);
* :class:`PickleEntry`: a tensor inside a torch pickle, read through ``torch.load(weights_only=True)``;
* :class:`SavedBoxes`: a tensor of the original checkpoint of a pre-sharded save, whose boxes are
  stored in the rank files.

Nothing in this package reads tensor data: :func:`functional_load.io.reader_for` does, for every
kind of location, for every consumer.
"""

from __future__ import annotations

import gc
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from ..dtypes import itemsize
from ..errors import FormatError
from ..layout.segments import Box
from ..model.mapping import MappingTable
from ..storage import FileStamp as FileStamp  # re-exported: a file's identity
from ..storage import Stamp, StoredPath


@dataclass(frozen=True, slots=True)
class FileSpan:
    """The tensor's bytes are ``nbytes`` bytes of ``file`` from absolute ``offset`` (row-major)."""

    file: StoredPath
    offset: int
    nbytes: int
    stamp: Stamp | None = None  # the file as it was indexed; readers refuse a changed file


@dataclass(frozen=True, slots=True)
class PickleEntry:
    """The tensor is an entry of a torch pickle ``file``."""

    file: Path
    stamp: FileStamp


class RankFiles:
    """The headers of a pre-sharded save's rank files, read on first use (a rank that keeps only
    its own boxes never opens another rank's file) and then kept."""

    def __init__(self, read_header: Callable[[StoredPath], Mapping[str, TensorInfo]], known: Mapping[StoredPath, Mapping[str, TensorInfo]]):
        self._read = read_header
        self._headers = dict(known)
        self._lock = threading.Lock()

    def info(self, file: StoredPath, name: str) -> TensorInfo:
        with self._lock:
            if file not in self._headers:
                self._headers[file] = self._read(file)
            header = self._headers[file]
        if name not in header:
            raise FormatError(f"{file}: has no tensor {name!r}, which the manifest lists")
        return header[name]

    def opened(self, file: StoredPath) -> bool:
        """Whether ``file``'s header was read (its data may have been)."""
        with self._lock:
            return file in self._headers


@dataclass(frozen=True, slots=True)
class SavedPiece:
    """Box ``src`` of an original tensor, stored at box ``dst`` of tensor ``name`` of rank file
    ``file`` (transposed back when ``transpose``: the parameter holds it ``[out, in]``)."""

    src: Box
    dst: Box
    transpose: bool
    file: StoredPath
    name: str
    headers: RankFiles = field(compare=False, repr=False)

    @property
    def stored(self) -> TensorInfo:
        """The rank-file tensor that holds the box (its header is read on first use)."""
        return self.headers.info(self.file, self.name)


@dataclass(frozen=True, slots=True)
class SavedBoxes:
    """The tensor is an original tensor of a pre-sharded save: its boxes are in the rank files,
    the preferred rank's first."""

    pieces: tuple[SavedPiece, ...]
    manifest: StoredPath


Location = FileSpan | PickleEntry | SavedBoxes


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One checkpoint tensor: name, safetensors dtype code, shape, and where its bytes are."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    location: Location

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def file(self) -> StoredPath:
        """The file that holds the tensor (the manifest, for a tensor of a pre-sharded save)."""
        location = self.location
        return location.manifest if isinstance(location, SavedBoxes) else location.file

    def where(self, box: Box | None = None) -> str:
        """The file names that hold the tensor, or its ``box``: a pre-sharded save's rank files
        holding pieces of it (not its manifest)."""
        location = self.location
        if not isinstance(location, SavedBoxes):
            return location.file.name
        pieces = [p for p in location.pieces if box is None or all(a < d and c < b for (a, b), (c, d) in zip(p.src, box))]
        return ", ".join(sorted({p.file.name for p in pieces})) or location.manifest.name


_gc_lock = threading.Lock()
_gc_pauses = [0, False]  # callers inside paused_gc(); whether the collector was enabled before the first


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while building tens of thousands of small objects
    (indexing and planning a checkpoint of 90,000 tensors), which would otherwise trigger
    full collections that rescan them all; creates no garbage cycles, so nothing is lost."""
    with _gc_lock:
        if _gc_pauses[0] == 0:
            _gc_pauses[1] = gc.isenabled()
            gc.disable()
        _gc_pauses[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses[0] -= 1
            if _gc_pauses[0] == 0 and _gc_pauses[1]:
                gc.enable()


_new = object.__new__
_SET_SPAN = tuple(vars(FileSpan)[f].__set__ for f in ("file", "offset", "nbytes", "stamp"))  # the slots' setters
_SET_INFO = tuple(vars(TensorInfo)[f].__set__ for f in ("name", "dtype", "shape", "location"))


def span_info(name: str, dtype: str, shape: tuple[int, ...], file: StoredPath, offset: int, nbytes: int, stamp: Stamp) -> TensorInfo:
    """``TensorInfo(name, dtype, shape, FileSpan(file, offset, nbytes, stamp))``, built through the
    slots directly: a frozen dataclass's ``__init__`` costs three times as much, which counts
    at 90,000 tensors (neither class has a ``__post_init__``; the values are equal)."""
    span = _new(FileSpan)
    set_file, set_offset, set_nbytes, set_stamp = _SET_SPAN
    set_file(span, file)
    set_offset(span, offset)
    set_nbytes(span, nbytes)
    set_stamp(span, stamp)
    info = _new(TensorInfo)
    set_name, set_dtype, set_shape, set_location = _SET_INFO
    set_name(info, name)
    set_dtype(info, dtype)
    set_shape(info, shape)
    set_location(info, span)
    return info


class IndexedTensors(Mapping[str, TensorInfo]):
    """A read-only mapping of tensors that knows their dtypes without building every info
    (:class:`~.lazy.LazyTensors`)."""

    def dtypes(self) -> dict[str, str]:
        return {name: info.dtype for name, info in self.items()}


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """All tensors of a checkpoint directory, from headers only.

    ``rank_local``: the tensors are one rank's parameters as they are (a pre-sharded save of
    weights quantized while loading, which reloads only at its saved layout).
    """

    directory: StoredPath
    load_format: str  # resolved load format: "hf", "safetensors", "mistral", "pt" or "sharded"
    files: tuple[StoredPath, ...]  # weight files in load order (natural sort)
    tensors: Mapping[str, TensorInfo]
    index_file: StoredPath | None = None
    rank_local: bool = False
    checksums: Mapping[StoredPath, str] = field(default_factory=dict)  # file -> SHA-256 where recorded (a save's manifest)
    # name tables of how the checkpoint is stored, applied before the layout's (Mistral's own names)
    renames: tuple[MappingTable, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, IndexedTensors | MappingProxyType):  # a copy, frozen
            object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        object.__setattr__(self, "checksums", MappingProxyType(dict(self.checksums)))

    def dtypes(self) -> dict[str, str]:
        """Every tensor's dtype code, without building the infos of a lazily indexed checkpoint."""
        if isinstance(self.tensors, IndexedTensors):
            return self.tensors.dtypes()
        return {name: info.dtype for name, info in self.tensors.items()}

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
