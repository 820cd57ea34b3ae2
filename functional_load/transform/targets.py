"""Output layouts for a named target: the post-load transforms a kernel family expects.

``load(..., target=...)``:

* ``"checkpoint"`` (default): rank shards in checkpoint orientation, what vLLM holds right after
  ``load_weights`` (per-shard FP8 scales, ``[out, in]`` weights).
* ``"cuda-fp8"``: what vLLM's CUDA FP8 linear methods hold after ``process_weights_after_loading``:
  per-tensor FP8 weights requantized to one (max) scale and transposed to ``[in, out]`` (K, N),
  the scale a 0-dim tensor, static input scales reduced to their max; per-channel weights
  transposed; block-quantized weights unchanged.
* ``"rocm-fp8"``: the same after converting e4m3fn to e4m3fnuz (bits reinterpreted, weight and
  input scales doubled, KV-cache scales doubled, e8m0 block scales + 1 exponent).

:func:`functional_load.dequantize` gives the same dense weight for every target.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..plan.plan import Plan
from .dlpack import to_jax, to_torch

TARGETS = ("checkpoint", "cuda-fp8", "rocm-fp8")


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise ConfigError(f"target={target!r} is not a known output layout; use one of {TARGETS}")


def _segment_widths(plan: Plan, module: str) -> tuple[int, ...]:
    """Local rows of each output segment of a linear's weight (one width when unsplit)."""
    return tuple(b - a for _, (a, b) in plan.param(f"{module}.weight").spec.local_pieces(plan.parallel))


def apply_target(plan: Plan, tensors: Mapping[str, Any], target: str) -> dict[str, Any]:
    """New tensors with the transforms of ``target`` applied (the input is not modified)."""
    check_target(target)
    if target == "checkpoint":
        return dict(tensors)
    import torch

    from . import kernels as transforms  # jax, imported only when a transform runs

    out = dict(tensors)
    fnuz = target == "rocm-fp8"
    for module, scheme in plan.schemes.items():
        if scheme.format != "fp8":
            continue
        weight_name, scale_name = f"{module}.weight", f"{module}.{scheme.scale_name}"
        weight, scale = to_jax(out[weight_name]), out[scale_name]
        if fnuz:
            weight = transforms.e4m3fn_to_e4m3fnuz(weight)
            if scale.dtype == torch.float8_e8m0fnu:
                scale = to_torch(transforms.e8m0_scales_to_fnuz(to_jax(scale)))
            else:
                scale = scale * 2
            if f"{module}.input_scale" in out:
                out[f"{module}.input_scale"] = out[f"{module}.input_scale"] * 2
        if scheme.strategy == "tensor":
            weight, max_scale = transforms.requantize_with_max_scale(weight, to_jax(scale.contiguous()), _segment_widths(plan, module))
            scale = to_torch(max_scale).clone()
            if f"{module}.input_scale" in out:
                out[f"{module}.input_scale"] = out[f"{module}.input_scale"].max()
        if scheme.strategy in ("tensor", "channel"):
            weight = transforms.transpose(weight)
        out[weight_name], out[scale_name] = to_torch(weight), scale
    for name in [n for n in out if n.endswith(".attn.k_scale") and n[: -len("k_scale")] + "v_scale" in out]:
        k_name, v_name = name, name[: -len("k_scale")] + "v_scale"
        k, v = _kv_scales(out[k_name], out[v_name])
        out[k_name], out[v_name] = (k * 2, v * 2) if fnuz else (k, v)
    return out


def _kv_scales(k: Any, v: Any) -> tuple[Any, Any]:
    """vLLM's ``BaseKVCacheMethod.process_weights_after_loading``: both present (positive) stay;
    neither (vLLM's -1.0) becomes 1.0; one alone serves both."""
    if bool((k > 0).all()) and bool((v > 0).all()):
        return k, v
    if bool((k < 0).all()) and bool((v < 0).all()):
        return k.new_ones(k.shape), v.new_ones(v.shape)
    both = k.maximum(v)
    return both.clone(), both.clone()
