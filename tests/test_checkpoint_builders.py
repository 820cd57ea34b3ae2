"""The tiny checkpoint builders write real, sharded, random bf16 transformers checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (required by the test extra: a missing one fails, never skips)

from functional_load.testing.archs import CORE
from functional_load.testing.checkpoints import (
    ARCHS,
    fuse_experts,
    linear_experts,
    list_tensors,
    read_checkpoint_tensors,
    unfuse_experts,
    write_checkpoint,
)

# MoE architectures of the core table with a per-expert layout on disk (gpt_oss and llama4 exist
# only fused); the group tables' MoE models are built by their parity cases
MOE_ARCHS = [a for a, spec in CORE.items() if spec.moe is not None and spec.moe.per_expert_prefix is not None]
EXPECTED = {
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "mixtral", "qwen3_moe", "deepseek_v3",
    "gpt_oss", "llama4", "llama4_text", "glm4_moe", "gemma2", "gemma3_text", "glm4", "qwen2_5_vl", "gemma3",
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {arch: write_checkpoint(arch, root / arch) for arch in EXPECTED}


@pytest.fixture(scope="module")
def built_fused(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused")
    return {arch: write_checkpoint(arch, root / arch, fused_experts=True) for arch in MOE_ARCHS}


def test_all_architectures_present() -> None:
    """The core table is the families the project started with; the group tables
    (``archs_*.py``) add the others, each key once (the parity cases build those)."""
    assert set(CORE) == EXPECTED
    assert set(CORE) < set(ARCHS)


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
    assert config.get("text_config", config)["vocab_size"] == 1000

    tensors = read_checkpoint_tensors(d)  # also checks index == shards
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, t in tensors.items():
        assert t.dtype == torch.bfloat16, name
        assert not bool((t == 0).all()), f"{name} is all zeros"
        assert t.numel() == 1 or bool((t != t.flatten()[0]).any()), f"{name} is constant"
    embed = {
        "gpt2": "transformer.wte.weight", "llama4": "language_model.model.embed_tokens.weight",
        "gemma3": "language_model.model.embed_tokens.weight",
    }.get(
        arch, "model.embed_tokens.weight"
    )
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


def test_glm4_moe_layout(built: dict[str, Path]) -> None:
    t = list_tensors(built["glm4_moe"])
    assert t["model.layers.0.mlp.gate_proj.weight"][0] == (128, 64)  # first_k_dense_replace=1
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"][0] == (64, 32)
    assert t["model.layers.1.mlp.shared_experts.up_proj.weight"][0] == (32, 64)
    assert t["model.layers.1.mlp.gate.weight"][0] == (8, 64)
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"][0] == (8,)
    assert t["model.layers.0.self_attn.q_proj.bias"][0] == (64,) and "model.layers.0.self_attn.o_proj.bias" not in t
    assert t["model.layers.0.self_attn.k_norm.weight"][0] == (8,)
    assert not any(".layers.2." in n for n in t)  # no MTP layer
    assert json.loads((built["glm4_moe"] / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_gpt_oss_layout(built: dict[str, Path], tmp_path: Path) -> None:
    t = list_tensors(built["gpt_oss"])
    layer = "model.layers.1"
    assert t[f"{layer}.mlp.experts.gate_up_proj"][0] == (8, 64, 256)  # [E, H, 2I]
    assert t[f"{layer}.mlp.experts.gate_up_proj_bias"][0] == (8, 256)
    assert t[f"{layer}.mlp.experts.down_proj"][0] == (8, 128, 64)  # [E, I, H]
    assert t[f"{layer}.mlp.experts.down_proj_bias"][0] == (8, 64)
    assert t[f"{layer}.mlp.router.weight"][0] == (8, 64) and t[f"{layer}.mlp.router.bias"][0] == (8,)
    assert t[f"{layer}.self_attn.sinks"][0] == (8,)
    assert t[f"{layer}.self_attn.o_proj.bias"][0] == (64,)
    gqa = list_tensors(write_checkpoint("gpt_oss", tmp_path / "gqa", kv_heads=4))
    assert gqa[f"{layer}.self_attn.k_proj.weight"][0] == (32, 64) and gqa[f"{layer}.self_attn.k_proj.bias"][0] == (32,)
    config = json.loads((built["gpt_oss"] / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]


def test_llama4_layout(built: dict[str, Path], tmp_path: Path) -> None:
    t = list_tensors(built["llama4"])
    text = list_tensors(built["llama4_text"])
    for name, value in text.items():  # the same text model, under language_model.
        assert t["language_model." + name] == value, name
    assert {n.split(".")[0] for n in t} == {"language_model", "vision_model", "multi_modal_projector"}
    pre = "model.layers"
    assert text[f"{pre}.0.feed_forward.gate_proj.weight"][0] == (128, 64)  # dense: intermediate_size_mlp
    assert text[f"{pre}.1.feed_forward.experts.gate_up_proj"][0] == (8, 64, 64)  # [E, H, 2I]
    assert text[f"{pre}.1.feed_forward.experts.down_proj"][0] == (8, 32, 64)  # [E, I, H]
    assert text[f"{pre}.1.feed_forward.router.weight"][0] == (8, 64)
    assert text[f"{pre}.1.feed_forward.shared_expert.down_proj.weight"][0] == (64, 32)
    assert t["multi_modal_projector.linear_1.weight"][0] == (64, 64)
    # composite config: sizes and overrides go to text_config, top-level keys stay there
    d = write_checkpoint("llama4", tmp_path / "l4", kv_heads=2, num_layers=4, image_token_index=5, tie_word_embeddings=True)
    config = json.loads((d / "config.json").read_text())
    assert config["image_token_index"] == 5 and config["vision_config"]["num_attention_heads"] == 4
    text_config = config["text_config"]
    assert text_config["num_key_value_heads"] == 2 and text_config["moe_layers"] == [1, 3]
    t4 = list_tensors(d)
    assert t4["language_model.model.layers.3.self_attn.k_proj.weight"][0] == (16, 64)
    assert "language_model.lm_head.weight" not in t4


@pytest.mark.parametrize("arch", ["gpt_oss", "llama4_text"])
def test_fused_only_experts(built: dict[str, Path], tmp_path: Path, arch: str) -> None:
    """Experts that exist only fused: fused_experts changes nothing, there is nothing to convert, and
    linear_experts reads them as transformers' own experts module computes them."""
    from transformers import AutoModelForCausalLM

    tensors = read_checkpoint_tensors(built[arch])
    again = read_checkpoint_tensors(write_checkpoint(arch, tmp_path / "fused", fused_experts=True))
    assert set(again) == set(tensors) and all(torch.equal(again[k], tensors[k]) for k in tensors)
    with pytest.raises(ValueError, match="only fused"):
        unfuse_experts(tensors, arch)

    moe = ARCHS[arch].moe
    assert moe is not None
    layer = "model.layers.1"
    w = {k: v.float() for k, v in linear_experts(tensors, layer, moe).items()}
    model = AutoModelForCausalLM.from_pretrained(built[arch], dtype=torch.float32)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    for e in (0, 5):
        gate, up = x @ w["gate"][e].T, x @ w["up"][e].T
        if arch == "gpt_oss":
            experts = model.model.layers[1].mlp.experts
            gate, up = gate + w["gate_bias"][e], up + w["up_bias"][e]
            gate, up = gate.clamp(max=experts.limit), up.clamp(-experts.limit, experts.limit)
            want = ((up + 1) * gate * torch.sigmoid(gate * experts.alpha)) @ w["down"][e].T + w["down_bias"][e]
            got = experts(x, torch.full((3, 1), e), torch.ones(3, 1))
        else:
            experts = model.model.layers[1].feed_forward.experts
            want = (torch.nn.functional.silu(gate) * up) @ w["down"][e].T
            routed = torch.zeros(8 * 3, 64)
            routed[e * 3 : (e + 1) * 3] = x
            got = experts(routed).reshape(8, 3, 64)[e]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


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
    linear_per, linear_fused = linear_experts(per, layer, moe), linear_experts(fused, layer, moe)
    assert set(linear_per) == set(linear_fused) == {"gate", "up", "down"}
    assert all(torch.equal(linear_per[k], linear_fused[k]) for k in linear_per)
    assert torch.equal(linear_fused["up"][5], per[f"{layer}.{moe.per_expert_prefix}.5.{moe.up}.weight"])
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
        write_checkpoint("no_such_family", tmp_path / "x")
    with pytest.raises(ValueError, match="divide"):
        write_checkpoint("llama", tmp_path / "x", kv_heads=3)
    with pytest.raises(ValueError, match="grouped-query"):
        write_checkpoint("gpt2", tmp_path / "x", kv_heads=2)
    with pytest.raises(ValueError, match="MoE"):
        write_checkpoint("llama", tmp_path / "x", fused_experts=True)
