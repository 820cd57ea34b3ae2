"""tpu-inference (vLLM's JAX backend) as a test oracle: its flax NNX models, their abstract
parameter trees, its own weight loaders and its forward pass, on CPU devices.

Runs inside ``.venv-tpu-inference`` (``python -m harness.jaxstacks.env
tpu-inference``). Import this module before jax is imported (it asks XLA for 8 host devices).

* The model is built as ``tpu_inference.models.common.model_loader._get_nnx_model`` builds it:
  the class from tpu-inference's own registry (``_get_model_architecture``), ``to_jax_dtype`` and
  ``get_tpu_quantization_config`` applied to a real ``VllmConfig`` (``ModelConfig`` of the
  checkpoint directory, ``ParallelConfig(tensor_parallel_size=<model axis>)``), the pipeline
  group initialised for one stage, and ``nnx.eval_shape`` under ``jax.set_mesh`` of a plain
  ``Mesh(devices, ("data", "model"))``.
* The abstract tree is ``nnx.to_pure_dict(nnx.state(model, nnx.Param))`` with every leaf a
  ``jax.ShapeDtypeStruct`` whose sharding is the ``NamedSharding`` of the Param's partition
  metadata (``nnx.get_named_sharding``): nested dicts keyed by attribute names and, for the
  layer lists, ``int`` indices, so a key path reads ``model.layers.0.self_attn.q_proj.kernel``.
* ``own_load`` calls ``_get_nnx_model`` itself (``model.load_weights(rng)`` for ``llama3``,
  vLLM's ``get_model_loader(load_config).load_weights(model, model_config)`` for models that
  are ``LoadableWithIterator``, such as ``qwen3``), then takes the same pure dict.
* ``forward`` merges a tree into the model and runs the model's ``__call__`` and
  ``compute_logits`` for one prefill sequence. The attention kernel is TPU-only Pallas (ragged
  paged attention); on CPU :func:`causal_attention` replaces ``attention`` in each model
  module's namespace (a monkeypatch made once, at import: :data:`PATCHED`). It is plain causal
  softmax attention over the q/k/v the model computes, in float32, KV heads shared by
  ``n // (N / K)`` as vLLM groups them; the KV cache is neither read nor written.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from .common import run_cli, setup_cpu_devices

setup_cpu_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from tpu_inference.distributed.jax_parallel_state import init_pp_distributed_environment  # noqa: E402
from tpu_inference.layers.common import attention_interface  # noqa: E402
from tpu_inference.layers.common.attention_metadata import AttentionMetadata  # noqa: E402
from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES, ShardingConfigManager  # noqa: E402
from tpu_inference.layers.jax.quantization import get_tpu_quantization_config  # noqa: E402
from tpu_inference.models.common import model_loader  # noqa: E402
from tpu_inference.models.jax import llama3, qwen2, qwen3  # noqa: E402
from tpu_inference.models.jax.utils import weight_utils as tpu_weight_utils  # noqa: E402
from tpu_inference.models.jax.utils.qwix.qwix_utils import update_vllm_config_for_qwix_quantization  # noqa: E402
from tpu_inference.utils import to_jax_dtype  # noqa: E402
from vllm.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.model_loader import weight_utils as vllm_weight_utils  # noqa: E402

MESH_AXES = ("data", "model")
ATTENTION_MODULES = (llama3, qwen2, qwen3)


def causal_attention(kv_cache: Any, q: jax.Array, k: jax.Array, v: jax.Array, attention_metadata: Any, mesh: Any,
                     head_dim_original: int | None = None, sm_scale: float | None = None, **unused: Any) -> tuple[Any, jax.Array]:
    """Stand-in for ``attention_interface.attention`` on CPU: one causal sequence, q ``[T, N, H]``,
    k/v ``[T, K, H]`` (H may be zero-padded past ``head_dim_original``), scale
    ``head_dim_original ** -0.5`` as the kernel's default; returns ``(kv_cache, [T, N, H])``."""
    tokens, heads, _ = q.shape
    groups = heads // k.shape[1]
    scale = sm_scale if sm_scale is not None else (head_dim_original or q.shape[-1]) ** -0.5
    keys = jnp.repeat(k, groups, axis=1).astype(jnp.float32)
    values = jnp.repeat(v, groups, axis=1).astype(jnp.float32)
    scores = jnp.einsum("tnh,snh->nts", q.astype(jnp.float32), keys) * scale
    mask = jnp.tril(jnp.ones((tokens, tokens), dtype=bool))
    probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
    return kv_cache, jnp.einsum("nts,snh->tnh", probs, values).astype(q.dtype)


PATCHED = []
for _module in ATTENTION_MODULES:
    if getattr(_module, "attention", None) is attention_interface.attention:
        _module.attention = causal_attention
        PATCHED.append(_module.__name__)


class Handle:
    """What :func:`forward` needs besides the parameters: the abstract model, its config, the mesh."""

    def __init__(self, model: Any, vllm_config: VllmConfig, mesh: jax.sharding.Mesh) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.mesh = mesh


def _mesh(mesh_shape: Mapping[str, int], full_mesh: bool | str = False) -> jax.sharding.Mesh:
    """``Mesh(devices, ("data", "model"))``, or with ``full_mesh`` tpu-inference's 7 axes
    (``sharding.MESH_AXIS_NAMES``; the ones not given of size 1), which DeepSeek-V3's MoE needs."""
    axes = MESH_AXIS_NAMES if str(full_mesh).lower() in ("1", "true") else MESH_AXES
    unknown = set(mesh_shape) - set(axes)
    if unknown:
        raise ValueError(f"mesh axes {axes}; got {sorted(unknown)}")
    sizes = tuple(mesh_shape.get(a, 1) for a in axes)
    devices = np.array(jax.devices()[: int(np.prod(sizes))]).reshape(sizes)
    return jax.sharding.Mesh(devices, axes)


def _config(checkpoint_dir: str, mesh: jax.sharding.Mesh, dtype: str) -> VllmConfig:
    model_config = ModelConfig(model=str(checkpoint_dir), dtype=dtype, skip_tokenizer_init=True)
    parallel = ParallelConfig(tensor_parallel_size=mesh.shape["model"])
    config = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format="auto"), parallel_config=parallel)
    # As tpu-inference's worker (sharding_config) and get_flax_model (the rest) do before building:
    config.sharding_config = ShardingConfigManager.from_vllm_config(config)
    config.model_config.dtype = to_jax_dtype(config.model_config.dtype)
    config.quant_config = get_tpu_quantization_config(config)
    update_vllm_config_for_qwix_quantization(config)
    init_pp_distributed_environment(ip="", rank=0, world_size=1, device=jax.devices()[0], need_pp=False)
    return config


def _params(model: nnx.Module, mesh: jax.sharding.Mesh, abstract: bool) -> dict[str, Any]:
    state = nnx.state(model, nnx.Param)
    shardings = nnx.to_pure_dict(nnx.get_named_sharding(state, mesh))
    values = nnx.to_pure_dict(state)
    if not abstract:
        return values
    return jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), values, shardings)


def abstract_target(checkpoint_dir: str, mesh_shape: Mapping[str, int], dtype: str = "float32", full_mesh: bool | str = False,
                    **_: Any) -> tuple[dict[str, Any], jax.sharding.Mesh, Handle]:
    """The model's parameter tree as tpu-inference builds it abstractly (see the module docstring)."""
    mesh = _mesh(mesh_shape, full_mesh)
    config = _config(checkpoint_dir, mesh, dtype)
    model_class = model_loader._get_model_architecture(config.model_config.hf_config)
    rng = jax.random.PRNGKey(0)
    with jax.set_mesh(mesh), set_current_vllm_config(config):
        model = nnx.eval_shape(lambda: model_class(config, rng, mesh), graph_updates=False)
    tree = _params(model, mesh, abstract=True)
    for leaf in jax.tree.leaves(tree):
        assert isinstance(leaf.sharding, NamedSharding)
    return tree, mesh, Handle(model, config, mesh)


class ReadCounter:
    """Tensor bytes the own loader takes out of safetensors files (``get_tensor``/``get_slice``
    of every ``safe_open`` made by tpu-inference's and vLLM's weight utilities)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.tensors = 0
        self._lock = threading.Lock()

    def add(self, array: Any) -> Any:
        with self._lock:
            self.bytes += int(np.prod(array.shape)) * array.dtype.itemsize
            self.tensors += 1
        return array

    @contextlib.contextmanager
    def patch(self) -> Iterator[ReadCounter]:
        counter = self

        def wrap(safe_open: Any) -> Any:
            @contextlib.contextmanager
            def counted(*args: Any, **kwargs: Any) -> Iterator[Any]:
                with safe_open(*args, **kwargs) as handle:
                    yield _CountedHandle(handle, counter)

            return counted

        saved = (tpu_weight_utils.safe_open, vllm_weight_utils.safe_open)
        tpu_weight_utils.safe_open, vllm_weight_utils.safe_open = wrap(saved[0]), wrap(saved[1])
        try:
            yield self
        finally:
            tpu_weight_utils.safe_open, vllm_weight_utils.safe_open = saved


class _CountedHandle:
    def __init__(self, handle: Any, counter: ReadCounter) -> None:
        self._handle, self._counter = handle, counter

    def get_tensor(self, name: str) -> Any:
        return self._counter.add(self._handle.get_tensor(name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def own_load(checkpoint_dir: str, mesh_shape: Mapping[str, int], dtype: str = "float32", full_mesh: bool | str = False,
             counter: ReadCounter | None = None, **_: Any) -> dict[str, Any]:
    """tpu-inference's own load (``_get_nnx_model``), as a tree of global jax.Arrays shaped like
    :func:`abstract_target`'s. With ``counter``, the tensor bytes read are added to it."""
    mesh = _mesh(mesh_shape, full_mesh)
    config = _config(checkpoint_dir, mesh, dtype)
    model_class = model_loader._get_model_architecture(config.model_config.hf_config)
    with contextlib.ExitStack() as stack:
        if counter is not None:
            stack.enter_context(counter.patch())
        stack.enter_context(set_current_vllm_config(config))
        model = model_loader._get_nnx_model(model_class, config, jax.random.PRNGKey(0), mesh)
    return _params(model, mesh, abstract=False)


def forward(params: Mapping[str, Any], handle: Handle, token_ids: list[int] | np.ndarray) -> np.ndarray:
    """Float32 logits ``[T, vocab]`` of one causal sequence through the stack's own model code."""
    model, mesh = handle.model, handle.mesh
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, dict(params))
    nnx.update(model, state)
    ids = jnp.asarray(np.asarray(token_ids, dtype=np.int32))
    layers = handle.vllm_config.model_config.hf_config.num_hidden_layers
    metadata = AttentionMetadata(
        input_positions=jnp.arange(ids.shape[0], dtype=jnp.int32),
        block_tables=jnp.zeros((1,), jnp.int32),
        seq_lens=jnp.asarray([ids.shape[0]], jnp.int32),
        query_start_loc=jnp.asarray([0, ids.shape[0]], jnp.int32),
        request_distribution=jnp.asarray([0, 0, 1], jnp.int32),
    )
    with jax.set_mesh(mesh), set_current_vllm_config(handle.vllm_config):
        _, hidden, *_ = model([None] * layers, ids, metadata)
        logits = model.compute_logits(hidden)
    vocab = handle.vllm_config.model_config.get_vocab_size()
    return np.asarray(logits, dtype=np.float32)[:, :vocab]


if __name__ == "__main__":
    raise SystemExit(run_cli("tpu_inference_stack", abstract_target, own_load, forward))
