"""KV-cache scales: vLLM's names for them, and the parameters each KV-cache method creates.

A checkpoint tensor overwrites a parameter's created value; an absent one keeps it (vLLM's
``process_weights_after_loading`` later reads -1.0 as "not in the checkpoint"). Scales read from
a checkpoint must be finite and positive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..model.mapping import MappingTable
from .config import KVParam

if TYPE_CHECKING:
    import torch

# vLLM's KV-cache scale names (``QuantizationConfig.get_cache_scale_mapper`` + Fp8/Quark/ModelOpt output scales).
CACHE_SCALES = MappingTable.from_dicts(
    regex={
        r"\.kv_scale$": ".attn.k_scale",
        r"\.self_attn\.[kv]_proj\.([kv])_scale$": r".self_attn.attn.\1_scale",
        r"\.self_attn\.qk(?:qk)?v_proj\.([kv])_scale$": r".self_attn.attn.\1_scale",
        r"\.self_attn\.q\.scale$": ".self_attn.attn.q_scale",
        r"\.self_attn\.([kv])_cache\.scale$": r".self_attn.attn.\1_scale",
        r"(?<!\.attn)\.([qkv])_scale$": r".attn.\1_scale",
        r"(?<!\.attn)\.([qkv])_zero_point$": r".attn.\1_zero_point",
    },
    suffix={
        ".k_proj.output_scale": ".attn.k_scale",
        ".v_proj.output_scale": ".attn.v_scale",
    },
)

BASE_KV: tuple[KVParam, ...] = tuple((f"{n}_scale", (), "model", -1.0, "positive") for n in ("q", "k", "v", "prob"))
COMPRESSED_TENSORS_KV: tuple[KVParam, ...] = (
    *((f"{n}_scale", (1,), "float32", 1.0, "positive") for n in ("k", "v", "q")),
    *((f"{n}_zero_point", (1,), "model", 0.0, None) for n in ("k", "v", "q")),
)

# KV-cache tensors a method may have no parameter for: vLLM ignores them when unexpected.
OPTIONAL_KV = ((r"\.[qkv]_(scale|zero_point)$", "the quantization method has no such KV-cache parameter (vLLM ignores it)"),)


def kv_to_target(target: str, module: str, out: dict[str, torch.Tensor]) -> None:
    """vLLM's ``BaseKVCacheMethod.process_weights_after_loading`` for one attention layer: both
    scales present (positive) stay; neither (vLLM's -1.0) becomes 1.0; one alone serves both; on
    ROCm (FNUZ) both double."""
    k_name, v_name = f"{module}.k_scale", f"{module}.v_scale"
    if k_name not in out or v_name not in out:
        return
    k, v = out[k_name], out[v_name]
    if bool((k > 0).all()) and bool((v > 0).all()):
        pass
    elif bool((k < 0).all()) and bool((v < 0).all()):
        k, v = k.new_ones(k.shape), v.new_ones(v.shape)
    else:
        both = k.maximum(v)
        k, v = both.clone(), both.clone()
    out[k_name], out[v_name] = (k * 2, v * 2) if target == "rocm-fp8" else (k, v)
