"""Where the bytes live: weight-file discovery, header index, and readers.

Everything here except the readers works from file names and headers only; no tensor data is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One checkpoint tensor, described by its header entry.

    ``offset`` is the absolute byte offset of the first element in ``file`` and ``nbytes`` the
    size of its data, so a reader can ``pread`` any row-major sub-box without parsing again.
    """

    name: str
    file: Path
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    stamp: FileStamp | None = None  # the file as it was indexed; readers refuse a changed file


@dataclass(frozen=True, slots=True)
class FileStamp:
    """Identity of a file's contents as far as ``stat`` can tell: a file replaced, rewritten or
    truncated after indexing no longer matches."""

    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """All tensors of a checkpoint directory, from headers only."""

    directory: Path
    load_format: str  # resolved load format: "hf", "safetensors", "mistral" or "pt"
    files: tuple[Path, ...]  # weight files in load order (natural sort)
    tensors: Mapping[str, TensorInfo]
    index_file: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
