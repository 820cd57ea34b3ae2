"""Parity cases of the dense decoder families (group ``dense``): see
:mod:`functional_load.testing.archs_dense`. Each case picks a shape the family's releases have
(GQA, MQA, tied, biases) that its spec's other cases do not already cover."""

from __future__ import annotations

from functional_load.testing.parity.case import MOE, Case, Options

__all__ = ["CASES"]

CASES: tuple[Case, ...] = (
    # --- existing specs under another architecture name ---
    Case("granite-gqa-tied", "granite", {"kv_heads": 2, "tie_word_embeddings": True}, note="Granite 3 ties its embeddings"),
    Case("internlm3-mqa", "internlm3", {"kv_heads": 1}, note="InternLM3-8B's 16:1 GQA as MQA; qkv_bias/bias false"),
    Case("iquestcoder-gqa", "iquestcoder", {"kv_heads": 4}),
    Case("llama_caps-gqa-tied", "llama_caps", {"kv_heads": 2, "tie_word_embeddings": True}),
    Case("telechat3-bias", "telechat3", {"kv_heads": 2, "attention_bias": True}, note="q/k/v and o_proj biases"),
    Case("solar-mlp_bias", "solar", {"kv_heads": 2, "mlp_bias": True}, note="gate/up/down biases"),
    Case("ministral3-gqa-tied", "ministral3", {"kv_heads": 2, "tie_word_embeddings": True}, note="Ministral 3 3B ties"),
    Case("mimo-mtp", "mimo", {"kv_heads": 2, "num_layers": 3}, note="model.mtp_layers.0.* dropped, as vLLM's loader"),
    Case("llama4_text-scout", "llama4_text", {"kv_heads": 1, "interleave_moe_layer_step": 1}, options=MOE,
         note="Scout: every layer MoE; MQA"),
    # --- small changes ---
    Case("olmo-mha-tied", "olmo", {"tie_word_embeddings": True}, note="OLMo-1B: MHA, tied; no norm parameters"),
    Case("cohere2-gqa", "cohere2", {"kv_heads": 2}, note="tied: no lm_head anywhere"),
    Case("cohere2-untied", "cohere2", {"kv_heads": 2, "tie_word_embeddings": False}, tps=(1, 2),
         note="lm_head.weight stored: vLLM drops it by name (its logits use embed_tokens), so do we"),
    Case("gemma-mqa", "gemma", {"kv_heads": 1}, note="Gemma 2B: MQA, tied"),
    Case("gemma-mha-untied", "gemma", {"tie_word_embeddings": False}, tps=(1, 2, 8), note="an untied lm_head is loaded"),
    Case("granite_swa-gqa", "granite_swa", {"kv_heads": 2}, note="sinks [heads] split by head (1 per rank at tp 8)"),
    Case("exaone4-gqa", "exaone4", {"kv_heads": 2}),
    Case("ernie4_5-gqa-tied", "ernie4_5", {"kv_heads": 2}),
    Case("seed_oss-gqa", "seed_oss", {"kv_heads": 2}, note="q/k/v biases"),
    Case("seed_oss-biases", "seed_oss", {"kv_heads": 1, "attention_out_bias": True, "mlp_bias": True}, tps=(1, 4),
         note="o_proj and MLP biases too, MQA"),
    Case("hyperclovax-gqa", "hyperclovax", {"kv_heads": 2}),
    Case("cwm-gqa", "cwm", {"kv_heads": 2}),
    Case("smollm3-gqa-tied", "smollm3", {"kv_heads": 2}),
    Case("glm-gqa", "glm", {"kv_heads": 2}, note="gate_up_proj one contiguous block of [gate; up] per rank"),
    # --- new dense specs ---
    Case("olmo2-gqa", "olmo2", {"kv_heads": 2}, note="q_norm [64], k_norm [16] whole on every rank"),
    Case("olmo3-mqa", "olmo3", {"kv_heads": 1}),
    Case("nemotron-gqa", "nemotron", {"kv_heads": 2}),
    Case("arcee-gqa", "arcee", {"kv_heads": 2}),
    Case("apertus-gqa", "apertus", {"kv_heads": 2}, options=(Options(), Options(dtype="float32")),
         note="alpha_p/alpha_n stay bfloat16 in a float32 model; act_fn.beta/eps are buffers, left out"),
    Case("hunyuan_dense-gqa", "hunyuan_dense", {"kv_heads": 2}),
    Case("jais2-gqa", "jais2", {"kv_heads": 2}),
    Case("vaultgemma-gqa", "vaultgemma", {"kv_heads": 2}),
    Case("starcoder2-gqa", "starcoder2", {"kv_heads": 2}),
    Case("starcoder2-nobias-untied", "starcoder2", {"kv_heads": 1, "use_bias": False, "tie_word_embeddings": False}, tps=(1, 2)),
    Case("phi-mha", "phi"),
    Case("phi-qk_layernorm", "phi", {"kv_heads": 2, "qk_layernorm": True}, tps=(1, 2)),
)
