"""Checkpoint files of the tiny models: shards written the way transformers writes them, read back."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _size_to_int(size: str | int) -> int:
    if isinstance(size, int):
        return size
    from transformers.utils.hub import convert_file_size_to_int

    return convert_file_size_to_int(size)


def remove_weight_files(out: Path) -> None:
    for p in out.iterdir():
        if p.is_file() and (p.name == INDEX_NAME or (p.name.startswith("model") and p.suffix == ".safetensors")):
            p.unlink()


def write_shards(
    out_dir: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], max_shard_size: str | int = "100KB"
) -> list[Path]:
    """Write ``tensors`` as transformers-style shards (greedy, in the given order) plus the index.

    Replaces existing ``model*.safetensors`` files and the index in ``out_dir``. A shard is closed
    before a tensor that would push it past ``max_shard_size`` (a larger tensor gets its own
    shard). One shard is written as ``model.safetensors`` without an index, as transformers does.
    Returns the shard paths.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    limit = _size_to_int(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    remove_weight_files(out)
    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    paths = []
    for fname, shard in zip(names, shards):
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        paths.append(out / fname)
    if n > 1:
        index = {
            "metadata": {
                "total_parameters": sum(t.numel() for t in tensors.values()),
                "total_size": sum(t.numel() * t.element_size() for t in tensors.values()),
            },
            "weight_map": {name: fname for fname, shard in zip(names, shards) for name in shard},
        }
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {path}")
    return files


def read_checkpoint_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint (directory, via the index if any, or one file).

    Reference data for tests: loaded with ``safetensors.torch.load_file``, shard by shard in file
    name order. Raises if a name appears in two shards or the index disagrees with the shards.
    """
    from safetensors.torch import load_file

    p = Path(path)
    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(p):
        for name, t in load_file(str(f)).items():
            if name in out:
                raise ValueError(f"tensor {name!r} appears in more than one shard ({f.name})")
            out[name] = t
    index = p / INDEX_NAME if p.is_dir() else None
    if index is not None and index.exists():
        mapped = set(json.loads(index.read_text())["weight_map"])
        if mapped != set(out):
            raise ValueError(
                f"index and shards disagree: only in index {sorted(mapped - set(out))[:5]}, "
                f"only in shards {sorted(set(out) - mapped)[:5]}"
            )
    return out


def list_tensors(path: str | os.PathLike[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``name -> (shape, safetensors dtype code)`` for a checkpoint, from headers only, sorted by name."""
    from safetensors import safe_open

    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in _weight_files(Path(path)):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                found[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return dict(sorted(found.items(), key=lambda kv: _natural_key(kv[0])))


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
