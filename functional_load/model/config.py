"""``config.json``: where it is, strict parsing, and the one rule for the model dtype."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from ..dtypes import DtypeChoice, canonical_dtype, torch_name
from ..errors import CheckpointError, ConfigError, MissingFileError
from ..paths import JsonDict, JsonObject, strict_json_loads
from ..storage import StoredPath, as_path, read_all, storage_for
from .mistral import PARAMS, mistral_config

MAX_CONFIG_BYTES = 16 * 1024 * 1024
CONFIG = "config.json"


def model_directory(model: str | os.PathLike[str] | StoredPath) -> StoredPath:
    """The model directory ``model`` names: a directory, or the ``config.json`` inside one. Any
    other path is an error that says what it is and what to pass."""
    path = as_path(model)
    kind = storage_for(path).kind(path)
    if kind == "directory":
        return path
    if kind == "file" and path.name == CONFIG:
        return path.parent
    if kind == "file":
        raise ConfigError(
            f"{path} is a file, not a model directory; pass the directory that holds config.json and the weight files "
            f"({path.parent})"
        )
    raise MissingFileError(f"{path}: model directory not found (it must be a directory holding config.json)")


def read_config(model: str | os.PathLike[str] | StoredPath, fmt: str = "hf") -> JsonDict:
    """The model's config as a dict: its ``config.json`` (strict JSON: no duplicate keys, no NaN),
    or for Mistral's own format (``fmt="mistral"``, as :func:`functional_load.checkpoint.discover.checkpoint_format`
    decides) its ``params.json`` adapted as vLLM adapts it (with ``config.json``'s keys as
    defaults). ``model`` is the model directory or its ``config.json``."""
    directory = model_directory(model)
    path = directory / CONFIG
    params = directory / PARAMS
    kind = storage_for(directory).kind
    if fmt == "mistral" and kind(params) == "file":
        defaults = _read_json(path, directory) if kind(path) == "file" else {}
        for key in ("dtype", "torch_dtype"):  # vLLM takes the dtype from params.json or the weights, never config.json
            defaults.pop(key, None)
        return mistral_config(_read_json(params, directory), defaults, str(params))
    if kind(path) != "file":
        hint = " (Mistral's params.json is read only with its consolidated*.safetensors)" if kind(params) == "file" else ""
        if storage_for(directory).list_files(directory, "model-rank-*-of-*.safetensors"):
            hint = (" (it holds rank files of a save_sharded but no manifest functional_load.sharded.json: that save was "
                    "interrupted before its commit and is not a checkpoint; save again)")
        raise ConfigError(f"{path}: no config.json in the model directory; it is needed to know the model's shapes{hint}")
    return _read_json(path, directory)


def _read_json(path: StoredPath, directory: StoredPath) -> JsonDict:
    storage_for(path).contained(path, directory, "Config file")
    try:
        config = strict_json_loads(read_all(path, "a config", MAX_CONFIG_BYTES), str(path))
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


_FLOATS = ("float16", "bfloat16", "float32", "float64")


def declared_dtype(config: JsonObject) -> Any:
    """The dtype ``config.json`` names (``dtype``/``torch_dtype``, or its ``text_config``'s), or None."""
    declared = config.get("dtype") or config.get("torch_dtype")
    text = config.get("text_config")
    if declared is None and isinstance(text, Mapping):
        declared = text.get("dtype") or text.get("torch_dtype")
    return declared


def model_dtype(requested: DtypeChoice, config: JsonObject, weight_dtypes: Iterable[str] = (), where: str = "config.json") -> str:
    """The destination dtype of a model, as vLLM's ``dtype="auto"`` decides it (the one rule
    used by ``layout``, ``plan``, ``load`` and ``load_jax``).

    ``requested`` when given; else the config's ``dtype``/``torch_dtype`` (or its
    ``text_config``'s); else the widest floating dtype of the weights (``weight_dtypes``,
    safetensors codes from the headers); else float32. vLLM serves float32 models in bfloat16,
    so float32 from the config or the weights becomes bfloat16 unless it was ``requested``.
    ``where`` names the config in errors.
    """
    try:
        explicit = canonical_dtype(requested)
    except ValueError as exc:
        raise ConfigError(f"the dtype argument: {exc}") from None
    if explicit:
        return explicit
    try:
        found = canonical_dtype(declared_dtype(config))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if found is None:
        floats = {torch_name(code) for code in weight_dtypes} & set(_FLOATS)
        found = "float32" if not floats or floats - {"float16", "bfloat16"} or len(floats) > 1 else floats.pop()
    return "bfloat16" if found in ("float32", "float64") else found
