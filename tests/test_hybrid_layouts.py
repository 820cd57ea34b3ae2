"""The hybrid group's layouts against the checkpoint itself, without vLLM (the parity cases hold
them against vLLM 0.32): what a rank of Qwen3.5, Qwen3-Next, Mamba-1 and Mamba-2 holds, rebuilt
from the full tensors as vLLM's loaders compute it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (required by the test extra: a missing one fails, never skips)

import functional_load as fl
from functional_load.testing.checkpoints import read_checkpoint_tensors, write_checkpoint


def _rows(t: torch.Tensor, sizes: list[int], tp: int, rank: int, replicate: tuple[bool, ...] = ()) -> torch.Tensor:
    """Each section's share of ``rank`` (a replicated section whole), back to back."""
    parts, start = [], 0
    for i, size in enumerate(sizes):
        section = t[start : start + size]
        parts.append(section if (replicate and replicate[i]) else section.chunk(tp)[rank])
        start += size
    return torch.cat(parts)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    return {
        "qwen3_5": write_checkpoint("qwen3_5", root / "qwen3_5", kv_heads=2),
        "qwen3_next": write_checkpoint("qwen3_next", root / "qwen3_next", kv_heads=2),
        "mamba": write_checkpoint("mamba", root / "mamba"),
        "mamba2": write_checkpoint("mamba2", root / "mamba2", n_groups=1),
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_qwen3_5_gdn_projections(built: dict[str, Path], tp: int) -> None:
    ck = read_checkpoint_tensors(built["qwen3_5"])
    p = "model.layers.0.linear_attn."
    key, value, heads = 32, 64, 8
    for rank in range(tp):
        state = fl.load(built["qwen3_5"], tp_size=tp, rank=rank)
        qkvz = torch.cat([_rows(ck[p + "in_proj_qkv.weight"], [key, key, value], tp, rank), ck[p + "in_proj_z.weight"].chunk(tp)[rank]])
        assert torch.equal(state[p + "in_proj_qkvz.weight"], qkvz)
        ba = torch.cat([ck[p + "in_proj_b.weight"].chunk(tp)[rank], ck[p + "in_proj_a.weight"].chunk(tp)[rank]])
        assert torch.equal(state[p + "in_proj_ba.weight"], ba)
        assert torch.equal(state[p + "conv1d.weight"], _rows(ck[p + "conv1d.weight"], [key, key, value], tp, rank))
        assert state[p + "A_log"].dtype == torch.float32  # stored bf16, copied as is into vLLM's float32
        assert torch.equal(state[p + "A_log"], ck[p + "A_log"].float().chunk(tp)[rank])
        assert state[p + "dt_bias"].shape == (heads // tp,)
        # full attention: q_proj holds [query; gate] per head, split with its heads
        q = ck["model.layers.1.self_attn.q_proj.weight"]
        assert torch.equal(state["model.layers.1.self_attn.qkv_proj.weight"][: q.shape[0] // tp], q.chunk(tp)[rank])


def test_qwen3_next_fused_projections_split_as_stored(built: dict[str, Path]) -> None:
    ck = read_checkpoint_tensors(built["qwen3_next"])
    p = "model.layers.0.linear_attn."
    state = fl.load(built["qwen3_next"], tp_size=4, rank=3)
    assert torch.equal(state[p + "in_proj_qkvz.weight"], ck[p + "in_proj_qkvz.weight"].chunk(4)[3])
    assert torch.equal(state[p + "in_proj_ba.weight"], ck[p + "in_proj_ba.weight"].chunk(4)[3])
    assert "lm_head.weight" in state and "model.layers.0.mlp.shared_expert_gate.weight" in state


@pytest.mark.parametrize("tp", [1, 2])
def test_mamba_a_is_minus_exp_of_a_log(built: dict[str, Path], tp: int) -> None:
    ck = read_checkpoint_tensors(built["mamba"])
    p = "backbone.layers.1.mixer."
    for rank in range(tp):
        state = fl.load(built["mamba"], tp_size=tp, rank=rank)
        a = state[p + "A"]
        assert a.dtype == torch.float32
        assert torch.equal(a, (-torch.exp(ck[p + "A_log"].float())).chunk(tp)[rank])
        assert torch.equal(state[p + "in_proj.weight"], _rows(ck[p + "in_proj.weight"], [128, 128], tp, rank))
        assert state["lm_head.weight"] is state["backbone.embeddings.weight"]  # tied


def test_mamba2_single_group_b_c_whole_on_every_rank(built: dict[str, Path]) -> None:
    ck = read_checkpoint_tensors(built["mamba2"])
    p = "backbone.layers.0.mixer."
    sizes, replicate = [128, 128, 16, 16, 8], (False, False, True, True, False)
    for rank in range(4):
        state = fl.load(built["mamba2"], tp_size=4, rank=rank)
        assert torch.equal(state[p + "in_proj.weight"], _rows(ck[p + "in_proj.weight"], sizes, 4, rank, replicate))
        assert torch.equal(state[p + "conv1d.bias"], _rows(ck[p + "conv1d.bias"], [128, 16, 16], 4, rank, replicate[1:4]))
        assert torch.equal(state[p + "A"], (-torch.exp(ck[p + "A_log"].float())).chunk(4)[rank])
