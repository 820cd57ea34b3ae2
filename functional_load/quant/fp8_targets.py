"""The FP8 format after loading: vLLM's ``process_weights_after_loading`` layouts, and online FP8.

``cuda-fp8``: per-tensor FP8 weights requantized to one (max) scale and transposed to ``[in,
out]`` (K, N), the scale a 0-dim tensor, static input scales reduced to their max; per-channel
weights transposed; block-quantized weights unchanged. ``rocm-fp8``: the same after e4m3fn ->
e4m3fnuz (bits reinterpreted, weight and input scales doubled, e8m0 block scales + 1 exponent).
Fused MoE experts follow vLLM's Triton fused-MoE processing: per-tensor ``w13`` requantized per
expert to the larger of its w1/w3 scales (``w13_weight_scale [E]``), static input scales their
max over the layer's experts, weights ``[E, out, in]``. Online quantization turns one dense
rank-local weight into FP8 and its scales (per tensor ``amax / 448``, or 128 x 128 blocks per
output segment). The kernels are the jitted functions of :mod:`.fp8_kernels`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from functools import cache
from typing import TYPE_CHECKING, Protocol

from ..dlpack import to_jax, to_torch
from ..layout.parallel import Parallel
from ..layout.param import ParamSpec

if TYPE_CHECKING:
    import torch


class Fp8Like(Protocol):
    """What the transforms read of an FP8 scheme (:class:`.fp8.Fp8Scheme`, which imports this module)."""

    @property
    def scale_name(self) -> str: ...

    @property
    def strategy(self) -> str: ...

    @property
    def block_size(self) -> tuple[int, int]: ...


def linear_to_target(scheme: Fp8Like, target: str, module: str, out: dict[str, torch.Tensor], widths: tuple[int, ...]) -> None:
    """One FP8 linear's tensors (``out``, by full name) in ``target``'s layout."""
    import torch

    from . import fp8_kernels as kernels  # jax, imported only when a transform runs

    fnuz = target == "rocm-fp8"
    weight_name, scale_name, input_name = f"{module}.weight", f"{module}.{scheme.scale_name}", f"{module}.input_scale"
    weight, scale = to_jax(out[weight_name]), out[scale_name]
    if fnuz:
        weight = kernels.e4m3fn_to_e4m3fnuz(weight)
        scale = to_torch(kernels.e8m0_scales_to_fnuz(to_jax(scale))) if scale.dtype == torch.float8_e8m0fnu else scale * 2
        if input_name in out:
            out[input_name] = out[input_name] * 2
    if scheme.strategy == "tensor":
        weight, max_scale = kernels.requantize_with_max_scale(weight, to_jax(scale.contiguous()), widths)
        scale = to_torch(max_scale).clone()
        if input_name in out:
            out[input_name] = out[input_name].max()
    if scheme.strategy in ("tensor", "channel"):
        weight = kernels.transpose(weight)
    out[weight_name], out[scale_name] = to_torch(weight), scale


def experts_to_target(scheme: Fp8Like, target: str, prefix: str, out: dict[str, torch.Tensor]) -> None:
    """An FP8 MoE layer's fused experts (``prefix`` = ``<layer>.experts.routed_experts.``) in
    ``target``'s layout; channel and block scales keep theirs."""
    import torch

    from . import fp8_kernels as kernels

    fnuz = target == "rocm-fp8"
    scale = scheme.scale_name
    for stem in ("w13", "w2"):
        weight_name, scale_name = f"{prefix}{stem}_weight", f"{prefix}{stem}_{scale}"
        if fnuz:
            out[weight_name] = to_torch(kernels.e4m3fn_to_e4m3fnuz(to_jax(out[weight_name])))
            s = out[scale_name]
            out[scale_name] = to_torch(kernels.e8m0_scales_to_fnuz(to_jax(s))) if s.dtype == torch.float8_e8m0fnu else s * 2
        if f"{prefix}{stem}_input_scale" in out:
            inputs = out[f"{prefix}{stem}_input_scale"]
            out[f"{prefix}{stem}_input_scale"] = (inputs * 2 if fnuz else inputs).max()
    w13, w13_scale = f"{prefix}w13_weight", f"{prefix}w13_{scale}"
    if scheme.strategy == "tensor" and out[w13].shape[0]:
        weight, max_scales = kernels.requantize_experts_with_max_scale(to_jax(out[w13]), to_jax(out[w13_scale].contiguous()))
        out[w13], out[w13_scale] = to_torch(weight), to_torch(max_scales).clone()
    elif scheme.strategy == "tensor":
        out[w13_scale] = out[w13_scale].new_empty((0,))


def quantize_dense(scheme: Fp8Like, dense: torch.Tensor, specs: Mapping[str, ParamSpec], parallel: Parallel) -> dict[str, torch.Tensor]:
    """``{suffix: tensor}`` of one linear quantized from ``dense`` (its rank-local weight).

    Per-tensor: one ``amax / 448`` scale for the whole local weight, stored in every shard slot
    (the checkpoint FP8 layout). Block: ``128 x 128`` tiles per output segment, so each
    segment's scale rows line up with its own rows, as for block-quantized checkpoints."""
    import torch

    from . import fp8_kernels as kernels

    _release_freed_memory()
    weight = to_jax(dense)
    scale_spec = specs[scheme.scale_name]
    if scheme.strategy == "tensor":
        quantized, scale = kernels.quantize_fp8_per_tensor(weight)
        scales = torch.full(scale_spec.local_shape, float(scale), dtype=torch.float32)
        return {"weight": to_torch(quantized), scheme.scale_name: scales}
    ranges = [rng for _, rng in specs["weight"].local_pieces(parallel)]
    parts = [kernels.quantize_fp8_block(weight[a:b], scheme.block_size) for a, b in ranges]
    quantized = torch.cat([to_torch(q) for q, _ in parts])
    scales = torch.cat([to_torch(s) for _, s in parts]).to(torch.float32)
    if tuple(scales.shape) != tuple(scale_spec.local_shape):
        raise AssertionError(f"block scales {tuple(scales.shape)} vs layout {scale_spec.local_shape}")
    return {"weight": quantized, scheme.scale_name: scales}


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (AttributeError, OSError, TypeError):
        return None


def _release_freed_memory() -> None:
    """Hand the free heap pages back to the OS (glibc ``malloc_trim``; nothing elsewhere).

    glibc keeps freed blocks mapped: the previous dense weight, and XLA's temporaries, which are
    allocated on its worker threads' arenas. Without trimming, the resident size of an online
    load grows by about a dense layer per layer, to the size of the unquantized model."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
