"""Pre-sharded saves into object storage (``save_sharded(model, "s3://bucket/prefix", ...)``).

An object store has no rename and no directory to swap, so the commit point is the manifest, and
it is written last:

1. each rank's file is written to a local scratch folder (``TMPDIR``: one rank file at a time),
   its size and SHA-256 taken, then uploaded (a multipart upload past
   :attr:`~functional_load.storage.s3_config.S3Config.upload_part_bytes`) under a name of its own
   (``model-rank-{g}-of-{world}-{save_id}.safetensors``: never an object an existing save uses)
   and removed from the scratch folder;
2. the manifest ``functional_load.sharded.json`` is put (one PUT: readers see the old object or the
   new one, never part of it); this is the commit;
3. ``config.json`` is put when it differs from the one there (a fresh prefix: always, after the
   manifest, so an interrupted fresh save has no ``config.json`` and is never read as an ordinary
   checkpoint); a reload between 2 and 3 is refused by the config's recorded SHA-256, as locally;
4. the files of the save replaced that the new manifest does not name are deleted.

A failure before 2 deletes what this save uploaded and raises; a previous save under the prefix
stays loadable. A process killed before 2 leaves its uploaded rank files (and, with S3, maybe
parts of an unfinished multipart upload, which the bucket's lifecycle rule for incomplete
multipart uploads removes) but no manifest: not loadable, and ``read_config`` says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..checkpoint.sharded import MANIFEST, read_manifest
from ..errors import LoadError, MissingFileError
from ..paths import JsonDict
from ..storage import ObjectPath, StoredPath, as_path, read_all, storage_for
from .save import _manifest, _write_ranks, write_sharded
from .state import LoadedState


def _step(name: str) -> None:
    """A named point of the save; tests replace this to fail at a step."""


def write_to(states: Iterable[LoadedState], out_dir: str | os.PathLike[str], model_dir: StoredPath | None = None) -> StoredPath:
    """:func:`.save.write_sharded` into a local ``out_dir``, :func:`write_remote` into object storage."""
    out = as_path(out_dir)
    if isinstance(out, ObjectPath):
        return write_remote(iter(states), out, model_dir)
    return write_sharded(states, out, model_dir)


def write_remote(states: Iterator[LoadedState], out: ObjectPath, model_dir: StoredPath | None) -> ObjectPath:
    """Write every rank's file, the manifest (last) and the config under ``out`` (see the module)."""
    from safetensors.torch import save_file

    storage = storage_for(out)
    try:  # a missing bucket or a denied read fails here, before any rank is loaded
        old = read_manifest(out) if storage.kind(out) == "directory" else None
    except MissingFileError as exc:
        raise MissingFileError(f"save_sharded: {exc}, or create the bucket first (a save writes into an existing bucket)") from None
    save_id = uuid.uuid4().hex[:12]
    uploaded: list[StoredPath] = []

    def publish(local: Path) -> None:
        _step(f"upload {local.name}")
        storage.write_file(out / local.name, local)
        uploaded.append(out / local.name)
        local.unlink()

    try:
        with tempfile.TemporaryDirectory(prefix="functional-load-save-") as scratch:
            first_plan, model_dir, sections = _write_ranks(states, Path(scratch), save_id, save_file, [], model_dir, publish)
        config = model_dir / "config.json" if model_dir is not None else None
        config_bytes = read_all(config, "a config") if config is not None and storage_for(config).kind(config) == "file" else b""
        manifest = _manifest(first_plan, model_dir, config_bytes, sections)
        _step("write manifest")
        storage.write_file(out / MANIFEST, json.dumps(manifest, indent=1).encode())
    except OSError as exc:
        _discard(uploaded)
        raise LoadError(
            f"save_sharded: writing {out} failed while staging a rank file in {tempfile.gettempdir()} ({exc.strerror or exc}); "
            f"nothing was committed, and any previous save there is intact. Free space there (a rank file's size) or set TMPDIR"
        ) from None
    except BaseException:
        _discard(uploaded)
        raise
    _step("commit")
    _put_config(out, config_bytes, old)
    for name in (old or {}).get("files", {}):
        if name not in sections["files"]:
            with contextlib.suppress(LoadError):  # a leftover costs space, not correctness
                storage.delete(out / name)
    _step("cleanup")
    return out


def _put_config(out: ObjectPath, config_bytes: bytes, old: JsonDict | None) -> None:
    """``config.json`` under ``out`` when the source had one and the one there differs."""
    if not config_bytes:
        return
    source = old.get("source") if old is not None else None
    recorded = source.get("config_sha256") if isinstance(source, dict) else None
    if recorded != hashlib.sha256(config_bytes).hexdigest() or storage_for(out).kind(out / "config.json") != "file":
        storage_for(out).write_file(out / "config.json", config_bytes)


def _discard(uploaded: list[StoredPath]) -> None:
    """After a failure before the commit: delete what this save uploaded (best effort)."""
    for path in uploaded:
        with contextlib.suppress(LoadError):
            storage_for(path).delete(path)
