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

from typing import Any

from .materialize import to_jax, to_torch
from .sharding import Split, split_pieces

TARGETS = ("checkpoint", "cuda-fp8", "rocm-fp8")


def _segment_widths(plan: Any, module: str) -> tuple[int, ...]:
    sharding = plan.param(f"{module}.weight").spec.sharding
    if isinstance(sharding, Split) and sharding.dim == 0:
        tp, rank = (1, 0) if sharding.disable_tp else (plan.parallel.tp_size, plan.parallel.rank)
        return tuple(p.dst[1] - p.dst[0] for p in split_pieces(sharding, tp, rank))
    return (plan.param(f"{module}.weight").spec.local_shape[0],)


def apply_target(state: Any, target: str) -> Any:
    """A new state with the transforms of ``target`` applied (the input is not modified)."""
    from .errors import ConfigError

    if target not in TARGETS:
        raise ConfigError(f"target={target!r} is not a known output layout; use one of {TARGETS}")
    if target == "checkpoint":
        return state
    import torch

    from . import transforms  # jax, imported only when a transform runs
    from .execute import LoadedState

    plan, out = state.plan, dict(state)
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
    if fnuz:
        for name in list(out):
            if name.endswith((".attn.k_scale", ".attn.v_scale")):
                out[name] = out[name] * 2
    return LoadedState(out, plan, target, state.stats)
