"""Local files (a model directory, a Hugging Face cache snapshot): :class:`LocalStorage`.

The readers of :mod:`functional_load.io.files` add what only a local file has (descriptors kept
open and advised, ``O_DIRECT``, memory maps, the page cache); this module serves everything else,
and the two writes of the seam (a whole file, atomically: a temporary name, fsync, rename; a delete).
"""

from __future__ import annotations

import glob
import os
import stat
import uuid
from pathlib import Path

from ..errors import IntegrityError, MissingFileError, SecurityError
from ..paths import check_contained
from .base import FileStamp, Kind, Stamp, StoredPath


def file_stamp(st: os.stat_result) -> FileStamp:
    return FileStamp(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def _local(path: StoredPath) -> Path:
    if not isinstance(path, Path):
        raise TypeError(f"{path} is not a local path")
    return path


class LocalStorage:
    """The local file system (see :class:`~.base.Storage`)."""

    def kind(self, path: StoredPath) -> Kind:
        try:
            mode = os.stat(_local(path)).st_mode
        except OSError:
            return "missing"
        return "directory" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "missing"

    def list_files(self, directory: StoredPath, pattern: str) -> list[StoredPath]:
        """Regular files (symlinks followed, but contained) matching ``pattern``; directories are
        skipped, other kinds refused before anything opens them."""
        found: list[StoredPath] = []
        for text in glob.glob(os.path.join(glob.escape(str(directory)), pattern)):
            path = Path(text)
            try:
                mode = os.stat(path).st_mode
            except FileNotFoundError as exc:
                raise MissingFileError(f"Weight file {str(path)!r} is a broken symlink; fix or remove it") from exc
            except OSError as exc:  # a symlink loop
                raise SecurityError(f"Weight file {str(path)!r} cannot be resolved ({exc.strerror}); remove it") from exc
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise SecurityError(
                    f"Weight file {str(path)!r} is not a regular file (a FIFO, socket or device), which could block or "
                    "feed endless data; replace it with the real file"
                )
            check_contained(path, _local(directory))
            found.append(path)
        return found

    def contained(self, path: StoredPath, directory: StoredPath, what: str) -> None:
        check_contained(_local(path), _local(directory), what)

    def stamp(self, file: StoredPath) -> Stamp:
        try:
            return file_stamp(os.stat(_local(file)))
        except FileNotFoundError:
            raise MissingFileError(f"{file}: no such file") from None

    def read(self, file: StoredPath, offset: int, size: int) -> bytes:
        try:
            fd = os.open(_local(file), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise MissingFileError(f"{file}: no such file") from None
        try:
            chunks, got = [], 0
            while got < size:
                chunk = os.pread(fd, size - got, offset + got)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def read_into(self, file: StoredPath, offset: int, out: memoryview, stamp: Stamp | None) -> int:
        with open(_local(file), "rb", buffering=0) as f:
            if stamp is not None and file_stamp(os.fstat(f.fileno())) != stamp:
                raise IntegrityError(f"{file}: changed after it was indexed; re-plan the load once the checkpoint is stable")
            got = 0
            while got < out.nbytes:
                more = os.preadv(f.fileno(), [out[got:]], offset + got)
                if more == 0:
                    raise IntegrityError(f"{file}: ends at byte {offset + got}, {out.nbytes - got} bytes early; it was truncated")
                got += more
        return got

    def write_file(self, file: StoredPath, data: bytes | Path) -> Stamp:
        """Written under a temporary name beside ``file``, fsynced, renamed over it and the directory
        fsynced (as a save's files are): a crash leaves the old file or the new one."""
        path = _local(file)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            with open(tmp, "wb") as out:
                if isinstance(data, Path):
                    with open(data, "rb") as source:
                        while block := source.read(16 << 20):
                            out.write(block)
                else:
                    out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
        return self.stamp(path)

    def delete(self, file: StoredPath) -> None:
        _local(file).unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


LOCAL = LocalStorage()
