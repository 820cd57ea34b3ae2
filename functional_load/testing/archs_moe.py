"""Tiny MoE architectures (group ``moe``): the 2026 releases (MiniMax-M2, GLM-4.7-Flash), DeepSeek-V2,
Qwen2-MoE, Granite-MoE, PhiMoE, ERNIE-4.5-MoE, EXAONE-MoE, MiMo-V2-Flash, AFMoE, A.X-K1, HY-V3,
Laguna, LongCat-Flash, Cohere2-MoE and the Transformers-backend MoEs (FlexOlmo, Mellum, HunYuan-MoE).

8 routed experts, top-2, expert intermediate 32 unless noted; ``config_json`` carries the release
config.json fields that transformers' config classes lack (as the survey's CONFIG_JSON_PATCH).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from .archspec import _LLAMA_LIKE, _NO_HEAD_DIM, _QWEN_MOE_EXPERTS, ArchSpec
from .experts import MoeLayout

__all__ = ["ARCHS"]

_EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
# DeepSeek-style MLA and MoE: layer 0 dense (intermediate 128), one shared expert
_DSV3_SIZES = {
    **_EXPERTS, "n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 32,
    "kv_lora_rank": 32, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "num_nextn_predict_layers": 0,
}
_GRANITE_MOE = {**_NO_HEAD_DIM, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2}
_GRANITE_EXPERTS = MoeLayout(None, fused_prefix="block_sparse_moe.experts")  # only fused (names per release below)
_MIXTRAL_EXPERTS = MoeLayout("block_sparse_moe.experts", "w1", "w3", "w2", fused_renames=((".block_sparse_moe.", ".mlp."),))

ARCHS: Mapping[str, ArchSpec] = MappingProxyType(
    {
        # MiniMax-M2 / M2.1 (2026): Mixtral's block_sparse_moe with a float32 router and routing bias,
        # full-width q_norm/k_norm, partial rotary (rotary_dim: release field, as the fields below).
        "minimax_m2": ArchSpec(
            "MiniMaxM2Config",
            "MiniMaxM2ForCausalLM",
            MappingProxyType({**_LLAMA_LIKE, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2}),
            moe=_MIXTRAL_EXPERTS,
            config_json=MappingProxyType(
                {"rotary_dim": 4, "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True}
            ),
            notes="q_norm [heads*head_dim] and k_norm [kv_heads*head_dim] split with the q/k rows",
        ),
        # GLM-4.7-Flash: DeepSeek-V3's MLA and MoE with GLM-4.5's float32 router; transformers writes
        # mlp_layer_types, the release (and vLLM) first_k_dense_replace.
        "glm4_moe_lite": ArchSpec(
            "Glm4MoeLiteConfig",
            "Glm4MoeLiteForCausalLM",
            MappingProxyType({**_NO_HEAD_DIM, **_DSV3_SIZES, "mlp_layer_types": ["dense", "sparse"], "n_group": 1, "topk_group": 1}),
            moe=_QWEN_MOE_EXPERTS,
            config_json=MappingProxyType({"first_k_dense_replace": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}),
            notes="MLA with q_lora; layer 0 dense; float32 gate.weight and e_score_correction_bias",
        ),
        # DeepSeek-V2-Lite: greedy routing (no e_score_correction_bias), no q_lora (q_proj column-parallel).
        "deepseek_v2": ArchSpec(
            "DeepseekV2Config",
            "DeepseekV2ForCausalLM",
            MappingProxyType({**_NO_HEAD_DIM, **_DSV3_SIZES, "head_dim": 8, "q_lora_rank": None, "topk_method": "greedy"}),
            moe=_QWEN_MOE_EXPERTS,
            notes="pass q_lora_rank=32, topk_method='group_limited_greedy', n_group=2, topk_group=1 for DeepSeek-V2",
        ),
        # Mistral Large 3 in HF format: DeepSeek-V3's layout under its own architecture name.
        "mistral_large_3": ArchSpec(
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            MappingProxyType({**_NO_HEAD_DIM, **_DSV3_SIZES, "head_dim": 8, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc"}),
            moe=_QWEN_MOE_EXPERTS,
            config_json=MappingProxyType({"architectures": ["MistralLarge3ForCausalLM"], "scoring_func": "sigmoid"}),
        ),
        "olmoe": ArchSpec(
            "OlmoeConfig",
            "OlmoeForCausalLM",
            MappingProxyType({**_LLAMA_LIKE, "intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}),
            moe=_QWEN_MOE_EXPERTS,
            notes="q_norm [heads*head_dim], k_norm [kv_heads*head_dim], replicated; every layer MoE",
        ),
        "qwen2_moe": ArchSpec(
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            MappingProxyType({
                **_NO_HEAD_DIM, **_EXPERTS, "num_experts": 8, "shared_expert_intermediate_size": 32,
                "decoder_sparse_step": 1, "mlp_only_layers": [],
            }),
            moe=_QWEN_MOE_EXPERTS,
            notes="q/k/v biases; shared_expert + shared_expert_gate [1, 64]; pass mlp_only_layers=[0] for a dense layer",
        ),
        # Granite 3.0 MoE: experts stored fused, block_sparse_moe.input_linear [E, 2I, H] / output_linear
        # [E, H, I]; router block_sparse_moe.router.layer.
        "granitemoe": ArchSpec(
            "GraniteMoeConfig", "GraniteMoeForCausalLM", MappingProxyType(_GRANITE_MOE), moe=_GRANITE_EXPERTS,
        ),
        "granitemoeshared": ArchSpec(
            "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
            MappingProxyType({**_GRANITE_MOE, "shared_intermediate_size": 32}), moe=_GRANITE_EXPERTS,
            notes="plus shared_mlp.input_linear [2*32, 64] (gate|up) and output_linear",
        ),
        "granitemoe_swa": ArchSpec(
            "GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM",
            MappingProxyType({
                **_GRANITE_MOE, "shared_intermediate_size": 32, "sliding_window": 16,
                "layer_types": ["full_attention", "sliding_attention"], "layer_rope_theta": [10000.0, 10000.0],
            }),
            moe=_GRANITE_EXPERTS,
            notes="GraniteMoeShared plus attention sinks [heads] on every layer and sliding-window layers",
        ),
        # Phi-3.5-MoE: as released, q/k/v/o and lm_head biases (attention_bias, lm_head_bias); LayerNorms.
        "phimoe": ArchSpec(
            "PhimoeConfig", "PhimoeForCausalLM",
            MappingProxyType({
                **_LLAMA_LIKE, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                "attention_bias": True, "lm_head_bias": True,
            }),
            moe=_MIXTRAL_EXPERTS,
            config_json=MappingProxyType({"architectures": ["PhiMoEForCausalLM"]}),
            notes="pass attention_bias=False, lm_head_bias=False for a checkpoint without the biases vLLM always creates",
        ),
        # ERNIE-4.5-21B-A3B / 300B-A47B: MoE from moe_layer_start_index, router bias as moe_statics; tied.
        "ernie4_5_moe": ArchSpec(
            "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
            MappingProxyType({
                **_NO_HEAD_DIM, "moe_intermediate_size": 32, "moe_k": 2, "moe_num_experts": 8, "moe_num_shared_experts": 1,
                "moe_layer_start_index": 1, "moe_layer_end_index": 1, "moe_layer_interval": 1, "tie_word_embeddings": True,
            }),
            moe=_QWEN_MOE_EXPERTS,
            notes="layer 0 dense; mlp.moe_statics.e_score_correction_bias; tied by default",
        ),
        "exaone_moe": ArchSpec(
            "ExaoneMoeConfig", "ExaoneMoeForCausalLM",
            MappingProxyType({
                **_LLAMA_LIKE, **_EXPERTS, "num_experts": 8, "num_shared_experts": 1, "first_k_dense_replace": 1,
                "mlp_layer_types": ["dense", "sparse"], "layer_types": ["sliding_attention", "full_attention"],
                "sliding_window": 16, "n_group": 1, "topk_group": 1,
            }),
            moe=_QWEN_MOE_EXPERTS,
            notes="layer 0 dense; per-head q/k norms; mlp.e_score_correction_bias beside the router",
        ),
        "exaone_moe_caps": ArchSpec(  # the same model under the registry's other spelling
            "ExaoneMoeConfig", "ExaoneMoeForCausalLM",
            MappingProxyType({
                **_LLAMA_LIKE, **_EXPERTS, "num_experts": 8, "num_shared_experts": 1, "first_k_dense_replace": 1,
                "mlp_layer_types": ["dense", "sparse"], "layer_types": ["sliding_attention", "full_attention"],
                "sliding_window": 16, "n_group": 1, "topk_group": 1,
            }),
            moe=_QWEN_MOE_EXPERTS,
            config_json=MappingProxyType({"architectures": ["ExaoneMoEForCausalLM"]}),
            notes="exaone_moe written as ExaoneMoEForCausalLM",
        ),
        # MiMo-V2-Flash: full-attention and SWA layers (hybrid_layer_pattern) of their own head geometry,
        # SWA sinks, v_head_dim; release fields in config.json (swa_* equal to the full layers' here).
        "mimo_v2_flash": ArchSpec(
            "MiMoV2FlashConfig", "MiMoV2FlashForCausalLM",
            MappingProxyType({
                **_LLAMA_LIKE, **_EXPERTS, "num_key_value_heads": 2, "n_routed_experts": 8, "n_group": 1, "topk_group": 1,
                "v_head_dim": 8, "layer_types": ["full_attention", "sliding_attention"], "mlp_layer_types": ["dense", "sparse"],
                "sliding_window": 16,
            }),
            moe=_QWEN_MOE_EXPERTS,
            config_json=MappingProxyType({
                "hybrid_layer_pattern": [0, 1], "moe_layer_freq": [0, 1], "swa_num_attention_heads": 8,
                "swa_num_key_value_heads": 4, "swa_head_dim": 8, "swa_v_head_dim": 8, "sliding_window_size": 16,
                "layernorm_epsilon": 1e-5, "add_swa_attention_sink_bias": True,
            }),
            notes="layer 0 full attention and dense, layer 1 SWA (sinks) and MoE; 2 KV heads, 4 on SWA layers as "
            "transformers writes them (the swa_ fields are fixed)",
        ),
        "afmoe": ArchSpec(
            "AfmoeConfig", "AfmoeForCausalLM",
            MappingProxyType({
                **_LLAMA_LIKE, **_EXPERTS, "num_experts": 8, "num_shared_experts": 1, "num_dense_layers": 1,
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16, "global_attn_every_n_layers": 2,
            }),
            moe=_QWEN_MOE_EXPERTS,
            config_json=MappingProxyType({"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1}),
            notes="attention output gate; four norms per layer; layer 0 dense; mlp.router.gate and mlp.expert_bias",
        ),
        # A.X K1: DeepSeek-V3 plus post_mlp_layernorm (transformers writes it on MoE layers only); every
        # layer MoE here (first_k_dense_replace, which vLLM reads, saved from the config kwargs).
        "axk1": ArchSpec(
            "AXK1Config", "AXK1ForCausalLM",
            MappingProxyType({**_NO_HEAD_DIM, **_DSV3_SIZES, "head_dim": 8, "n_group": 1, "topk_group": 1,
                              "first_k_dense_replace": 0, "mlp_layer_types": ["sparse", "sparse"]}),
            moe=_QWEN_MOE_EXPERTS,
            notes="first_k_dense_replace is kept as an extra config field; pass 1 with mlp_layer_types "
            "['dense', 'sparse'] for a dense layer 0",
        ),
        "hy_v3": ArchSpec(
            "HYV3Config", "HYV3ForCausalLM",
            MappingProxyType({
                **_LLAMA_LIKE, **_EXPERTS, "num_experts": 8, "num_shared_experts": 1, "mlp_layer_types": ["dense", "sparse"],
            }),
            moe=_QWEN_MOE_EXPERTS,
            config_json=MappingProxyType({"first_k_dense_replace": 1, "expert_hidden_dim": 32, "route_norm": True, "qk_norm": True}),
            notes="layer 0 dense; mlp.router.gate, mlp.expert_bias, shared_mlp",
        ),
        # Cohere2-MoE: parallel blocks, LayerNorm weights, tied (vLLM has no lm_head); layer 0 dense.
        "cohere2_moe": ArchSpec(
            "Cohere2MoeConfig", "Cohere2MoeForCausalLM",
            MappingProxyType({
                **_LLAMA_LIKE, "intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1,
                "mlp_layer_types": ["dense", "sparse"], "layer_types": ["sliding_attention", "full_attention"],
                "sliding_window": 16, "tie_word_embeddings": True,
            }),
            moe=_QWEN_MOE_EXPERTS,
            notes="layer 0 dense (intermediate 32); shared experts; no post-attention norm",
        ),
        # The Transformers-backend MoEs (vLLM's TransformersMoEForCausalLM): names as transformers writes them.
        "flex_olmo": ArchSpec(
            "FlexOlmoConfig", "FlexOlmoForCausalLM",
            MappingProxyType({**_LLAMA_LIKE, "intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}),
            moe=_QWEN_MOE_EXPERTS,
            notes="Olmo2 post-norms, full-width q_norm/k_norm",
        ),
        "mellum": ArchSpec(
            "MellumConfig", "MellumForCausalLM",
            MappingProxyType({
                **_LLAMA_LIKE, **_EXPERTS, "num_local_experts": 8, "layer_types": ["full_attention", "full_attention"],
                "mlp_layer_types": ["sparse", "sparse"], "sliding_window": 16,
                "num_nextn_predict_layers": 0,  # transformers' default null breaks vLLM's backend (base.py:548)
            }),
            moe=_QWEN_MOE_EXPERTS,
            notes="router mlp.gate (vLLM's mlp.experts.gate); per-head q/k norms",
        ),
        "hunyuan_moe": ArchSpec(
            "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
            MappingProxyType({**_LLAMA_LIKE, "intermediate_size": 32, "num_experts": 8, "moe_topk": 2}),
            moe=_QWEN_MOE_EXPERTS,
            notes="query_layernorm/key_layernorm per head, router mlp.gate.wg, shared_mlp",
        ),
        # Laguna: per-head output gate, SWA sinks, unstacked gate/up; layer 0 dense.
        "laguna": ArchSpec(
            "LagunaConfig", "LagunaForCausalLM",
            MappingProxyType({
                **_LLAMA_LIKE, **_EXPERTS, "num_experts": 8, "shared_expert_intermediate_size": 32,
                "mlp_layer_types": ["dense", "sparse"], "layer_types": ["full_attention", "sliding_attention"],
                "num_attention_heads_per_layer": [8, 8], "sliding_window": 16, "gating": True,
            }),
            moe=_QWEN_MOE_EXPERTS,
            notes="transformers writes mlp.experts.e_score_correction_bias, which vLLM 0.32 never loads; no SWA sinks "
            "(transformers writes none: swa_attention_sink_enabled would leave vLLM's unwritten)",
        ),
        # LongCat-Flash: two MLA attention blocks and two dense MLPs per layer beside one MoE; no zero
        # (identity) experts here: transformers writes gate/up tensors for them, which the releases lack
        # and vLLM refuses. mla_scale_* false: vLLM scales the q/kv LoRA norms on load when true.
        "longcat_flash": ArchSpec(
            "LongcatFlashConfig", "LongcatFlashForCausalLM",
            MappingProxyType({
                **_NO_HEAD_DIM, **_DSV3_SIZES, "head_dim": 8, "ffn_hidden_size": 128, "expert_ffn_hidden_size": 32, "moe_topk": 2,
                "zero_expert_num": 0, "zero_expert_type": "identity", "mla_scale_q_lora": False, "mla_scale_kv_lora": False,
            }),  # release fields transformers' class lacks, kept as extra config fields (so a case may override them)
            layers_key="num_layers",
            moe=_QWEN_MOE_EXPERTS,
            notes="num_layers blocks of two attentions and two MLPs; router mlp.router.classifier (float32)",
        ),
    }
)
