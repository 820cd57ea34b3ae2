"""Pre-sharded saves, read side: the manifest, and the virtual checkpoint it describes.

A directory written by :func:`functional_load.save_sharded` holds one safetensors file per rank
and a manifest that records, for every rank tensor, which box of which original checkpoint
tensor it holds. :func:`sharded_checkpoint` rebuilds the original checkpoint from it
*virtually*: every original tensor's bytes are :class:`~functional_load.checkpoint.SavedBoxes`
in the rank files, so the normal planner runs against it at any tp size (at the saved one, a
rank's boxes all come from its own file). Headers and sizes only; hashes are checked by the
reader (``ReadOptions(verify_hashes=True)``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence

from ..dtypes import SAFETENSORS_DTYPES, TORCH_TO_SAFETENSORS
from ..errors import ConfigError, FormatError, IntegrityError
from ..layout.parallel import Parallel
from ..paths import JsonDict, JsonObject, strict_json_loads
from ..storage import StoredPath, as_path, read_all, storage_for
from . import Checkpoint, RankFiles, SavedBoxes, SavedPiece, TensorInfo
from .index import read_header

MANIFEST = "functional_load.sharded.json"
FORMAT = "functional_load.sharded"
VERSION = 1


def read_manifest(directory: str | os.PathLike[str] | StoredPath) -> JsonDict | None:
    """The manifest of a pre-sharded directory, or ``None`` when it is not one."""
    directory = as_path(directory)
    path = directory / MANIFEST
    storage = storage_for(path)
    if storage.kind(path) != "file":
        return None
    storage.contained(path, directory, "Manifest")
    manifest = strict_json_loads(read_all(path, "a manifest"), str(path))
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


def _is_int(value: object, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_box(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(r, list) and len(r) == 2 and _is_int(r[0]) and _is_int(r[1]) and r[0] <= r[1] for r in value
    )


def _check_schema(path: StoredPath, manifest: JsonObject) -> None:
    """Every field the loader reads has the type it expects; a FormatError names the first that
    does not (instead of a KeyError deep inside the reshard)."""

    def need(ok: bool, where: str, value: object) -> None:
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
            for source in sources or ():
                ok = (
                    isinstance(source, dict)
                    and source.get("tensor") in manifest["tensors"]
                    and _is_box(source.get("src"))
                    and _is_box(source.get("dst"))
                    and isinstance(source.get("transpose"), bool)
                )
                need(ok, f"ranks[{rank!r}].params[{param!r}].sources", source)


def verify_sizes(directory: StoredPath, manifest: JsonObject, names: Sequence[str]) -> None:
    """Every rank file named exists, in the directory, with the size the manifest records."""
    for name in names:
        entry = manifest["files"][name]
        path = directory / name
        storage = storage_for(path)
        if storage.kind(path) != "file":
            raise IntegrityError(f"{path}: listed in the manifest but missing; the save is incomplete")
        storage.contained(path, directory, "Rank file")
        size = storage.stamp(path).size
        if size != entry["size"]:
            raise IntegrityError(f"{path}: {size} bytes, the manifest says {entry['size']}")


def _check_config(directory: StoredPath, manifest: JsonObject) -> None:
    source = manifest.get("source")
    recorded = source.get("config_sha256") if isinstance(source, dict) else None
    config = directory / "config.json"
    if recorded is None or storage_for(config).kind(config) != "file":
        return
    if hashlib.sha256(read_all(config, "a config")).hexdigest() != recorded:
        raise IntegrityError(
            f"{config}: differs from the config.json saved with {directory / MANIFEST} (SHA-256); it was edited, or a "
            f"re-save was interrupted between the manifest and the config. Re-save the checkpoint"
        )


def sharded_checkpoint(directory: str | os.PathLike[str] | StoredPath, manifest: JsonObject, rank: int) -> Checkpoint:
    """The virtual original checkpoint of a pre-sharded directory, as rank ``rank`` reads it.

    Every rank file holds boxes of original tensors; a box kept by several ranks (replicated
    parameters, shared KV heads) is read from ``rank``'s own file when it has it. A save of
    weights quantized while loading has no original tensors: it is the rank's own file, as is
    (``rank_local``), and loads only at its saved layout.
    """
    directory = as_path(directory)
    _check_config(directory, manifest)
    saved_tp = manifest["parallel"]["tp_size"]
    checksums = {directory / name: entry["sha256"] for name, entry in manifest["files"].items()}
    if manifest.get("online_quantization"):
        if rank >= saved_tp:
            raise ConfigError(f"{directory}: saved for tp_size={saved_tp}; it has no rank {rank}")
        own = manifest["ranks"][str(rank)]["file"]
        verify_sizes(directory, manifest, [own])
        tensors = read_header(directory / own)
        return Checkpoint(directory, "sharded", (directory / own,), tensors, directory / MANIFEST, True, checksums)
    order = sorted(range(saved_tp), key=lambda r: (r != rank % saved_tp, r))
    needed = sorted({manifest["ranks"][str(r)]["file"] for r in order})
    verify_sizes(directory, manifest, needed)
    own = directory / manifest["ranks"][str(order[0])]["file"]
    headers = RankFiles(read_header, {own: read_header(own)})  # the others' when a box is read from them
    pieces: dict[str, list[SavedPiece]] = {}
    for r in order:
        entry = manifest["ranks"][str(r)]
        for param, record in entry["params"].items():
            if not record["sources"]:
                continue  # a default value, not stored
            for s in record["sources"]:
                src = tuple(tuple(b) for b in s["src"])
                have = pieces.setdefault(s["tensor"], [])
                if any(p.src == src for p in have):
                    continue  # the same box from an earlier (preferred) rank
                dst = tuple(tuple(b) for b in s["dst"])
                have.append(SavedPiece(src, dst, bool(s["transpose"]), directory / entry["file"], param, headers))
    for param, record in manifest["ranks"][str(order[0])]["params"].items():  # the own file holds what is listed
        if record["sources"]:
            headers.info(own, param)
    tensors = {
        name: TensorInfo(name, meta["dtype"], tuple(meta["shape"]), SavedBoxes(tuple(pieces.get(name, ())), directory / MANIFEST))
        for name, meta in manifest["tensors"].items()
    }
    files = tuple(directory / n for n in needed)
    return Checkpoint(directory, "sharded", files, tensors, directory / MANIFEST, False, checksums)


def saved_rank(
    directory: str | os.PathLike[str] | StoredPath, manifest: JsonObject, parallel: Parallel, params: Mapping[str, tuple[int, ...]]
) -> Checkpoint | None:
    """The rank's own file as a rank-local checkpoint, when this load is the saved one: the same
    tp size and expert placement, and the file holds exactly ``params`` (the layout's rank-local
    parameters less tied aliases, and less those the save records as defaults) at those shapes. Its tensors are then read
    as they are, in file order (no virtual original tensors, no per-box gather). None otherwise:
    the load reshards through :func:`sharded_checkpoint`."""
    saved = manifest["parallel"]
    same = (parallel.tp_size, parallel.expert_parallel, parallel.expert_placement, parallel.num_redundant_experts) == (
        saved["tp_size"], saved["expert_parallel"], saved["expert_placement"], saved["num_redundant_experts"],
    )
    if not same or manifest.get("online_quantization"):
        return None
    directory = as_path(directory)
    entry = manifest["ranks"][str(parallel.rank)]
    verify_sizes(directory, manifest, [entry["file"]])
    own = directory / entry["file"]
    tensors = read_header(own)
    stored = {n: shape for n, shape in params.items() if entry["params"].get(n, {}).get("fill") is None}
    if {n: t.shape for n, t in tensors.items()} != stored:
        return None
    checksums = {directory / name: e["sha256"] for name, e in manifest["files"].items()}
    return Checkpoint(directory, "sharded", (own,), tensors, directory / MANIFEST, True, checksums)
