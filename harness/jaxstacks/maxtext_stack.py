"""MaxText as a test oracle: its decoder (scanned or unscanned layers), its abstract parameter
tree with its own logical-axis shardings, its own HF loader (``to_maxtext`` conversion to Orbax,
then an Orbax restore) and its forward pass, on CPU devices.

Runs inside ``.venv-maxtext`` (``python -m harness.jaxstacks.env maxtext``).
Import this module before jax is imported (it asks XLA for 8 host devices).

* Config: MaxText never reads ``config.json``. :func:`overrides` turns it into MaxText's own
  command-line overrides on top of ``base.yml`` and a registry model name (``llama3.1-8b`` for
  ``LlamaForCausalLM``, ``qwen3-0.6b`` for ``Qwen3ForCausalLM``; ``model_name=`` to choose), with
  ``override_model_config=true`` so the sizes may be overridden. The mesh is MaxText's own
  12-axis mesh (``maxtext_utils.create_device_mesh``), the given axes set through
  ``ici_<axis>_parallelism`` and every other axis 1.
* Abstract tree: ``models.transformer_as_linen`` + ``maxtext_utils.get_abstract_param`` (as
  ``to_maxtext.get_maxtext_model_info`` builds it), shardings from
  ``nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, config.logical_axis_rules)``,
  then unboxed (``nn.unbox``): a ``{"params": {...}}`` dict of ``jax.ShapeDtypeStruct`` with
  ``NamedSharding``. Key paths read ``params.decoder.layers.self_attention.query.kernel``; MaxText's
  conversion and Orbax name the same leaf ``params-decoder-layers-self_attention-query-kernel``.
* Own loader: ``checkpoint_conversion.to_maxtext.main`` (lazy safetensors reads, ``save_dtype``
  the param dtype, the local directory as ``hf_model_path``) writes an Orbax checkpoint; then
  ``common.checkpointing.load_params_from_path`` restores it into the abstract tree. The
  conversion takes the architecture (layers, heads, head_dim) for its hooks from its own
  ``HF_MODEL_CONFIGS[model_name]``, so that entry is replaced, for the call, by the checkpoint's
  own config (``transformers.AutoConfig.from_pretrained``).
* Forward: ``model.apply(params, tokens, positions, segment_ids, enable_dropout=False,
  model_mode=MODEL_MODE_TRAIN)`` with ``attention=dot_product``, the tokens repeated over a
  batch of one row per device (the batch is sharded), row 0 returned.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from unittest import mock

from .common import run_cli, setup_cpu_devices

setup_cpu_devices()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import maxtext.configs  # noqa: E402
import numpy as np  # noqa: E402
import transformers  # noqa: E402
from flax.linen import partitioning as nn_partitioning  # noqa: E402
from maxtext.checkpoint_conversion import to_maxtext  # noqa: E402
from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS  # noqa: E402
from maxtext.common import checkpointing  # noqa: E402
from maxtext.common.common_types import MODEL_MODE_TRAIN  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.layers import quantizations  # noqa: E402
from maxtext.models import models  # noqa: E402
from maxtext.utils import maxtext_utils  # noqa: E402

BASE_YML = Path(maxtext.configs.__file__).parent / "base.yml"
MODEL_NAMES = {"LlamaForCausalLM": "llama3.1-8b", "Qwen3ForCausalLM": "qwen3-0.6b"}
AXES = ("data", "fsdp", "fsdp_transpose", "sequence", "context", "tensor", "tensor_sequence", "expert", "autoregressive", "pipeline")


def hf_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint_dir) / "config.json").read_text())


def rope_theta(config: Mapping[str, Any]) -> float:
    parameters = config.get("rope_parameters") or {}
    theta = parameters.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json names no rope_theta (in rope_parameters or at the top level)")
    return float(theta)


def overrides(config: Mapping[str, Any], mesh_shape: Mapping[str, int], scan_layers: bool, dtype: str = "float32",
              model_name: str | None = None, max_target_length: int = 16, output_dir: str = "") -> list[str]:
    """MaxText ``key=value`` overrides building the decoder of an HF ``config.json`` (see the
    module docstring); every one is needed for the tiny checkpoints (NOTES.md says why)."""
    arch = config["architectures"][0]
    name = model_name or MODEL_NAMES[arch]
    unknown = set(mesh_shape) - set(AXES)
    if unknown:
        raise ValueError(f"unknown MaxText ICI axes {sorted(unknown)}; known: {AXES}")
    heads = config["num_attention_heads"]
    values: dict[str, Any] = {
        "model_name": name,
        "override_model_config": "true",
        "base_emb_dim": config["hidden_size"],
        "base_num_query_heads": heads,
        "base_num_kv_heads": config.get("num_key_value_heads", heads),
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "base_mlp_dim": config["intermediate_size"],
        "base_num_decoder_layers": config["num_hidden_layers"],
        "vocab_size": config["vocab_size"],
        "normalization_layer_epsilon": config["rms_norm_eps"],
        "rope_max_timescale": rope_theta(config),
        "logits_via_embedding": str(bool(config.get("tie_word_embeddings", False))).lower(),
        "dtype": dtype,
        "weight_dtype": dtype,
        "matmul_precision": "highest",
        "attention": "dot_product",
        "scan_layers": str(scan_layers).lower(),
        "hardware": "cpu",
        "skip_jax_distributed_system": "true",
        "enable_checkpointing": "false",
        "per_device_batch_size": 1,
        "max_target_length": max_target_length,
        "run_name": "functional_load",
        "base_output_directory": output_dir,
    }
    if arch == "LlamaForCausalLM":
        rope = (config.get("rope_parameters") or config.get("rope_scaling") or {}).get("rope_type", "default")
        if rope not in ("default", "llama3"):
            raise ValueError(f"MaxText's llama3.1 decoder has no {rope!r} RoPE")
        values["rope_use_scale"] = str(rope == "llama3").lower()  # a llama3.1* name turns llama3.1 scaling on
    for axis in AXES:
        values[f"ici_{axis}_parallelism"] = mesh_shape.get(axis, 1)
    return [f"{k}={v}" for k, v in values.items()]


class Handle:
    """What :func:`forward` needs besides the parameters: the linen model, its config and mesh."""

    def __init__(self, model: Any, config: Any, mesh: jax.sharding.Mesh) -> None:
        self.model, self.config, self.mesh = model, config, mesh


def _build(checkpoint_dir: str, mesh_shape: Mapping[str, int], scan_layers: bool, dtype: str, model_name: str | None,
           output_dir: str = "") -> tuple[Any, jax.sharding.Mesh, Any, list[str]]:
    args = overrides(hf_config(checkpoint_dir), mesh_shape, scan_layers, dtype, model_name, output_dir=output_dir)
    config = pyconfig.initialize(["maxtext", str(BASE_YML), *args])
    mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
    model = models.transformer_as_linen(config, mesh, quant=quantizations.configure_quantization(config), model_mode=MODEL_MODE_TRAIN)
    return config, mesh, model, args


def abstract_target(checkpoint_dir: str, mesh_shape: Mapping[str, int], scan_layers: bool | str = True, dtype: str = "float32",
                    model_name: str | None = None, **_: Any) -> tuple[dict[str, Any], jax.sharding.Mesh, Handle]:
    """MaxText's abstract parameters with its logical-axis shardings (see the module docstring)."""
    scan = _bool(scan_layers)
    config, mesh, model, _args = _build(checkpoint_dir, mesh_shape, scan, dtype, model_name)
    boxed = maxtext_utils.get_abstract_param(model, config)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, config.logical_axis_rules)
    tree = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), nn.unbox(boxed), shardings)
    return tree, mesh, Handle(model, config, mesh)


def _bool(value: bool | str) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def convert(checkpoint_dir: str, mesh_shape: Mapping[str, int], output_dir: str, scan_layers: bool = True, dtype: str = "float32",
            model_name: str | None = None) -> Path:
    """MaxText's own HF -> Orbax conversion (``to_maxtext.main``, lazy loading) of a local
    checkpoint; returns the ``.../0/items`` directory it wrote."""
    _, _, _, args = _build(checkpoint_dir, mesh_shape, scan_layers, dtype, model_name, output_dir=output_dir)
    name = next(a.split("=", 1)[1] for a in args if a.startswith("model_name="))
    own_config = transformers.AutoConfig.from_pretrained(checkpoint_dir)
    with mock.patch.dict(HF_MODEL_CONFIGS, {name: own_config}):
        to_maxtext.main(["to_maxtext", str(BASE_YML), *args], lazy_load_tensors=True, hf_model_path=str(checkpoint_dir),
                        save_dtype=dtype, simulated_cpu_devices_count=jax.device_count())
    return Path(output_dir) / "0" / "items"


def own_load(checkpoint_dir: str, mesh_shape: Mapping[str, int], scan_layers: bool | str = True, dtype: str = "float32",
             model_name: str | None = None, workdir: str | None = None, **_: Any) -> dict[str, Any]:
    """MaxText's own load: :func:`convert` then ``checkpointing.load_params_from_path`` into
    :func:`abstract_target`'s tree; a tree of global jax.Arrays."""
    scan = _bool(scan_layers)
    target, mesh, handle = abstract_target(checkpoint_dir, mesh_shape, scan, dtype, model_name)
    with contextlib.ExitStack() as stack:
        out = workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="maxtext-orbax-"))
        items = convert(checkpoint_dir, mesh_shape, os.path.join(out, "orbax"), scan, dtype, model_name)
        config = handle.config
        with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
            restored = checkpointing.load_params_from_path(str(items), target, config.checkpoint_storage_concurrent_gb,
                                                           config.checkpoint_storage_use_ocdbt, config.checkpoint_storage_use_zarr3)
        return jax.tree.map(lambda x: x, restored)


def forward(params: Mapping[str, Any], handle: Handle, token_ids: list[int] | np.ndarray) -> np.ndarray:
    """Float32 logits ``[T, vocab]`` of one causal sequence through MaxText's decoder."""
    config, mesh = handle.config, handle.mesh
    ids = np.asarray(token_ids, dtype=np.int32)
    if ids.shape[0] > config.max_target_length:
        raise ValueError(f"{ids.shape[0]} tokens, max_target_length {config.max_target_length}")
    batch = jax.device_count()
    tokens = jnp.asarray(np.tile(ids, (batch, 1)))
    positions = jnp.asarray(np.tile(np.arange(ids.shape[0], dtype=np.int32), (batch, 1)))
    segments = jnp.ones_like(tokens)
    with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
        logits = handle.model.apply(dict(params), tokens, positions, decoder_segment_ids=segments, enable_dropout=False,
                                    model_mode=MODEL_MODE_TRAIN)
    if isinstance(logits, tuple):
        logits = logits[0]
    return np.asarray(logits[0], dtype=np.float32)


if __name__ == "__main__":
    raise SystemExit(run_cli("maxtext_stack", abstract_target, own_load, forward))
