"""Tiny hybrid architectures (group ``hybrid``): linear-attention and state-space families.

* Gated delta-net (GDN) linear attention: Qwen3.5 (dense and MoE, 2026) and Qwen3-Next; layer 0
  linear attention (4 key heads and 8 value heads of 8: key_dim 32, value_dim 64; kernel 4),
  layer 1 full attention (8 heads of 8 with the output gate: q_proj rows 2 x heads x head_dim).
* State-space: Mamba-1 (Mamba, FalconMamba, Jamba's mixer) and Mamba-2 (Mamba2 with 8 groups;
  Falcon-H1, Granite 4.0 hybrid and Zamba2 with 1 group, as their releases), hidden 64,
  intermediate 128, state 16; LFM2's short convolution (dense and MoE).

``config_json`` carries the release config.json fields transformers' config classes lack.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from .archspec import _LLAMA_LIKE, _QWEN_MOE_EXPERTS, _TOKENS, ArchSpec
from .experts import MoeLayout

__all__ = ["ARCHS"]

_GDN = {
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
_QWEN_NEXT_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}

# State-space models: hidden 64, expand 2 (intermediate 128), state 16, kernel 4, 2 layers.
_SSM = {"hidden_size": 64, "vocab_size": 1000, "state_size": 16, "expand": 2, "conv_kernel": 4, **_TOKENS}
_MAMBA = {**_SSM, "intermediate_size": 128, "time_step_rank": 8, "use_mambapy": False}
_MAMBA2 = {**_SSM, "num_heads": 8, "head_dim": 16, "n_groups": 8, "chunk_size": 16}  # Codestral Mamba: 8 groups

# Mamba-2 mixers of the hybrid models: 8 heads of 16 (intermediate 128), state 16, 1 group (as
# the releases: B/C replicated over the ranks)
_MAMBA2_MIXER = {"mamba_d_state": 16, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_chunk_size": 16,
                 "mamba_d_conv": 4}

# Zamba2 with 4 layers (build options): hybrid layers 1 and 3, 2 memory blocks (one each), or 1
# (both run block 0)
ZAMBA2_LAYERS = {"num_layers": 4, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"], "hybrid_layer_ids": [1, 3]}

ARCHS: Mapping[str, ArchSpec] = MappingProxyType(
    {
        "qwen3_5": ArchSpec(
            "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", MappingProxyType({**_LLAMA_LIKE, **_GDN}),
            notes="GDN in_proj_qkv/in_proj_z/in_proj_b/in_proj_a stored apart; dense MLP",
        ),
        "qwen3_5_language_model": ArchSpec(
            "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", MappingProxyType({**_LLAMA_LIKE, **_GDN}),
            renames=(("model.", "model.language_model."),),
            notes="qwen3_5 under model.language_model.*, as text-only cuts of the multimodal release are saved",
        ),
        "qwen3_5_moe": ArchSpec(
            "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", MappingProxyType({**_LLAMA_LIKE, **_GDN, **_QWEN_NEXT_MOE}),
            moe=_QWEN_MOE_EXPERTS,
            notes="as qwen3_5, every layer sparse with a shared expert and its sigmoid gate",
        ),
        "qwen3_next": ArchSpec(
            "Qwen3NextConfig", "Qwen3NextForCausalLM",
            MappingProxyType({**_LLAMA_LIKE, **_GDN, **_QWEN_NEXT_MOE, "decoder_sparse_step": 1, "mlp_only_layers": []}),
            moe=_QWEN_MOE_EXPERTS,
            notes="GDN in_proj_qkvz / in_proj_ba fused on disk, per key-head group",
        ),
        "mamba": ArchSpec(
            "MambaConfig", "MambaForCausalLM", MappingProxyType(dict(_MAMBA)), kv_heads_key=None, heads_key="hidden_size",
            notes="Mamba-1 mixer: in_proj [x|z], conv1d, x_proj, dt_proj, A_log, D, out_proj; tied by default",
        ),
        "falcon_mamba": ArchSpec(
            "FalconMambaConfig", "FalconMambaForCausalLM", MappingProxyType(dict(_MAMBA)), kv_heads_key=None,
            heads_key="hidden_size", notes="Mamba-1 with weightless RMS norms of dt/B/C",
        ),
        "mamba2": ArchSpec(
            "Mamba2Config", "Mamba2ForCausalLM", MappingProxyType(dict(_MAMBA2)), kv_heads_key=None, heads_key="num_heads",
            notes="Mamba-2 mixer: in_proj [z|x|B|C|dt], conv1d [x|B|C], A_log, D, dt_bias, gated norm, out_proj",
        ),
        "falcon_h1": ArchSpec(
            "FalconH1Config", "FalconH1ForCausalLM", MappingProxyType({**_LLAMA_LIKE, **_MAMBA2_MIXER, "mamba_d_ssm": 128}),
            notes="every layer: attention and a Mamba-2 mixer in parallel, then the MLP (feed_forward)",
        ),
        "granite_moe_hybrid": ArchSpec(
            "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
            MappingProxyType({**_LLAMA_LIKE, **_MAMBA2_MIXER, "layer_types": ["linear_attention", "full_attention"],
                              "intermediate_size": 32, "shared_intermediate_size": 64, "num_local_experts": 8,
                              "num_experts_per_tok": 2}),
            config_json=MappingProxyType({"layer_types": ["mamba", "attention"]}),  # the releases' names (transformers 5 remaps them)
            notes="layer 0 Mamba-2, layer 1 attention; every layer MoE (input_linear fused) plus a shared MLP",
        ),
        "jamba": ArchSpec(
            "JambaConfig", "JambaForCausalLM",
            MappingProxyType({**_LLAMA_LIKE, "intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                              "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 3,
                              "expert_layer_offset": 0, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
                              "mamba_dt_rank": 8}),
            notes="with 4 layers: 0 Mamba-1 + MoE, 1 attention + MLP, 2 Mamba-1 + MLP, 3 attention + MoE",
        ),
        "lfm2": ArchSpec(
            "Lfm2Config", "Lfm2ForCausalLM",
            MappingProxyType({**_LLAMA_LIKE, "layer_types": ["conv", "full_attention"], "conv_L_cache": 3, "intermediate_size": 144,
                              "block_multiple_of": 32, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
                              "tie_word_embeddings": True}),
            # LFM2's release fields (transformers' Lfm2Config lacks them; vLLM reads them)
            config_json=MappingProxyType({"conv_dim": 64, "conv_dim_out": 64, "block_dim": 64, "block_ff_dim": 144}),
            notes="layer 0 short convolution, layer 1 attention; MLP intermediate int(2 * 144 / 3) = 96 (auto-adjusted)",
        ),
        "lfm2_moe": ArchSpec(
            "Lfm2MoeConfig", "Lfm2MoeForCausalLM",
            MappingProxyType({**_LLAMA_LIKE, "layer_types": ["conv", "full_attention"], "conv_L_cache": 3, "num_dense_layers": 1,
                              "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
            moe=MoeLayout("feed_forward.experts", "w1", "w3", "w2", fused_prefix="feed_forward.experts"),
            config_json=MappingProxyType({"conv_dim": 64, "conv_dim_out": 64}),
            notes="layer 0 short convolution + dense MLP, layer 1 attention + MoE with a float32 expert_bias",
        ),
        "zamba2": ArchSpec(
            "Zamba2Config", "Zamba2ForCausalLM",
            MappingProxyType({**_LLAMA_LIKE, "attention_head_dim": 16, "layers_block_type": ["mamba", "hybrid"],
                              "hybrid_layer_ids": [1], "num_mem_blocks": 1, "use_shared_attention_adapter": True,
                              "adapter_rank": 8, "use_mem_rope": True, "n_mamba_heads": 8, "mamba_d_state": 16,
                              "mamba_ngroups": 1, "chunk_size": 16, "hidden_act": "gelu", "tie_word_embeddings": True}),
            notes="layer 0 Mamba-2, layer 1 hybrid: Mamba-2 plus the shared transformer block with its LoRA adapters; "
            "ZAMBA2_LAYERS builds more layers and blocks",
        ),
    }
)
