"""The FP8 format's kernels: pure, jitted JAX functions over arrays (imported when one runs).

Checkpoint layouts are made for storage; kernels want others. Each function here takes and
returns arrays (no module state) and is ``jax.jit``-compiled once per shape; :mod:`.fp8_targets`
applies them to a loaded state. Torch tensors cross over through DLPack (:mod:`functional_load.dlpack`).

Bit-level conventions follow vLLM (``w8a8_utils``, ``fp8_utils``):

* dequantize for requantization: ``round_f16(f32(q) * scale)`` (vLLM's ``per_tensor_dequantize``
  multiplies an fp16 copy by the fp32 scale);
* static quantization: ``fp8(clamp(f32(x) * (1 / scale), -max, max))`` with round-to-nearest-even;
* every division is correctly rounded on every backend (:func:`divide`): XLA's float32 division
  on NVIDIA GPUs is ``div.full.f32``, one ulp off for about a quarter of all quotients;
* FNUZ: byte 0x80 (-0 in e4m3fn, NaN in e4m3fnuz) becomes 0x00, the bits are reinterpreted
  (each value halves) and the scales double; e8m0 block scales get exponent + 1, at most 254.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

FP8_MAX = 448.0  # float8_e4m3fn
FP8_FNUZ_MAX = 224.0  # vLLM quantizes to +-224 on FNUZ platforms (the format's max is 240)
_SIGN, _FRACTION, _HIDDEN = -(1 << 31), (1 << 23) - 1, 1 << 23


def divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a / b`` in float32, rounded to nearest even as IEEE 754 (and torch, and vLLM's CUDA
    kernels) round it, on every backend. XLA lowers a float32 division on NVIDIA GPUs to
    ``div.full.f32`` (openxla/xla#37181: one ulp off for about a quarter of all quotients) and
    rewrites a division by a constant into a multiplication by its inexact reciprocal; a scale
    one ulp off vLLM's changes the FP8 values it quantizes. So the significands are divided as
    integers (24 quotient bits, a guard bit and a sticky remainder). Zeros, subnormals,
    infinities, NaNs and quotients outside the normal range take the backend's division (XLA
    flushes subnormal results to zero)."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    ia, ib = jax.lax.bitcast_convert_type(a, jnp.int32), jax.lax.bitcast_convert_type(b, jnp.int32)
    ea, eb = (ia >> 23) & 0xFF, (ib >> 23) & 0xFF
    ma, mb = (ia & _FRACTION) | _HIDDEN, (ib & _FRACTION) | _HIDDEN
    low = (ma < mb).astype(jnp.int32)  # the quotient of the significands is below 1: one bit more
    rest, quotient = (ma << low) - mb, jnp.ones_like(ma)  # (ma << low) / mb is in [1, 2)
    for _ in range(24):  # 23 fraction bits and a guard bit; the remainder stays below 2**25
        rest = rest << 1
        bit = (rest >= mb).astype(jnp.int32)
        rest, quotient = rest - bit * mb, (quotient << 1) | bit
    significand = quotient >> 1
    significand = significand + ((quotient & 1) & ((rest != 0) | (significand & 1)).astype(jnp.int32))
    exponent = ea - eb + 127 - low + (significand >> 24)
    significand = jnp.where(significand >> 24 == 1, significand >> 1, significand)
    bits = ((ia ^ ib) & _SIGN) | (exponent << 23) | (significand & _FRACTION)
    exact = jax.lax.bitcast_convert_type(bits, jnp.float32)
    normal = (ea > 0) & (ea < 255) & (eb > 0) & (eb < 255) & (exponent >= 1) & (exponent <= 254)
    return jnp.where(normal, exact, a / b)


@jax.jit
def dequantize_fp8_f16(q: jax.Array, scale: jax.Array) -> jax.Array:
    """vLLM ``per_tensor_dequantize``: the fp16 product of the fp8 values and a scalar scale.

    The barrier keeps the fp16 rounding when a caller computes on: XLA allows itself excess
    precision by default (``xla_allow_excess_precision``) and on GPUs drops a float32 -> float16
    -> float32 round trip inside a fusion, which moved 0.5-14 % of requantized FP8 values by one
    step on an H200."""
    return jax.lax.optimization_barrier((q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(jnp.float16))


@partial(jax.jit, static_argnames=("fnuz",))
def quantize_fp8_static(x: jax.Array, scale: jax.Array, fnuz: bool = False) -> jax.Array:
    """vLLM static ``scaled_fp8_quant``: multiply by the reciprocal scale, clamp, round to fp8
    (e4m3fn, or e4m3fnuz clamped to +-224 as vLLM does on ROCm)."""
    inverse = divide(jnp.float32(1.0), scale)
    limit, dtype = (FP8_FNUZ_MAX, jnp.float8_e4m3fnuz) if fnuz else (FP8_MAX, jnp.float8_e4m3fn)
    return jnp.clip(x.astype(jnp.float32) * inverse, -limit, limit).astype(dtype)


@partial(jax.jit, static_argnames=("widths",))
def requantize_with_max_scale(weight: jax.Array, scales: jax.Array, widths: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """One scale for a fused FP8 weight stored with one scale per logical shard.

    Each row segment (``widths`` rows, in order) is dequantized with its own scale and
    requantized with the largest; returns ``(weight, max_scale)``. Segments whose scale already
    is the max come back unchanged (vLLM re-rounds them too; skipping avoids a double rounding
    and changes nothing when the round trip is exact), so a checkpoint fused with one scale is
    left exactly as it is. Works for e4m3fn and e4m3fnuz weights alike.
    """
    fnuz = weight.dtype == jnp.float8_e4m3fnuz
    max_scale = jnp.max(scales.astype(jnp.float32))
    pieces, start = [], 0
    for i, width in enumerate(widths):
        segment = weight[start : start + width]
        requantized = quantize_fp8_static(dequantize_fp8_f16(segment, scales[i]), max_scale, fnuz=fnuz)
        pieces.append(jnp.where(scales[i] == max_scale, segment, requantized))
        start += width
    return jnp.concatenate(pieces, axis=0), max_scale


@jax.jit
def requantize_experts_with_max_scale(w13: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MoE ``w13 [E, 2I, H]`` with per-expert ``scales [E, 2]`` (w1, w3): per-expert max."""
    half = w13.shape[1] // 2
    max_scales = jnp.max(scales.astype(jnp.float32), axis=1)

    def one(expert: jax.Array, s: jax.Array, m: jax.Array) -> jax.Array:
        parts = [expert[:half], expert[half:]]
        fnuz = expert.dtype == jnp.float8_e4m3fnuz
        out = [jnp.where(s[i] == m, p, quantize_fp8_static(dequantize_fp8_f16(p, s[i]), m, fnuz=fnuz)) for i, p in enumerate(parts)]
        return jnp.concatenate(out, axis=0)

    return jax.vmap(one)(w13, scales, max_scales), max_scales


@jax.jit
def e4m3fn_to_e4m3fnuz(weight: jax.Array) -> jax.Array:
    """Reinterpret e4m3fn bits as e4m3fnuz (each value halves); 0x80 (-0) becomes 0x00."""
    bits = jax.lax.bitcast_convert_type(weight, jnp.uint8)
    bits = jnp.where(bits == 0x80, jnp.uint8(0), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fnuz)


@jax.jit
def e8m0_scales_to_fnuz(scales: jax.Array) -> jax.Array:
    """E8M0 block scales for an FNUZ weight: exponent byte + 1 (doubling), clamped to 254."""
    bits = jax.lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.minimum(bits + 1, 254).astype(jnp.uint8), jnp.float8_e8m0fnu)


def _amax_scale(amax: jax.Array) -> jax.Array:
    """vLLM's ``amax / fp8_max``, correctly rounded (:func:`divide`); 1.0 where ``amax`` is 0."""
    return jnp.where(amax > 0, divide(amax, jnp.float32(FP8_MAX)), jnp.float32(1.0))


@jax.jit
def quantize_fp8_per_tensor(weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Online FP8: ``scale = amax / 448`` over the whole (rank-local) tensor, then static quantization."""
    amax = jnp.max(jnp.abs(weight.astype(jnp.float32)))
    scale = _amax_scale(amax)
    return quantize_fp8_static(weight, scale), scale


@partial(jax.jit, static_argnames=("block",))
def quantize_fp8_block(weight: jax.Array, block: tuple[int, int] = (128, 128)) -> tuple[jax.Array, jax.Array]:
    """Online block FP8 of a 2-D weight: one ``amax / 448`` scale per ``block`` tile (edge tiles
    partial), DeepSeek's ``weight_scale_inv`` layout ``[ceil(rows/bn), ceil(cols/bk)]``."""
    bn, bk = block
    rows, cols = weight.shape
    nr, nc = -(-rows // bn), -(-cols // bk)
    padded = jnp.zeros((nr * bn, nc * bk), jnp.float32).at[:rows, :cols].set(weight.astype(jnp.float32))
    tiles = padded.reshape(nr, bn, nc, bk)
    amax = jnp.max(jnp.abs(tiles), axis=(1, 3))
    scales = _amax_scale(amax)
    inverse = jnp.repeat(jnp.repeat(divide(jnp.float32(1.0), scales), bn, axis=0), bk, axis=1)[:rows, :cols]
    quantized = jnp.clip(weight.astype(jnp.float32) * inverse, -FP8_MAX, FP8_MAX)
    return quantized.astype(jnp.float8_e4m3fn), scales


def transpose(weight: jax.Array) -> jax.Array:
    """``[N, K] -> [K, N]`` (contiguous), the orientation FP8 GEMM kernels take."""
    return _transpose(weight)


@jax.jit
def _transpose(weight: jax.Array) -> jax.Array:
    return weight.T

