"""Parity cases of the older decoder families (group ``legacy``): GPT-J, StableLM, OPT, Cohere,
BLOOM, Falcon, GPT-NeoX, GPTBigCode and MiniCPM3 (:mod:`functional_load.testing.archs_legacy`).

Each family's cases are named ``<family>-...``; the configurations vLLM refuses are included
("refused by both").
"""

from __future__ import annotations

from functional_load.testing.parity.case import Case

__all__ = ["CASES"]

_ODD = {"vocab_size": 100}  # pads to 128: at tp 8 rank 7 holds padding only

CASES: tuple[Case, ...] = (
    # GPT-J: parallel block, q/k/v stacked, lm_head with a bias; vLLM asserts untied embeddings.
    Case("gptj-6b", "gptj"),
    Case("gptj-tied", "gptj", {"tie_word_embeddings": True}, tps=(1,), note="vLLM asserts untied embeddings: both refuse"),
    # StableLM: LayerNorms with bias, optional q/k/v biases; StableLM-2-12B's per-head q/k LayerNorms
    # (with parallel residual, no post_attention_layernorm) are refused by vLLM's StableLM.
    Case("stablelm-gqa", "stablelm", {"kv_heads": 2}, note="q/k/v biases"),
    Case("stablelm-mqa-tied-nobias", "stablelm", {"kv_heads": 1, "tie_word_embeddings": True, "use_qkv_bias": False}),
    Case("stablelm-2-12b-qk_layernorm", "stablelm", {"kv_heads": 2, "qk_layernorm": True, "use_parallel_residual": True},
         tps=(1, 2), note="vLLM's StableLM has no q/k_layernorm and always a post_attention_layernorm: both refuse"),
    # OPT: tied (the releases), untied, and OPT-350m's shape: project_in/out around a narrower
    # embedding, LayerNorms after the blocks (no final decoder LayerNorm).
    Case("opt-tied", "opt"),
    Case("opt-untied-nobias", "opt", {"tie_word_embeddings": False, "enable_bias": False}),
    Case("opt-350m-proj", "opt", {"word_embed_proj_dim": 32, "do_layer_norm_before": False, **_ODD},
         note="word_embed_proj_dim 32 != hidden 64: project_in/out replicated; no final LayerNorm; vocab 100"),
    # Cohere: per-head q_norm/k_norm split with the heads; vLLM cannot replicate k_norm over more
    # ranks than KV heads.
    Case("cohere-qknorm-mha", "cohere", note="Command-R+ shape: use_qk_norm, 8 KV heads"),
    Case("cohere-qknorm-gqa", "cohere", {"kv_heads": 2}, tps=(1, 2)),
    Case("cohere-qknorm-gqa-replicated", "cohere", {"kv_heads": 2}, tps=(4, 8),
         we_refuse="vLLM's ranks 2.. fail on k_norm ('start (2) + length (1) exceeds dimension size (2).'), and its ranks 0 and "
         "1 load, rank 1 with k_norm row 1 although it holds KV head 0 (row_parallel_weight_loader knows no KV-head "
         "replication): the tensor-parallel group cannot load, so functional_load refuses every rank",
         note="2 KV heads over 4 and 8 ranks"),
    Case("cohere-mqa-untied", "cohere", {"kv_heads": 1, "use_qk_norm": False, "tie_word_embeddings": False},
         note="Command-R shape, MQA; a stored lm_head.weight is dropped, as vLLM's mapper drops it (logits use embed_tokens)"),
    # BLOOM: query_key_value stored per head, regrouped to q|k|v by vLLM.
    Case("bloom-tied", "bloom", {**_ODD}, note="vocab 100"),
    Case("bloom-untied", "bloom", {"tie_word_embeddings": False}, tps=(1, 2),
         note="vLLM prefixes lm_head.weight with transformer. too (bloom.py:370-376), which BloomModel lacks: both refuse"),
    # Falcon: query_key_value stored per KV group, regrouped to q|k|v by vLLM; each layout of norms.
    Case("falcon-40b-gqa", "falcon", {"kv_heads": 2}, note="new_decoder_architecture, ln_attn + ln_mlp, tied"),
    Case("falcon-11b-untied", "falcon", {"kv_heads": 4, "num_ln_in_parallel_attn": 1, "tie_word_embeddings": False, "bias": True},
         note="Falcon2-11B: one input_layernorm, untied lm_head; biases"),
    Case("falcon-7b-mqa", "falcon", {"new_decoder_architecture": False, "multi_query": True, "alibi": True},
         note="Falcon-7B layout: multi_query (one KV head, num_kv_heads ignored), input_layernorm only; ALiBi"),
    Case("falcon-rw-sequential", "falcon", {"new_decoder_architecture": False, "multi_query": False, "parallel_attn": False,
                                             "bias": True, **_ODD},
         note="Falcon-RW layout: one KV group per head, input + post_attention LayerNorms; vocab 100"),
    Case("falcon-ffn", "falcon", {"ffn_hidden_size": 128}, tps=(1,),
         note="ffn_hidden_size != 4 * hidden: vLLM builds 4 * hidden wide MLPs; both refuse the shapes"),
    # GPT-NeoX (Transformers backend): query_key_value one column of whole heads.
    Case("gpt_neox-pythia", "gpt_neox", note="untied embed_out"),
    Case("gpt_neox-tied-nobias", "gpt_neox", {"tie_word_embeddings": True, "attention_bias": False, **_ODD}, tps=(1, 2, 8)),
    Case("gpt_neox-12heads", "gpt_neox", {"hidden_size": 96, "num_attention_heads": 12}, tps=(4, 8),
         note="12 heads: 3 whole heads per rank at tp 4; tp 8 does not divide the heads (refused by both)"),
    # GPTBigCode (Transformers backend): multi-query c_attn fused as QKVParallelLinear, the MLP
    # replicated; multi-head attention wholly replicated.
    Case("gpt_bigcode-mqa", "gpt_bigcode", note="StarCoder: one KV head replicated on every rank; tied"),
    Case("gpt_bigcode-mha-untied", "gpt_bigcode", {"multi_query": False, "tie_word_embeddings": False},
         note="no fuser matches: c_attn and c_proj whole on every rank"),
    # MiniCPM3: its own MLA (q_a_proj, kv_a_proj_with_mqa replicated; q_b/kv_b split by head).
    Case("minicpm3-tied", "minicpm3"),
    Case("minicpm3-untied-v16", "minicpm3", {"tie_word_embeddings": False, "v_head_dim": 16, **_ODD}, tps=(1, 2, 8),
         note="v_head_dim 16 != qk_nope_head_dim 8; vocab 100"),
)
