"""Pre-sharded saves, read side: the manifest, and the virtual checkpoint it describes.

A directory written by :func:`functional_load.save_sharded` holds one safetensors file per
global rank of its layout (``pp_size x dp_size x tp_size`` ranks) and a manifest that records each
rank's coordinates and, for every rank tensor, which box of which original checkpoint tensor it
holds and which file stores it (a data-parallel replica's or later stage's copy of a tensor an
earlier rank of the same tensor rank stored is not stored again). :func:`sharded_checkpoint`
rebuilds the original checkpoint from it *virtually*: every original tensor's bytes are
:class:`~functional_load.checkpoint.SavedBoxes` in the rank files, so the normal planner runs
against it at any layout; :func:`saved_rank` reads a rank's tensors as they are at the saved
layout. Headers and sizes only; hashes are checked by the reader
(``ReadOptions(verify_hashes=True)``).

A rank cache (``LoadOptions(cache_dir=...)``) is the same format for one rank: its manifest has a
``cache`` object (the source objects' identities) and lists only the ranks it holds.

Manifest version 1 is a single-stage, single-replica save (``parallel.tp_size`` ranks, keyed by
tensor rank); version 2 adds ``parallel.pp_size``/``dp_size`` and keys ranks by vLLM's global
rank ``(dp_rank * pp_size + pp_rank) * tp_size + rank``. Both are read.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence

from ..dtypes import SAFETENSORS_DTYPES, TORCH_TO_SAFETENSORS
from ..errors import ConfigError, FormatError, IntegrityError, LoadError
from ..layout.parallel import Parallel
from ..paths import JsonDict, JsonObject, strict_json_loads
from ..storage import StoredPath, as_path, read_all, storage_for
from . import Checkpoint, RankFiles, SavedBoxes, SavedPiece, TensorInfo
from .index import read_header

MANIFEST = "functional_load.sharded.json"
FORMAT = "functional_load.sharded"
VERSION = 2  # what this loader reads up to; a single-stage, single-replica save is still written as version 1
VERSIONS = (1, 2)


def world_size(manifest: JsonObject) -> int:
    """The saved layout's number of ranks: ``tp_size x pp_size x dp_size`` (version 1: ``tp_size``)."""
    saved = manifest["parallel"]
    return int(saved["tp_size"]) * int(saved.get("pp_size", 1)) * int(saved.get("dp_size", 1))


def stored_ranks(manifest: JsonObject) -> list[int]:
    """The global ranks the manifest's files hold: every rank of the layout, or a rank cache's
    own (a manifest with a ``cache`` object: :mod:`functional_load.output.rank_cache`)."""
    if manifest.get("cache") is not None:
        return sorted(int(k) for k in manifest["ranks"])
    return list(range(world_size(manifest)))


def rank_layout(manifest: JsonObject, key: str) -> JsonObject:
    """Saved rank ``key``'s coordinates (``Parallel.to_json()``): recorded, or, in a save written
    before they were, tensor rank ``key`` of the save's tp layout."""
    recorded = manifest["ranks"][key].get("parallel")
    if isinstance(recorded, dict):
        return recorded
    saved = manifest["parallel"]
    return Parallel(saved["tp_size"], int(key), saved["expert_parallel"], saved["expert_placement"],
                    saved["num_redundant_experts"]).to_json()


def param_file(entry: JsonObject, record: JsonObject) -> str:
    """The file that stores a rank's parameter: its own, unless the manifest points at another
    rank's (a data-parallel replica's or later stage's copy stored once)."""
    return str(record.get("file", entry["file"]))


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
    if manifest.get("version") not in VERSIONS:
        raise FormatError(
            f"{path}: manifest version {manifest.get('version')!r}; this loader reads versions {list(VERSIONS)}. "
            f"Upgrade functional_load, or save again from the original checkpoint"
        )
    for key in ("files", "tensors", "ranks", "parallel"):
        if not isinstance(manifest.get(key), dict):
            raise FormatError(f"{path}: manifest field {key!r} is missing or not an object")
    for name in manifest["files"]:
        if not isinstance(name, str) or os.path.basename(name) != name or name.startswith("."):
            raise FormatError(f"{path}: manifest file name {name!r} is not a plain file name")
    for axis in ("tp_size", "pp_size", "dp_size"):
        size = manifest["parallel"].get(axis, 1)
        if not _is_int(size, 1) or (manifest["version"] == 1 and axis != "tp_size" and size != 1):
            raise FormatError(f"{path}: manifest parallel.{axis} {size!r} is not a positive integer (1 in a version 1 manifest)")
    world = world_size(manifest)
    cached = manifest.get("cache")
    if cached is not None and (not isinstance(cached, dict) or not all(k.isdigit() and int(k) < world for k in manifest["ranks"])):
        raise FormatError(f"{path}: a rank cache's manifest whose 'cache' or 'ranks' is malformed; delete that cache folder")
    for rank in stored_ranks(manifest):
        entry = manifest["ranks"].get(str(rank))
        file = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(file, str) or file not in manifest["files"] or not isinstance(entry.get("params"), dict):
            raise FormatError(
                f"{path}: manifest rank {rank} of {world} ({_layout_words(manifest)}) is missing, names no file listed "
                f"under 'files' (found {file!r}) or has no 'params' object"
            )
    _check_schema(path, manifest)
    return manifest


def _layout_words(manifest: JsonObject) -> str:
    saved = manifest["parallel"]
    return f"tp_size {saved['tp_size']}, pp_size {saved.get('pp_size', 1)}, dp_size {saved.get('dp_size', 1)}"


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
        _check_rank_layout(path, manifest, rank)
        for param, record in entry["params"].items():
            sources = record.get("sources") if isinstance(record, dict) else None
            need(isinstance(sources, list), f"ranks[{rank!r}].params[{param!r}].sources", sources)
            need(record.get("file", entry["file"]) in manifest["files"], f"ranks[{rank!r}].params[{param!r}].file", record.get("file"))
            for source in sources or ():
                ok = (
                    isinstance(source, dict)
                    and source.get("tensor") in manifest["tensors"]
                    and _is_box(source.get("src"))
                    and _is_box(source.get("dst"))
                    and isinstance(source.get("transpose"), bool)
                )
                need(ok, f"ranks[{rank!r}].params[{param!r}].sources", source)


def _check_rank_layout(path: StoredPath, manifest: JsonObject, key: str) -> None:
    """A rank's recorded coordinates are a rank of the saved layout, filed under its global rank."""
    recorded = manifest["ranks"][key].get("parallel")
    if recorded is None:
        return
    saved = manifest["parallel"]
    try:
        fields = {k: recorded[k] for k in ("tp_size", "rank", "expert_parallel", "expert_placement", "num_redundant_experts")}
        axes = {k: recorded.get(k, d) for k, d in (("pp_size", 1), ("pp_rank", 0), ("dp_size", 1), ("dp_rank", 0))}
        rank = Parallel(**fields, **axes, pp_partition=tuple(recorded.get("pp_partition", ())))
        ok = str(rank.flat_rank) == key and (rank.tp_size, rank.pp_size, rank.dp_size) == (
            saved["tp_size"], saved.get("pp_size", 1), saved.get("dp_size", 1))
    except (TypeError, KeyError, AttributeError, LoadError):
        ok = False
    if not ok:
        raise FormatError(
            f"{path}: manifest ranks[{key!r}].parallel {recorded!r:.200} is not global rank {key} of the saved layout "
            f"({_layout_words(manifest)}); the manifest was edited or is corrupt. Save again from the original checkpoint"
        )


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


def _rank_tensors(directory: StoredPath, manifest: JsonObject, key: str) -> tuple[tuple[StoredPath, ...], dict[str, TensorInfo]]:
    """Saved rank ``key``'s tensors as they are stored: every tensor of its own file, then those of
    its parameters the manifest points at another rank's file for (in file order); and the files."""
    entry = manifest["ranks"][key]
    names = [entry["file"], *sorted({param_file(entry, r) for r in entry["params"].values()} - {entry["file"]})]
    verify_sizes(directory, manifest, names)
    tensors = dict(read_header(directory / entry["file"]))
    for name in names[1:]:
        header = read_header(directory / name)
        wanted = {p for p, r in entry["params"].items() if param_file(entry, r) == name}
        for param in sorted(wanted - set(header)):
            raise FormatError(f"{directory / name}: has no tensor {param!r}, which the manifest lists for saved rank {key}")
        tensors.update((param, info) for param, info in header.items() if param in wanted)
    return tuple(directory / n for n in names), tensors


def _sizes(layout: JsonObject) -> tuple[object, object, object]:
    return layout["tp_size"], layout.get("pp_size", 1), layout.get("dp_size", 1)


def _saved_key(manifest: JsonObject, parallel: Parallel) -> str | None:
    """The saved rank that is ``parallel`` (the same coordinates over every axis), if any."""
    key = str(parallel.flat_rank)
    return key if key in manifest["ranks"] and rank_layout(manifest, key) == parallel.to_json() else None


def sharded_checkpoint(directory: str | os.PathLike[str] | StoredPath, manifest: JsonObject, rank: int | Parallel) -> Checkpoint:
    """The virtual original checkpoint of a pre-sharded directory, as ``rank`` (a rank of any
    layout, or a tensor rank) reads it.

    Every rank file holds boxes of original tensors; a box kept by several ranks (replicated
    parameters, shared KV heads) is read from ``rank``'s own file when it has it (the saved rank
    of the same coordinates, else one of the same tensor rank). A save of weights quantized while
    loading has no original tensors: it is the rank's stored tensors, as they are (``rank_local``),
    and loads only at its saved layout.
    """
    directory = as_path(directory)
    _check_config(directory, manifest)
    parallel = rank if isinstance(rank, Parallel) else Parallel(manifest["parallel"]["tp_size"], rank)
    checksums = {directory / name: entry["sha256"] for name, entry in manifest["files"].items()}
    if manifest.get("online_quantization"):
        key = str(parallel.flat_rank)
        if key not in manifest["ranks"] or _sizes(rank_layout(manifest, key)) != _sizes(parallel.to_json()):
            raise ConfigError(f"{directory}: saved at {_layout_words(manifest)}; it has no {parallel.describe()}")
        files, tensors = _rank_tensors(directory, manifest, key)
        return Checkpoint(directory, "sharded", files, tensors, directory / MANIFEST, True, checksums)
    saved_tp, exact = manifest["parallel"]["tp_size"], _saved_key(manifest, parallel)
    order = sorted(stored_ranks(manifest), key=lambda r: (str(r) != exact, r % saved_tp != parallel.rank % saved_tp, r))
    needed = sorted({manifest["ranks"][str(r)]["file"] for r in order})
    verify_sizes(directory, manifest, needed)
    first = manifest["ranks"][str(order[0])]
    own = directory / first["file"]
    headers = RankFiles(read_header, {own: read_header(own)})  # the others' when a box is read from them
    pieces: dict[str, list[SavedPiece]] = {}
    for r in order:
        entry = manifest["ranks"][str(r)]
        for param, record in entry["params"].items():
            for s in record["sources"]:  # none: a default value, not stored
                src = tuple(tuple(b) for b in s["src"])
                have = pieces.setdefault(s["tensor"], [])
                if any(p.src == src for p in have):
                    continue  # the same box from an earlier (preferred) rank
                dst = tuple(tuple(b) for b in s["dst"])
                file = directory / param_file(entry, record)
                have.append(SavedPiece(src, dst, bool(s["transpose"]), file, param, headers))
    for param, record in first["params"].items():  # the own file holds what is listed
        if record["sources"] and param_file(first, record) == first["file"]:
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
    """The rank's stored tensors as a rank-local checkpoint, when this load is a saved rank: the
    same coordinates over every axis (``parallel``: the layout's, as served) and expert placement,
    and the rank's files hold exactly ``params`` (the layout's rank-local parameters less tied
    aliases, and less those the save records as defaults) at those shapes. They are then read as
    they are, in file order (its own file, then those of an earlier replica or stage that stored
    a tensor it shares; no virtual original tensors, no per-box gather). None otherwise: the load
    reshards through :func:`sharded_checkpoint`."""
    key = _saved_key(manifest, parallel)
    if key is None or manifest.get("online_quantization"):
        return None
    directory = as_path(directory)
    entry = manifest["ranks"][key]
    files, tensors = _rank_tensors(directory, manifest, key)
    stored = {n: shape for n, shape in params.items() if entry["params"].get(n, {}).get("fill") is None}
    if {n: t.shape for n, t in tensors.items()} != stored:
        return None
    checksums = {directory / name: e["sha256"] for name, e in manifest["files"].items()}
    return Checkpoint(directory, "sharded", files, tensors, directory / MANIFEST, True, checksums)
