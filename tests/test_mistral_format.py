"""Mistral's own checkpoint format (params.json + consolidated*.safetensors), as vLLM 0.32 reads it.

Mistral repositories ship it next to the HF files; both must give the same rank states (the
parity harness checks the same against real vLLM with ``load_format`` auto, "mistral" and "hf").
The Mistral copies here are DERIVED from transformers-written HF checkpoints
(:func:`functional_load.testing.mistral_format.add_mistral_copy`), as no tool writes the format on
CPU: renamed tensors, ``wq``/``wk`` rows put back in Meta's interleaved rotary order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import functional_load as fl
from functional_load import ConfigError, PlanError
from functional_load.model.mistral import mistral_config
from functional_load.testing.checkpoints import read_checkpoint_tensors, write_checkpoint
from functional_load.testing.mistral_format import add_mistral_copy


@pytest.fixture(scope="module")
def dual(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_mistral_copy(write_checkpoint("mistral", tmp_path_factory.mktemp("mistral") / "dual", kv_heads=2))


def _same(a: fl.LoadedState, b: fl.LoadedState) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_both_copies_give_the_same_ranks(dual: Path, tp: int) -> None:
    for rank in range(tp):
        hf = fl.load(dual, tp_size=tp, rank=rank, load_format="hf")
        auto = fl.load(dual, tp_size=tp, rank=rank)
        assert {i.file.name for i in auto.plan.tensors.values()} == {"consolidated.safetensors"}
        assert all(i.file.name.startswith("model") for i in hf.plan.tensors.values())
        assert _same(hf, auto)


def test_consolidated_weights_with_only_config_json(dual: Path, tmp_path: Path) -> None:
    """vLLM reads config.json when there is no params.json, and still Mistral's names."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text((dual / "config.json").read_text())
    (model / "consolidated.safetensors").write_bytes((dual / "consolidated.safetensors").read_bytes())
    assert _same(fl.load(model, tp_size=2, rank=1), fl.load(dual, tp_size=2, rank=1, load_format="hf"))


def test_consolidated_files_with_hf_names_load_as_vllm_loads_them(dual: Path, tmp_path: Path) -> None:
    """vLLM renames (and permutes) only Mistral's own names, so HF names in a consolidated file
    load as they are; names that are neither point to load_format='hf'."""
    model = tmp_path / "m"
    model.mkdir()
    for name in ("config.json", "params.json"):
        (model / name).write_text((dual / name).read_text())
    tensors = read_checkpoint_tensors(dual)
    save_file(tensors, str(model / "consolidated.safetensors"), metadata={"format": "pt"})
    assert _same(fl.load(model, tp_size=2, rank=0), fl.load(dual, tp_size=2, rank=0, load_format="hf"))
    save_file({f"transformer.{k}": v for k, v in tensors.items()}, str(model / "consolidated.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PlanError, match="load_format='hf'"):
        fl.plan(model, tp_size=1, rank=0)


def test_params_json_is_adapted_as_vllm_does() -> None:
    params = {"dim": 64, "n_layers": 2, "head_dim": 8, "hidden_dim": 128, "n_heads": 8, "n_kv_heads": 2, "norm_eps": 1e-5,
              "vocab_size": 1000, "rope_theta": 1e6, "quantization": {"qformat_weight": "fp8_e4m3", "qscheme_act": "TENSOR"}}
    config = mistral_config(params, {"max_position_embeddings": 4096, "dtype": "bfloat16"})
    assert config["architectures"] == ["MistralForCausalLM"]
    sizes = (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"], config["intermediate_size"])
    assert sizes == (64, 2, 2, 128)
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "static"}
    assert config["max_position_embeddings"] == 4096
    moe = mistral_config({**params, "moe": {"num_experts": 8, "num_experts_per_tok": 2}, "quantization": None})
    assert moe["architectures"] == ["MixtralForCausalLM"] and moe["num_local_experts"] == 8
    with pytest.raises(ConfigError, match="load_format='hf'"):
        mistral_config({**params, "vision_encoder": {"hidden_size": 32}})
    with pytest.raises(ConfigError, match="qscheme_act"):
        mistral_config({**params, "quantization": {"qformat_weight": "fp8_e4m3", "qscheme_act": "CHANNEL"}})


def test_fp8_consolidated_scales_are_named_qscale(tmp_path: Path) -> None:
    """A per-tensor FP8 Mistral (DERIVED: the tiny model's weights quantized by hand, amax / 448):
    ``qscale_weight``/``qscale_act`` fill the same parameters as HF's ``weight_scale``/``input_scale``."""
    model = write_checkpoint("mistral", tmp_path / "fp8", kv_heads=2)
    tensors = read_checkpoint_tensors(model)
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        weight = tensors[name].float()
        scale = weight.abs().max() / 448
        tensors[name] = (weight / scale).to(torch.float8_e4m3fn)
        tensors[name.replace(".weight", ".weight_scale")] = scale.reshape(1)
        tensors[name.replace(".weight", ".input_scale")] = torch.tensor([0.02])
    for f in model.glob("model*.safetensors"):
        f.unlink()
    (model / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (model / "config.json").write_text(json.dumps(config))
    add_mistral_copy(model)
    consolidated = read_checkpoint_tensors(model / "consolidated.safetensors")
    assert "layers.0.attention.wq.qscale_weight" in consolidated and "layers.0.feed_forward.w2.qscale_act" in consolidated
    for rank in range(2):
        assert _same(fl.load(model, tp_size=2, rank=rank, load_format="hf"), fl.load(model, tp_size=2, rank=rank))
