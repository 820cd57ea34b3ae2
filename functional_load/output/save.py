"""Pre-sharded checkpoints, write side: every rank's tensors once, with a manifest.

:func:`write_sharded` (behind :func:`functional_load.save_sharded`) writes one safetensors file per rank
(``model-rank-{r}-of-{tp}-{save_id}.safetensors``), a copy of ``config.json`` and a versioned
manifest ``functional_load.sharded.json`` that records the source's identity, the parallel
layout, each file's size and SHA-256, and for every rank tensor which box of which original
checkpoint tensor it holds. Writing is atomic: into a temporary directory renamed into place
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
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..checkpoint.sharded import FORMAT, MANIFEST, VERSION, read_manifest
from ..dtypes import TORCH_TO_SAFETENSORS
from ..errors import ConfigError, LoadError
from ..layout.segments import Box
from ..plan.plan import ParamPlan, Plan
from ..storage import StoredPath, as_path, read_all, storage_for
from .state import LoadedState

if TYPE_CHECKING:
    import torch


class SaveFile(Protocol):
    """``safetensors.torch.save_file``'s signature."""

    def __call__(self, tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None: ...


def _step(name: str) -> None:
    """A named point of the save; tests replace this to fail at every step in turn."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    """Write the ``LoadedState`` of every rank of one layout to ``out_dir`` (atomically), with
    the manifest that lets any tp size reload it. Returns ``out_dir``.

    ``model_dir`` is the checkpoint the states were loaded from (default: their plan's); its
    ``config.json`` is copied. Disk full or another OS error is a ``LoadError``, and a previous
    save in ``out_dir`` stays loadable.
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
        tp_size = first_plan.parallel.tp_size
        if len(sections["ranks"]) != tp_size:
            raise ConfigError(f"save_sharded: got {len(sections['ranks'])} rank states for tp_size={tp_size}; pass every rank")
        _commit(out, work, fresh, save_id, manifest, sections["files"], config_tmp)
    except BaseException:
        _discard(out, work, fresh, save_id, written)
        raise
    return out


def _write_ranks(
    states: Iterator[LoadedState], work: Path, save_id: str, save_file: SaveFile, written: list[Path], model_dir: StoredPath | None
) -> tuple[Plan, StoredPath | None, dict[str, dict[str, dict[str, object]]]]:
    """Write each rank's file into ``work`` (appending it to ``written``); returns the first plan, the
    model directory (default: the plans') and the manifest's ``files``, ``tensors`` and ``ranks``."""
    ranks: dict[str, dict[str, object]] = {}  # the manifest's JSON
    originals: dict[str, dict[str, object]] = {}
    files: dict[str, dict[str, object]] = {}
    first_plan = None
    for state in states:
        plan = state.plan
        _check_saveable(state, plan)
        first_plan = first_plan or plan
        if model_dir is None:
            model_dir = as_path(plan.model_dir)
        rank = plan.parallel.rank
        name = f"model-rank-{rank}-of-{plan.parallel.tp_size}-{save_id}.safetensors"
        files[name] = _write_rank_file(state, plan, work / name, save_file, written)
        params = {p.spec.name: _param_entry(plan, p, name, originals) for p in plan.params}
        ranks[str(rank)] = {"file": name, "params": params, "aliases": dict(plan.aliases)}
    if first_plan is None:
        raise ConfigError("save_sharded: no rank states to save")
    return first_plan, model_dir, {"files": files, "tensors": originals, "ranks": ranks}


def _check_saveable(state: LoadedState, plan: Plan) -> None:
    """Raise ``ConfigError`` unless ``state`` is a checkpoint-layout load of real tensors."""
    if getattr(state, "target", "checkpoint") != "checkpoint":
        raise ConfigError("save_sharded saves checkpoint-layout loads only (target='checkpoint')")
    if plan.dummy:
        raise ConfigError("save_sharded saves a checkpoint's tensors; a load_format='dummy' load has none to save")
    if plan.parallel.pp_size > 1 or plan.parallel.dp_size > 1:
        raise ConfigError(
            f"save_sharded saves every tensor rank of one whole layout; pp_size={plan.parallel.pp_size}, "
            f"dp_size={plan.parallel.dp_size} is one pipeline stage or data-parallel replica, and saves per stage are not "
            f"built yet: save with pp_size=1 and dp_size=1 (a reload at pp_size > 1 reads only its stage's tensors)"
        )


def _write_rank_file(state: LoadedState, plan: Plan, path: Path, save_file: SaveFile, written: list[Path]) -> dict[str, object]:
    """Write and fsync one rank's tensors (tied aliases once, filled defaults not at all) to ``path``,
    appending it to ``written``; returns the file's entry of the manifest's ``files``."""
    rank = plan.parallel.rank
    unique = {id(t): (n, t) for n, t in reversed(list(state.items()))}  # tied aliases stored once
    fills = {p.spec.name for p in plan.params if p.fill is not None}  # defaults: in the manifest only
    tensors = {n: t.contiguous() for n, t in unique.values() if n not in fills}
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
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": {"model_dir": str(model_dir), "config_sha256": hashlib.sha256(config_bytes).hexdigest()},
        "arch": first_plan.arch,
        "dtype": first_plan.dtype,
        "parallel": {
            "tp_size": p0.tp_size,
            "expert_parallel": p0.expert_parallel,
            "expert_placement": p0.expert_placement,
            "num_redundant_experts": p0.num_redundant_experts,
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
    _fsync_dir(work)
    _step("commit")
    if fresh:
        os.replace(work, out)
        _fsync_dir(out.parent)
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
