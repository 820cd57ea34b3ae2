"""Multimodal models (Qwen2.5-VL, Gemma 3): the language model under ``language_model.``, the
vision tower and projector with vLLM's sharding, and ``text_only=True``.

Every rank's tensors, put back together with vLLM's layout rules written out here (independently
of the planner), equal the checkpoint's; the parity harness compares the same ranks with real
vLLM (cases ``qwen2_5_vl*`` and ``gemma3-mm*``). Tiny towers: 2 layers, hidden 32, 4 heads of
head_dim 8, intermediate 64.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import assert_same_bits, assert_same_state, unreplicate

import functional_load as fl
from functional_load.errors import ConfigError, PlanError, ShardingError
from functional_load.layout.build import TEXT_ONLY_REASON
from functional_load.model.expressions import Scope, evaluate
from functional_load.model.spec import load_spec
from functional_load.testing.checkpoints import read_checkpoint_tensors, write_checkpoint, write_shards
from functional_load.testing.multimodal import rename_checkpoint

HEAD_DIM, VOCAB = 8, 1000
TEXT = {"qwen2_5_vl": ("model.", "lm_head."), "gemma3": ("language_model.model.", "language_model.lm_head.")}
VISION = ("visual.", "vision_tower.", "multi_modal_projector.")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multimodal")
    return {arch: write_checkpoint(arch, root / arch, kv_heads=2) for arch in TEXT}


def checkpoint_name(arch: str, name: str) -> str:
    """vLLM's parameter name -> the released checkpoint's tensor name."""
    if arch == "qwen2_5_vl":
        return re.sub(r"^language_model\.(model\.|lm_head\.)", r"\1", name)
    return name


def split_qkv(ranks: list[torch.Tensor], heads: int, kv_heads: int, tp: int, what: str) -> tuple[torch.Tensor, ...]:
    """Each rank holds [q_r; k_r; v_r] (KV heads replicated when tp exceeds them)."""
    q_rows, kv_rows = heads // tp * HEAD_DIM, max(kv_heads // tp, 1) * HEAD_DIM
    assert all(r.shape[0] == q_rows + 2 * kv_rows for r in ranks), what
    q = torch.cat([r[:q_rows] for r in ranks])
    k = unreplicate([r[q_rows : q_rows + kv_rows] for r in ranks], kv_heads, tp, what + " k")
    v = unreplicate([r[q_rows + kv_rows :] for r in ranks], kv_heads, tp, what + " v")
    return q, k, v


def reassemble(arch: str, tp: int, states: list[fl.LoadedState]) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor, rebuilt from every rank with vLLM's layout rules."""
    out: dict[str, torch.Tensor] = {}
    for name in states[0]:
        ranks = [s[name] for s in states]
        ckpt = checkpoint_name(arch, name)
        if name.endswith("lm_head.weight") and ranks[0] is states[0].get(name.replace("lm_head", "model.embed_tokens")):
            continue  # tied: not in the checkpoint
        if re.search(r"(qkv_proj|attn\.qkv)\.(weight|bias)$", name):
            vision = name.startswith(VISION)
            heads, kv_heads = (4, 4) if vision else (8, 2)
            q, k, v = split_qkv(ranks, heads, kv_heads, tp, name)
            if ".attn.qkv." in name:  # Qwen2.5-VL's tower stores q, k, v fused
                out[ckpt] = torch.cat([q, k, v])
            else:
                for part, tensor in zip("qkv", (q, k, v)):
                    out[ckpt.replace("qkv_proj", f"{part}_proj")] = tensor
        elif "gate_up_proj." in name:
            half = ranks[0].shape[0] // 2
            out[ckpt.replace("gate_up_proj", "gate_proj")] = torch.cat([r[:half] for r in ranks])
            out[ckpt.replace("gate_up_proj", "up_proj")] = torch.cat([r[half:] for r in ranks])
        elif re.search(r"(o_proj|down_proj|attn\.proj|out_proj|fc2|merger\.mlp\.2)\.weight$", name):
            out[ckpt] = torch.cat(ranks, dim=1)  # row parallel: input columns split
        elif re.search(r"(fc1|merger\.mlp\.0)\.(weight|bias)$", name):
            out[ckpt] = torch.cat(ranks)  # column parallel: output rows split
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            full = torch.cat(ranks)
            assert full.shape[0] == 1024 and not full[VOCAB:].any(), f"{name}: vocabulary padding"
            out[ckpt] = full[:VOCAB]
        else:  # replicated: norms, row biases, patch/position embeddings, the Gemma 3 projector
            for r, tensor in enumerate(ranks):
                assert_same_bits(tensor, ranks[0], f"{name} rank {r}")
            out[ckpt] = ranks[0]
    return out


@pytest.mark.parametrize("arch", sorted(TEXT))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_ranks_reassemble_to_the_checkpoint(built: dict[str, Path], arch: str, tp: int) -> None:
    states = [fl.load(built[arch], tp_size=tp, rank=r, progress=False) for r in range(tp)]
    assert_same_state(reassemble(arch, tp, states), read_checkpoint_tensors(built[arch]), f"{arch} tp={tp}")


def test_vision_shapes_as_vllm_shards_them(built: dict[str, Path]) -> None:
    qwen = fl.layout(built["qwen2_5_vl"], tp_size=4, rank=1).params
    assert qwen["visual.blocks.1.attn.qkv.weight"].local_shape == (3 * 8, 32)  # one of 4 heads, q k v
    assert qwen["visual.blocks.1.mlp.gate_up_proj.weight"].local_shape == (2 * 16, 32)
    assert qwen["visual.blocks.1.attn.proj.weight"].local_shape == (32, 8)
    assert qwen["visual.merger.mlp.0.weight"].local_shape == (32, 128)
    assert qwen["visual.merger.mlp.2.weight"].local_shape == (64, 32)
    assert qwen["visual.patch_embed.proj.weight"].local_shape == (32, 3, 2, 14, 14)
    assert qwen["language_model.model.layers.0.self_attn.qkv_proj.weight"].local_shape == (16 + 8 + 8, 64)
    gemma = fl.layout(built["gemma3"], tp_size=2, rank=0).params
    assert gemma["vision_tower.vision_model.encoder.layers.0.self_attn.qkv_proj.bias"].local_shape == (48,)
    assert gemma["vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"].local_shape == (32, 32)
    assert gemma["vision_tower.vision_model.encoder.layers.0.mlp.fc2.weight"].local_shape == (32, 32)
    assert gemma["vision_tower.vision_model.embeddings.position_embedding.weight"].local_shape == (4, 32)
    assert gemma["multi_modal_projector.mm_input_projection_weight"].local_shape == (32, 64)
    assert "language_model.lm_head.weight" in fl.layout(built["gemma3"]).aliases


@pytest.mark.parametrize("arch", sorted(TEXT))
def test_transformers_4_52_names_load_the_same(built: dict[str, Path], arch: str, tmp_path: Path) -> None:
    """transformers 4.52-4.57 saved model.language_model.*, model.visual.* / model.vision_tower.*."""
    other = tmp_path / arch
    write_shards(other, read_checkpoint_tensors(built[arch]))
    (other / "config.json").write_text((built[arch] / "config.json").read_text())
    rename_checkpoint(other, arch, "transformers_4_52")
    assert any(n.startswith("model.language_model.") for n in read_checkpoint_tensors(other))
    for rank in range(2):
        got = fl.load(other, tp_size=2, rank=rank, progress=False)
        assert_same_state(got, fl.load(built[arch], tp_size=2, rank=rank, progress=False), f"{arch} rank {rank}")


@pytest.mark.parametrize("arch", sorted(TEXT))
def test_text_only_drops_the_vision_parts_with_the_reason(built: dict[str, Path], arch: str) -> None:
    whole = fl.load(built[arch], tp_size=2, rank=1, progress=False)
    text = fl.load(built[arch], tp_size=2, rank=1, progress=False, text_only=True)
    assert set(text) == {n for n in whole if n.startswith("language_model.")}
    for name in text:
        assert_same_bits(text[name], whole[name], name)
    vision = {n for n in read_checkpoint_tensors(built[arch]) if n.startswith(VISION)}
    dropped = dict(text.plan.dropped)
    assert set(dropped) == vision and vision
    modules = ("visual.", "vision_tower.", "multi_modal_projector")
    assert all(why.endswith(TEXT_ONLY_REASON) and why.startswith(modules) for why in dropped.values())
    assert text.plan.bytes_to_read < whole.plan.bytes_to_read
    assert not whole.plan.dropped


def test_text_only_needs_no_vision_config(built: dict[str, Path]) -> None:
    config = json.loads((built["qwen2_5_vl"] / "config.json").read_text())
    del config["vision_config"]
    with pytest.raises(ConfigError, match=r"\(dim vision_hidden = .vision_config.hidden_size.\) evaluated to None"):
        fl.layout(config)
    layout = fl.layout(config, tp_size=8, rank=3, text_only=True)  # 4 vision heads would not divide by 8
    assert all(n.startswith("language_model.") for n in layout.params)
    assert {m.split(".")[0] for m, _ in layout.left_out} == {"visual"}
    assert "visual.blocks.{layer}.attn.qkv" in dict(layout.left_out)


def test_vision_heads_must_divide(built: dict[str, Path]) -> None:
    with pytest.raises(ShardingError) as err:
        fl.layout(built["gemma3"], tp_size=8, rank=0)
    assert "vision_tower.vision_model.encoder.layers.0.self_attn.qkv_proj (and every layer like it)" in str(err.value)
    assert "[1, 2, 4]" in str(err.value)
    fl.plan(built["gemma3"], tp_size=8, rank=7, text_only=True)  # the language model alone shards over 8


def test_transformers_5_flat_siglip_is_refused_as_vllm_refuses_it(built: dict[str, Path], tmp_path: Path) -> None:
    tensors = {n.replace("vision_tower.vision_model.", "vision_tower."): t for n, t in read_checkpoint_tensors(built["gemma3"]).items()}
    write_shards(tmp_path, tensors)
    (tmp_path / "config.json").write_text((built["gemma3"] / "config.json").read_text())
    with pytest.raises(PlanError) as err:
        fl.plan(tmp_path)
    # every flat tensor, biases included (an undeclared bias is no longer dropped silently)
    assert "37 checkpoint tensors" in str(err.value) and "have no destination" in str(err.value)
    assert "'vision_tower.encoder.layers.0.mlp.fc1.bias'" in str(err.value)
    assert "Following weights were not initialized" in str(err.value)
    with pytest.raises(PlanError, match="have no destination"):  # the flat names are no vision module's either
        fl.plan(tmp_path, text_only=True)


def test_siglip_pooling_head_is_dropped_as_vllm_drops_it(tmp_path: Path) -> None:
    directory = write_checkpoint("gemma3", tmp_path, kv_heads=2, num_layers=1, vision_config={
        "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "num_hidden_layers": 1, "image_size": 28,
        "patch_size": 14, "vision_use_head": True,
    })
    head = [n for n in read_checkpoint_tensors(directory) if ".head." in n]
    assert "vision_tower.vision_model.head.probe" in head
    dropped = dict(fl.plan(directory).dropped)
    assert set(dropped) == set(head) and all("attention-pooling head" in why for why in dropped.values())


def test_expressions_read_nested_configs() -> None:
    scope = Scope({"vision_config": {"hidden_size": 32, "spatial_merge_size": 2}, "text_config": {"hidden_size": 64}}, {})
    assert evaluate("vision_config.hidden_size * vision_config.spatial_merge_size", scope) == 64
    assert evaluate("vision_config.in_channels or 3", scope) == 3
    assert evaluate("audio_config.hidden_size or 7", scope) == 7  # a missing nested config is None
    assert evaluate("hidden_size", scope) == 64  # from text_config
    with pytest.raises(ConfigError, match="not a nested config"):
        evaluate("hidden_size.depth", scope)
    with pytest.raises(ConfigError, match=r"config\.json has no 'vision_config\.depth'"):
        evaluate("vision_config.depth + 1", scope)


def test_modules_with_their_own_layer_count_and_prefix(tmp_path: Path) -> None:
    """A spec extending another adds a tower of its own depth beside the prefixed language model."""
    spec_file = tmp_path / "tiny_vlm.toml"
    spec_file.write_text(
        'name = "tiny_vlm"\nextends = "llama"\narchitectures = ["TinyVLM"]\nprefix = "lm."\n'
        '[modules."tower.blocks.{layer}.fc"]\nkind = "column"\nin = "vision_config.width"\nout = "vision_config.width"\n'
        'layers = "vision_config.depth"\nprefix = ""\nvision = true\n'
        '[modules."tower.blocks.{layer}.norm"]\nkind = "replicated"\nparams = { weight = ["vision_config.width"] }\n'
        'layers = "vision_config.depth"\nprefix = ""\nvision = true\n'
    )
    spec = load_spec(spec_file)
    config = {"architectures": ["TinyVLM"], "hidden_size": 64, "num_attention_heads": 8, "intermediate_size": 128,
              "num_hidden_layers": 2, "vocab_size": 1000, "vision_config": {"width": 16, "depth": 3}, "dtype": "bfloat16"}
    names = list(fl.layout(config, spec=spec, tp_size=2).params)
    tower = [n for n in names if n.startswith("tower.")]
    assert tower == [f"tower.blocks.{i}.{m}" for i in range(3) for m in ("fc.weight", "norm.weight")]
    assert names.index("lm.model.layers.1.mlp.down_proj.weight") < names.index("lm.model.norm.weight")
    assert all(n.startswith(("lm.", "tower.")) for n in names)
    text = fl.layout(config, spec=spec, tp_size=2, text_only=True)
    assert not [n for n in text.params if n.startswith("tower.")]
    assert [m for m, _ in text.left_out] == ["tower.blocks.{layer}.fc", "tower.blocks.{layer}.norm"]
