"""What the multimodal group's parity cases cannot show, checked against the checkpoint by hand
(vLLM's own loads of the tiny checkpoints are compared in the parity harness).

* Gemma 4 and Gemma 3n: the k/v projections and k_norm original checkpoints still ship for the
  KV-shared layers are dropped, as vLLM's per-layer mapper drops them; Gemma 4's ``layer_scalar``
  (a persistent buffer vLLM's loader fills) is loaded as stored.
* Llama 4: the language model's q/k rows are permuted to rotary halves, the vision tower's are not.
* Qwen3-VL-MoE: the releases' input-major fused experts reach ``w13`` transposed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import functional_load as fl
from functional_load.testing.checkpoints import read_checkpoint_tensors, write_checkpoint, write_shards

_LAYERS4 = ["sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma3n_text"])
def test_kv_shared_layers_drop_the_k_and_v_a_checkpoint_ships(arch: str, tmp_path: Path) -> None:
    extra = {"layer_types": _LAYERS4, "num_kv_shared_layers": 2}
    if arch == "gemma3n_text":
        extra["activation_sparsity_pattern"] = [0.0] * 4
    model = write_checkpoint(arch, tmp_path / arch, kv_heads=2, num_layers=4, **extra)
    tensors = read_checkpoint_tensors(model)
    shipped = {f"model.layers.{i}.self_attn.{p}.weight" for i in (2, 3) for p in ("k_proj", "v_proj", "k_norm")}
    for name in shipped:  # an original release's leftovers (transformers 5 writes none)
        tensors[name] = tensors[name.replace(".layers.2.", ".layers.0.").replace(".layers.3.", ".layers.1.")].clone()
    write_shards(model, tensors, "100KB")
    state = fl.load(model, tp_size=2, rank=1)
    dropped = dict(state.plan.dropped)
    assert {n for n in dropped if ".self_attn." in n} == shipped
    assert "model.layers.2.self_attn.q_proj.weight" in state and "model.layers.1.self_attn.qkv_proj.weight" in state
    if arch == "gemma4_text":  # a persistent buffer vLLM's loader fills: loaded, replicated
        assert torch.equal(state["model.layers.0.layer_scalar"], tensors["model.layers.0.layer_scalar"])


def test_llama4_permutes_the_language_model_q_k_rows_only(tmp_path: Path) -> None:
    model = write_checkpoint("llama4", tmp_path / "llama4", kv_heads=2)
    stored = read_checkpoint_tensors(model)
    state = fl.load(model, tp_size=1, rank=0)
    vision = state["vision_model.model.layers.0.self_attn.qkv_proj.weight"]
    q = stored["vision_model.model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(vision[: q.shape[0]], q)  # as stored
    text = state["language_model.model.layers.0.self_attn.qkv_proj.weight"]
    q = stored["language_model.model.layers.0.self_attn.q_proj.weight"]
    halves = torch.cat([torch.cat([h[0::2], h[1::2]]) for h in q.split(8)])  # head_dim 8: evens, then odds
    assert torch.equal(text[: q.shape[0]], halves)


def test_qwen3_vl_moe_input_major_experts_reach_w13_transposed(tmp_path: Path) -> None:
    model = write_checkpoint("qwen3_vl_moe", tmp_path / "q", kv_heads=2, fused_experts=True, moe_intermediate_size=24)
    tensors = read_checkpoint_tensors(model)
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert tuple(tensors[name].shape) == (8, 48, 64)  # transformers 5 saves it output-major
    release = {n: t.transpose(-1, -2).contiguous() if n.endswith(("experts.gate_up_proj", "experts.down_proj")) else t
               for n, t in tensors.items()}
    write_shards(model, release, "100KB")
    for rank in (0, 1):
        w13 = fl.load(model, tp_size=2, rank=rank)["language_model.model.layers.0.mlp.experts.routed_experts.w13_weight"]
        gate, up = tensors[name][:, :24], tensors[name][:, 24:]
        rows = slice(rank * 12, (rank + 1) * 12)
        assert torch.equal(w13, torch.cat([gate[:, rows], up[:, rows]], dim=1))
