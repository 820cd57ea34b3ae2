"""Parity cases of the ``moe`` group (see :mod:`functional_load.testing.archs_moe`): every MoE
case without and with expert parallelism, both placements."""

from __future__ import annotations

from functional_load.testing.parity.case import MOE, Case

__all__ = ["CASES"]

CASES: tuple[Case, ...] = (
    Case("minimax_m2-gqa", "minimax_m2", {"kv_heads": 2}, options=MOE,
         note="2026: full-width q_norm/k_norm split with the heads (k_norm shared by replicated KV heads), "
         "float32 router and routing bias"),
    Case("glm4_moe_lite", "glm4_moe_lite", {}, options=MOE, note="2026 (GLM-4.7-Flash): MLA with q_lora, float32 router and bias"),
    Case("deepseek_v2-lite", "deepseek_v2", {}, options=MOE, note="topk_method greedy: no e_score_correction_bias; q_lora_rank null"),
    Case("deepseek_v2-qlora", "deepseek_v2", {"q_lora_rank": 32, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
         tps=(1, 4), options=MOE, note="DeepSeek-V2: q_lora, 2 expert groups, no router bias"),
    Case("mistral_large_3", "mistral_large_3", {}, tps=(1, 2), options=MOE[:2], note="HF format: DeepSeek-V3's layout"),
    Case("olmoe-gqa", "olmoe", {"kv_heads": 2}, options=MOE, note="full-width q/k norms kept whole"),
    Case("qwen2_moe-gqa", "qwen2_moe", {"kv_heads": 2, "mlp_only_layers": [0]}, options=MOE,
         note="layer 0 dense (mlp_only_layers), shared expert and its gate"),
    Case("qwen2_moe-4experts", "qwen2_moe", {"kv_heads": 2, "num_experts": 4}, tps=(8,), options=MOE,
         note="tp 8 > 4 experts: refused by both, with and without EP"),
    Case("granitemoe-gqa", "granitemoe", {"kv_heads": 2}, options=MOE, note="fused input_linear/output_linear experts"),
    Case("granitemoeshared-gqa", "granitemoeshared", {"kv_heads": 2}, options=MOE, note="plus shared_mlp, stored fused"),
    Case("granitemoe_swa-mqa-tied", "granitemoe_swa", {"kv_heads": 1, "tie_word_embeddings": True}, options=MOE,
         note="sinks split by head; transformers 5 names (experts.gate_up_proj, router.weight)"),
    Case("phimoe-gqa", "phimoe", {"kv_heads": 2}, options=MOE, note="LayerNorms with biases; q/k/v, o_proj and lm_head biases"),
    Case("phimoe-nobias", "phimoe", {"kv_heads": 2, "attention_bias": False, "lm_head_bias": False}, tps=(1, 2),
         we_refuse="vLLM creates qkv_proj.bias, o_proj.bias and lm_head.bias and leaves them unwritten when the "
         "checkpoint lacks them (phimoe.py:339, 346, 555)"),
    Case("ernie4_5_moe-gqa-tied", "ernie4_5_moe", {"kv_heads": 2}, options=MOE,
         note="layer 0 dense; float32 router, its bias stored [1, E] as moe_statics and squeezed; shared expert; tied"),
    Case("exaone_moe-gqa", "exaone_moe", {"kv_heads": 2}, options=MOE, note="layer 0 dense, float32 router bias beside the gate"),
    Case("exaone_moe_caps-gqa", "exaone_moe_caps", {"kv_heads": 2}, tps=(1, 2), note="the registry's ExaoneMoEForCausalLM spelling"),
    Case("mimo_v2_flash", "mimo_v2_flash", {}, options=MOE,
         note="full layer 0 (2 KV heads, dense), SWA layer 1 (4 KV heads, sinks split by head, MoE); float32 router"),
    Case("afmoe-gqa", "afmoe", {"kv_heads": 2}, options=MOE, note="attention output gate, float32 router and expert_bias"),
    Case("axk1", "axk1", {}, options=MOE, note="every layer MoE, post_mlp_layernorm on each"),
    Case("axk1-dense0", "axk1", {"first_k_dense_replace": 1, "mlp_layer_types": ["dense", "sparse"]}, tps=(1, 2),
         note="vLLM creates post_mlp_layernorm on the dense layer too (AXK1.py:643), transformers writes none: refused by both"),
    Case("hy_v3-gqa", "hy_v3", {"kv_heads": 2}, options=MOE, note="float32 router and expert_bias, shared_mlp, qk-norm"),
    Case("cohere2_moe-gqa", "cohere2_moe", {"kv_heads": 2}, options=MOE, note="parallel blocks, layer 0 dense, shared expert; tied"),
    # vLLM's Transformers backend (TransformersMoEForCausalLM; slow to build: tp 4 left out)
    Case("flex_olmo-gqa", "flex_olmo", {"kv_heads": 2}, tps=(1, 2, 8), options=MOE, note="post-norms, full-width q/k norms"),
    Case("mellum-gqa", "mellum", {"kv_heads": 2}, tps=(1, 2, 8), options=MOE, note="router under mlp.experts.gate"),
    Case("hunyuan_moe-gqa", "hunyuan_moe", {"kv_heads": 2}, tps=(1, 2, 8), options=MOE, note="mlp.gate.wg, shared_mlp"),
    # Checked with the bias mapped: every other parameter identical, the bias vLLM's zeros.
    Case("laguna-gqa", "laguna", {"kv_heads": 2}, tps=(1, 2), options=MOE[:2],
         we_refuse="vLLM 0.32 never loads the checkpoint's mlp.experts.e_score_correction_bias into its "
         "mlp.experts.routed_experts.e_score_correction_bias (it serves zeros; laguna.py:202, 697-700)"),
    Case("longcat_flash", "longcat_flash", {}, options=MOE, note="two MLA attentions and two MLPs per block, float32 router"),
    Case("longcat_flash-scaled", "longcat_flash", {"mla_scale_q_lora": True, "mla_scale_kv_lora": True}, tps=(1,),
         we_refuse="vLLM multiplies q_a_layernorm / kv_a_layernorm by sqrt(hidden / rank) as it loads them "
         "(longcat_flash.py:87-101), a transform functional_load does not compute yet"),
)
