"""Tiny architectures of the dense decoder families (group ``dense``).

Release names vLLM serves with an existing spec (InternLM3, IQuest-Coder, LLaMA, TeleChat3, Solar,
MiMo: transformers writes them as Llama or Qwen2, ``config_json`` sets the release's name), and
dense families with small changes or their own spec (OLMo 1/2/3, Cohere 2, Gemma, Granite,
EXAONE 4, ERNIE 4.5, Seed-OSS, HyperCLOVA X, CWM, SmolLM3, GLM v1, Nemotron, Arcee, Apertus,
Hunyuan dense, Jais 2, VaultGemma, StarCoder2, Phi). Sizes divide over tp 1, 2, 4 and 8 (8 heads of
8, hidden 64) unless a note says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .archspec import _LLAMA_LIKE, _NO_HEAD_DIM, ArchSpec

__all__ = ["ARCHS"]

_TIED = {**_LLAMA_LIKE, "tie_word_embeddings": True}
_SWA = {**_LLAMA_LIKE, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}


def _as(arch: str, **fields: Any) -> Mapping[str, Any]:
    """config.json fields: the release's architecture name (and more release fields)."""
    return MappingProxyType({"architectures": [arch], **fields})


def _llama(arch: str, notes: str = "", **fields: Any) -> ArchSpec:
    """A release transformers writes as LlamaForCausalLM, renamed to ``arch`` in config.json."""
    return ArchSpec("LlamaConfig", "LlamaForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)), notes=notes,
                    config_json=_as(arch, **fields))


ARCHS: Mapping[str, ArchSpec] = MappingProxyType(
    {
        # --- the layout of an existing spec, under another architecture name ---
        "granite": ArchSpec("GraniteConfig", "GraniteForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)),
                            notes="llama layout; the multipliers are config scalars"),
        "internlm3": _llama("InternLM3ForCausalLM", "llama layout (vLLM's LlamaForCausalLM)", qkv_bias=False, bias=False),
        "iquestcoder": _llama("IQuestCoderForCausalLM", "llama layout (vLLM's LlamaForCausalLM)"),
        "llama_caps": _llama("LLaMAForCausalLM", "the old LLaMA name (vLLM's LlamaForCausalLM)"),
        "telechat3": _llama("TeleChat3ForCausalLM", "llama layout (vLLM's LlamaForCausalLM)"),
        "solar": _llama("SolarForCausalLM", "llama layout (vLLM's SolarForCausalLM; its bskcn skips have no parameters)"),
        "ministral3": ArchSpec("Ministral3Config", "Ministral3ForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)),
                               notes="llama layout (vLLM's MistralForCausalLM)"),
        # MiMo: Qwen2 plus multi-token-prediction layers model.mtp_layers.N.* that vLLM's main model
        # drops; transformers writes none, so a third decoder layer is written and renamed to
        # mtp_layers.0 (config.json keeps two layers).
        "mimo": ArchSpec("Qwen2Config", "Qwen2ForCausalLM", MappingProxyType(dict(_NO_HEAD_DIM)),
                         notes="qwen2 layout; model.mtp_layers.* dropped (vLLM loads them in its MTP draft model)",
                         renames=(("model.layers.2.", "model.mtp_layers.0."),),
                         config_json=_as("MiMoForCausalLM", num_hidden_layers=2, num_nextn_predict_layers=1,
                                         layer_types=["full_attention", "full_attention"])),
        # --- small changes ---
        "olmo": ArchSpec("OlmoConfig", "OlmoForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)),
                         notes="Transformers backend; LayerNorm without parameters: no norm weights"),
        "cohere2": ArchSpec("Cohere2Config", "Cohere2ForCausalLM", MappingProxyType({**_TIED, **_SWA}),
                            notes="LayerNorm weight only, one norm per layer (parallel block), no lm_head (tied)"),
        "gemma": ArchSpec("GemmaConfig", "GemmaForCausalLM", MappingProxyType(dict(_TIED)),
                          notes="llama linears, gelu; tied by default, an untied lm_head is loaded"),
        "granite_swa": ArchSpec("GraniteSWAConfig", "GraniteSWAForCausalLM", MappingProxyType({**_TIED, "sliding_window": 16}),
                                notes="llama + self_attn.sinks [heads] split by head; tied by default"),
        "exaone4": ArchSpec("Exaone4Config", "Exaone4ForCausalLM", MappingProxyType({**_SWA, "sliding_window_pattern": 2}),
                            notes="qwen3 attention, post_attention/post_feedforward norms, no input_layernorm"),
        "ernie4_5": ArchSpec("Ernie4_5Config", "Ernie4_5ForCausalLM", MappingProxyType(dict(_TIED)), notes="llama layout, tied"),
        "seed_oss": ArchSpec("SeedOssConfig", "SeedOssForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)),
                             notes="Transformers backend; q/k/v biases (attention_out_bias, mlp_bias: more)"),
        "hyperclovax": ArchSpec("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)),
                                notes="llama + post_norm1/post_norm2 (use_post_norm)"),
        "cwm": ArchSpec("CwmConfig", "CwmForCausalLM", MappingProxyType({**_LLAMA_LIKE, "sliding_window": 16}),
                        notes="Transformers backend; llama layout, sliding-window layer types"),
        "smollm3": ArchSpec("SmolLM3Config", "SmolLM3ForCausalLM",
                            MappingProxyType({**_TIED, "no_rope_layers": [1, 0], "no_rope_layer_interval": 2}),
                            notes="Transformers backend; llama layout, NoPE on layer 1, tied"),
        "glm": ArchSpec("GlmConfig", "GlmForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)),
                        notes="Transformers backend; q/k/v biases, gate_up_proj fused on disk and split as one column"),
        # --- new dense specs ---
        "olmo2": ArchSpec("Olmo2Config", "Olmo2ForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)),
                          notes="Transformers backend; post-norms, full-width q_norm/k_norm kept whole"),
        "olmo3": ArchSpec("Olmo3Config", "Olmo3ForCausalLM", MappingProxyType(dict(_SWA)),
                          notes="as olmo2, sliding-window layer types"),
        "nemotron": ArchSpec("NemotronConfig", "NemotronForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)),
                             notes="LayerNorm1P weight + bias, up_proj/down_proj MLP, partial rotary"),
        "arcee": ArchSpec("ArceeConfig", "ArceeForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)),
                          notes="Transformers backend; up_proj/down_proj MLP"),
        "apertus": ArchSpec("ApertusConfig", "ApertusForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)),
                            notes="q/k norms, attention_/feedforward_layernorm, xIELU alpha_p/alpha_n [1] (bf16 in vLLM)"),
        "hunyuan_dense": ArchSpec("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)),
                                  notes="Transformers backend; per-head query_layernorm/key_layernorm"),
        "jais2": ArchSpec("Jais2Config", "Jais2ForCausalLM", MappingProxyType(dict(_LLAMA_LIKE)),
                          notes="Transformers backend; LayerNorm with bias, all linears biased, up/down MLP"),
        "vaultgemma": ArchSpec("VaultGemmaConfig", "VaultGemmaForCausalLM", MappingProxyType({**_SWA, **_TIED}),
                               notes="Transformers backend; input/pre_feedforward norms only, tied"),
        "starcoder2": ArchSpec("Starcoder2Config", "Starcoder2ForCausalLM", MappingProxyType(dict(_TIED)),
                               notes="Transformers backend; LayerNorm with bias, c_fc/c_proj MLP, use_bias, tied"),
        "phi": ArchSpec("PhiConfig", "PhiForCausalLM", MappingProxyType({**_NO_HEAD_DIM, "partial_rotary_factor": 0.5}),
                        notes="Transformers backend; parallel block, dense/fc1/fc2, final_layernorm, lm_head bias"),
    }
)
