"""Pre-sharded checkpoints: save every rank's tensors once, reload them fast, at any tp size.

``save_sharded(model_dir, out_dir, tp_size)`` writes one safetensors file per rank
(``model-rank-{r}-of-{tp}-{save_id}.safetensors``), a copy of ``config.json`` and a versioned
manifest ``functional_load.sharded.json`` that records the source's identity, the parallel
layout, each file's size and SHA-256, and for every rank tensor which box of which original
checkpoint tensor it holds. Writing is atomic: into a temporary directory renamed into place
(new ``out_dir``), or, over an existing save, new files first and the manifest replaced last,
each fsynced; a crash at any step leaves the old save or the new one, never a mix that loads.

``load(out_dir, tp_size=..., rank=...)`` recognises the manifest. The original checkpoint is
rebuilt *virtually* from the recorded boxes, so the normal planner runs against it: at the saved
tp size each rank reads exactly its own file; at another tp size (reshard) each rank reads the
boxes it needs from whichever rank files hold them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import Checkpoint, TensorInfo
from .checkpoint.discover import check_contained, strict_json_loads
from .checkpoint.index import read_header
from .checkpoint.read import PreadReader
from .dtypes import SAFETENSORS_DTYPES, TORCH_TO_SAFETENSORS, itemsize
from .errors import ConfigError, FormatError, IntegrityError
from .sharding import Box

MANIFEST = "functional_load.sharded.json"
FORMAT = "functional_load.sharded"
VERSION = 1


def _step(name: str) -> None:
    """A named point of the save; tests replace this to fail at every step in turn."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _box(b: Box) -> list[list[int]]:
    return [list(r) for r in b]


def save_sharded(
    source: str | os.PathLike | Sequence[Any],
    out_dir: str | os.PathLike,
    tp_size: int | None = None,
    **options: Any,
) -> Path:
    """Save every rank of ``source`` (a checkpoint directory, loaded one rank at a time with
    ``options`` as for :func:`functional_load.load`; or the ``LoadedState`` of every rank) to
    ``out_dir``. Returns ``out_dir``."""
    from safetensors.torch import save_file

    from .api import load

    out = Path(out_dir)
    if isinstance(source, (str, os.PathLike)):
        if tp_size is None:
            raise ConfigError("save_sharded(model_dir, out_dir, tp_size): tp_size is required for a checkpoint directory")
        states = (load(source, tp_size=tp_size, rank=r, progress=False, **options) for r in range(tp_size))
        model_dir = Path(source)
    else:
        states = iter(source)
        model_dir = None
    save_id = uuid.uuid4().hex[:12]
    fresh = not (out / MANIFEST).exists()
    work = out.parent / f".{out.name}.tmp-{save_id}" if fresh else out
    work.mkdir(parents=True, exist_ok=not fresh)
    written: list[Path] = []
    try:
        ranks: dict[str, Any] = {}
        originals: dict[str, Any] = {}
        files: dict[str, Any] = {}
        first_plan = None
        for state in states:
            plan = state.plan
            if getattr(state, "target", "checkpoint") != "checkpoint":
                raise ConfigError("save_sharded saves checkpoint-layout loads only (target='checkpoint')")
            first_plan = first_plan or plan
            if model_dir is None:
                model_dir = Path(plan.model_dir)
            rank = plan.parallel.rank
            name = f"model-rank-{rank}-of-{plan.parallel.tp_size}-{save_id}.safetensors"
            unique = {id(t): (n, t) for n, t in reversed(list(state.items()))}  # tied aliases stored once
            fills = {p.spec.name for p in plan.params if p.fill is not None}  # defaults: in the manifest only
            tensors = {n: t.contiguous() for n, t in unique.values() if n not in fills}
            _step(f"write rank {rank}")
            save_file(tensors, str(work / name), metadata={"format": "pt", "rank": str(rank)})
            written.append(work / name)
            with open(work / name, "rb+") as f:
                os.fsync(f.fileno())
            _step(f"fsync rank {rank}")
            files[name] = {"rank": rank, "size": (work / name).stat().st_size, "sha256": _sha256(work / name)}
            params = {}
            for p in plan.params:
                sources = [
                    {"tensor": c.tensor, "src": _box(c.src), "dst": _box(c.dst), "transpose": c.transpose}
                    for c in p.copies + p.checks
                ]
                for c in p.copies + p.checks:
                    info = plan.tensors[c.tensor]
                    originals[c.tensor] = {"shape": list(info.shape), "dtype": TORCH_TO_SAFETENSORS[p.spec.dtype]}
                params[p.spec.name] = {"file": name, "sources": sources, "derived": p.spec.derived, "fill": p.fill}
            ranks[str(rank)] = {"file": name, "params": params, "aliases": dict(plan.aliases)}
        if first_plan is None:
            raise ConfigError("save_sharded: no rank states to save")
        # Over an old save, the new config.json waits under a temporary name and replaces the old
        # one together with the manifest: the old manifest must never meet the new config.
        config_tmp = work / ("config.json" if fresh else f".config.json.{save_id}")
        if model_dir is not None and (model_dir / "config.json").is_file():
            shutil.copyfile(model_dir / "config.json", config_tmp)
            with open(config_tmp, "rb+") as f:
                os.fsync(f.fileno())
        config_file = config_tmp if config_tmp.exists() else work / "config.json"
        config_bytes = config_file.read_bytes() if config_file.exists() else b""
        p0 = first_plan.parallel
        manifest = {
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
            "online_quantization": next((q.method for q in [_online_method(first_plan)] if q), None),
            "files": files,
            "tensors": originals,
            "ranks": ranks,
        }
        if len(ranks) != p0.tp_size:
            raise ConfigError(f"save_sharded: got {len(ranks)} rank states for tp_size={p0.tp_size}; pass every rank")
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
            os.replace(config_tmp, work / "config.json")  # a crash just before: plan_sharded refuses the mix
        _fsync_dir(work)
        _step("commit")
        if fresh:
            os.replace(work, out)
            _fsync_dir(out.parent)
        for stale in old_files:
            stale.unlink(missing_ok=True)
        _step("cleanup")
    except BaseException:
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
        raise
    return out


@dataclass(frozen=True, slots=True)
class _Method:
    method: str


def _online_method(plan: Any) -> _Method | None:
    """The ``quantization=`` value a plan was made with, if it quantized while loading."""
    for scheme in plan.schemes.values():
        if scheme.online:
            return _Method("fp8_block" if scheme.strategy == "block" else "fp8")
    return None


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of a pre-sharded directory, or ``None`` when it is not one."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    check_contained(path, Path(directory), "Manifest")
    manifest = strict_json_loads(path.read_bytes(), str(path))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FormatError(f"{path}: not a functional_load sharded-state manifest")
    if manifest.get("version") != VERSION:
        raise FormatError(f"{path}: manifest version {manifest.get('version')!r}; this loader reads version {VERSION}")
    for key in ("files", "tensors", "ranks", "parallel"):
        if not isinstance(manifest.get(key), dict):
            raise FormatError(f"{path}: manifest field {key!r} is missing or not an object")
    for name in manifest["files"]:
        if not isinstance(name, str) or os.path.basename(name) != name or name.startswith("."):
            raise FormatError(f"{path}: manifest file name {name!r} is not a plain file name")
    tp_size = manifest["parallel"].get("tp_size")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise FormatError(f"{path}: manifest parallel.tp_size {tp_size!r} is not a positive integer")
    for rank in range(tp_size):
        entry = manifest["ranks"].get(str(rank))
        file = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(file, str) or file not in manifest["files"] or not isinstance(entry.get("params"), dict):
            raise FormatError(
                f"{path}: manifest rank {rank} of tp_size {tp_size} is missing, names no file listed under 'files' "
                f"(found {file!r}) or has no 'params' object"
            )
    _check_schema(path, manifest)
    return manifest


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_box(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(r, list) and len(r) == 2 and _is_int(r[0]) and _is_int(r[1]) and r[0] <= r[1] for r in value
    )


def _check_schema(path: Path, manifest: Mapping[str, Any]) -> None:
    """Every field the loader reads has the type it expects; a FormatError names the first that
    does not (instead of a KeyError deep inside the reshard)."""

    def need(ok: bool, where: str, value: Any) -> None:
        if not ok:
            raise FormatError(f"{path}: manifest field {where} is malformed (found {value!r:.80})")

    parallel = manifest["parallel"]
    need(isinstance(parallel.get("expert_parallel"), bool), "parallel.expert_parallel", parallel.get("expert_parallel"))
    need(isinstance(parallel.get("expert_placement"), str), "parallel.expert_placement", parallel.get("expert_placement"))
    need(_is_int(parallel.get("num_redundant_experts")), "parallel.num_redundant_experts", parallel.get("num_redundant_experts"))
    need(manifest.get("dtype") in TORCH_TO_SAFETENSORS, "dtype", manifest.get("dtype"))
    for name, entry in manifest["files"].items():
        ok = isinstance(entry, dict) and _is_int(entry.get("size")) and isinstance(entry.get("sha256"), str)
        need(ok, f"files[{name!r}]", entry)
    for name, meta in manifest["tensors"].items():
        ok = isinstance(meta, dict) and isinstance(meta.get("shape"), list) and all(_is_int(d) for d in meta["shape"])
        need(ok and meta.get("dtype") in SAFETENSORS_DTYPES, f"tensors[{name!r}]", meta)
    for rank, entry in manifest["ranks"].items():
        need(isinstance(entry.get("aliases", {}), dict), f"ranks[{rank!r}].aliases", entry.get("aliases"))
        for param, record in entry["params"].items():
            sources = record.get("sources") if isinstance(record, dict) else None
            need(isinstance(sources, list), f"ranks[{rank!r}].params[{param!r}].sources", sources)
            for source in sources:
                ok = (
                    isinstance(source, dict)
                    and source.get("tensor") in manifest["tensors"]
                    and _is_box(source.get("src"))
                    and _is_box(source.get("dst"))
                    and isinstance(source.get("transpose"), bool)
                )
                need(ok, f"ranks[{rank!r}].params[{param!r}].sources", source)


def verify_files(directory: Path, manifest: Mapping[str, Any], names: Sequence[str], hashes: bool) -> None:
    """Sizes always; SHA-256 too with ``hashes=True``."""
    for name in names:
        entry = manifest["files"][name]
        path = directory / name
        if not path.is_file():
            raise IntegrityError(f"{path}: listed in the manifest but missing; the save is incomplete")
        check_contained(path, directory, "Rank file")
        if path.stat().st_size != entry["size"]:
            raise IntegrityError(f"{path}: {path.stat().st_size} bytes, the manifest says {entry['size']}")
        if hashes and _sha256(path) != entry["sha256"]:
            raise IntegrityError(f"{path}: SHA-256 differs from the manifest; the file is corrupt (bit flip?) or was replaced")


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of an original checkpoint tensor, stored at ``dst`` of ``info`` (a rank-file tensor)."""

    src: Box
    dst: Box
    transpose: bool
    info: TensorInfo


def sharded_checkpoint(directory: str | os.PathLike, manifest: Mapping[str, Any], rank: int, hashes: bool = False):
    """The virtual original checkpoint of a pre-sharded directory, and a reader factory for it.

    Every rank file holds boxes of original tensors; a box kept by several ranks (replicated
    parameters, shared KV heads) is read from ``rank``'s own file when it has it.
    """
    directory = Path(directory)
    if manifest.get("online_quantization"):
        raise ConfigError(
            f"{directory}: this save holds weights quantized while loading; it reloads only as saved (its original "
            f"weights are not in it). Save from the original checkpoint to reshard"
        )
    saved_tp = manifest["parallel"]["tp_size"]
    order = sorted(range(saved_tp), key=lambda r: (r != rank % saved_tp, r))
    needed = sorted({manifest["ranks"][str(r)]["file"] for r in order})
    verify_files(directory, manifest, needed, hashes)
    headers = {name: read_header(directory / name) for name in needed}
    pieces: dict[str, list[Piece]] = {}
    for r in order:
        entry = manifest["ranks"][str(r)]
        header = headers[entry["file"]]
        aliases = entry.get("aliases", {})
        for param, record in entry["params"].items():
            if not record["sources"]:
                continue  # a default value, not stored
            info = header.get(param) or header.get(aliases.get(param, ""))
            if info is None:
                raise FormatError(f"{directory / entry['file']}: has no tensor {param!r}, which the manifest lists")
            for s in record["sources"]:
                src = tuple(tuple(b) for b in s["src"])
                have = pieces.setdefault(s["tensor"], [])
                if any(p.src == src for p in have):
                    continue  # the same box from an earlier (preferred) rank
                have.append(Piece(src, tuple(tuple(b) for b in s["dst"]), bool(s["transpose"]), info))
    tensors = {}
    for name, meta in manifest["tensors"].items():
        shape = tuple(meta["shape"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize(meta["dtype"])
        tensors[name] = TensorInfo(name, directory / MANIFEST, meta["dtype"], shape, -2, nbytes)
    files = tuple(directory / n for n in needed)
    checkpoint = Checkpoint(directory, "sharded", files, tensors, directory / MANIFEST)
    return checkpoint, lambda: ShardedReader(pieces)


class ShardedReader:
    """Serves boxes of the virtual original tensors from the rank files' boxes."""

    def __init__(self, pieces: Mapping[str, list[Piece]]):
        self._pieces = pieces
        self._reader = PreadReader()
        self.bytes_read = 0

    def read_into(self, info: TensorInfo, box: Box, out: memoryview) -> None:
        item = itemsize(info.dtype)
        shape = tuple(b - a for a, b in box) or (1,)
        target = np.frombuffer(out, dtype=np.uint8).reshape(shape[:-1] + (shape[-1] * item,))
        covered = 0
        for piece in self._pieces.get(info.name, ()):
            inter = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(box, piece.src))
            if any(lo >= hi for lo, hi in inter):
                if box:
                    continue
            rel = [(lo - s0, hi - s0) for (lo, hi), (s0, _) in zip(inter, piece.src)]
            # the piece's box, in the rank tensor's coordinates (transposed back when needed)
            if piece.transpose:
                rel = rel[::-1]
            lead = len(piece.dst) - len(rel)  # a per-expert matrix sits in one slot of a 3-D parameter
            stored = piece.dst[:lead] + tuple((d0 + lo, d0 + hi) for (lo, hi), (d0, _) in zip(rel, piece.dst[lead:]))
            n = int(np.prod([hi - lo for lo, hi in stored], dtype=np.int64))
            chunk = bytearray(n * item)
            self._reader.read_into(piece.info, stored, memoryview(chunk))
            block = np.frombuffer(chunk, dtype=np.uint8).reshape(tuple(hi - lo for lo, hi in stored[lead:]) + (item,))
            if piece.transpose:
                block = block.transpose(1, 0, 2)
            where = tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(inter, box))
            view = target.reshape(shape + (item,))[where]
            view[...] = block.reshape(view.shape)
            covered += n
        if covered != int(np.prod(shape, dtype=np.int64)):
            raise IntegrityError(
                f"{info.name}: the pre-sharded files hold {covered} of the {int(np.prod(shape))} elements of box "
                f"{[list(b) for b in box]}; the save is incomplete for this layout"
            )
        self.bytes_read += out.nbytes

    def close(self) -> None:
        self._reader.close()


def same_layout(manifest: Mapping[str, Any], parallel: Any) -> bool:
    saved = manifest["parallel"]
    return (
        saved["tp_size"] == parallel.tp_size
        and saved["expert_parallel"] == parallel.expert_parallel
        and (not parallel.expert_parallel or saved["expert_placement"] == parallel.expert_placement)
        and saved["num_redundant_experts"] == parallel.num_redundant_experts
    )


def plan_sharded(directory: str | os.PathLike, manifest: Mapping[str, Any], layout: Any, hashes: bool = False) -> Any:
    """The plan of one rank of a pre-sharded directory under ``layout``: straight from its own
    file when the layout is the saved one, else resharded from the recorded boxes."""
    from dataclasses import replace

    from .plan import Copy, ParamPlan, Plan, make_plan
    from .sharding import full_box

    directory = Path(directory)
    parallel = layout.parallel
    source = manifest.get("source")
    recorded = source.get("config_sha256") if isinstance(source, dict) else None
    config = directory / "config.json"
    if recorded is not None and config.is_file() and hashlib.sha256(config.read_bytes()).hexdigest() != recorded:
        raise IntegrityError(
            f"{config}: differs from the config.json saved with {directory / MANIFEST} (SHA-256); it was edited, or a "
            f"re-save was interrupted between the manifest and the config. Re-save the checkpoint"
        )
    if manifest.get("dtype") != layout.dtype:
        raise ConfigError(
            f"{directory}: saved in {manifest.get('dtype')}, asked for {layout.dtype}; load it with dtype=None (or the "
            f"saved dtype) — a pre-sharded save is not re-cast"
        )
    if not same_layout(manifest, parallel):
        checkpoint, reader = sharded_checkpoint(directory, manifest, parallel.rank, hashes)
        return replace(make_plan(layout, checkpoint), source=reader)
    entry = manifest["ranks"][str(parallel.rank)]
    verify_files(directory, manifest, [entry["file"]], hashes)
    header = read_header(directory / entry["file"])
    params, problems = [], []
    for spec in layout.params.values():
        fill = entry["params"].get(spec.name, {}).get("fill")
        if fill is not None:  # a default value (an absent KV-cache scale), not stored in the rank file
            params.append(ParamPlan(spec, (), fill=fill))
            continue
        info = header.get(spec.name)
        if info is None:
            problems.append(f"{spec.name} is not in {entry['file']}")
            continue
        if info.shape != spec.local_shape:
            problems.append(f"{spec.name}: saved shape {list(info.shape)}, the layout wants {list(spec.local_shape)}")
            continue
        from .dtypes import torch_name

        spec = replace(spec, dtype=torch_name(info.dtype), derived=False)
        box = full_box(spec.local_shape)
        params.append(ParamPlan(spec, (Copy(spec.name, box, box),)))
    if problems:
        raise ConfigError(
            f"{directory}: the save does not match this layout ({len(problems)} problems, e.g. {problems[0]}); it was "
            f"saved for {manifest['parallel']} — load it with those settings"
        )
    schemes = {m: replace(q, online=False) for m, q in layout.schemes.items()}
    return Plan(
        model_dir=str(directory), arch=layout.arch, parallel=parallel, dtype=layout.dtype, params=tuple(params),
        tensors={p.spec.name: header[p.spec.name] for p in params if p.copies}, aliases=layout.aliases, schemes=schemes,
    )
