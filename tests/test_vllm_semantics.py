"""Focused tests of the vLLM behaviours the parity harness found (issue: parity with real vLLM).

Each was a difference between functional_load and vLLM 0.32 on CPU; test_parity.py proves them
against real vLLM, these pin them without it. (Round-robin fallback: test_moe.py; the
quantization differences, KV-cache parameters, scale dtypes and ``weight_shape``: test_quant.py.)
"""

from __future__ import annotations

import torch
from helpers import assert_same_bits

import functional_load as fl
from functional_load.testing.checkpoints import read_checkpoint_tensors
from functional_load.vllm_target import VLLM_VERSION


def test_expert_parameters_have_the_target_release_names(tiny_checkpoint) -> None:
    """vLLM 0.32 names fused experts ``<moe>.experts.routed_experts.w13_weight`` / ``w2_weight``."""
    assert VLLM_VERSION == "0.32.0"
    for arch, moe in (("qwen3_moe", "mlp"), ("mixtral", "block_sparse_moe"), ("deepseek_v3", "mlp")):
        state = fl.load(tiny_checkpoint(arch), tp_size=2, rank=1, progress=False)
        assert f"model.layers.1.{moe}.experts.routed_experts.w13_weight" in state, arch
        assert f"model.layers.1.{moe}.experts.routed_experts.w2_weight" in state, arch
        assert not [n for n in state if ".experts.w" in n], arch


def test_deepseek_without_q_lora_rank(tiny_checkpoint) -> None:
    """DeepSeek-V2-Lite style (``q_lora_rank: null``): ``q_proj`` is column-parallel by heads and
    ``kv_a_proj_with_mqa`` replicated; vLLM stacks no q/k/v into a qkv_proj."""
    path = tiny_checkpoint("deepseek_v3", q_lora_rank=None)
    checkpoint = read_checkpoint_tensors(path)
    heads, qk_head = 8, 16  # 8 heads of qk_nope 8 + qk_rope 8
    for tp in (1, 2, 4):
        states = [fl.load(path, tp_size=tp, rank=r, progress=False) for r in range(tp)]
        for layer in (0, 1):
            q = [s[f"model.layers.{layer}.self_attn.q_proj.weight"] for s in states]
            assert all(t.shape == (heads // tp * qk_head, 64) for t in q)
            assert_same_bits(torch.cat(q), checkpoint[f"model.layers.{layer}.self_attn.q_proj.weight"], f"tp {tp} q_proj")
            for s in states:
                assert_same_bits(
                    s[f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"],
                    checkpoint[f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"],
                    f"tp {tp} kv_a_proj_with_mqa",
                )
                assert not [n for n in s if "qkv_proj" in n or "q_a_proj" in n]


def test_a_vocabulary_shard_of_only_padding_is_zeros(tiny_checkpoint) -> None:
    """vocab 100 pads to 128; at tp 8 rank 6 holds 4 real rows and 12 padding, rank 7 only padding."""
    path = tiny_checkpoint("llama", kv_heads=2, vocab_size=100, intermediate_size=96)
    embed = read_checkpoint_tensors(path)["model.embed_tokens.weight"]
    for rank, real in ((6, 4), (7, 0)):
        state = fl.load(path, tp_size=8, rank=rank, progress=False)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            shard = state[name]
            assert shard.shape == (16, 64), name
            assert torch.equal(shard[real:], torch.zeros_like(shard[real:])), f"rank {rank} {name} padding"
        assert_same_bits(state["model.embed_tokens.weight"][:real], embed[96 : 96 + real], f"rank {rank} rows")
    assert fl.plan(path, tp_size=8, rank=7).param("model.embed_tokens.weight").copies == ()


def test_more_ranks_than_experts_without_expert_parallelism(tiny_checkpoint) -> None:
    """4 experts at tp 8 without EP: vLLM loads every expert on every rank, sliced by tp."""
    path = tiny_checkpoint("mixtral", kv_heads=2, num_local_experts=4)
    state = fl.load(path, tp_size=8, rank=5, progress=False)
    assert state["model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"].shape == (4, 8, 64)
    assert state["model.layers.0.block_sparse_moe.experts.routed_experts.w2_weight"].shape == (4, 64, 4)
