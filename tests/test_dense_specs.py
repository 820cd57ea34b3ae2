"""The dense-family specs' config-dependent parts, from config.json values alone (no weights):
what the parity cases' tiny checkpoints do not vary (Granite's sink rule, optional norms and
biases, defaults of absent keys). Each expectation is vLLM 0.32's, cited in the spec."""

from __future__ import annotations

from typing import Any

import pytest

import functional_load as fl
from functional_load.layout.sharding import Split

_SIZES = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 128,
          "num_hidden_layers": 2, "vocab_size": 1000, "dtype": "bfloat16", "tie_word_embeddings": False}


def _params(arch: str, tp: int = 2, rank: int = 0, dtype: str | None = None, **config: Any) -> dict[str, Any]:
    layout = fl.layout({"architectures": [arch], **_SIZES, **config}, tp_size=tp, rank=rank, dtype=dtype)
    return dict(layout.params)


@pytest.mark.parametrize(
    ("config", "sinks"),
    [
        ({}, False),  # Granite 3: no layer_types
        ({"layer_types": ["sliding_attention", "full_attention"]}, True),  # Granite SWA releases
        ({"layer_types": ["sliding_attention", "full_attention"], "attention_sinks": False}, False),
        ({"attention_sinks": True}, True),
    ],
)
def test_granite_sinks_follow_vllm_rule(config: dict[str, Any], sinks: bool) -> None:
    # granite.py:109: getattr(config, "attention_sinks", layer_types is not None)
    params = _params("GraniteForCausalLM", **config)
    assert ("model.layers.0.self_attn.sinks" in params) is sinks
    if sinks:
        assert params["model.layers.1.self_attn.sinks"].local_shape == (4,)


def test_hyperclovax_post_norms_only_with_use_post_norm() -> None:
    assert "model.layers.0.post_norm1.weight" in _params("HyperCLOVAXForCausalLM", use_post_norm=True)
    assert "model.layers.0.post_norm2.weight" not in _params("HyperCLOVAXForCausalLM", use_post_norm=False)


def test_seed_oss_bias_defaults_are_transformers() -> None:
    params = _params("SeedOssForCausalLM")  # no bias keys: q/k/v biased, o_proj and MLP not
    assert "model.layers.0.self_attn.qkv_proj.bias" in params
    assert "model.layers.0.self_attn.o_proj.bias" not in params
    assert "model.layers.0.mlp.down_proj.bias" not in params
    params = _params("SeedOssForCausalLM", attention_bias=False, attention_out_bias=True)
    assert "model.layers.0.self_attn.qkv_proj.bias" not in params
    assert "model.layers.0.self_attn.o_proj.bias" in params


def test_glm_v1_gate_up_is_one_column_block() -> None:
    param = _params("GlmForCausalLM")["model.layers.0.mlp.gate_up_proj.weight"]
    assert param.shape == (256, 64) and param.local_shape == (128, 64)
    assert isinstance(param.sharding, Split) and len(param.sharding.segments) == 1  # rank 0: every gate row


def test_phi_qk_layernorm_optional() -> None:
    assert "model.layers.0.self_attn.q_layernorm.weight" not in _params("PhiForCausalLM")
    params = _params("PhiForCausalLM", qk_layernorm=True)
    assert params["model.layers.0.self_attn.k_layernorm.bias"].local_shape == (8,)
    assert params["lm_head.bias"].local_shape == (512,)


def test_apertus_xielu_alphas_stay_bfloat16() -> None:
    params = _params("ApertusForCausalLM", dtype="float32")
    assert params["model.layers.0.mlp.act_fn.alpha_p"].dtype == "bfloat16"
    assert params["model.layers.0.feedforward_layernorm.weight"].dtype == "float32"


def test_drops_and_missing_heads() -> None:
    layout = fl.layout({"architectures": ["MiMoForCausalLM"], **_SIZES}, tp_size=1, rank=0)
    assert any(prefix == "model.mtp_layers." for prefix, _ in layout.drops)
    layout = fl.layout({"architectures": ["Cohere2ForCausalLM"], **_SIZES}, tp_size=1, rank=0)
    assert "lm_head.weight" not in layout.params and any(prefix == "lm_head" for prefix, _ in layout.drops)
    assert "model.layers.0.post_attention_layernorm.weight" not in layout.params
    olmo = _params("OlmoForCausalLM")
    assert not [n for n in olmo if "norm" in n]
    olmo2 = _params("Olmo2ForCausalLM", tp=4)
    assert olmo2["model.layers.0.self_attn.k_norm.weight"].local_shape == (16,)  # whole on every rank
