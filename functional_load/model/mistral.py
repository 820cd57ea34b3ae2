"""Mistral's own config (``params.json``), as vLLM 0.32 reads it: adapted to an HF-style config
(``transformers_utils.configs.mistral``). Its tensor names are the checkpoint stage's business
(:mod:`functional_load.checkpoint.mistral`)."""

from __future__ import annotations

from ..errors import ConfigError
from ..paths import JsonDict, JsonObject

PARAMS = "params.json"

# params.json key -> HF config key
_KEYS = {
    "dim": "hidden_size",
    "norm_eps": "rms_norm_eps",
    "n_kv_heads": "num_key_value_heads",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "hidden_dim": "intermediate_size",
    "tied_embeddings": "tie_word_embeddings",
    "activation": "hidden_act",
}


def mistral_config(params: JsonObject, defaults: JsonObject | None = None, where: str = PARAMS) -> JsonDict:
    """``params.json`` as the HF-style config vLLM builds from it (``adapt_config_dict``): keys
    renamed, FP8 ``quantization`` as an ``fp8`` quantization_config, ``moe`` as a Mixtral config;
    keys it lacks come from ``defaults`` (the directory's ``config.json``, when there is one)."""
    config = {_KEYS.get(k, k): v for k, v in params.items()}
    config.setdefault("tie_word_embeddings", False)
    if config.get("vision_encoder") or (config.get("multimodal") or {}).get("vision_encoder_args"):
        raise ConfigError(
            f"{where}: a Mistral vision model (vision_encoder) in Mistral's own format is not supported yet; load its HF "
            f"files with load_format='hf'"
        )
    quantization = config.pop("quantization", None)
    if quantization:
        if quantization.get("qformat_weight") != "fp8_e4m3":
            raise ConfigError(f"{where}: quantization {dict(quantization)} is not supported; Mistral's format has fp8_e4m3 weights")
        scheme = quantization.get("qscheme_act")
        if scheme not in ("NO_SCALES", "TENSOR", None):
            raise ConfigError(f"{where}: quantization.qscheme_act {scheme!r} is not supported (NO_SCALES, TENSOR)")
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic" if scheme == "NO_SCALES" else "static"}
    moe = config.get("moe")
    if moe:
        if moe.get("num_shared_experts"):
            raise ConfigError(f"{where}: Mistral Large 3 (MoE with shared experts) in Mistral's format is not supported yet")
        config["architectures"] = ["MixtralForCausalLM"]
        config["num_local_experts"] = moe.get("num_experts")
        config["num_experts_per_tok"] = moe.get("num_experts_per_tok")
    else:
        config["architectures"] = ["MistralForCausalLM"]
    config["model_type"] = "mistral"
    for key, value in (defaults or {}).items():
        config.setdefault(key, value)
    config.setdefault("max_position_embeddings", 128_000)
    return config
