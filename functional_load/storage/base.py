"""The storage seam's values: file identities (stamps), object paths and the protocol (reads, and
the two writes a save needs: a whole file, a delete).

A file's identity (its :data:`Stamp`) is fixed when it is indexed and compared again before and
after reading: a local file by size, mtime, inode and device, an object by size and version
(its ETag).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import ClassVar, Literal, Protocol

from ..errors import CheckpointError


class StorageError(CheckpointError):
    """A store refused or failed a request for reasons other than a missing or changed file:
    denied credentials, an unreachable endpoint, a wrong region, failures past the retries. The
    message names the URI and the fix."""


@dataclass(frozen=True, slots=True)
class FileStamp:
    """A local file's identity as far as ``stat`` can tell: a file replaced, rewritten or
    truncated after indexing no longer matches."""

    size: int
    mtime_ns: int
    inode: int
    device: int

    def change(self, then: Stamp) -> str:
        """How the file changed since ``then`` (for an error message)."""
        if not isinstance(then, FileStamp):
            return f"size {then.size} -> {self.size}"
        return (
            f"size {then.size} -> {self.size}, mtime_ns {then.mtime_ns} -> {self.mtime_ns}, inode {then.inode} -> {self.inode}"
        )


@dataclass(frozen=True, slots=True)
class ObjectStamp:
    """An object's identity: its size and the version its store gives it (an ETag)."""

    size: int
    version: str

    def change(self, then: Stamp) -> str:
        before = then.version if isinstance(then, ObjectStamp) else "?"
        return f"size {then.size} -> {self.size}, version {before!r} -> {self.version!r}"


Stamp = FileStamp | ObjectStamp
Kind = Literal["file", "directory", "missing"]


class ObjectPath(PurePosixPath):
    """``scheme://bucket/key`` as a path (``/bucket/key`` underneath, so ``/``, ``.name`` and
    ``.parent`` work as for files); a subclass per scheme names it in :attr:`scheme`."""

    scheme: ClassVar[str] = ""

    def __str__(self) -> str:
        return f"{self.scheme}:/{self.key}"

    @property
    def key(self) -> str:
        """``/bucket/key``: the path without its scheme."""
        return PurePosixPath.__str__(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


StoredPath = Path | ObjectPath


class Storage(Protocol):
    """A source of checkpoint bytes. Every method takes paths of this storage only; missing
    files raise :class:`~functional_load.errors.MissingFileError` naming the path."""

    def kind(self, path: StoredPath) -> Kind:
        """Whether ``path`` is a file, a directory (a prefix, for objects) or nothing."""
        ...

    def list_files(self, directory: StoredPath, pattern: str) -> list[StoredPath]:
        """The files directly in ``directory`` whose names match the glob ``pattern``; a local
        storage refuses what is no regular file or leads outside the directory."""
        ...

    def contained(self, path: StoredPath, directory: StoredPath, what: str) -> None:
        """Refuse a ``path`` that leads outside ``directory`` (a local symlink can; an object cannot)."""
        ...

    def stamp(self, file: StoredPath) -> Stamp:
        """The file's identity now."""
        ...

    def read(self, file: StoredPath, offset: int, size: int) -> bytes:
        """At most ``size`` bytes from ``offset`` (fewer only at the end of the file)."""
        ...

    def read_into(self, file: StoredPath, offset: int, out: memoryview, stamp: Stamp | None) -> int:
        """Fill ``out`` from ``offset``, from the version ``stamp`` names when given (an object
        replaced since is refused); an early end of the file is an ``IntegrityError``."""
        ...

    def write_file(self, file: StoredPath, data: bytes | Path) -> Stamp:
        """Create or replace ``file`` with ``data`` (bytes, or the content of a local file), whole
        or not at all (a reader sees the old file or the new one); returns the new file's identity.
        Only a save's writer calls it (reading never writes)."""
        ...

    def delete(self, file: StoredPath) -> None:
        """Remove ``file``; nothing when it is missing already."""
        ...
