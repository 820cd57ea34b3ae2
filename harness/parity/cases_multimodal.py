"""Parity cases of the multimodal group: Qwen3-VL, Qwen3-VL-MoE, the Llama 4 vision tower, Gemma 4,
Gemma 3n, Qwen3.5 ConditionalGeneration.

Every multimodal case runs vLLM's whole model (``multimodal=True``: its worker gets torchvision)
and ours with and without ``text_only``. The vision towers have 4 heads, which vLLM splits over
tp: tp 8 is refused by both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from functional_load.testing.files import read_checkpoint_tensors, write_shards
from functional_load.testing.parity.case import MOE, Case, Options

__all__ = ["CASES"]

_MULTIMODAL = (Options(), Options(text_only=True))
_MOE_MULTIMODAL = (*MOE, Options(text_only=True))


@dataclass(frozen=True)
class _InputMajorExperts(Case):
    """A case whose fused experts are rewritten after the build to the releases' input-major layout:
    transformers 5 saves Qwen3-VL-MoE's ``experts.gate_up_proj`` ``[E, 2I, H]`` and
    ``experts.down_proj`` ``[E, H, I]`` (its in-memory layout); the releases (Qwen3-VL-30B-A3B)
    store ``[E, H, 2I]`` and ``[E, I, H]``, which is what vLLM reads."""

    def write(self, root: Path) -> Path:
        fresh = not (root / self.name / "config.json").exists()
        out = super().write(root)
        if fresh:
            tensors = read_checkpoint_tensors(out)
            suffixes = (".experts.gate_up_proj", ".experts.down_proj")
            write_shards(out, {n: t.transpose(-1, -2).contiguous() if n.endswith(suffixes) else t for n, t in tensors.items()}, "100KB")
        return out


@dataclass(frozen=True)
class _ReleaseConfig(Case):
    """A case whose config.json (its ``text_config`` when nested) is rewritten after the build to
    a release's fields: ``config`` entries set, ``None`` entries deleted. Gemma 4's releases carry
    ``global_head_dim`` / ``num_global_key_value_heads``, from which transformers 5 builds the
    ``per_layer_config`` it saves instead."""

    config: Mapping[str, Any] = field(default_factory=dict)

    def write(self, root: Path) -> Path:
        fresh = not (root / self.name / "config.json").exists()
        out = super().write(root)
        if fresh:
            path = out / "config.json"
            config = json.loads(path.read_text())
            text = config.get("text_config", config)
            for key, value in self.config.items():
                if value is None:
                    text.pop(key, None)
                else:
                    text[key] = value
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return out


_QWEN3_VL_MOE = {"kv_heads": 2, "moe_intermediate_size": 24}  # 2I = 48 != H = 64: the two fused layouts differ in shape

_GEMMA4_LAYERS = ["sliding_attention", "full_attention"]
_GEMMA3N_4 = {"num_layers": 4, "layer_types": _GEMMA4_LAYERS * 2, "num_kv_shared_layers": 2, "activation_sparsity_pattern": [0.0] * 4}
_GEMMA4_KEQV = {"hidden_size_per_layer_input": 0, "attention_k_eq_v": True, "num_global_key_value_heads": 1}
_GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32}

CASES: tuple[Case, ...] = (
    # Qwen3-VL: Qwen3 under language_model., the vision tower with qkv fused on disk, merger and a deepstack merger.
    Case("qwen3vl-gqa", "qwen3_vl", {"kv_heads": 2}, options=_MULTIMODAL, multimodal=True,
         note="vision qkv fused on disk (q|k|v each split by head), fc1 column, fc2 row, merger + deepstack merger"),
    Case("qwen3vl-mqa-tied", "qwen3_vl", {"kv_heads": 1, "tie_word_embeddings": True}, tps=(1, 2, 4),
         options=_MULTIMODAL, multimodal=True, note="tied lm_head (Qwen3-VL-2B/4B)"),
    # Qwen3-VL-MoE: the releases' fused input-major experts, per-expert tensors, and transformers 5's output-major save.
    _InputMajorExperts("qwen3vlmoe-release", "qwen3_vl_moe", {**_QWEN3_VL_MOE, "fused_experts": True}, options=_MOE_MULTIMODAL,
                       multimodal=True, note="experts.gate_up_proj [E, H, 2I], down_proj [E, I, H] as the releases"),
    Case("qwen3vlmoe-per-expert", "qwen3_vl_moe", _QWEN3_VL_MOE, tps=(1, 2, 4), options=MOE[:2], multimodal=True,
         note="experts.{e}.gate_proj/up_proj/down_proj, as the FP8 releases"),
    Case("qwen3vlmoe-tf5-save", "qwen3_vl_moe", {**_QWEN3_VL_MOE, "fused_experts": True}, tps=(1, 2), multimodal=True,
         note="transformers 5 save_pretrained's output-major experts: vLLM cannot read them, both refuse"),
    # Llama 4 with its vision tower: q/k/v stacked, no rotary permutation of the tower's q/k; the projector column.
    Case("llama4-mm", "llama4", {"kv_heads": 2}, options=(*MOE[:2], Options(text_only=True)), multimodal=True,
         note="MoE every 2nd layer; vision tower and projector built unquantized; 4 vision heads: tp 8 refused by both"),
    # Qwen3.5 / Qwen3.5-MoE ConditionalGeneration: the hybrid text specs under language_model., the Qwen3-VL tower.
    Case("qwen3_5mm-gqa", "qwen3_5_vl", {"kv_heads": 2}, options=_MULTIMODAL, multimodal=True,
         note="GDN and full-attention layers under language_model.; vision tower without deepstack mergers"),
    Case("qwen3_5mm-mqa-tied", "qwen3_5_vl", {"kv_heads": 1, "tie_word_embeddings": True}, tps=(1, 2), multimodal=True),
    Case("qwen3_5moemm", "qwen3_5_moe_vl", {"kv_heads": 2}, options=_MOE_MULTIMODAL, multimodal=True,
         note="per-expert experts, shared expert and its gate"),
    Case("qwen3_5moemm-fused", "qwen3_5_moe_vl", {"kv_heads": 2, "fused_experts": True}, tps=(1, 2), options=MOE[:2],
         multimodal=True, note="transformers 5's fused experts [E, 2I, H] / [E, H, I]"),
    # Gemma 4 text: E2B/E4B (per-layer inputs, KV-shared layers with a double-wide MLP), 31B (attention_k_eq_v,
    # its own KV heads on full-attention layers, no per-layer inputs), 26B-A4B (MoE beside the dense MLP).
    Case("gemma4_text-e", "gemma4_text", {"kv_heads": 2, "num_layers": 4, "layer_types": _GEMMA4_LAYERS * 2,
                                          "num_kv_shared_layers": 2, "use_double_wide_mlp": True},
         note="layers 2, 3 share KV: q_proj column, no k/v/k_norm; per-layer inputs; layer_scalar (a buffer) dropped"),
    Case("gemma4_text-keqv", "gemma4_text", {"kv_heads": 2, **_GEMMA4_KEQV}, note="full-attention layer: k_proj fills k and v, 1 KV head"),
    _ReleaseConfig("gemma4_text-release-config", "gemma4_text", {"kv_heads": 2, **_GEMMA4_KEQV}, tps=(1, 2),
                   config={"per_layer_config": None, "global_head_dim": 16, "num_global_key_value_heads": 1},
                   note="config.json as the releases: global_head_dim, num_global_key_value_heads, no per_layer_config"),
    Case("gemma4_text-moe-per-expert", "gemma4_text", {"kv_heads": 2, **_GEMMA4_KEQV, **_GEMMA4_MOE}, tps=(1, 2), options=MOE[:2],
         note="experts.{e}.gate_proj/up_proj/down_proj, as quantized releases"),
    # Gemma 4 multimodal: the vision tower and projector replicated (tp 8 too); the E2B/E4B text layout.
    Case("gemma4-mm", "gemma4", {"kv_heads": 2, "num_layers": 4, "layer_types": _GEMMA4_LAYERS * 2, "num_kv_shared_layers": 2},
         options=_MULTIMODAL, multimodal=True, note="vision q/k/v/o and MLP ReplicatedLinear, q/k norms, embed_vision projection"),
    Case("gemma4-mm-keqv-untied", "gemma4", {"kv_heads": 1, **_GEMMA4_KEQV, "tie_word_embeddings": False}, tps=(1, 2),
         options=_MULTIMODAL, multimodal=True, note="31B-style text (k_eq_v, no per-layer inputs), MQA, lm_head stored"),
    # Gemma 3n text: AltUp, Laurel, per-layer embeddings under model.self_decoder., KV-shared layers 2 and 3.
    Case("gemma3n-gqa", "gemma3n_text", {"kv_heads": 2, **_GEMMA3N_4}, note="altup coefs replicated, altup/unembed projections column"),
    Case("gemma3n-mqa-altup4", "gemma3n_text", {"kv_heads": 1, **_GEMMA3N_4, "altup_num_inputs": 4}, tps=(1, 2),
         note="4 AltUp streams (the releases): 3 projections each side"),
    Case("gemma3n-untied", "gemma3n_text", {"kv_heads": 2, "tie_word_embeddings": False}, tps=(1,),
         note="lm_head.weight stored: vLLM's Gemma 3n has no lm_head; both refuse"),
    Case("gemma4_text-moe", "gemma4_text", {"kv_heads": 2, **_GEMMA4_KEQV, **_GEMMA4_MOE, "fused_experts": True}, options=MOE[:2],
         note="router scale/per_expert_scale/proj, experts fused on disk [E, 2I, H], three more norms"),
)
