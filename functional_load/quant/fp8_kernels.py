"""The FP8 format's kernels: pure, jitted JAX functions over arrays (imported when one runs).

Checkpoint layouts are made for storage; kernels want others. Each function here takes and
returns arrays (no module state) and is ``jax.jit``-compiled once per shape; :mod:`.fp8_targets`
applies them to a loaded state. Torch tensors cross over through DLPack (:mod:`functional_load.dlpack`).

Bit-level conventions follow vLLM (``w8a8_utils``, ``fp8_utils``):

* dequantize for requantization: ``round_f16(f32(q) * scale)`` (vLLM's ``per_tensor_dequantize``
  multiplies an fp16 copy by the fp32 scale);
* static quantization: ``fp8(clamp(f32(x) * (1 / scale), -max, max))`` with round-to-nearest-even;
* FNUZ: byte 0x80 (-0 in e4m3fn, NaN in e4m3fnuz) becomes 0x00, the bits are reinterpreted
  (each value halves) and the scales double; e8m0 block scales get exponent + 1, at most 254.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

FP8_MAX = 448.0  # float8_e4m3fn
FP8_FNUZ_MAX = 224.0  # vLLM quantizes to +-224 on FNUZ platforms (the format's max is 240)


@jax.jit
def dequantize_fp8_f16(q: jax.Array, scale: jax.Array) -> jax.Array:
    """vLLM ``per_tensor_dequantize``: the fp16 product of the fp8 values and a scalar scale."""
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(jnp.float16)


@partial(jax.jit, static_argnames=("fnuz",))
def quantize_fp8_static(x: jax.Array, scale: jax.Array, fnuz: bool = False) -> jax.Array:
    """vLLM static ``scaled_fp8_quant``: multiply by the reciprocal scale, clamp, round to fp8
    (e4m3fn, or e4m3fnuz clamped to +-224 as vLLM does on ROCm)."""
    inverse = jnp.float32(1.0) / scale.astype(jnp.float32)
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
    """``amax / 448`` correctly rounded (1.0 where ``amax`` is 0). XLA rewrites a division by a
    constant into a multiplication by its reciprocal, and 1/448 is inexact: about half of all
    scales would come out one ulp off vLLM's ``amax / fp8_max``. The barrier keeps a true division."""
    divisor = jax.lax.optimization_barrier(jnp.full(amax.shape, FP8_MAX, jnp.float32))
    return jnp.where(amax > 0, amax / divisor, jnp.float32(1.0))


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
    expanded = jnp.repeat(jnp.repeat(scales, bn, axis=0), bk, axis=1)[:rows, :cols]
    quantized = jnp.clip(weight.astype(jnp.float32) * (jnp.float32(1.0) / expanded), -FP8_MAX, FP8_MAX)
    return quantized.astype(jnp.float8_e4m3fn), scales


def transpose(weight: jax.Array) -> jax.Array:
    """``[N, K] -> [K, N]`` (contiguous), the orientation FP8 GEMM kernels take."""
    return _transpose(weight)


@jax.jit
def _transpose(weight: jax.Array) -> jax.Array:
    return weight.T


@partial(jax.jit, static_argnames=("grid", "offset"))
def dequantize_box(weight: jax.Array, scale: jax.Array, grid: tuple[int, int], offset: tuple[int, int]) -> jax.Array:
    """``W = q * scale`` for a box of a weight: each scale cell covers a ``grid`` of values, the
    box starting ``offset`` values into its first cell (block scales; per channel ``(1, cols)``,
    per tensor the whole box)."""
    rows, cols = weight.shape
    expanded = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), grid[0], axis=0), grid[1], axis=1)
    return weight.astype(jnp.float32) * expanded[offset[0] : offset[0] + rows, offset[1] : offset[1] + cols]
