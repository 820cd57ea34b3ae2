"""Where checkpoint bytes live: one seam for every byte source.

A file is named by a path value that says where it lives: a local :class:`pathlib.Path` (a model
directory, a Hugging Face cache snapshot), or an :class:`ObjectPath` (``scheme://bucket/key``)
served by the storage registered for its scheme. :func:`storage_for` gives any path's
:class:`Storage`; discovery, configs, manifests, the header index, the reader and the checks that
a file did not change during a load all go through it, so a new source of bytes is one more
implementation of :class:`Storage` and nothing in ``plan/`` or ``layout/`` changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path, PurePath

from ..errors import ConfigError
from .base import FileStamp, Kind, ObjectPath, ObjectStamp, Stamp, Storage, StorageError, StoredPath
from .local import LOCAL, LocalStorage
from .s3 import S3Path, S3Storage, open_s3

__all__ = [
    "LOCAL", "FileStamp", "Kind", "LocalStorage", "ObjectPath", "ObjectStamp", "S3Path", "S3Storage", "Stamp", "Storage",
    "StorageError", "StoredPath", "as_path", "is_local", "read_all", "register_scheme", "storage_for",
]

_SCHEMES: dict[str, tuple[type[ObjectPath], Callable[[], Storage]]] = {}
_OPEN: dict[str, Storage] = {}


def register_scheme(path_type: type[ObjectPath], open_storage: Callable[[], Storage]) -> None:
    """Serve ``path_type.scheme://`` paths from the storage ``open_storage()`` returns (called
    once, on first use)."""
    _SCHEMES[path_type.scheme] = (path_type, open_storage)
    _OPEN.pop(path_type.scheme, None)


def storage_for(path: PurePath) -> Storage:
    """The storage that holds ``path``."""
    if not isinstance(path, ObjectPath):
        return LOCAL
    scheme = path.scheme
    if scheme not in _OPEN:
        if scheme not in _SCHEMES:
            raise ConfigError(f"{path}: no storage serves {scheme}:// paths here")
        _OPEN[scheme] = _SCHEMES[scheme][1]()
    return _OPEN[scheme]


def as_path(model: str | os.PathLike[str]) -> StoredPath:
    """A model argument as a path: ``scheme://...`` of a registered scheme, else a local path."""
    if isinstance(model, (Path, ObjectPath)):
        return model
    text = os.fspath(model)
    scheme, sep, rest = text.partition("://")
    if sep and scheme in _SCHEMES:
        return _SCHEMES[scheme][0]("/" + rest)
    return Path(text)


def is_local(path: PurePath) -> bool:
    return not isinstance(path, ObjectPath)


def read_all(path: StoredPath, what: str, limit: int | None = None) -> bytes:
    """A small file whole (``what``: a config, an index, a manifest), refused when over ``limit`` bytes."""
    storage = storage_for(path)
    size = storage.stamp(path).size
    if limit is not None and size > limit:
        raise ConfigError(f"{path}: {size} bytes is larger than the {limit}-byte limit for {what}")
    return storage.read(path, 0, size)


register_scheme(S3Path, open_s3)  # s3://bucket/prefix: the standard AWS configuration (storage.s3_config)
