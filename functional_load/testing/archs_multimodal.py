"""Tiny multimodal architectures of 2026 (group ``multimodal``): Qwen3-VL and Qwen3-VL-MoE, the
Llama 4 vision tower, Gemma 4 (text and multimodal), Gemma 3n, Qwen3.5 (MoE) ConditionalGeneration.

Vision towers are tiny as the other multimodal ones (:mod:`.archspec`): hidden 32, 4 heads (vLLM
splits them over tp, so tp 8 is refused), 2 blocks, patch 14.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from .archs_hybrid import _GDN, _QWEN_NEXT_MOE
from .archspec import _LLAMA_LIKE, _QWEN_MOE_EXPERTS, ArchSpec
from .experts import MoeLayout

__all__ = ["ARCHS"]

# Qwen3-VL: interleaved M-RoPE over head_dim 8 (sections of 4 pairs: 2 + 1 + 1), a 4 x 4 grid of
# learned position embeddings, one deepstack merger (after block 0).
_QWEN3_VL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
_QWEN3_VL_VISION = {
    "depth": 2, "hidden_size": 32, "num_heads": 4, "intermediate_size": 64, "out_hidden_size": 64, "patch_size": 14,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16, "deepstack_visual_indexes": [0],
}
_QWEN3_VL_OUTER = {
    "vision_config": MappingProxyType(_QWEN3_VL_VISION),
    "image_token_id": 999,  # inside the tiny vocabulary
    "video_token_id": 998,
    "vision_start_token_id": 997,
    "vision_end_token_id": 996,
    "tie_word_embeddings": False,
}

# Gemma 4 text: sliding layers of head_dim 8, full-attention layers of global_head_dim 16 (the last
# layer is always full); per-layer inputs of 16 per layer; tied embeddings (transformers' default).
_GEMMA4_TEXT = {
    **_LLAMA_LIKE,
    "tie_word_embeddings": True,
    "global_head_dim": 16,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 16,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 1000,
}
_GEMMA4_VISION = {
    "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "intermediate_size": 64,
    "num_hidden_layers": 2, "patch_size": 14, "position_embedding_size": 64,
}

# Qwen3.5 ConditionalGeneration: the hybrid text models of archs_hybrid under the Qwen3-VL tower
# (no deepstack mergers, as Qwen3.5's vision config has none).
_QWEN3_5_OUTER = {
    **_QWEN3_VL_OUTER,
    "vision_config": MappingProxyType({k: v for k, v in _QWEN3_VL_VISION.items() if k != "deepstack_visual_indexes"}),
}

# Gemma 3n text: AltUp over 2 streams, Laurel rank 8, per-layer inputs of 16; no KV sharing at the
# default 2 layers (the parity cases build 4, the last 2 sharing); no activation sparsity; tied
# (vLLM's Gemma 3n has no lm_head).
_GEMMA3N_TEXT = {
    **_LLAMA_LIKE,
    "tie_word_embeddings": True,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 16,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 1000,
    "laurel_rank": 8,
    "altup_num_inputs": 2,
    "num_kv_shared_layers": 0,
    "activation_sparsity_pattern": [0.0, 0.0],
}

ARCHS: Mapping[str, ArchSpec] = MappingProxyType(
    {
        "qwen3_vl": ArchSpec(
            "Qwen3VLConfig",
            "Qwen3VLForConditionalGeneration",
            MappingProxyType({**_LLAMA_LIKE, "rope_parameters": _QWEN3_VL_ROPE}),
            notes="Qwen3 text model as model.language_model.* + lm_head, the vision tower model.visual.* "
            "(qkv fused on disk, merger and deepstack mergers)",
            text_config_key="text_config",
            outer_config=MappingProxyType(_QWEN3_VL_OUTER),
        ),
        "qwen3_vl_moe": ArchSpec(
            "Qwen3VLMoeConfig",
            "Qwen3VLMoeForConditionalGeneration",
            MappingProxyType(
                {
                    **_LLAMA_LIKE,
                    "rope_parameters": _QWEN3_VL_ROPE,
                    "num_experts": 8,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [],
                    "norm_topk_prob": True,
                    "tie_word_embeddings": False,
                }
            ),
            moe=MoeLayout("mlp.experts"),
            notes="Qwen3-VL with Qwen3-MoE experts, fused on disk",
            text_config_key="text_config",
            outer_config=MappingProxyType(_QWEN3_VL_OUTER),
        ),
        "qwen3_5_vl": ArchSpec(
            "Qwen3_5Config",
            "Qwen3_5ForConditionalGeneration",
            MappingProxyType({**_LLAMA_LIKE, **_GDN}),
            notes="Qwen3.5 text (GDN + full attention) as model.language_model.*, the Qwen3-VL tower model.visual.*",
            text_config_key="text_config",
            outer_config=MappingProxyType(_QWEN3_5_OUTER),
        ),
        "qwen3_5_moe_vl": ArchSpec(
            "Qwen3_5MoeConfig",
            "Qwen3_5MoeForConditionalGeneration",
            MappingProxyType({**_LLAMA_LIKE, **_GDN, **_QWEN_NEXT_MOE}),
            moe=_QWEN_MOE_EXPERTS,
            notes="as qwen3_5_vl, every layer sparse with a shared expert and its gate",
            text_config_key="text_config",
            outer_config=MappingProxyType(_QWEN3_5_OUTER),
        ),
        "gemma4_text": ArchSpec(
            "Gemma4TextConfig",
            "Gemma4ForCausalLM",
            MappingProxyType(_GEMMA4_TEXT),
            moe=MoeLayout("experts", fused_prefix="experts"),
            notes="Gemma 4 text: per-layer head sizes (per_layer_config), per-layer inputs, KV sharing, "
            "attention_k_eq_v, MoE beside the dense MLP (num_experts)",
        ),
        "gemma3n_text": ArchSpec(
            "Gemma3nTextConfig",
            "Gemma3nForCausalLM",
            MappingProxyType(_GEMMA3N_TEXT),
            notes="Gemma 3n text: AltUp, Laurel, per-layer embeddings, KV-shared layers (q_proj only); tied",
        ),
        "gemma4": ArchSpec(
            "Gemma4Config",
            "Gemma4ForConditionalGeneration",
            MappingProxyType(_GEMMA4_TEXT),
            notes="Gemma 4 text under model.language_model.*, the vision tower model.vision_tower.* and "
            "model.embed_vision.*, all replicated in vLLM; tied",
            text_config_key="text_config",
            outer_config=MappingProxyType(
                {
                    "vision_config": MappingProxyType(_GEMMA4_VISION),
                    "audio_config": None,
                    "image_token_id": 999,  # inside the tiny vocabulary
                    "boi_token_id": 997,
                    "eoi_token_id": 998,
                    "video_token_id": 996,
                    "audio_token_id": 995,
                    "boa_token_id": 994,
                    "eoa_token_index": 993,
                    "tie_word_embeddings": True,
                }
            ),
        ),
    }
)
