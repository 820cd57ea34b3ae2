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

FP8 MoE experts follow vLLM's fused-MoE processing for its Triton kernels: per-tensor ``w13`` is
requantized per expert to the larger of its w1/w3 scales (``w13_weight_scale [E]``), static input
scales become their max over the layer's experts, and weights stay ``[E, out, in]``.

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
        if f"{module}.routed_experts.w13_weight" in out:
            _experts(out, f"{module}.routed_experts.", scheme, fnuz, transforms)
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


def _experts(out: dict[str, Any], prefix: str, scheme: Any, fnuz: bool, transforms: Any) -> None:
    """vLLM's FP8 MoE ``process_weights_after_loading`` (Triton layout): on ROCm the weights become
    e4m3fnuz with doubled scales; per-tensor w13 is requantized per expert to the larger of its
    w1/w3 scales (``w13_weight_scale [E]``) and static input scales become their max over experts.
    Channel and block scales keep their layout."""
    import torch

    scale = scheme.scale_name
    for stem in ("w13", "w2"):
        weight_name, scale_name = f"{prefix}{stem}_weight", f"{prefix}{stem}_{scale}"
        if fnuz:
            out[weight_name] = to_torch(transforms.e4m3fn_to_e4m3fnuz(to_jax(out[weight_name])))
            s = out[scale_name]
            out[scale_name] = to_torch(transforms.e8m0_scales_to_fnuz(to_jax(s))) if s.dtype == torch.float8_e8m0fnu else s * 2
        if f"{prefix}{stem}_input_scale" in out:
            inputs = out[f"{prefix}{stem}_input_scale"]
            out[f"{prefix}{stem}_input_scale"] = (inputs * 2 if fnuz else inputs).max()
    w13, w13_scale = f"{prefix}w13_weight", f"{prefix}w13_{scale}"
    if scheme.strategy == "tensor" and out[w13].shape[0]:
        weight, max_scales = transforms.requantize_experts_with_max_scale(to_jax(out[w13]), to_jax(out[w13_scale].contiguous()))
        out[w13], out[w13_scale] = to_torch(weight), to_torch(max_scales).clone()
    elif scheme.strategy == "tensor":
        out[w13_scale] = out[w13_scale].new_empty((0,))

