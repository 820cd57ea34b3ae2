"""How a tiny architecture is built (:class:`ArchSpec`), and the tiny config values shared by the tables.

The tables of architectures are :mod:`.archs` (the families the project started with) and the
``archs_*`` modules, one per group of families; :data:`functional_load.testing.archs.ARCHS` is
all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .experts import MoeLayout

__all__ = ["ArchSpec"]


@dataclass(frozen=True)
class ArchSpec:
    """How to build one tiny architecture: transformers class names and tiny config values.

    ``layers_key``/``heads_key``/``kv_heads_key`` are the config.json keys that ``num_layers`` and
    ``kv_heads`` set (``kv_heads_key`` is None where the architecture has no KV-head count).
    ``text_config_key`` names the nested config of a composite model (Llama 4's ``text_config``):
    ``config``, ``num_layers``, ``kv_heads``, ``tie_word_embeddings`` and the overrides then go
    there, except overrides named in ``outer_config`` (or ``text_config_key`` itself), which go
    to the top-level config together with ``outer_config``. None: the config is flat.
    ``config_json`` is merged into the saved config.json last (see the field).
    """

    config_class: str
    model_class: str
    config: Mapping[str, Any]
    layers_key: str = "num_hidden_layers"
    heads_key: str = "num_attention_heads"
    kv_heads_key: str | None = "num_key_value_heads"
    moe: MoeLayout | None = None
    notes: str = ""
    text_config_key: str | None = None
    outer_config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # (old, new) name prefixes applied after save_pretrained: the released layout, where
    # transformers 5 saves another one (Gemma 3's vision tower)
    renames: tuple[tuple[str, str], ...] = ()
    # top-level config.json fields written after save_pretrained: the architecture name a release
    # carries where transformers writes another class's (InternLM3 written as Llama), and fields
    # releases carry that transformers' config class lacks (MiniMax-M2's rotary_dim, LFM2's conv_dim)
    config_json: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # defaults lie outside vocab 1000

_LLAMA_LIKE = {
    "hidden_size": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 8,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    **_TOKENS,
}
_NO_HEAD_DIM = {k: v for k, v in _LLAMA_LIKE.items() if k != "head_dim"}  # derived as hidden/heads

# Gemma 2 / Gemma 3 text: tied embeddings (transformers' default; vLLM's Gemma 2 has no lm_head),
# a sliding window inside the tiny context.
_GEMMA = {**_LLAMA_LIKE, "tie_word_embeddings": True, "sliding_window": 16}

_QWEN_MOE_EXPERTS = MoeLayout("mlp.experts", "gate_proj", "up_proj", "down_proj")

# Llama 4 text model: layer 0 dense (intermediate_size_mlp), layer 1 MoE (interleave step 2, as
# Maverick; Scout has step 1, every layer MoE) with a shared expert; top-1 routing as both.
_LLAMA4_TEXT = {
    **_LLAMA_LIKE,
    "intermediate_size": 32,  # routed and shared experts
    "intermediate_size_mlp": 128,  # dense layers
    "num_local_experts": 8,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 2,
    "attention_chunk_size": 16,  # chunked local attention on the RoPE layers
}
# The vision tower of Llama4ForConditionalGeneration: 4 heads (vLLM splits them over tp);
# intermediate = hidden / pixel_shuffle_ratio**2, which the pixel-shuffle adapter needs.
_LLAMA4_VISION = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_hidden_layers": 1,
    "intermediate_size": 128,
    "image_size": 28,
    "patch_size": 14,
    "vision_output_dim": 64,
    "projector_input_dim": 64,
    "projector_output_dim": 64,
}
_LLAMA4_EXPERTS = MoeLayout(None, fused_prefix="feed_forward.experts", input_major=True)

# Multimodal vision towers: 2 layers, hidden 32, 4 heads (vLLM splits them over tp: tp 1, 2, 4),
# intermediate 64, patch 14, image 28. Qwen2.5-VL's merger works on hidden * 2 * 2 = 128.
_QWEN2_5_VL_VISION = {
    "depth": 2, "hidden_size": 32, "num_heads": 4, "intermediate_size": 64, "out_hidden_size": 64, "patch_size": 14,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
}
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}  # M-RoPE: 1 + 1 + 2 pairs of head_dim 8
_GEMMA3_VISION = {
    "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "num_hidden_layers": 2, "image_size": 28,
    "patch_size": 14, "vision_use_head": False,  # as the releases: vLLM builds no pooling head
}
