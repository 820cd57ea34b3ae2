"""Pre-sharded checkpoints, write side: every rank's tensors once, with a manifest.

:func:`write_sharded` (behind :func:`functional_load.save_sharded`) writes one safetensors file per
global rank ``g = (dp_rank * pp_size + pp_rank) * tp_size + rank`` of the layout
(``model-rank-{g}-of-{world}-{save_id}.safetensors``), a copy of ``config.json`` and a versioned
manifest ``functional_load.sharded.json`` that records the source's identity, the parallel
layout, each file's size and SHA-256, each rank's coordinates (``Parallel.to_json()``), and for
every rank tensor which box of which original checkpoint tensor it holds and which file stores
it. Within one (stage, replica) the tensor ranks' files are complete, as a tp save's; a tensor a
rank of another replica or stage holds identically (the same tensor rank, parameter name and
boxes: a data-parallel replica's attention, an outer module repeated on a later stage) is stored
once, by the first rank in global order, and the manifest points the others at that file.
Writing is atomic: into a temporary directory renamed into place
(new ``out_dir``), or, over an existing save, new files first and the manifest replaced last,
each fsynced; a crash at any step leaves the old save or the new one, never a mix that loads.

``load(out_dir, tp_size=..., rank=...)`` recognises the manifest
(:mod:`functional_load.checkpoint.sharded`): the original checkpoint is rebuilt *virtually* from
the recorded boxes and the normal planner runs against it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..checkpoint.sharded import FORMAT, MANIFEST, VERSION, read_manifest
from ..dtypes import TORCH_TO_SAFETENSORS
from ..errors import ConfigError, LoadError
from ..layout.segments import Box
from ..plan.plan import ParamPlan, Plan
from ..storage import StoredPath, as_path, read_all, storage_for
from ..storage.local import fsync_dir
from .state import LoadedState

if TYPE_CHECKING:
    import torch


class SaveFile(Protocol):
    """``safetensors.torch.save_file``'s signature."""

    def __call__(self, tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None: ...


def _step(name: str) -> None:
    """A named point of the save; tests replace this to fail at every step in turn."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def follow_umask(path: Path) -> None:
    """Give a file the permissions a plain ``open`` would (``0o666`` less the umask): safetensors
    creates its files readable by their owner only."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors`` ``save_file`` with the umask's permissions, its I/O failures (disk full,
    ...) raised as the ``OSError`` they are."""
    from safetensors.torch import save_file

    _save_file(save_file, tensors, path, metadata)


def _save_file(save_file: SaveFile, tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors`` ``save_file``, whose I/O failures (disk full, ...) arrive as its own
    ``SafetensorError``: raised again as the ``OSError`` they are, so a full disk is a LoadError.
    The file gets the umask's permissions (safetensors makes it owner-only)."""
    from safetensors import SafetensorError

    try:
        save_file(tensors, str(path), metadata=metadata)
        follow_umask(path)
    except SafetensorError as exc:
        found = re.search(r"I/O error: .*\(os error (\d+)\)", str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc


def _box(b: Box) -> list[list[int]]:
    return [list(r) for r in b]


def write_sharded(states: Iterable[LoadedState], out_dir: str | os.PathLike, model_dir: str | os.PathLike | None = None) -> Path:
    """Write the ``LoadedState`` of every rank of one layout (every global rank of its
    ``pp_size x dp_size x tp_size``, in any order) to ``out_dir`` (atomically), with the manifest
    that lets any layout reload it. Returns ``out_dir``.

    ``model_dir`` is the checkpoint the states were loaded from (default: their plan's); its
    ``config.json`` is copied. Disk full or another OS error is a ``LoadError``, and a previous
    save in ``out_dir`` stays loadable. (An object-storage ``out_dir``: :func:`.save_remote.write_to`.)
    """
    try:
        return _write(iter(states), Path(out_dir), as_path(model_dir) if model_dir is not None else None)
    except OSError as exc:
        raise LoadError(
            f"save_sharded: writing {out_dir} failed ({exc.strerror or exc}); nothing was committed, and any previous "
            f"save there is intact. Free space (a save needs about the model's size) and save again"
        ) from None


def _write(states: Iterator[LoadedState], out: Path, model_dir: StoredPath | None) -> Path:
    """Write every rank's file, the config and the manifest into ``out`` (atomically, see the module docstring); returns ``out``."""
    from safetensors.torch import save_file

    save_id = uuid.uuid4().hex[:12]
    fresh = not (out / MANIFEST).exists()
    work = out.parent / f".{out.name}.tmp-{save_id}" if fresh else out
    work.mkdir(parents=True, exist_ok=not fresh)
    written: list[Path] = []
    try:
        first_plan, model_dir, sections = _write_ranks(states, work, save_id, save_file, written, model_dir)
        config_tmp, config_bytes = _stage_config(work, fresh, save_id, model_dir)
        manifest = _manifest(first_plan, model_dir, config_bytes, sections)
        _commit(out, work, fresh, save_id, manifest, sections["files"], config_tmp)
    except BaseException:
        _discard(out, work, fresh, save_id, written)
        raise
    return out


def _write_ranks(
    states: Iterator[LoadedState], work: Path, save_id: str, save_file: SaveFile, written: list[Path], model_dir: StoredPath | None,
    publish: Callable[[Path], None] | None = None,
) -> tuple[Plan, StoredPath | None, dict[str, dict[str, dict[str, object]]]]:
    """Write each rank's file into ``work`` (appending it to ``written``; then ``publish(file)``, when
    given: an upload); returns the first plan, the model directory (default: the plans') and the
    manifest's ``files``, ``tensors`` and ``ranks``."""
    ranks: dict[str, dict[str, object]] = {}  # the manifest's JSON
    originals: dict[str, dict[str, object]] = {}
    files: dict[str, dict[str, object]] = {}
    stored: dict[str, str] = {}  # a rank tensor's identity (see _shared) -> the file that stores it
    first_plan = None
    for state in states:
        plan = state.plan
        _check_saveable(state, plan, first_plan)
        first_plan = first_plan or plan
        if model_dir is None:
            model_dir = as_path(plan.model_dir)
        flat = plan.parallel.flat_rank
        if str(flat) in ranks:
            raise ConfigError(f"save_sharded: two rank states are {plan.parallel.describe()} (global rank {flat}); pass each rank once")
        name = f"model-rank-{flat}-of-{_world(plan)}-{save_id}.safetensors"
        params = {p.spec.name: _param_entry(plan, p, name, originals) for p in plan.params}
        shared = _shared(state, plan, params, stored, name)
        files[name] = _write_rank_file(state, plan, work / name, save_file, written, shared)
        if publish is not None:
            publish(work / name)
        ranks[str(flat)] = {"file": name, "parallel": plan.parallel.to_json(), "params": params, "aliases": dict(plan.aliases)}
    if first_plan is None:
        raise ConfigError("save_sharded: no rank states to save")
    missing = sorted(set(range(_world(first_plan))) - {int(r) for r in ranks})
    if missing:
        p0 = first_plan.parallel
        raise ConfigError(
            f"save_sharded: got {len(ranks)} rank states for tp_size={p0.tp_size}, pp_size={p0.pp_size}, dp_size={p0.dp_size} "
            f"({_world(first_plan)} ranks); global ranks {missing[:8]} are missing. Pass every rank (global rank "
            f"(dp_rank * pp_size + pp_rank) * tp_size + rank)"
        )
    return first_plan, model_dir, {"files": files, "tensors": originals, "ranks": ranks}


def _world(plan: Plan) -> int:
    return plan.parallel.tp_size * plan.parallel.pp_size * plan.parallel.dp_size


def _layout_key(plan: Plan) -> tuple[object, ...]:
    """What every rank of one save shares: the model, dtype and layout (all but the rank's coordinates)."""
    p = plan.parallel
    return (plan.arch, plan.dtype, p.tp_size, p.pp_size, p.dp_size, p.expert_parallel, p.expert_placement,
            p.num_redundant_experts, p.pp_partition, _online_method(plan))


def _check_saveable(state: LoadedState, plan: Plan, first: Plan | None) -> None:
    """Raise ``ConfigError`` unless ``state`` is a checkpoint-layout load of real tensors, of the
    layout of the ``first`` state saved."""
    if getattr(state, "target", "checkpoint") != "checkpoint":
        raise ConfigError("save_sharded saves checkpoint-layout loads only (target='checkpoint')")
    if plan.dummy:
        raise ConfigError("save_sharded saves a checkpoint's tensors; a load_format='dummy' load has none to save")
    if first is not None and _layout_key(plan) != _layout_key(first):
        raise ConfigError(
            f"save_sharded: the rank states are of different models or layouts: {plan.parallel.describe()} is "
            f"{_layout_key(plan)}, {first.parallel.describe()} is {_layout_key(first)} (arch, dtype, tp, pp and dp sizes, "
            f"expert parallelism, pipeline partition, online quantization). Pass the ranks of one load"
        )


def _shared(state: LoadedState, plan: Plan, params: dict[str, dict[str, object]], stored: dict[str, str], file: str) -> set[str]:
    """The parameters of this rank that an earlier rank's file stores already: the same tensor rank,
    name, original boxes, shape and dtype (a data-parallel replica's attention, an outer module on
    a later stage; online-quantization scales with their module's weights). Their manifest entry
    points at that file; the rest are recorded in ``stored`` as held by ``file``."""
    keys: dict[str, str] = {}
    modules: dict[str, list[str]] = {}  # module -> the identities of its weights on this rank
    for p in sorted(plan.params, key=lambda p: p.spec.derived):  # the weights first, then the scales derived from them
        name, tensor = p.spec.name, state[p.spec.name]
        origin = sorted(modules.get(p.spec.module, ())) if p.spec.derived else params[name]["sources"]
        if p.fill is None and origin:
            keys[name] = json.dumps([plan.parallel.rank, name, origin, list(tensor.shape), str(tensor.dtype)])
            if not p.spec.derived:
                modules.setdefault(p.spec.module, []).append(keys[name])
    shared = set()
    for name, key in keys.items():
        if key in stored:
            params[name]["file"] = stored[key]
            shared.add(name)
        else:
            stored[key] = file
    return shared


def _write_rank_file(
    state: LoadedState, plan: Plan, path: Path, save_file: SaveFile, written: list[Path], shared: set[str]
) -> dict[str, object]:
    """Write and fsync one rank's tensors (tied aliases once, filled defaults and the ``shared``
    ones an earlier file stores not at all) to ``path``, appending it to ``written``; returns the
    file's entry of the manifest's ``files``."""
    rank = plan.parallel.flat_rank
    unique = {id(t): (n, t) for n, t in reversed(list(state.items()))}  # tied aliases stored once
    fills = {p.spec.name for p in plan.params if p.fill is not None}  # defaults: in the manifest only
    tensors = {n: t.contiguous() for n, t in unique.values() if n not in fills and n not in shared}
    _step(f"write rank {rank}")
    _save_file(save_file, tensors, path, {"format": "pt", "rank": str(rank)})
    written.append(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    _step(f"fsync rank {rank}")
    return {"rank": rank, "size": path.stat().st_size, "sha256": file_sha256(path)}


def _param_entry(plan: Plan, p: ParamPlan, file: str, originals: dict[str, dict[str, object]]) -> dict[str, object]:
    """A parameter's manifest entry: the boxes of the checkpoint tensors it holds (their shape and
    dtype recorded in ``originals``); ``ConfigError`` if it is not a plain slice of them."""
    if any(not (c.plain or c.transposed) or len(c.src) > len(c.dst) for c in p.copies):
        raise ConfigError(
            f"save_sharded: {p.spec.name} is not a plain slice of the checkpoint (refined FP8 MoE block "
            f"scales, MXFP4 blocks, Llama 4's permuted q/k rows, Mamba's A = -exp(A_log)); pre-sharded saves "
            f"of it are not supported yet. Load it from the original checkpoint instead"
        )
    sources = [
        {"tensor": c.tensor, "src": _box(c.src), "dst": _box(c.dst), "transpose": c.transposed}
        for c in p.copies + p.checks
    ]
    for c in p.copies + p.checks:
        info = plan.tensors[c.tensor]
        originals[c.tensor] = {"shape": list(info.shape), "dtype": TORCH_TO_SAFETENSORS[p.spec.dtype]}
    return {"file": file, "sources": sources, "derived": p.spec.derived, "fill": p.fill}


def _stage_config(work: Path, fresh: bool, save_id: str, model_dir: StoredPath | None) -> tuple[Path, bytes]:
    """Copy (and fsync) the source's ``config.json`` into ``work``; returns the path it waits at and
    the config bytes the manifest digests (empty when there is none)."""
    # Over an old save, the new config.json waits under a temporary name and replaces the old
    # one together with the manifest: the old manifest must never meet the new config.
    config_tmp = work / ("config.json" if fresh else f".config.json.{save_id}")
    if model_dir is not None and storage_for(model_dir).kind(model_dir / "config.json") == "file":
        config_tmp.write_bytes(read_all(model_dir / "config.json", "a config"))
        with open(config_tmp, "rb+") as f:
            os.fsync(f.fileno())
    config_file = config_tmp if config_tmp.exists() else work / "config.json"
    config_bytes = config_file.read_bytes() if config_file.exists() else b""
    return config_tmp, config_bytes


def _manifest(
    first_plan: Plan, model_dir: StoredPath | None, config_bytes: bytes, sections: dict[str, dict[str, dict[str, object]]]
) -> dict[str, object]:
    """The manifest's JSON: the source's identity, the parallel layout, then ``sections`` (files, tensors, ranks)."""
    p0 = first_plan.parallel
    layout: dict[str, object] = {"pp_size": p0.pp_size, "dp_size": p0.dp_size}
    if p0.pp_partition:
        layout["pp_partition"] = list(p0.pp_partition)
    return {
        "format": FORMAT,
        "version": 1 if p0.pp_size == p0.dp_size == 1 else VERSION,  # older loaders read a single-stage, single-replica save
        "source": {"model_dir": str(model_dir), "config_sha256": hashlib.sha256(config_bytes).hexdigest()},
        "arch": first_plan.arch,
        "dtype": first_plan.dtype,
        "parallel": {
            "tp_size": p0.tp_size,
            "expert_parallel": p0.expert_parallel,
            "expert_placement": p0.expert_placement,
            "num_redundant_experts": p0.num_redundant_experts,
            **layout,
        },
        "online_quantization": _online_method(first_plan),
        **sections,
    }


def _commit(
    out: Path, work: Path, fresh: bool, save_id: str, manifest: dict[str, object], files: dict[str, dict[str, object]], config_tmp: Path
) -> None:
    """Write and fsync the manifest, replace the old one and config (or rename ``work`` to ``out``),
    then delete the old save's files that ``files`` does not reuse."""
    _step("write manifest")
    tmp = work / f".{MANIFEST}.{save_id}"
    tmp.write_text(json.dumps(manifest, indent=1))
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    _step("fsync manifest")
    old_files = []
    if not fresh:
        old = read_manifest(out)
        old_files = [out / n for n in (old or {}).get("files", {}) if n not in files]
    os.replace(tmp, work / MANIFEST)
    if config_tmp != work / "config.json" and config_tmp.exists():
        os.replace(config_tmp, work / "config.json")  # a crash just before: the reload refuses the mix
    fsync_dir(work)
    _step("commit")
    if fresh:
        os.replace(work, out)
        fsync_dir(out.parent)
    for stale in old_files:
        stale.unlink(missing_ok=True)
    _step("cleanup")


def _discard(out: Path, work: Path, fresh: bool, save_id: str, written: list[Path]) -> None:
    """After a failed save: remove what it wrote, unless the manifest in ``out`` already names its files."""
    if fresh:
        shutil.rmtree(work, ignore_errors=True)
    elif not (out / MANIFEST).exists() or json.loads((out / MANIFEST).read_text()).get("files", {}).keys().isdisjoint(
        p.name for p in written
    ):
        for path in written:
            path.unlink(missing_ok=True)
    if not fresh:  # the temporary manifest and config of this save, if not renamed yet
        for leftover in work.glob(f".*.{save_id}"):
            leftover.unlink(missing_ok=True)


def _online_method(plan: Any) -> str | None:  # a Plan; its online scheme (FP8's) has a strategy the Scheme protocol lacks
    """The ``quantization=`` value a plan was made with, if it quantized while loading."""
    for scheme in plan.schemes.values():
        if scheme.online:
            return "fp8_block" if scheme.strategy == "block" else "fp8"
    return None
