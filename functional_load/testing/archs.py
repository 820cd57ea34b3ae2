"""The tiny architectures :func:`functional_load.testing.checkpoints.write_checkpoint` builds.

Each :class:`~.archspec.ArchSpec` names the transformers config and model classes and the tiny
config values; the on-disk tensor names and shapes they give are listed in the docstring of
:mod:`functional_load.testing.checkpoints`. :data:`ARCHS` holds the families the project started
with and those of the ``archs_*`` modules (one per group of families added later).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from .archspec import (
    _GEMMA,
    _GEMMA3_VISION,
    _LLAMA4_EXPERTS,
    _LLAMA4_TEXT,
    _LLAMA4_VISION,
    _LLAMA_LIKE,
    _MROPE,
    _NO_HEAD_DIM,
    _QWEN2_5_VL_VISION,
    _QWEN_MOE_EXPERTS,
    ArchSpec,
)
from .experts import MoeLayout

__all__ = ["ARCHS", "ArchSpec"]

CORE: Mapping[str, ArchSpec] = MappingProxyType(
    {
        "llama": ArchSpec("LlamaConfig", "LlamaForCausalLM", MappingProxyType(dict(_LLAMA_LIKE))),
        "mistral": ArchSpec("MistralConfig", "MistralForCausalLM", MappingProxyType(dict(_LLAMA_LIKE))),
        "qwen2": ArchSpec(
            "Qwen2Config", "Qwen2ForCausalLM", MappingProxyType(dict(_NO_HEAD_DIM)),
            notes="q/k/v projections carry biases",
        ),
        "qwen3": ArchSpec(
            "Qwen3Config", "Qwen3ForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)),
            notes="per-head q_norm/k_norm RMSNorm weights [head_dim]",
        ),
        "phi3": ArchSpec(
            "Phi3Config", "Phi3ForCausalLM", MappingProxyType(dict(_NO_HEAD_DIM)),
            notes="fused qkv_proj and gate_up_proj on disk",
        ),
        "gemma2": ArchSpec(
            "Gemma2Config", "Gemma2ForCausalLM", MappingProxyType(dict(_GEMMA)),
            notes="pre/post-feedforward norms; lm_head tied (vLLM has none: an untied checkpoint is refused)",
        ),
        "gemma3_text": ArchSpec(
            "Gemma3TextConfig", "Gemma3ForCausalLM", MappingProxyType(dict(_GEMMA)),
            notes="Gemma 2 plus per-head q_norm/k_norm; lm_head tied by default",
        ),
        "glm4": ArchSpec(
            "Glm4Config", "Glm4ForCausalLM", MappingProxyType({**_LLAMA_LIKE, "attention_bias": True}),
            notes="q/k/v biases; fused gate_up_proj on disk; post_self_attn/post_mlp norms",
        ),
        "gpt2": ArchSpec(
            "GPT2Config",
            "GPT2LMHeadModel",
            MappingProxyType(
                {
                    "n_embd": 64,
                    "n_head": 8,
                    "n_layer": 2,
                    "n_positions": 64,
                    "vocab_size": 1000,
                    "tie_word_embeddings": True,
                    "bos_token_id": 1,
                    "eos_token_id": 2,
                }
            ),
            layers_key="n_layer",
            heads_key="n_head",
            kv_heads_key=None,
            notes="Conv1D weights stored [in, out]; n_inner null means 4*n_embd=256; lm_head tied to wte",
        ),
        "mixtral": ArchSpec(
            "MixtralConfig",
            "MixtralForCausalLM",
            MappingProxyType(
                {**_LLAMA_LIKE, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2}
            ),
            moe=MoeLayout(
                "block_sparse_moe.experts", "w1", "w3", "w2",
                fused_renames=((".block_sparse_moe.", ".mlp."),),
            ),
        ),
        "qwen3_moe": ArchSpec(
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            MappingProxyType(
                {
                    **_LLAMA_LIKE,
                    "num_experts": 8,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [],
                    "norm_topk_prob": True,
                }
            ),
            moe=_QWEN_MOE_EXPERTS,
        ),
        "deepseek_v3": ArchSpec(
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            MappingProxyType(
                {
                    **_NO_HEAD_DIM,
                    "head_dim": 8,  # = qk_rope_head_dim, as transformers derives it
                    "n_routed_experts": 8,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32,
                    "n_shared_experts": 1,
                    "first_k_dense_replace": 1,
                    "n_group": 2,
                    "topk_group": 1,
                    "q_lora_rank": 32,
                    "kv_lora_rank": 32,
                    "qk_nope_head_dim": 8,
                    "qk_rope_head_dim": 8,
                    "v_head_dim": 8,
                    "topk_method": "noaux_tc",  # as DeepSeek-V3's release: the router has e_score_correction_bias
                }
            ),
            moe=_QWEN_MOE_EXPERTS,
            notes="MLA attention (num_key_value_heads is recorded but unused); layer 0 dense",
        ),
        "gpt_oss": ArchSpec(
            "GptOssConfig",
            "GptOssForCausalLM",
            MappingProxyType(
                {
                    **_LLAMA_LIKE,
                    # vLLM's CPU experts for swigluoai need intermediate / tp divisible by 32
                    "intermediate_size": 128,
                    "num_local_experts": 8,
                    "num_experts_per_tok": 2,
                    "sliding_window": 16,  # layer_types default: sliding on even layers, full on odd
                    "attention_bias": True,
                    "rope_parameters": {  # yarn, as gpt-oss; sized so that 32 * factor = max positions
                        "rope_type": "yarn",
                        "rope_theta": 150000.0,
                        "factor": 2.0,
                        "original_max_position_embeddings": 32,
                        "beta_fast": 32.0,
                        "beta_slow": 1.0,
                        "truncate": False,
                    },
                }
            ),
            moe=MoeLayout(None, input_major=True, interleaved=True, biases=True),
            notes="experts only fused, input-major, gate/up interleaved, with biases; attention sinks; "
            "vLLM never replicates KV heads, so kv_heads must be a multiple of tp",
        ),
        "llama4": ArchSpec(
            "Llama4Config",
            "Llama4ForConditionalGeneration",
            MappingProxyType(dict(_LLAMA4_TEXT)),
            moe=_LLAMA4_EXPERTS,
            notes="Llama 4 Scout/Maverick class: text model under language_model. plus a tiny vision tower",
            text_config_key="text_config",
            outer_config=MappingProxyType(
                {
                    "vision_config": MappingProxyType(_LLAMA4_VISION),
                    "boi_token_index": 997,  # inside the tiny vocabulary
                    "eoi_token_index": 998,
                    "image_token_index": 999,
                    "tie_word_embeddings": False,
                }
            ),
        ),
        "llama4_text": ArchSpec(
            "Llama4TextConfig",
            "Llama4ForCausalLM",
            MappingProxyType(dict(_LLAMA4_TEXT)),
            moe=_LLAMA4_EXPERTS,
            notes="the llama4 text model alone (model_type llama4_text), no language_model. prefix",
        ),
        "qwen2_5_vl": ArchSpec(
            "Qwen2_5_VLConfig",
            "Qwen2_5_VLForConditionalGeneration",
            MappingProxyType({**_NO_HEAD_DIM, "rope_parameters": _MROPE}),
            notes="Qwen2 language model saved as model.* + lm_head (the releases' names) and the vision tower visual.*",
            text_config_key="text_config",
            outer_config=MappingProxyType(
                {
                    "vision_config": MappingProxyType(_QWEN2_5_VL_VISION),
                    "image_token_id": 999,  # inside the tiny vocabulary
                    "video_token_id": 998,
                    "vision_start_token_id": 997,
                    "vision_end_token_id": 996,
                    "tie_word_embeddings": False,
                }
            ),
        ),
        "gemma3": ArchSpec(
            "Gemma3Config",
            "Gemma3ForConditionalGeneration",
            MappingProxyType(dict(_GEMMA)),
            notes="gemma3_text under language_model.model., the SigLIP tower and the projector; tied",
            text_config_key="text_config",
            outer_config=MappingProxyType(
                {
                    "vision_config": MappingProxyType(_GEMMA3_VISION),
                    "mm_tokens_per_image": 4,  # 2 x 2 patches per image: one per token
                    "image_token_index": 999,
                    "boi_token_index": 997,
                    "eoi_token_index": 998,
                    "tie_word_embeddings": True,
                }
            ),
            # transformers 5 saves the SigLIP tower flat (vision_tower.embeddings...); the releases,
            # and vLLM 0.32, have it under vision_tower.vision_model.
            renames=(("vision_tower.", "vision_tower.vision_model."),),
        ),
        "glm4_moe": ArchSpec(
            "Glm4MoeConfig",
            "Glm4MoeForCausalLM",
            MappingProxyType(
                {
                    **_LLAMA_LIKE,
                    "n_routed_experts": 8,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32,
                    "n_shared_experts": 1,
                    "first_k_dense_replace": 1,
                    "n_group": 1,
                    "topk_group": 1,
                    "norm_topk_prob": True,
                    "attention_bias": True,  # q/k/v biases, as GLM-4.5
                    "use_qk_norm": True,  # as GLM-4.5 (GLM-4.5-Air: False)
                    "num_nextn_predict_layers": 0,  # transformers' num_mtp_layers; it writes no MTP weights
                }
            ),
            moe=_QWEN_MOE_EXPERTS,
            notes="partial rotary 0.5; layer 0 dense; router gate.weight + e_score_correction_bias",
        ),
    }
)


def _tables() -> dict[str, ArchSpec]:
    """Every table, by architecture name (a name in two tables is a mistake, and an error)."""
    import importlib
    import pkgutil
    from pathlib import Path

    out = dict(CORE)
    for module in sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.name.startswith("archs_")):
        table = importlib.import_module(f"{__package__}.{module}").ARCHS
        twice = sorted(set(table) & set(out))
        if twice:
            raise ValueError(f"{module}: architectures {twice} are in another table too")
        out.update(table)
    return out


ARCHS: Mapping[str, ArchSpec] = MappingProxyType(_tables())
