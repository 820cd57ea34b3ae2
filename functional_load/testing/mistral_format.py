"""A second copy of a tiny Mistral checkpoint in Mistral's own format, as Mistral's repositories
ship one next to the HF files: ``params.json`` and ``consolidated.safetensors`` with Mistral-native
names (``tok_embeddings``, ``layers.N.attention.wq``, ``feed_forward.w1``, ``attention_norm``...)
and ``wq``/``wk`` rows in Meta's interleaved rotary order (HF's converter permutes them to halves;
this undoes it, head by head).

DERIVED from the HF files (no tool writes this format on CPU): each tensor is the HF one renamed,
q/k permuted back; FP8 ``weight_scale``/``input_scale`` become ``qscale_weight``/``qscale_act``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..plan.rotary import to_pairs
from .files import read_checkpoint_tensors

_NAMES = (  # HF fragment -> Mistral fragment, applied in order
    ("model.embed_tokens.", "tok_embeddings."),
    ("model.norm.", "norm."),
    ("lm_head.", "output."),
    ("model.layers.", "layers."),
    (".self_attn.q_proj.", ".attention.wq."),
    (".self_attn.k_proj.", ".attention.wk."),
    (".self_attn.v_proj.", ".attention.wv."),
    (".self_attn.o_proj.", ".attention.wo."),
    (".input_layernorm.", ".attention_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".mlp.gate_proj.", ".feed_forward.w1."),
    (".mlp.down_proj.", ".feed_forward.w2."),
    (".mlp.up_proj.", ".feed_forward.w3."),
)
_SUFFIXES = ((".weight_scale", ".qscale_weight"), (".input_scale", ".qscale_act"))


def _interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotary halves back to Meta's interleaved pairs, head by head (rows of a [out, ...] tensor)."""
    return to_pairs(w, w.shape[0] // heads).contiguous()


def add_mistral_copy(model_dir: str | os.PathLike[str], *, params: bool = True) -> Path:
    """Write ``params.json`` (unless ``params=False``) and ``consolidated.safetensors`` next to the
    HF files of ``model_dir`` (a MistralForCausalLM checkpoint); returns the directory."""
    from safetensors.torch import save_file

    out = Path(model_dir)
    config = json.loads((out / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    tensors = {}
    for name, tensor in read_checkpoint_tensors(out).items():
        new = name
        for hf, mistral in _NAMES:
            new = new.replace(hf, mistral)
        for hf, mistral in _SUFFIXES:
            new = new[: -len(hf)] + mistral if new.endswith(hf) else new
        if (".attention.wq." in new or ".attention.wk." in new) and tensor.dim() >= 1 and tensor.numel() > 1:
            tensor = _interleave(tensor, heads if ".wq." in new else kv_heads)
        tensors[new] = tensor.contiguous()
    save_file(tensors, str(out / "consolidated.safetensors"), metadata={"format": "pt"})
    if params:
        (out / "params.json").write_text(json.dumps(_params(config), indent=2) + "\n")
    return out


def _params(config: dict) -> dict:
    params = {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        "hidden_dim": config["intermediate_size"],
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
        "norm_eps": config.get("rms_norm_eps", 1e-5),
        "vocab_size": config["vocab_size"],
        "rope_theta": (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0)),
        "max_position_embeddings": config.get("max_position_embeddings", 4096),
        "tied_embeddings": bool(config.get("tie_word_embeddings", False)),
    }
    quant = config.get("quantization_config")
    if quant and quant.get("quant_method") == "fp8":
        static = quant.get("activation_scheme") == "static"
        params["quantization"] = {"qformat_weight": "fp8_e4m3", "qscheme_act": "TENSOR" if static else "NO_SCALES"}
    return params
