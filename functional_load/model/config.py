"""``config.json``: strict parsing and the model dtype it declares."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .checkpoint import Checkpoint
from .checkpoint.discover import check_contained, strict_json_loads
from .dtypes import canonical_dtype, torch_name
from .errors import CheckpointError, ConfigError, MissingFileError

MAX_CONFIG_BYTES = 16 * 1024 * 1024


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """The model's ``config.json`` as a dict (strict JSON: no duplicate keys, no NaN)."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise MissingFileError(f"{model_dir}: model directory not found (it must be a local directory)")
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in the model directory; it is needed to know the model's shapes")
    check_contained(path, Path(model_dir), "Config file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {path.stat().st_size} bytes is larger than the {MAX_CONFIG_BYTES}-byte limit for a config")
    try:
        config = strict_json_loads(path.read_bytes(), str(path))
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def model_dtype(config: Mapping[str, Any], checkpoint: Checkpoint, requested: Any = None) -> str:
    """The destination dtype: ``requested`` if given, else the config's ``dtype``/``torch_dtype``,
    else the most common floating dtype among the checkpoint tensors."""
    try:
        explicit = canonical_dtype(requested)
        if explicit:
            return explicit
        declared = canonical_dtype(config.get("dtype") or config.get("torch_dtype"))
    except ValueError as exc:
        raise ConfigError(f"{checkpoint.directory}/config.json or dtype argument: {exc}") from None
    if declared:
        return declared
    counts: dict[str, int] = {}
    for info in checkpoint.tensors.values():
        name = torch_name(info.dtype)
        if name in ("float16", "bfloat16", "float32", "float64"):
            counts[name] = counts.get(name, 0) + info.nbytes
    return max(counts, key=counts.__getitem__) if counts else "float32"
