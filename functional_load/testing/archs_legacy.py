"""Tiny architectures of the older decoder families (group ``legacy``): GPT-J, Falcon, BLOOM,
GPT-NeoX, StableLM, Cohere (Command-R), OPT, GPTBigCode (StarCoder) and MiniCPM3.

Sizes divide over tp 1, 2, 4 and 8 (8 heads of 8, hidden 64) unless a note says otherwise.
MiniCPMForCausalLM (MiniCPM 1/2) is not here: transformers has no class for it (remote code only).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from .archspec import _NO_HEAD_DIM, _TOKENS, ArchSpec

__all__ = ["ARCHS"]

# no KV-head count in the config (vLLM would read a stray num_key_value_heads)
_MHA = {k: v for k, v in _NO_HEAD_DIM.items() if k != "num_key_value_heads"}
# GPT-2-style config keys (n_embd, n_head, n_layer)
_GPT_STYLE = {"n_embd": 64, "n_head": 8, "n_positions": 64, "vocab_size": 1000, **_TOKENS}

ARCHS: Mapping[str, ArchSpec] = MappingProxyType(
    {
        "gptj": ArchSpec(
            "GPTJConfig", "GPTJForCausalLM",
            MappingProxyType({**_GPT_STYLE, "n_inner": 128, "rotary_dim": 4, "tie_word_embeddings": False}),
            layers_key="n_layer", heads_key="n_head", kv_heads_key=None,
            notes="parallel attention+MLP under ln_1; q/k/v stacked; lm_head with a bias (vLLM asserts untied)",
        ),
        "stablelm": ArchSpec(
            "StableLmConfig", "StableLmForCausalLM",
            MappingProxyType({**_NO_HEAD_DIM, "partial_rotary_factor": 0.25, "use_qkv_bias": True, "qk_layernorm": False,
                              "use_parallel_residual": False}),
            notes="Llama with LayerNorms (weight, bias), q/k/v biases, partial rotary",
        ),
        "opt": ArchSpec(
            "OPTConfig", "OPTForCausalLM",
            MappingProxyType({"hidden_size": 64, "num_attention_heads": 8, "ffn_dim": 128, "word_embed_proj_dim": 64,
                              "max_position_embeddings": 64, "vocab_size": 1000, "tie_word_embeddings": True,
                              "enable_bias": True, "do_layer_norm_before": True, **_TOKENS}),
            kv_heads_key=None,
            notes="model.decoder.*; learned positions (max_position_embeddings + 2 rows); lm_head tied by default",
        ),
        "cohere": ArchSpec(
            "CohereConfig", "CohereForCausalLM",
            MappingProxyType({**_NO_HEAD_DIM, "tie_word_embeddings": True, "use_qk_norm": True}),
            notes="parallel block under one LayerNorm (no bias); tied (vLLM has no lm_head); per-head q_norm/k_norm",
        ),
        "bloom": ArchSpec(
            "BloomConfig", "BloomForCausalLM",
            MappingProxyType({"hidden_size": 64, "n_head": 8, "vocab_size": 1000, "tie_word_embeddings": True, **_TOKENS}),
            layers_key="n_layer", heads_key="n_head", kv_heads_key=None,
            notes="query_key_value stored per head [q, k, v]; ALiBi; word_embeddings_layernorm; tied",
        ),
        "falcon": ArchSpec(
            "FalconConfig", "FalconForCausalLM",
            MappingProxyType({"hidden_size": 64, "num_attention_heads": 8, "num_kv_heads": 8, "ffn_hidden_size": 256,
                              "new_decoder_architecture": True, "multi_query": False, "parallel_attn": True, "bias": False,
                              "alibi": False, "vocab_size": 1000, "max_position_embeddings": 64, "tie_word_embeddings": True,
                              **_TOKENS}),
            kv_heads_key="num_kv_heads",
            notes="Falcon-40B layout (new_decoder_architecture, ln_attn/ln_mlp); query_key_value per KV group; "
            "ffn_hidden_size must be 4 * hidden (vLLM's width)",
        ),
        "gpt_neox": ArchSpec(
            "GPTNeoXConfig", "GPTNeoXForCausalLM",
            MappingProxyType({**_MHA, "rotary_pct": 0.25, "use_parallel_residual": True}),
            kv_heads_key=None,
            notes="Transformers backend: query_key_value fused per head (column), gpt_neox.* -> model.*, embed_out -> lm_head",
        ),
        "gpt_bigcode": ArchSpec(
            "GPTBigCodeConfig", "GPTBigCodeForCausalLM",
            MappingProxyType({**_GPT_STYLE, "n_inner": 128, "multi_query": True, "tie_word_embeddings": True}),
            layers_key="n_layer", heads_key="n_head", kv_heads_key=None,
            notes="Transformers backend: MQA c_attn [q | k | v] as QKVParallelLinear (one KV head); MLP replicated",
        ),
        "minicpm3": ArchSpec(
            "MiniCPM3Config", "MiniCPM3ForCausalLM",
            MappingProxyType({**_NO_HEAD_DIM, "tie_word_embeddings": True, "q_lora_rank": 32, "kv_lora_rank": 32,
                              "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}),
            notes="MLA-like attention: q_a/kv_a replicated, q_b/kv_b split by head; tied by default",
        ),
    }
)
