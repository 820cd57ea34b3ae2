"""Tiny, real transformers checkpoints on disk, for tests and notebooks.

Each builder makes a transformers config with tiny sizes, instantiates the real model class from
it (never a hub download), fills every saved tensor with seeded random values, casts to the
requested dtype and calls ``save_pretrained`` with a small ``max_shard_size``, so the directory
holds several ``model-0000i-of-0000n.safetensors`` shards, ``model.safetensors.index.json``,
``config.json`` (dtype recorded under ``"dtype"``, the transformers 5 spelling) and
``generation_config.json``.

Tiny sizes (chosen so tensor-parallel sizes 1, 2, 4 and 8 divide every sharded dimension):
hidden 64, 8 attention heads of head_dim 8, 8 KV heads by default (pass ``kv_heads=2`` for GQA,
``kv_heads=1`` for MQA), intermediate 128, vocab 1000 (not a multiple of 64, so vocab padding
is exercised), 2 layers. MoE: 8 routed experts, top-2, expert intermediate 32. The table of
architectures is :data:`functional_load.testing.archs.ARCHS`. vLLM loads gpt_oss and llama4 at
tp 1, 2 and 4 only (gpt_oss: its CPU experts need ``128 / tp`` divisible by 32; llama4: 4 vision
heads).

On-disk tensor layouts (names per layer ``N``; shapes for the defaults, ``kv = kv_heads * 8``):

* llama / mistral: ``model.layers.N.self_attn.{q,k,v,o}_proj.weight`` ``[64,64] [kv,64] [kv,64]
  [64,64]``; ``mlp.{gate,up}_proj.weight`` ``[128,64]``, ``mlp.down_proj.weight`` ``[64,128]``;
  ``input_layernorm.weight`` / ``post_attention_layernorm.weight`` ``[64]``; plus
  ``model.embed_tokens.weight`` ``[1000,64]``, ``model.norm.weight`` ``[64]``,
  ``lm_head.weight`` ``[1000,64]`` (absent when tied).
* qwen2: as llama plus ``self_attn.{q,k,v}_proj.bias`` ``[64] [kv] [kv]`` (no o_proj bias).
* qwen3: as llama plus ``self_attn.q_norm.weight`` / ``k_norm.weight`` ``[8]`` (per head_dim).
* phi3: fused on disk: ``self_attn.qkv_proj.weight`` ``[64 + 2*kv, 64]`` (rows q, then k, then
  v) and ``mlp.gate_up_proj.weight`` ``[256, 64]`` (rows gate, then up); ``o_proj``/``down_proj``
  as llama.
* gemma2: as llama (``mlp.{gate,up,down}_proj``, gelu-tanh) plus ``pre_feedforward_layernorm.weight``
  and ``post_feedforward_layernorm.weight`` ``[64]``; tied by default, so no ``lm_head.weight``
  (``tie_word_embeddings=False`` writes one, which vLLM's Gemma 2, having no lm_head, refuses).
  Norm weights are stored as-is (the model adds 1 at run time). Sliding window 16 on even layers.
* gemma3_text (Gemma3ForCausalLM): as gemma2 plus ``self_attn.q_norm.weight`` /
  ``k_norm.weight`` ``[8]``; tied by default.
* glm4 (Glm4ForCausalLM, GLM-4-0414): attention as qwen2 (``self_attn.{q,k,v}_proj.bias``, no
  o_proj bias); ``mlp.gate_up_proj.weight`` ``[256, 64]`` fused on disk (rows gate, then up),
  ``mlp.down_proj.weight`` ``[64,128]``; four norms per layer: ``input_layernorm``,
  ``post_self_attn_layernorm``, ``post_attention_layernorm``, ``post_mlp_layernorm`` ``[64]``.
* gpt2: ``transformer.h.N.attn.c_attn.{weight,bias}`` ``[64,192] [192]`` (Conv1D, so weights are
  ``[in, out]``; columns q, k, v), ``attn.c_proj`` ``[64,64] [64]``, ``mlp.c_fc`` ``[64,256]
  [256]``, ``mlp.c_proj`` ``[256,64] [64]``, ``ln_1``/``ln_2`` weight and bias ``[64]``; plus
  ``transformer.wte.weight`` ``[1000,64]``, ``transformer.wpe.weight`` ``[64,64]``,
  ``transformer.ln_f.{weight,bias}``; the LM head is tied to ``wte`` and not saved.
* mixtral (per-expert, the default): ``block_sparse_moe.experts.E.w1.weight`` (gate) and
  ``w3.weight`` (up) ``[32,64]``, ``w2.weight`` (down) ``[64,32]``, router
  ``block_sparse_moe.gate.weight`` ``[8,64]``; attention as llama.
* qwen3_moe (per-expert): ``mlp.experts.E.{gate,up}_proj.weight`` ``[32,64]``,
  ``mlp.experts.E.down_proj.weight`` ``[64,32]``, router ``mlp.gate.weight`` ``[8,64]``;
  attention as qwen3. Every layer is sparse.
* deepseek_v3: MLA attention ``self_attn.q_a_proj.weight`` ``[32,64]``,
  ``q_a_layernorm.weight`` ``[32]``, ``q_b_proj.weight`` ``[8*(8+8)=128, 32]``,
  ``kv_a_proj_with_mqa.weight`` ``[32+8=40, 64]``, ``kv_a_layernorm.weight`` ``[32]``,
  ``kv_b_proj.weight`` ``[8*(8+8)=128, 32]``, ``o_proj.weight`` ``[64, 8*8]``. Layer 0 is dense
  (``mlp.{gate,up,down}_proj`` with intermediate 128); later layers have per-expert
  ``mlp.experts.E.{gate,up,down}_proj.weight`` as qwen3_moe, ``mlp.shared_experts.{gate,up}_proj
  .weight`` ``[32,64]`` / ``down_proj.weight`` ``[64,32]``, router ``mlp.gate.weight`` ``[8,64]``
  and ``mlp.gate.e_score_correction_bias`` ``[8]`` (saved in the model dtype).
* glm4_moe (GLM-4.5): attention as qwen2 (``self_attn.{q,k,v}_proj.bias``, no o_proj bias) plus
  ``self_attn.q_norm.weight`` / ``k_norm.weight`` ``[8]`` (``use_qk_norm=True`` as GLM-4.5; pass
  ``use_qk_norm=False`` for GLM-4.5-Air, ``attention_bias=False`` to drop the biases); rotary on
  half of head_dim. MLP as deepseek_v3: layer 0 dense, later layers per-expert experts, shared
  experts, router ``mlp.gate.weight`` ``[8,64]`` and ``mlp.gate.e_score_correction_bias`` ``[8]``
  (model dtype here; transformers' ``_keep_in_fp32_modules_strict`` keeps both float32 when a
  model is loaded with a dtype, and then saves them so). ``num_nextn_predict_layers`` is 0:
  transformers holds it as ``num_mtp_layers`` and writes it to config.json as
  ``num_nextn_predict_layers``, but builds no MTP module, so it never writes the
  ``model.layers.<num_hidden_layers>.*`` MTP weights a real GLM-4.5 checkpoint carries.
* gpt_oss: experts exist only fused, input-major (``x @ W``) with biases:
  ``mlp.experts.gate_up_proj`` ``[8,64,256]`` with gate and up INTERLEAVED along the last dim
  (unit ``j``: gate column ``2j``, up column ``2j+1``), ``mlp.experts.gate_up_proj_bias``
  ``[8,256]`` (same interleave), ``mlp.experts.down_proj`` ``[8,128,64]``,
  ``mlp.experts.down_proj_bias`` ``[8,64]``; router ``mlp.router.weight`` ``[8,64]`` and
  ``mlp.router.bias`` ``[8]``; attention as llama plus ``self_attn.{q,k,v,o}_proj.bias`` ``[64]
  [kv] [kv] [64]`` and ``self_attn.sinks`` ``[8]`` (one per attention head). Every layer is
  sparse, expert intermediate 128 (vLLM's CPU experts need ``128 / tp`` divisible by 32);
  layer_types alternate sliding (window 16, even layers) and full attention; yarn RoPE. vLLM
  never replicates gpt-oss KV heads: ``kv_heads`` must be a multiple of tp (8 or 4 for tp 4).
* llama4 (Llama4ForConditionalGeneration, the class of the Scout/Maverick checkpoints): config.json
  nests the text sizes under ``text_config`` (plus a tiny ``vision_config``); every text tensor
  is under ``language_model.``: ``language_model.model.embed_tokens.weight`` ``[1000,64]``,
  ``language_model.model.layers.N.self_attn.{q,k,v,o}_proj.weight`` as llama (no biases; the
  L2 qk-norm has no weights), ``input_layernorm`` / ``post_attention_layernorm``,
  ``language_model.model.norm.weight``, ``language_model.lm_head.weight``. Dense layers (0, 2,
  ...): ``feed_forward.{gate,up}_proj.weight`` ``[128,64]``, ``feed_forward.down_proj.weight``
  ``[64,128]``. MoE layers (1, 3, ...: ``interleave_moe_layer_step`` 2 as Maverick; Scout has 1),
  top-1: router ``feed_forward.router.weight`` ``[8,64]``, experts only fused, input-major:
  ``feed_forward.experts.gate_up_proj`` ``[8,64,64]`` (columns ``[0,32)`` gate, ``[32,64)``
  up) and ``feed_forward.experts.down_proj`` ``[8,32,64]``, shared expert
  ``feed_forward.shared_expert.{gate,up}_proj.weight`` ``[32,64]`` / ``down_proj.weight``
  ``[64,32]``. Vision tower: ``vision_model.patch_embedding.linear.weight`` ``[32,588]``,
  ``vision_model.{class_embedding [32], positional_embedding_vlm [5,32]}``,
  ``vision_model.layernorm_{pre,post}.{weight,bias}`` ``[32]``, one encoder layer
  ``vision_model.model.layers.0.self_attn.{q,k,v,o}_proj.{weight,bias}`` ``[32,32] [32]``,
  ``mlp.fc1`` ``[128,32] [128]``, ``mlp.fc2`` ``[32,128] [32]``, ``{input,post_attention}_layernorm
  .{weight,bias}`` ``[32]``; ``vision_model.vision_adapter.mlp.fc1.weight`` ``[64,128]``,
  ``fc2.weight`` ``[64,64]``; ``multi_modal_projector.linear_1.weight`` ``[64,64]``.
* llama4_text (Llama4ForCausalLM, model_type ``llama4_text``): the same text model alone, named
  ``model.*`` and ``lm_head.weight``.
* qwen2_5_vl (Qwen2_5_VLForConditionalGeneration): the qwen2 text model (sizes in ``text_config``,
  M-RoPE) as ``model.*`` and ``lm_head.weight`` (the releases' names, which transformers 5 saves
  too), and the vision tower: ``visual.patch_embed.proj.weight`` ``[32,3,2,14,14]``,
  ``visual.blocks.N.{norm1,norm2}.weight`` ``[32]``, ``attn.qkv.{weight,bias}`` ``[96,32] [96]``
  (q, k, v fused), ``attn.proj.{weight,bias}`` ``[32,32] [32]``, ``mlp.{gate,up}_proj.{weight,bias}``
  ``[64,32] [64]``, ``mlp.down_proj.{weight,bias}`` ``[32,64] [32]``; ``visual.merger.ln_q.weight``
  ``[32]``, ``visual.merger.mlp.0.{weight,bias}`` ``[128,128] [128]``, ``mlp.2`` ``[64,128] [64]``.
* gemma3 (Gemma3ForConditionalGeneration): the gemma3_text model as ``language_model.model.*``
  (tied, no lm_head), the SigLIP tower renamed after saving to the releases' layout
  ``vision_tower.vision_model.*`` (transformers 5 writes ``vision_tower.*``):
  ``embeddings.patch_embedding.{weight,bias}`` ``[32,3,14,14] [32]``,
  ``embeddings.position_embedding.weight`` ``[4,32]``, ``encoder.layers.N.self_attn.{q,k,v,out}_proj
  .{weight,bias}`` ``[32,32] [32]``, ``mlp.fc1`` ``[64,32] [64]``, ``mlp.fc2`` ``[32,64] [32]``,
  ``layer_norm{1,2}.{weight,bias}``, ``post_layernorm.{weight,bias}`` ``[32]``; and
  ``multi_modal_projector.mm_input_projection_weight`` ``[32,64]``, ``mm_soft_emb_norm.weight`` ``[32]``.

:func:`linear_experts` reads any of these expert layouts as per-expert ``nn.Linear`` weights.

Fused experts (``fused_experts=True``): transformers 5 holds routed experts in memory as 3-D
tensors but ``save_pretrained`` writes them back per expert (above). With ``fused_experts=True``
the checkpoint is rewritten to the in-memory transformers 5 layout, i.e. exactly the keys of
``model.state_dict()``: per MoE layer ``model.layers.N.mlp.experts.gate_up_proj`` of shape
``[E, 2*I, H]`` (for each expert, rows ``[0, I)`` are the gate projection and rows ``[I, 2I)``
the up projection, each an ``nn.Linear`` weight ``[out, in]``) and
``model.layers.N.mlp.experts.down_proj`` of shape ``[E, H, I]`` (no ``.weight`` suffix). For
mixtral the module is renamed as transformers 5 does: ``block_sparse_moe.`` becomes ``mlp.``
(so the router is ``mlp.gate.weight``). transformers 5 ``from_pretrained`` loads either layout.
gpt_oss, llama4 and llama4_text have no per-expert form: ``fused_experts`` changes nothing.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..dtypes import canonical_dtype
from .archs import ARCHS, ArchSpec
from .experts import MoeLayout, fuse, has_fused, linear_experts, unfuse
from .files import list_tensors, read_checkpoint_tensors, remove_weight_files, write_shards
from .multimodal import renamed

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "ARCHS",
    "ArchSpec",
    "MoeLayout",
    "fuse_experts",
    "linear_experts",
    "list_tensors",
    "read_checkpoint_tensors",
    "unfuse_experts",
    "write_checkpoint",
    "write_shards",
    "write_unit_scale_checkpoint",
]


# --------------------------------------------------------------------------------------------
# Building


def write_checkpoint(
    arch: str,
    out_dir: str | os.PathLike[str],
    *,
    kv_heads: int | None = None,
    tie_word_embeddings: bool | None = None,
    num_layers: int = 2,
    dtype: Any = "bfloat16",
    max_shard_size: str | int = "100KB",
    seed: int = 0,
    fused_experts: bool = False,
    **config_overrides: Any,
) -> Path:
    """Build a tiny random ``arch`` checkpoint in ``out_dir`` and return the directory.

    ``kv_heads`` sets the KV-head count (default: as many as attention heads, i.e. MHA);
    ``tie_word_embeddings`` overrides the architecture's default (False, except gpt2, gemma2 and
    gemma3_text); ``config_overrides`` are passed to the transformers config last, so they win. Every saved
    tensor (parameters and persistent buffers, norm weights and biases included) is filled with
    ``randn * 0.02`` from a generator seeded with ``seed``, then cast to ``dtype``; the same
    arguments always give byte-identical tensors. ``max_shard_size`` follows transformers
    (``"100KB"`` = 100,000 bytes). ``fused_experts`` (MoE only) rewrites the routed experts to
    the 3-D layout described in the module docstring; it changes nothing for the architectures
    that exist only fused (gpt_oss, llama4, llama4_text). For a composite config (llama4),
    ``kv_heads``, ``num_layers`` and the overrides apply to its ``text_config``, except overrides
    of top-level keys (``vision_config``, ``image_token_index``, ...). Existing ``model*.safetensors`` files and
    the index in ``out_dir`` are replaced; other files are left alone.
    """
    spec = _spec(arch)
    dtype_name = canonical_dtype(dtype)
    if dtype_name is None:
        raise ValueError("write_checkpoint needs a concrete dtype, not None/'auto'")
    if fused_experts and spec.moe is None:
        raise ValueError(f"fused_experts=True needs a MoE architecture; {arch!r} has no experts")

    import transformers

    kwargs = _config_kwargs(spec, arch, num_layers, kv_heads, tie_word_embeddings, config_overrides)
    config = getattr(transformers, spec.config_class)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_class)(config)
    _randomize(model, seed)
    model = _cast(model, dtype_name)

    out = Path(out_dir)
    _save_model(model, out, spec, dtype_name, max_shard_size)
    _to_disk_layout(out, spec, fused_experts, max_shard_size)
    return out


def _config_kwargs(
    spec: ArchSpec, arch: str, num_layers: int, kv_heads: int | None, tie_word_embeddings: bool | None, overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """The transformers config's arguments: the architecture's tiny sizes, then the caller's
    layers, KV heads, tying and overrides (for a composite config, nested under its text config)."""
    kwargs = _plain(spec.config)
    kwargs[spec.layers_key] = num_layers
    if kv_heads is not None:
        heads = kwargs[spec.heads_key]
        if spec.kv_heads_key is None:
            if kv_heads != heads:
                raise ValueError(f"{arch!r} has no grouped-query attention; kv_heads must be {heads}")
        else:
            if kv_heads < 1 or heads % kv_heads:
                raise ValueError(f"kv_heads={kv_heads} must divide the {heads} attention heads")
            kwargs[spec.kv_heads_key] = kv_heads
    if tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = tie_word_embeddings
    if spec.text_config_key is not None:  # composite: sizes and overrides go to the text config
        outer = _plain(spec.outer_config)
        if tie_word_embeddings is not None:
            outer["tie_word_embeddings"] = tie_word_embeddings
        for key, value in overrides.items():
            (outer if key in outer or key == spec.text_config_key else kwargs)[key] = value
        kwargs = {**outer, spec.text_config_key: {**kwargs, **outer.get(spec.text_config_key, {})}}
    else:
        kwargs.update(overrides)
    return kwargs


def _cast(model: PreTrainedModel, dtype_name: str) -> PreTrainedModel:
    """``model`` cast to ``dtype_name``, its config recording that dtype."""
    with warnings.catch_warnings():  # llama4's complex RoPE buffers (not saved) warn when cast
        warnings.filterwarnings("ignore", message="Casting complex values to real")
        model = model.to(getattr(torch, dtype_name))
    model.config.dtype = getattr(torch, dtype_name)
    return model


def _save_model(model: PreTrainedModel, out: Path, spec: ArchSpec, dtype_name: str, max_shard_size: str | int) -> None:
    """Replace the weight files in ``out`` by ``model``'s (``save_pretrained``, in shards), with a
    config.json that records ``dtype_name`` and the architecture's extra keys."""
    out.mkdir(parents=True, exist_ok=True)
    remove_weight_files(out)
    with quiet_transformers():
        model.save_pretrained(out, max_shard_size=max_shard_size)
    _set_config_dtype(out / "config.json", dtype_name)
    if spec.config_json:
        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **_plain(spec.config_json)}, indent=2, sort_keys=True) + "\n")


def _to_disk_layout(out: Path, spec: ArchSpec, fused_experts: bool, max_shard_size: str | int) -> None:
    """Rewrite the saved tensors in ``out`` to the released names and the requested expert layout
    (fused or per expert), where they differ."""
    if spec.renames:  # to the released layout (see ArchSpec.renames)
        tensors = read_checkpoint_tensors(out)
        write_shards(out, {renamed(name, spec.renames): t for name, t in tensors.items()}, max_shard_size)

    if spec.moe is not None and spec.moe.per_expert_prefix is not None:
        tensors = read_checkpoint_tensors(out)
        on_disk_fused = has_fused(tensors, spec.moe)
        if fused_experts and not on_disk_fused:
            write_shards(out, fuse(tensors, spec.moe), max_shard_size)
        elif not fused_experts and on_disk_fused:
            write_shards(out, unfuse(tensors, spec.moe), max_shard_size)


def write_unit_scale_checkpoint(arch: str, out_dir: Any, *, dtype: str = "bfloat16", **options: Any) -> Any:
    """A tiny ``write_checkpoint`` model with its weights rescaled so every activation is O(1),
    saved by transformers' ``save_pretrained`` (several shards) in ``dtype``; returns the directory.

    ``write_checkpoint`` fills every tensor, norm weights included, with ``0.02 * randn``, so
    each layer adds a tiny fraction to the residual stream and a wrong block in one layer
    changes the logits only by ~1e-5 relative: too close to float32 rounding for a comparison
    to tell. Here linear weights (and experts, router, lm_head) become ``N(0, 1/fan_in)``, the
    embedding ``N(0, 1)``, norm weights ``1 + N(0, 0.4^2)`` and biases ``N(0, 0.5^2)`` (the same
    random draws, scaled), so every block matters at O(1). ``options`` go to ``write_checkpoint``.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")):
        raise FileExistsError(f"{out} already holds a checkpoint")
    with tempfile.TemporaryDirectory() as tmp:
        source = write_checkpoint(arch, tmp, dtype="float32", **options)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.mul_(20.0).add_(1.0)
            elif name.endswith(".bias"):
                p.mul_(25.0)
            elif "embed_tokens" in name:
                p.mul_(50.0)
            else:
                p.mul_(1.0 / (0.02 * math.sqrt(p.shape[-1])))
    torch_dtype = getattr(torch, dtype)
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    with quiet_transformers():
        model.save_pretrained(out, max_shard_size="100KB")
    return out


def _plain(value: Any) -> Any:
    """A fresh copy of a config value, mappings as plain dicts (transformers may edit what it gets)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _spec(arch: str) -> ArchSpec:
    try:
        return ARCHS[arch]
    except KeyError:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}") from None


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Fill every saved floating tensor with ``randn * 0.02`` (float32 draws, in module order)."""
    gen = torch.Generator().manual_seed(seed)
    saved = set(model.state_dict().keys())
    tensors = list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if n in saved
    ]
    for _, t in tensors:
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * 0.02)


def _set_config_dtype(config_path: Path, dtype_name: str) -> None:
    """Make config.json record ``dtype_name`` (transformers 5 writes ``dtype``; 4.x ``torch_dtype``)."""
    cfg = json.loads(config_path.read_text())
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]
    if all(cfg.get(k) == dtype_name for k in keys):
        return
    for k in keys:
        cfg[k] = dtype_name
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


class quiet_transformers:  # noqa: N801 (a context manager used like a function)
    """Silence transformers' shard-writing progress bar for the duration; restore it after."""

    def __enter__(self) -> None:
        from transformers.utils import logging as hf_logging

        self._logging = hf_logging
        self._was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()

    def __exit__(self, *exc: object) -> None:
        if self._was_enabled:
            self._logging.enable_progress_bar()


def fuse_experts(tensors: Mapping[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """Per-expert expert weights of ``arch`` -> the fused 3-D layout (see :class:`MoeLayout`)."""
    return fuse(tensors, _moe(arch))


def unfuse_experts(tensors: Mapping[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """Fused 3-D expert weights of ``arch`` -> per expert; inverse of :func:`fuse_experts`."""
    return unfuse(tensors, _moe(arch))


def _moe(arch: str) -> MoeLayout:
    moe = _spec(arch).moe
    if moe is None:
        raise ValueError(f"{arch!r} has no experts")
    return moe
