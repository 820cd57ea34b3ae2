"""The rank-local cache of loads from object storage (``LoadOptions(cache_dir=...)``).

A load of ``s3://...`` with ``cache_dir`` keeps the rank's tensors (checkpoint layout, before any
output target) in ``cache_dir/rank-{g}-of-{world}-{key}/`` as a one-rank pre-sharded save: the
rank file ``model-rank-{g}-of-{world}-{id}.safetensors``, ``config.json`` and the manifest
``functional_load.sharded.json`` (the save format of :mod:`.save`), whose ``cache`` object records
the identity (URI, size, ETag) of every object directly under the model's prefix and the load's
key (the model URI, the rank's coordinates, dtype, quantization, spec, format options). ``key`` is
a digest of that key: another layout, rank or dtype is another folder, never this one.

The next load with the same options lists the prefix and takes each object's identity (one LIST
and one HEAD per object: no byte of data). When every identity is the recorded one it plans and
reads the cached folder from local disk (0 bytes from the store). When any differs (an object
replaced, added or removed) the cache is not used: one warning line, the load reads the store,
and the folder is replaced by the new rank's. A folder that cannot be read back (truncated,
corrupt) is treated the same way.

Writing is atomic: a temporary folder ``.rank-...tmp-{id}`` beside it, every file fsynced, renamed
into place (the old folder moved aside first and deleted after), the parent fsynced. A process
killed mid-write leaves the temporary folder, which no load reads (and the next write of the same
folder removes). The identities recorded are the ones listed *before* the load, and the plan's
own (the versions every data GET named in ``If-Match``) must equal them, else nothing is kept: a
cached folder never holds bytes of another version than its manifest says.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.sharded import MANIFEST, read_manifest
from ..errors import LoadError
from ..model.config import model_directory
from ..options import LoadOptions
from ..paths import JsonObject
from ..plan.plan import Plan
from ..storage import ObjectStamp, StoredPath, as_path, is_local, read_all, storage_for
from ..storage.local import fsync_dir
from .save import _check_saveable, _manifest, _param_entry, _world, _write_rank_file
from .state import LoadedState

if TYPE_CHECKING:
    import torch

log = logging.getLogger("functional_load")
Sources = dict[str, dict[str, object]]  # object name -> {"uri", "size", "etag"}


@dataclass
class Uncached:
    """A load that no cache serves: planned from its model as it is."""

    model: object
    tp_size: int
    rank: int
    options: LoadOptions

    def plan(self, make: Callable[..., Plan]) -> Plan:
        return make(self.model, tp_size=self.tp_size, rank=self.rank, options=self.options)

    def keep(self, plan: Plan, tensors: Mapping[str, torch.Tensor]) -> None:
        """Nothing to keep."""


def open_rank_cache(model: object, tp_size: int, rank: int, options: LoadOptions) -> RankCache | Uncached:
    """The cache of this load, when ``options.cache_dir`` is set and ``model`` is in object storage
    (else :class:`Uncached`: a local model, a Hub id, a parsed config or a dummy load is read as it is)."""
    if options.cache_dir is None or options.dummy or not isinstance(model, (str, os.PathLike)) or is_local(as_path(model)):
        return Uncached(model, tp_size, rank, options)
    directory = model_directory(model)
    parallel = options.parallel(tp_size, rank)
    spec = options.spec if options.spec is None or isinstance(options.spec, str) else repr(options.spec)
    key: JsonObject = {
        "model": str(directory), "parallel": parallel.to_json(), "dtype": None if options.dtype is None else str(options.dtype),
        "quantization": options.quantization, "load_format": options.load_format, "allow_pickle": options.allow_pickle,
        "spec": spec, "text_only": options.text_only,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    world = parallel.tp_size * parallel.pp_size * parallel.dp_size
    folder = Path(options.cache_dir).expanduser() / f"rank-{parallel.flat_rank}-of-{world}-{digest}"
    cache = RankCache(directory, tp_size, rank, options, folder, key, _identities(directory))
    cache.hit = cache.valid()
    return cache


def _identities(directory: StoredPath) -> Sources:
    """Every object directly under ``directory``: its URI, size and version (ETag)."""
    storage = storage_for(directory)
    found: Sources = {}
    for path in storage.list_files(directory, "*"):
        stamp = storage.stamp(path)
        found[path.name] = {"uri": str(path), "size": stamp.size, "etag": stamp.version if isinstance(stamp, ObjectStamp) else ""}
    return found


@dataclass
class RankCache(Uncached):
    """One rank's cached folder, and whether it may be used (``hit``)."""

    model: StoredPath
    folder: Path = Path()
    key: JsonObject = field(default_factory=dict)
    sources: Sources | None = None  # the objects as listed before this load; None: keep nothing
    hit: bool = False

    def valid(self) -> bool:
        """The folder is complete and was made from exactly the objects there are now, for this load."""
        if not (self.folder / MANIFEST).is_file():
            return False
        try:
            manifest = read_manifest(self.folder)
        except LoadError as exc:
            log.warning("rank cache %s: unreadable (%s); reading %s and writing it again", self.folder, exc, self.model)
            return False
        recorded = manifest.get("cache") if manifest is not None else None
        if not isinstance(recorded, dict) or recorded.get("key") != self.key:
            return False
        if recorded.get("sources") != self.sources:
            log.warning("rank cache %s: not used, the objects changed since it was written (%s); reading %s and refreshing it",
                        self.folder, _changes(recorded.get("sources"), self.sources or {}), self.model)
            return False
        return True

    def plan(self, make: Callable[..., Plan]) -> Plan:
        """The plan of this load: of the cached folder on a hit, else of the model (``make``: ``fl.plan``)."""
        if self.hit:
            try:
                return make(self.folder, tp_size=self.tp_size, rank=self.rank, options=self.options)
            except LoadError as exc:
                log.warning("rank cache %s: not usable (%s); reading %s and writing it again", self.folder, exc, self.model)
                self.hit = False
        the_plan = make(self.model, tp_size=self.tp_size, rank=self.rank, options=self.options)
        for info in the_plan.tensors.values():  # the versions the plan reads must be the ones listed
            stamp = getattr(info.location, "stamp", None)
            listed = (self.sources or {}).get(info.file.name)
            if isinstance(stamp, ObjectStamp) and (listed is None or (listed["size"], listed["etag"]) != (stamp.size, stamp.version)):
                self.sources = None
        return the_plan

    def keep(self, plan: Plan, tensors: Mapping[str, torch.Tensor]) -> None:
        """After a load from the store: write the rank's tensors as the cached folder (atomically).
        A failure is a warning: the load itself succeeded."""
        if self.hit or self.sources is None:
            return
        tmp = self.folder.parent / f".{self.folder.name}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            for stale in self.folder.parent.glob(f".{self.folder.name}.*"):  # a killed writer's leftovers
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
            self._write(tmp, plan, tensors)
            self._commit(tmp)
        except (OSError, LoadError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("rank cache %s: not written (%s); the next load reads %s again", self.folder, exc, self.model)

    def _write(self, tmp: Path, plan: Plan, tensors: Mapping[str, torch.Tensor]) -> None:
        """The rank file, ``config.json`` and the manifest (with the ``cache`` object) in ``tmp``, each fsynced."""
        from safetensors.torch import save_file

        state = LoadedState(tensors, plan)
        _check_saveable(state, plan, None)
        flat = plan.parallel.flat_rank
        name = f"model-rank-{flat}-of-{_world(plan)}-{uuid.uuid4().hex[:12]}.safetensors"
        originals: dict[str, dict[str, object]] = {}
        params = {p.spec.name: _param_entry(plan, p, name, originals) for p in plan.params}
        files = {name: _write_rank_file(state, plan, tmp / name, save_file, [], set())}
        entry: dict[str, object] = {"file": name, "parallel": plan.parallel.to_json(), "params": params, "aliases": dict(plan.aliases)}
        ranks = {str(flat): entry}
        config = self.model / "config.json"
        config_bytes = read_all(config, "a config") if "config.json" in (self.sources or {}) else b""
        manifest = _manifest(plan, self.model, config_bytes, {"files": files, "tensors": originals, "ranks": ranks})
        manifest["cache"] = {"key": self.key, "sources": self.sources}
        for file, data in (("config.json", config_bytes), (MANIFEST, json.dumps(manifest, indent=1).encode())):
            if data:
                with open(tmp / file, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
        fsync_dir(tmp)

    def _commit(self, tmp: Path) -> None:
        """``tmp`` becomes the folder (the old one moved aside, then deleted)."""
        old = self.folder.parent / f".{self.folder.name}.old-{uuid.uuid4().hex[:12]}"
        if self.folder.exists():
            os.replace(self.folder, old)
        os.replace(tmp, self.folder)
        fsync_dir(self.folder.parent)
        shutil.rmtree(old, ignore_errors=True)


def _changes(recorded: object, now: Sources) -> str:
    """The objects whose identity differs (for the warning)."""
    before = recorded if isinstance(recorded, dict) else {}
    names = sorted(n for n in set(before) | set(now) if before.get(n) != now.get(n))
    words = [f"{n}: {'new' if n not in before else 'gone' if n not in now else 'replaced'}" for n in names[:4]]
    return ", ".join(words) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
