"""Release layouts of the big MoE models, checked against the checkpoint by hand (vLLM's own
loads of the same tiny checkpoints are compared in the parity harness, ``tests/test_parity.py``).

* Llama 4 released as ``Llama4ForConditionalGeneration`` is its text model under
  ``language_model.``, sizes read from ``text_config``, the vision tower dropped with its reason;
  q and k rows are permuted from interleaved rotary pairs to halves, head by head.
* gpt-oss experts are fused input-major with gate/up interleaved: a rank's ``w13`` is a contiguous
  range of ``gate_up_proj``'s columns, transposed.
* GLM-4.5's router is float32 whatever the checkpoint stores.
* GLM-4 dense drops the multi-token-prediction layers past ``num_hidden_layers``, as vLLM does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import functional_load as fl
from functional_load.testing.checkpoints import read_checkpoint_tensors, write_checkpoint


@pytest.fixture(scope="module")
def llama4_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("llama4_text", tmp_path_factory.mktemp("llama4") / "text", kv_heads=2)


def test_llama4_conditional_generation_text_only_is_its_text_model(llama4_text: Path, tmp_path: Path) -> None:
    """The language model of Llama4ForConditionalGeneration, with ``text_only=True``, is the text
    model under ``language_model.`` (the vision tower loads too without it: the parity case
    ``llama4-mm`` proves that against vLLM)."""
    text_config = json.loads((llama4_text / "config.json").read_text())
    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text_config,
              "vision_config": {"hidden_size": 32}, "dtype": text_config["dtype"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {f"language_model.{k}": v for k, v in read_checkpoint_tensors(llama4_text).items()}
    tensors["vision_model.patch_embedding.linear.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for rank in (0, 1):
        text = fl.load(llama4_text, tp_size=2, rank=rank)
        full = fl.load(tmp_path, tp_size=2, rank=rank, text_only=True)
        assert sorted(full) == sorted(f"language_model.{k}" for k in text)
        assert all(torch.equal(full[f"language_model.{k}"], v) for k, v in text.items())
        [(name, why)] = full.plan.dropped
        assert name == "vision_model.patch_embedding.linear.weight" and "text_only=True leaves out" in why


def test_llama4_q_and_k_rows_become_rotary_halves(llama4_text: Path) -> None:
    stored = read_checkpoint_tensors(llama4_text)
    config = json.loads((llama4_text / "config.json").read_text())
    hd, kv = config["head_dim"], config["num_key_value_heads"]
    for rank in (0, 1):
        state = fl.load(llama4_text, tp_size=2, rank=rank)
        qkv = state["model.layers.0.self_attn.qkv_proj.weight"]
        q_rows, k_rows = config["num_attention_heads"] * hd // 2, kv * hd // 2
        for part, rows, offset in (("q_proj", q_rows, 0), ("k_proj", k_rows, q_rows)):
            mine = stored[f"model.layers.0.self_attn.{part}.weight"][rank * rows : (rank + 1) * rows]
            heads = [mine[h * hd : (h + 1) * hd] for h in range(rows // hd)]
            halves = torch.cat([torch.cat([head[0::2], head[1::2]]) for head in heads])  # evens then odds, per head
            assert torch.equal(qkv[offset : offset + rows], halves), (rank, part)
        v = stored["model.layers.0.self_attn.v_proj.weight"][rank * k_rows : (rank + 1) * k_rows]
        assert torch.equal(qkv[q_rows + k_rows :], v)  # v is not permuted


def test_gpt_oss_ranks_hold_contiguous_interleaved_columns(tmp_path: Path) -> None:
    model = write_checkpoint("gpt_oss", tmp_path / "gpt_oss")
    stored = read_checkpoint_tensors(model)
    gate_up, down = stored["model.layers.0.mlp.experts.gate_up_proj"], stored["model.layers.0.mlp.experts.down_proj"]
    inter = down.shape[1]
    for rank in range(2):
        state = fl.load(model, tp_size=2, rank=rank)
        cols = slice(rank * inter, (rank + 1) * inter)  # 2I/2 interleaved gate/up columns
        assert torch.equal(state["model.layers.0.mlp.experts.routed_experts.w13_weight"], gate_up[:, :, cols].transpose(1, 2))
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        assert torch.equal(state["model.layers.0.mlp.experts.routed_experts.w2_weight"], down[:, half].transpose(1, 2))
        bias = state["model.layers.0.mlp.experts.routed_experts.w2_bias"]
        assert torch.equal(bias, stored["model.layers.0.mlp.experts.down_proj_bias"] if rank == 0 else torch.zeros_like(bias))
        assert torch.equal(state["model.layers.0.attn.sinks"], stored["model.layers.0.self_attn.sinks"][rank * 4 : (rank + 1) * 4])


def test_glm4_moe_router_is_float32(tmp_path: Path) -> None:
    model = write_checkpoint("glm4_moe", tmp_path / "glm")
    state = fl.load(model, tp_size=2, rank=1)
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"):
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], read_checkpoint_tensors(model)[name].float())


def test_glm4_drops_mtp_layers(tmp_path: Path) -> None:
    model = write_checkpoint("glm4", tmp_path / "glm4", kv_heads=2)
    tensors = read_checkpoint_tensors(model)
    mtp = {name.replace("layers.1.", "layers.2."): t for name, t in tensors.items() if ".layers.1." in name}
    save_file(mtp, str(model / "mtp.safetensors"))
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    plan = fl.plan(model, tp_size=2, rank=0)
    assert {name for name, _ in plan.dropped} == set(mtp)
    state = fl.load(model, tp_size=2, rank=0)
    assert not any(".layers.2." in name for name in state)
