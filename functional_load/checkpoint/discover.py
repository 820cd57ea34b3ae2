"""Which weight files a checkpoint directory holds, with vLLM's ``_prepare_weights`` rules.

File-name logic over the directory's storage (:mod:`functional_load.storage`): nothing here reads
tensor data, and nothing touches the Hugging Face Hub.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..errors import CheckpointError, ConfigError, FormatError, MissingFileError, SecurityError
from ..paths import strict_json_loads
from ..storage import StoredPath, as_path, read_all, storage_for

__all__ = ["LOAD_FORMATS", "WeightFiles", "discover", "natural_sort_key"]

# Resolved format -> glob patterns, tried in order; the first that yields files wins (vLLM 1.2 step 4/7).
PATTERNS: dict[str, tuple[str, ...]] = {
    "hf": ("*.safetensors", "*.bin", "*.pt"),
    "safetensors": ("*.safetensors",),
    "mistral": ("consolidated*.safetensors",),
    "pt": ("*.pt",),
}

HF_INDEX = "model.safetensors.index.json"
MISTRAL_INDEX = "consolidated.safetensors.index.json"

# Pickles saved by trainers next to the model; never weights (vLLM filter_files_not_needed_for_inference).
TRAINING_FILE_SUFFIXES = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")


@dataclass(frozen=True, slots=True)
class WeightFiles:
    """The weight files to load and, for sharded safetensors, the index that maps tensors to them."""

    directory: StoredPath
    load_format: str  # resolved: "hf", "safetensors", "mistral" or "pt"
    kind: str  # "safetensors" or "pickle"
    files: tuple[StoredPath, ...]  # natural-sorted by basename
    index_file: StoredPath | None
    weight_map: Mapping[str, str] | None  # tensor name -> shard basename, from index_file


def natural_sort_key(name: str) -> tuple[str | int, ...]:
    """Sort key that orders digit runs numerically (``model-2`` before ``model-10``), as vLLM does."""
    return tuple(int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name)))


def _plain_file_name(shard: str) -> bool:
    return bool(shard) and not os.path.isabs(shard) and "/" not in shard and "\\" not in shard and ".." not in shard


def _read_weight_map(index_file: StoredPath) -> dict[str, str]:
    what = str(index_file)
    data = strict_json_loads(read_all(index_file, "an index"), what)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError(f"{what}: expected a JSON object with a non-empty 'weight_map' object, found {data!r:.200}")
    shards = set(weight_map.values()) if set(map(type, weight_map.values())) == {str} else None
    if shards is not None and all(_plain_file_name(s) for s in shards):
        return weight_map  # the usual case: a few shard names, checked once each
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise FormatError(f"{what}: weight_map[{name!r}] must be a file name string, found {shard!r}")
        if not _plain_file_name(shard):
            raise SecurityError(
                f"{what}: weight_map[{name!r}] = {shard!r} must be a plain file name in the checkpoint "
                "directory (no path separators, '..' or absolute paths)"
            )
    return weight_map


LOAD_FORMATS = ("auto", "hf", "safetensors", "mistral", "pt")


def checkpoint_format(directory: StoredPath, load_format: str = "auto") -> str:
    """The weight format a load of ``directory`` uses, as vLLM 0.32 decides it: ``"auto"`` picks
    Mistral's own format when any ``consolidated*.safetensors`` is there, else ``"hf"``."""
    if not isinstance(load_format, str) or load_format.lower() not in LOAD_FORMATS:
        raise ConfigError(f"Unknown load_format {load_format!r}; use one of {', '.join(LOAD_FORMATS)} (or 'dummy' for plan/load)")
    fmt = load_format.lower()
    if fmt == "auto":
        return "mistral" if storage_for(directory).list_files(directory, "consolidated*.safetensors") else "hf"
    return fmt


def discover(model_dir: str | os.PathLike[str] | StoredPath, load_format: str = "auto") -> WeightFiles:
    """The weight files vLLM would load from ``model_dir`` for ``load_format``.

    The first pattern that yields files wins (safetensors > bin > pt); a safetensors index, when
    present, restricts the files to those it names; trainer pickles are dropped.
    """
    directory = as_path(model_dir)
    storage = storage_for(directory)
    if storage.kind(directory) != "directory":
        raise MissingFileError(f"Checkpoint directory {str(directory)!r} does not exist or is not a directory")
    fmt = checkpoint_format(directory, load_format)
    patterns = PATTERNS[fmt]
    for pattern in patterns:
        files = [p for p in storage.list_files(directory, pattern) if not p.name.endswith(TRAINING_FILE_SUFFIXES)]
        if fmt != "mistral" and any(not p.name.startswith("consolidated") for p in files):
            files = [p for p in files if not p.name.startswith("consolidated")]  # Mistral's own copy of the same weights
        if files:
            break
    else:
        raise CheckpointError(
            f"Cannot find any model weights in {str(directory)!r} (looked for {list(patterns)} with "
            f"load_format={fmt!r}). Point at the directory that holds the weight files, or pick another load_format."
        )
    files.sort(key=lambda p: natural_sort_key(p.name))
    if not pattern.endswith(".safetensors"):
        return WeightFiles(directory, fmt, "pickle", tuple(files), None, None)

    index_file = directory / (MISTRAL_INDEX if fmt == "mistral" else HF_INDEX)
    if storage.kind(index_file) != "file":
        return WeightFiles(directory, fmt, "safetensors", tuple(files), None, None)
    storage.contained(index_file, directory, "Index file")
    weight_map = _read_weight_map(index_file)
    named = set(weight_map.values())
    missing = sorted(named - {p.name for p in files}, key=natural_sort_key)
    if missing:
        raise MissingFileError(
            f"Weight files referenced in index {str(index_file)!r} but missing from {str(directory)!r} "
            f"(as {pattern!r}): {missing}. Download the missing shards or fix the index."
        )
    kept = tuple(p for p in files if p.name in named)
    return WeightFiles(directory, fmt, "safetensors", kept, index_file, MappingProxyType(dict(weight_map)))
