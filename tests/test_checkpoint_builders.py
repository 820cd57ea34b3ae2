"""The tiny checkpoint builders write real, sharded, random bf16 transformers checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from functional_load.testing.checkpoints import (  # noqa: E402
    ARCHS,
    fuse_experts,
    list_tensors,
    read_checkpoint_tensors,
    unfuse_experts,
    write_checkpoint,
)

MOE_ARCHS = [a for a, spec in ARCHS.items() if spec.moe is not None]
EXPECTED = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "mixtral", "qwen3_moe", "deepseek_v3"}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {arch: write_checkpoint(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def built_fused(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused")
    return {arch: write_checkpoint(arch, root / arch, fused_experts=True) for arch in MOE_ARCHS}


def test_all_architectures_present() -> None:
    assert set(ARCHS) == EXPECTED


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_sharded_bf16_checkpoint(built: dict[str, Path], arch: str) -> None:
    d = built[arch]
    shards = sorted(d.glob("*.safetensors"))
    assert len(shards) > 1
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [p.name for p in shards]

    config = json.loads((d / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert config["model_type"] == arch
    assert config["vocab_size"] == 1000

    tensors = read_checkpoint_tensors(d)  # also checks index == shards
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, t in tensors.items():
        assert t.dtype == torch.bfloat16, name
        assert not bool((t == 0).all()), f"{name} is all zeros"
        assert t.numel() == 1 or bool((t != t.flatten()[0]).any()), f"{name} is constant"
    embed = "transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"
    assert tuple(tensors[embed].shape) == (1000, 64)


def test_layer_shapes_gqa_and_fused_dense(tmp_path: Path) -> None:
    llama = list_tensors(write_checkpoint("llama", tmp_path / "llama", kv_heads=1))
    assert llama["model.layers.0.self_attn.q_proj.weight"] == ((64, 64), "BF16")
    assert llama["model.layers.0.self_attn.k_proj.weight"] == ((8, 64), "BF16")
    assert llama["model.layers.1.mlp.down_proj.weight"] == ((64, 128), "BF16")
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["num_key_value_heads"] == 1

    phi3 = list_tensors(write_checkpoint("phi3", tmp_path / "phi3", kv_heads=2))
    assert phi3["model.layers.0.self_attn.qkv_proj.weight"][0] == (64 + 2 * 16, 64)
    assert phi3["model.layers.0.mlp.gate_up_proj.weight"][0] == (256, 64)

    qwen2 = list_tensors(write_checkpoint("qwen2", tmp_path / "qwen2", kv_heads=2))
    assert qwen2["model.layers.0.self_attn.k_proj.bias"][0] == (16,)


def test_tied_embeddings(built: dict[str, Path], tmp_path: Path) -> None:
    gpt2 = list_tensors(built["gpt2"])
    assert "lm_head.weight" not in gpt2
    assert gpt2["transformer.h.0.attn.c_attn.weight"][0] == (64, 192)  # Conv1D: [in, out]
    assert "lm_head.weight" in list_tensors(built["llama"])
    tied = write_checkpoint("llama", tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in list_tensors(tied)
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"] is True


def test_deterministic_in_seed(built: dict[str, Path], tmp_path: Path) -> None:
    ref = read_checkpoint_tensors(built["qwen2"])
    again = read_checkpoint_tensors(write_checkpoint("qwen2", tmp_path / "again"))
    other = read_checkpoint_tensors(write_checkpoint("qwen2", tmp_path / "other", seed=1))
    assert all(torch.equal(ref[k], again[k]) for k in ref)
    assert not torch.equal(ref["model.layers.0.self_attn.q_proj.bias"], other["model.layers.0.self_attn.q_proj.bias"])


def test_other_dtype(tmp_path: Path) -> None:
    d = write_checkpoint("llama", tmp_path / "f32", dtype="float32", max_shard_size="200KB")
    assert json.loads((d / "config.json").read_text())["dtype"] == "float32"
    assert {code for _, code in list_tensors(d).values()} == {"F32"}
    assert len(list(d.glob("*.safetensors"))) > 1


def test_deepseek_layout(built: dict[str, Path]) -> None:
    t = list_tensors(built["deepseek_v3"])
    assert t["model.layers.0.mlp.gate_proj.weight"][0] == (128, 64)  # first_k_dense_replace=1
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" not in t
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"][0] == (64, 32)
    assert t["model.layers.1.mlp.shared_experts.gate_proj.weight"][0] == (32, 64)
    assert t["model.layers.1.self_attn.q_a_proj.weight"][0] == (32, 64)
    assert t["model.layers.1.self_attn.q_b_proj.weight"][0] == (128, 32)
    assert t["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"][0] == (40, 64)
    assert t["model.layers.1.self_attn.kv_b_proj.weight"][0] == (128, 32)
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"][0] == (8,)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fused_experts(built: dict[str, Path], built_fused: dict[str, Path], arch: str) -> None:
    per = read_checkpoint_tensors(built[arch])
    fused = read_checkpoint_tensors(built_fused[arch])
    assert len(list(built_fused[arch].glob("*.safetensors"))) > 1
    moe = ARCHS[arch].moe
    layer = "model.layers.1"
    gate_up = fused[f"{layer}.mlp.experts.gate_up_proj"]
    down = fused[f"{layer}.mlp.experts.down_proj"]
    assert tuple(gate_up.shape) == (8, 64, 64) and tuple(down.shape) == (8, 64, 32)
    for e in (0, 5):
        pre = f"{layer}.{moe.per_expert_prefix}.{e}"
        assert torch.equal(gate_up[e, :32], per[f"{pre}.{moe.gate}.weight"])  # gate rows first
        assert torch.equal(gate_up[e, 32:], per[f"{pre}.{moe.up}.weight"])
        assert torch.equal(down[e], per[f"{pre}.{moe.down}.weight"])
    assert not any(".experts.0." in n for n in fused)
    # conversions are exact inverses
    back = unfuse_experts(fused, arch)
    assert set(back) == set(per) and all(torch.equal(back[k], per[k]) for k in per)
    again = fuse_experts(per, arch)
    assert set(again) == set(fused) and all(torch.equal(again[k], fused[k]) for k in fused)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fused_layout_matches_transformers(built: dict[str, Path], built_fused: dict[str, Path], arch: str) -> None:
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(built[arch]).state_dict()  # local directory
    fused = read_checkpoint_tensors(built_fused[arch])
    assert set(fused) == set(state)
    assert all(torch.equal(fused[k], state[k]) for k in fused)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        write_checkpoint("bloom", tmp_path / "x")
    with pytest.raises(ValueError, match="divide"):
        write_checkpoint("llama", tmp_path / "x", kv_heads=3)
    with pytest.raises(ValueError, match="grouped-query"):
        write_checkpoint("gpt2", tmp_path / "x", kv_heads=2)
    with pytest.raises(ValueError, match="MoE"):
        write_checkpoint("llama", tmp_path / "x", fused_experts=True)
