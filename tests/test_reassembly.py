"""Every rank's tensors, put back together with vLLM's layout rules written out here
independently of the planner, equal the checkpoint tensors bit for bit.

Tiny models: 8 attention heads of head_dim 8, hidden 64, intermediate 128, vocab 1000
(padded to 1024), bf16, several shards. KV heads 8 (MHA), 2 (GQA) and 1 (MQA).
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import assert_same_bits, unreplicate

import functional_load as fl
from functional_load.testing.checkpoints import read_checkpoint_tensors

HEADS, HEAD_DIM, VOCAB, PADDED_VOCAB = 8, 8, 1000, 1024

CASES = [
    ("llama", 8), ("llama", 2), ("llama", 1),
    ("mistral", 2),
    ("qwen2", 2), ("qwen2", 1),
    ("qwen3", 2),
    ("phi3", 8), ("phi3", 2), ("phi3", 1),
    ("gpt2", 8),
    ("gemma2", 8), ("gemma2", 2),
    ("gemma3_text", 2), ("gemma3_text", 1),
    ("glm4", 2), ("glm4", 1),
]
FUSED_QKV = {"phi3"}  # q/k/v stored as one qkv_proj tensor
FUSED_GATE_UP = {"phi3", "glm4"}  # gate/up stored as one gate_up_proj tensor


def unshard_qkv(ranks: list[torch.Tensor], kv_heads: int, tp: int, what: str):
    q_rows = HEADS // tp * HEAD_DIM
    kv_rows = max(kv_heads // tp, 1) * HEAD_DIM
    assert all(r.shape[0] == q_rows + 2 * kv_rows for r in ranks)
    q = torch.cat([r[:q_rows] for r in ranks])
    k = unreplicate([r[q_rows : q_rows + kv_rows] for r in ranks], kv_heads, tp, what + " k")
    v = unreplicate([r[q_rows + kv_rows :] for r in ranks], kv_heads, tp, what + " v")
    return q, k, v


def unshard_vocab(ranks: list[torch.Tensor], tp: int, what: str) -> torch.Tensor:
    full = torch.cat(ranks)
    assert full.shape[0] == PADDED_VOCAB, what
    assert torch.count_nonzero(full[VOCAB:].float()) == 0, f"{what}: padding rows are not zero"
    return full[:VOCAB]


def reassemble(arch: str, kv_heads: int, tp: int, states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor rebuilt from the rank states."""
    out: dict[str, torch.Tensor] = {}
    names = states[0].keys()
    for name in names:
        ranks = [s[name] for s in states]
        if name == "lm_head.weight" and all(s[name] is s.get("model.embed_tokens.weight") for s in states):
            continue  # tied: the same tensor as model.embed_tokens.weight, not saved
        if arch == "gpt2":
            rebuild_gpt2(name, ranks, tp, out)
        elif name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            q, k, v = unshard_qkv(ranks, kv_heads, tp, name)
            if arch in FUSED_QKV:
                out[name] = torch.cat([q, k, v])
            else:
                for part, tensor in zip("qkv", (q, k, v)):
                    out[name.replace("qkv_proj", f"{part}_proj")] = tensor
        elif name.endswith("gate_up_proj.weight"):
            half = ranks[0].shape[0] // 2
            gate = torch.cat([r[:half] for r in ranks])
            up = torch.cat([r[half:] for r in ranks])
            if arch in FUSED_GATE_UP:
                out[name] = torch.cat([gate, up])
            else:
                out[name.replace("gate_up_proj", "gate_proj")] = gate
                out[name.replace("gate_up_proj", "up_proj")] = up
        elif re.search(r"(o_proj|down_proj)\.weight$", name):
            out[name] = torch.cat(ranks, dim=1)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = unshard_vocab(ranks, tp, name)
        else:  # replicated
            for r, t in enumerate(ranks):
                assert_same_bits(t, ranks[0], f"replicated {name} on rank {r}")
            out[name] = ranks[0]
    return out


def rebuild_gpt2(name: str, ranks: list[torch.Tensor], tp: int, out: dict[str, torch.Tensor]) -> None:
    """GPT-2 Conv1D weights are stored [in, out]; the loader holds them as [out, in]."""
    if name == "lm_head.weight":
        return  # tied: the same tensor as transformer.wte.weight
    if ".attn.c_attn." in name:
        full = torch.cat(unshard_qkv(ranks, HEADS, tp, name))
    elif ".mlp.c_fc." in name:
        full = torch.cat(ranks)
    elif re.search(r"\.c_proj\.weight$", name):
        full = torch.cat(ranks, dim=1)
    elif name == "transformer.wte.weight":
        full = unshard_vocab(ranks, tp, name)
    else:  # layer norms, wpe, row-parallel biases: replicated
        for r, t in enumerate(ranks):
            assert_same_bits(t, ranks[0], f"replicated {name} on rank {r}")
        full = ranks[0]
    out[name] = full.T if name.endswith(".weight") and full.dim() == 2 and "transformer.w" not in name else full


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("arch,kv_heads", CASES)
def test_ranks_reassemble_to_the_checkpoint(tiny_checkpoint, arch, kv_heads, tp):
    path = tiny_checkpoint(arch, kv_heads=kv_heads)
    checkpoint = read_checkpoint_tensors(path)
    states = [fl.load(path, tp_size=tp, rank=r) for r in range(tp)]

    rebuilt = reassemble(arch, kv_heads, tp, states)

    assert sorted(rebuilt) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert_same_bits(rebuilt[name], tensor, name)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text", "glm4"])
def test_tied_embeddings_are_one_tensor(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch, kv_heads=8, tie_word_embeddings=True)
    embed = "transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"
    for rank in range(2):
        state = fl.load(path, tp_size=2, rank=rank)
        assert state["lm_head.weight"] is state[embed]


def test_rank_shapes_follow_vllm(tiny_checkpoint):
    """GQA kv=2 at tp=8: each rank has 1 q head and 1 (replicated) kv head -> 3 * 8 rows."""
    state = fl.load(tiny_checkpoint("llama", kv_heads=2), tp_size=8, rank=5)
    assert state["model.layers.0.self_attn.qkv_proj.weight"].shape == (24, 64)
    assert state["model.layers.0.self_attn.o_proj.weight"].shape == (64, 8)
    assert state["model.layers.0.mlp.gate_up_proj.weight"].shape == (32, 64)
    assert state["model.layers.0.mlp.down_proj.weight"].shape == (64, 16)
    assert state["model.embed_tokens.weight"].shape == (128, 64)
    assert state["model.norm.weight"].shape == (64,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dtype_casts_every_float_parameter(tiny_checkpoint, dtype):
    path = tiny_checkpoint("llama", kv_heads=2)
    checkpoint = read_checkpoint_tensors(path)
    state = fl.load(path, tp_size=1, dtype=dtype)
    assert {t.dtype for t in state.values()} == {dtype}
    q = state["model.layers.1.self_attn.qkv_proj.weight"][:64]
    assert torch.equal(q, checkpoint["model.layers.1.self_attn.q_proj.weight"].to(dtype))


def test_default_dtype_is_the_configs(tiny_checkpoint):
    state = fl.load(tiny_checkpoint("llama", kv_heads=2), tp_size=2, rank=1)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def test_gemma2_has_no_lm_head(tiny_checkpoint):
    """vLLM's Gemma 2 computes the logits with embed_tokens and has no lm_head parameter; a
    checkpoint that stores lm_head.weight is refused, as vLLM refuses it."""
    for rank in range(2):
        assert "lm_head.weight" not in fl.load(tiny_checkpoint("gemma2", kv_heads=2), tp_size=2, rank=rank)
    with pytest.raises(fl.PlanError, match=r"checkpoint tensor 'lm_head.weight' in .*\.safetensors has no destination in gemma2"):
        fl.plan(tiny_checkpoint("gemma2", kv_heads=2, tie_word_embeddings=False), tp_size=2, rank=0)
