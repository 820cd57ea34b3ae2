"""Parity cases of the ``hybrid`` group (see :mod:`functional_load.testing.archs_hybrid`):
linear-attention (gated delta-net) and state-space families, layer 0 linear, layer 1 full
attention unless noted; MoE cases without and with expert parallelism, both placements."""

from __future__ import annotations

from functional_load.testing.archs_hybrid import ZAMBA2_LAYERS
from functional_load.testing.parity.case import MOE, Case

__all__ = ["CASES"]

_VL = True  # vLLM's qwen3_5.py imports the Qwen3-VL processor, which needs torchvision (env.ensure_torchvision)

CASES: tuple[Case, ...] = (
    # Qwen3.5 (2026): GDN projections stored apart, stacked into in_proj_qkvz (in_proj_qkv with the
    # tuple shard id (0, 1, 2)) and in_proj_ba; full attention with the output gate.
    Case("qwen3_5-gqa", "qwen3_5", {"kv_heads": 2}, multimodal=_VL,
         note="tp 8: 4 key heads of 8 rows split in halves, as vLLM does (it checks rows, not heads)"),
    Case("qwen3_5-mqa-tied", "qwen3_5", {"kv_heads": 1, "tie_word_embeddings": True}, tps=(1, 2, 4), multimodal=_VL),
    Case("qwen3_5-heads4", "qwen3_5", {"kv_heads": 2, "num_attention_heads": 4, "head_dim": 16}, tps=(4, 8), multimodal=_VL,
         note="4 heads: the gated q part (8 units) divides over 8 ranks, vLLM's heads % tp assertion refuses"),
    Case("qwen3_5-language_model", "qwen3_5_language_model", {"kv_heads": 2}, tps=(1, 2), multimodal=_VL,
         note="model.language_model.* names (text-only cuts of the multimodal release)"),
    Case("qwen3_5_moe", "qwen3_5_moe", {"kv_heads": 2}, options=MOE, multimodal=_VL),
    Case("qwen3_5_moe-fused", "qwen3_5_moe", {"kv_heads": 2, "fused_experts": True}, tps=(1, 2), options=MOE,
         multimodal=_VL, note="3-D expert tensors"),
    # Qwen3-Next: in_proj_qkvz / in_proj_ba fused on disk per key-head group, one row block per rank.
    Case("qwen3_next", "qwen3_next", {"kv_heads": 2}, options=MOE),
    Case("qwen3_next-sparse2", "qwen3_next", {"kv_heads": 2, "decoder_sparse_step": 2}, tps=(1, 2), options=MOE[:2],
         note="decoder_sparse_step 2: layer 0 (linear attention) dense, layer 1 sparse"),
    # State-space models: Mamba-1 (A = -exp(A_log) as vLLM's loader computes it), Mamba-2 with 8
    # groups (every in_proj/conv1d section split), 1 group (B/C whole on every rank), 2 groups.
    Case("mamba-tied", "mamba"),
    Case("mamba-untied", "mamba", {"tie_word_embeddings": False}, tps=(1, 2)),
    Case("falcon_mamba", "falcon_mamba"),
    Case("mamba2-groups8", "mamba2"),
    Case("mamba2-groups1-tied", "mamba2", {"n_groups": 1, "tie_word_embeddings": True}),
    Case("mamba2-groups2", "mamba2", {"n_groups": 2}, tps=(2, 4), note="2 groups over 4 ranks: refused by both"),
    Case("jamba", "jamba", {"kv_heads": 2, "num_layers": 4}, options=MOE,
         note="Mamba-1 + MoE, attention + MLP, Mamba-1 + MLP, attention + MoE"),
    # Mamba-2 inside hybrids (1 group, as the releases): Falcon-H1 (attention and mixer on every
    # layer), Granite 4.0 hybrid (Mamba-2 / attention layers, GraniteMoe experts and a shared MLP).
    Case("falcon_h1-gqa", "falcon_h1", {"kv_heads": 2}),
    Case("falcon_h1-groups2-tied", "falcon_h1", {"kv_heads": 2, "mamba_n_groups": 2, "tie_word_embeddings": True}, tps=(1, 2, 4),
         note="2 groups: split at tp 2, refused by both at tp 4"),
    Case("granitemoehybrid", "granite_moe_hybrid", {"kv_heads": 2}, options=MOE,
         note="the releases' layer_types names (mamba, attention)"),
    # LFM2: short convolution (conv.* -> short_conv.*) and attention layers; lm_head always tied.
    Case("lfm2-gqa", "lfm2", {"kv_heads": 2}, note="MLP width auto-adjusted: int(2 * 144 / 3) rounded to 32 = 96"),
    Case("lfm2-untied", "lfm2", {"kv_heads": 2, "tie_word_embeddings": False}, tps=(1, 2)),
    Case("lfm2_moe", "lfm2_moe", {"kv_heads": 2, "tie_word_embeddings": True}, options=MOE,
         note="layer 0 dense, layer 1 MoE with a float32 expert bias"),
    Case("lfm2_moe-fused-untied", "lfm2_moe", {"kv_heads": 2, "fused_experts": True}, tps=(1,),
         we_refuse="3-D experts.gate_up_proj / down_proj: vLLM 0.32 (FusedMoE with ckpt_names w1/w2/w3) matches neither "
         "and leaves w13_weight and w2_weight unwritten without an error"),
    # Zamba2: Mamba-2 layers and hybrid layers running shared transformer blocks with LoRA adapters.
    Case("zamba2-2blocks", "zamba2", {**ZAMBA2_LAYERS, "num_mem_blocks": 2}, note="hybrid layers 1 and 3, one block each"),
    Case("zamba2-1block", "zamba2", {**ZAMBA2_LAYERS, "num_mem_blocks": 1}, tps=(1, 2),
         note="both hybrid layers run block 0, named after layer 1, which holds both layers' adapters"),
)
