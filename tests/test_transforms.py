"""The jitted JAX transforms (``functional_load.quant.fp8_kernels``), the output targets and DLPack.

Everything bit-level is compared with a plain numpy / ml_dtypes reference written here, with the
conventions of ``transforms``' module docstring (vLLM's):

* dequantize for requantization: ``float16(float32(q) * float32(scale))``;
* static quantization: ``float8_e4m3fn(clip(float32(x) * (float32(1) / scale), -448, 448))``,
  round to nearest even (ml_dtypes' cast); on FNUZ ``float8_e4m3fnuz`` clipped to +-224;
* online per-tensor scale ``amax / 448`` (float32), block scales ``tile amax / 448`` per
  128 x 128 tile (edge tiles partial);
* a segment whose scale already is the max comes back unchanged (a deliberate difference from
  vLLM, which re-rounds it too; see ``requantize_with_max_scale``).

Random weights never hold the NaN bytes (0x7F/0xFF in e4m3fn, 0x80 in e4m3fnuz): a checkpoint
with NaN weights is broken and NaN payloads are not a convention worth pinning.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import functional_load as fl
from functional_load.dlpack import shares_memory, to_jax, to_torch
from functional_load.plan.rotary import to_halves, to_pairs
from functional_load.quant import fp8_kernels as transforms

FIXTURES = Path(__file__).parent / "fixtures" / "quant"
E4M3FN = ml_dtypes.float8_e4m3fn
E4M3FNUZ = ml_dtypes.float8_e4m3fnuz
E8M0 = ml_dtypes.float8_e8m0fnu
F32 = np.float32


from fp8_reference import ref_block, ref_dequant, ref_per_tensor, ref_quant, ref_requant  # noqa: E402
from helpers import segment_rows  # noqa: E402


def bits(a) -> np.ndarray:
    """Raw bytes of an array (jax, numpy or torch) as unsigned integers of the same width."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        width = a.element_size()
        return a.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[width]).numpy().view(f"u{width}")
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def random_fp8(rng: np.random.Generator, shape, fnuz: bool = False) -> np.ndarray:
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    nan = (raw == 0x80) if fnuz else ((raw & 0x7F) == 0x7F)
    raw[nan] = 0x00
    return raw.view(E4M3FNUZ if fnuz else E4M3FN)


def random_weights(rng: np.random.Generator, shape, dtype=ml_dtypes.bfloat16) -> np.ndarray:
    """Normal values with log-normal magnitudes over ~8 decades (so fp8 subnormals and the clip
    at the top both occur), a few exact zeros, random signs."""
    x = rng.standard_normal(shape) * np.exp(rng.normal(0.0, 3.0, size=shape)) * 0.01
    x[rng.random(shape) < 0.01] = 0.0
    return x.astype(dtype)


# ------------------------------------------------------------------------------------------
# FNUZ and e8m0 (reference section 2.6)

FNUZ_TABLE = [
    # byte, e4m3fn value, byte after the patch, e4m3fnuz value
    (0x00, 0.0, 0x00, 0.0),
    (0x01, 0.001953125, 0x01, 0.0009765625),
    (0x08, 0.015625, 0x08, 0.0078125),
    (0x38, 1.0, 0x38, 0.5),
    (0x40, 2.0, 0x40, 1.0),
    (0x7E, 448.0, 0x7E, 224.0),
    (0x7F, math.nan, 0x7F, 240.0),
    (0x80, -0.0, 0x00, 0.0),
    (0x81, -0.001953125, 0x81, -0.0009765625),
    (0xB8, -1.0, 0xB8, -0.5),
    (0xC0, -2.0, 0xC0, -1.0),
    (0xFE, -448.0, 0xFE, -224.0),
    (0xFF, math.nan, 0xFF, -240.0),
]


@pytest.mark.parametrize(("byte", "fn_value", "out_byte", "fnuz_value"), FNUZ_TABLE, ids=[f"0x{r[0]:02X}" for r in FNUZ_TABLE])
def test_fnuz_table(byte: int, fn_value: float, out_byte: int, fnuz_value: float) -> None:
    source = np.array([byte], dtype=np.uint8).view(E4M3FN)
    if math.isnan(fn_value):
        assert np.isnan(source.astype(F32)[0])
    else:
        assert source.astype(F32)[0] == fn_value and math.copysign(1, source.astype(F32)[0]) == math.copysign(1, fn_value)
    out = transforms.e4m3fn_to_e4m3fnuz(jnp.asarray(source))
    assert out.dtype == jnp.float8_e4m3fnuz
    assert int(bits(out)[0]) == out_byte
    value = float(np.asarray(out).astype(F32)[0])
    assert value == fnuz_value and math.copysign(1, value) == math.copysign(1, fnuz_value)


def test_fnuz_all_bytes_against_ml_dtypes() -> None:
    every = np.arange(256, dtype=np.uint8)
    out = transforms.e4m3fn_to_e4m3fnuz(jnp.asarray(every.view(E4M3FN)))
    expected = np.where(every == 0x80, 0, every).astype(np.uint8)
    np.testing.assert_array_equal(bits(out), expected)
    fn_values = every.view(E4M3FN).astype(np.float64)
    fnuz_values = np.asarray(out).astype(np.float64)
    finite = ~np.isnan(fn_values)
    assert finite.sum() == 254  # 0x7F and 0xFF are the only NaNs of e4m3fn
    # every finite e4m3fn value halves exactly (exponent bias 8 instead of 7); no NaN comes out
    np.testing.assert_array_equal(fnuz_values[finite], fn_values[finite] / 2)
    assert not np.isnan(fnuz_values).any()


def test_e8m0_scales_exponent_plus_one_all_bytes() -> None:
    every = np.arange(256, dtype=np.uint8)
    out = transforms.e8m0_scales_to_fnuz(jnp.asarray(every.view(E8M0)))
    assert out.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(bits(out), np.minimum(every.astype(np.int32) + 1, 254).astype(np.uint8))
    below = every < 254  # a doubling for every byte that is not clamped
    np.testing.assert_array_equal(np.asarray(out)[below].astype(np.float64), every[below].view(E8M0).astype(np.float64) * 2)


# ------------------------------------------------------------------------------------------
# Requantization with the max scale (reference section 2.7)

# rows 0-1 (scale 0.5): the values of section 2.7; rows 2-3 (scale 1.0): arbitrary
EXAMPLE_ROWS = [[448.0, 1.0, -3.0, 0.001953125], [0.5, 2.0, 10.0, -0.015625], [3.0, -0.5, 0.125, 448.0], [-448.0, 0.0, 7.0, -0.001953125]]
EXAMPLE_OUT_01 = [[224.0, 0.5, -1.5, 0.0], [0.25, 1.0, 5.0, -0.0078125]]


def _example() -> np.ndarray:
    return np.array(EXAMPLE_ROWS, dtype=F32).astype(E4M3FN)


def test_requantize_example_2_7() -> None:
    weight = _example()
    assert list(bits(weight)[0]) == [0x7E, 0x38, 0xC4, 0x01]
    out, scale = transforms.requantize_with_max_scale(jnp.asarray(weight), jnp.asarray([0.5, 1.0], jnp.float32), (2, 2))
    assert out.dtype == jnp.float8_e4m3fn and out.shape == (4, 4)
    assert scale.shape == () and scale.dtype == jnp.float32 and float(scale) == 1.0
    out_bits, out_values = bits(out), np.asarray(out).astype(F32)
    assert list(out_bits[0]) == [0x76, 0x30, 0xBC, 0x00]  # 224, 0.5, -1.5, and 2^-10 rounds (half to even) to +0
    np.testing.assert_array_equal(out_values[:2], np.array(EXAMPLE_OUT_01, dtype=F32))
    np.testing.assert_array_equal(out_bits[1], np.array(EXAMPLE_OUT_01[1], dtype=F32).astype(E4M3FN).view(np.uint8))
    np.testing.assert_array_equal(out_bits[2:], bits(weight)[2:])  # rows 2-3 (the max scale) unchanged
    ref, ref_top = ref_requant(weight, np.array([0.5, 1.0]), (2, 2))
    np.testing.assert_array_equal(out_bits, bits(ref))
    assert ref_top == 1.0


def test_requantize_example_2_7_on_fnuz() -> None:
    """On FNUZ the bits are reinterpreted (values halve) and the scales double to [1.0, 2.0]:
    the requantized bits are those of the e4m3fn example, and every dequantized value is too."""
    fn_out, _ = transforms.requantize_with_max_scale(jnp.asarray(_example()), jnp.asarray([0.5, 1.0], jnp.float32), (2, 2))
    weight = transforms.e4m3fn_to_e4m3fnuz(jnp.asarray(_example()))
    out, scale = transforms.requantize_with_max_scale(weight, jnp.asarray([1.0, 2.0], jnp.float32), (2, 2))
    assert out.dtype == jnp.float8_e4m3fnuz and float(scale) == 2.0
    np.testing.assert_array_equal(bits(out), np.where(bits(fn_out) == 0x80, 0, bits(fn_out)))
    np.testing.assert_array_equal(np.asarray(out).astype(F32) * F32(2.0), np.asarray(fn_out).astype(F32) * F32(1.0))
    ref, _ = ref_requant(np.asarray(weight), np.array([1.0, 2.0]), (2, 2))
    np.testing.assert_array_equal(bits(out), bits(ref))


def test_max_scale_segment_is_returned_unchanged() -> None:
    """Deliberate: with a scale of 2^-20 a re-rounding (vLLM's way) would flush small values to
    zero through fp16 (2^-9 * 2^-20 is below fp16's smallest subnormal) and turn -0 into +0;
    segments at the max scale keep every bit instead."""
    weight = np.array([[0x01, 0x80, 0x7E, 0x81], [0x02, 0x09, 0xB8, 0xFE]], dtype=np.uint8).view(E4M3FN)
    scales = jnp.asarray([2.0**-20, 2.0**-20], jnp.float32)
    out, scale = transforms.requantize_with_max_scale(jnp.asarray(weight), scales, (1, 1))
    np.testing.assert_array_equal(bits(out), bits(weight))
    assert float(scale) == 2.0**-20
    rerounded = ref_quant(ref_dequant(weight, F32(2.0**-20)), F32(2.0**-20))
    assert not np.array_equal(bits(rerounded), bits(weight))  # what skipping avoids


REQUANT_CASES = [
    # widths, scales
    ((2, 2), (0.5, 1.0)),
    ((64, 32, 32), (1.7e-4, 1.8e-4, 1.6e-4)),
    ((5, 3, 7), (0.01, 0.01, 0.002)),  # two segments at the max
    ((128, 0, 1), (3e-3, 4e-3, 2e-3)),  # a zero-width segment
    ((17, 33), (200.0, 1000.0)),  # fp16 overflow (448 * 200 > 65504): inf, clipped to 448
    ((9, 9), (2.0**-20, 1e-4)),  # fp16 subnormal products
    ((1,), (0.25,)),
    ((40, 24, 24), (1e-6, 3e-2, 5.0)),
]


@pytest.mark.parametrize("fnuz", [False, True], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize(("widths", "scales"), REQUANT_CASES)
def test_requantize_matches_reference(widths, scales, fnuz: bool) -> None:
    rng = np.random.default_rng(sum(widths) + len(widths))
    weight = random_fp8(rng, (sum(widths), 24), fnuz=fnuz)
    scales = np.array(scales, dtype=F32)
    out, top = transforms.requantize_with_max_scale(jnp.asarray(weight), jnp.asarray(scales), tuple(widths))
    ref, ref_top = ref_requant(weight, scales, widths)
    assert out.dtype == (jnp.float8_e4m3fnuz if fnuz else jnp.float8_e4m3fn)
    np.testing.assert_array_equal(bits(out), bits(ref))
    assert np.float32(top) == ref_top


@pytest.mark.parametrize("fnuz", [False, True], ids=["e4m3fn", "e4m3fnuz"])
def test_requantize_experts_matches_reference(fnuz: bool) -> None:
    rng = np.random.default_rng(7)
    experts, inter, hidden = 5, 24, 40
    w13 = random_fp8(rng, (experts, 2 * inter, hidden), fnuz=fnuz)
    scales = np.exp(rng.uniform(-12, 0, size=(experts, 2))).astype(F32)
    scales[1, 1] = scales[1, 0]  # one expert with equal scales: returned unchanged
    scales[3, 0] = 2.0**-20
    out, top = transforms.requantize_experts_with_max_scale(jnp.asarray(w13), jnp.asarray(scales))
    assert out.shape == w13.shape and top.shape == (experts,)
    for e in range(experts):
        ref, ref_top = ref_requant(w13[e], scales[e], (inter, inter))
        np.testing.assert_array_equal(bits(out[e]), bits(ref), err_msg=f"expert {e}")
        assert np.float32(top[e]) == ref_top
    np.testing.assert_array_equal(bits(out[1]), bits(w13[1]))


# ------------------------------------------------------------------------------------------
# Online quantization: per tensor and 128 x 128 blocks

SHAPES = [(1, 1), (7, 5), (128, 128), (129, 257), (300, 200), (256, 384), (1000, 130)]


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_quantize_per_tensor_matches_reference(shape, dtype) -> None:
    x = random_weights(np.random.default_rng(shape[0] * 1000 + shape[1]), shape, dtype)
    q, scale = transforms.quantize_fp8_per_tensor(jnp.asarray(x))
    ref_q, ref_s = ref_per_tensor(x)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == shape
    assert scale.shape == () and scale.dtype == jnp.float32 and np.float32(scale) == ref_s
    np.testing.assert_array_equal(bits(q), bits(ref_q))


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_quantize_block_matches_reference(shape) -> None:
    x = random_weights(np.random.default_rng(shape[0] * 7 + shape[1]), shape)
    if shape[0] > 128:
        x[128:] *= 1000  # tiles with very different scales
    q, scales = transforms.quantize_fp8_block(jnp.asarray(x))
    ref_q, ref_s = ref_block(x)
    assert scales.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)) and scales.dtype == jnp.float32
    np.testing.assert_array_equal(bits(scales), bits(ref_s))
    np.testing.assert_array_equal(bits(q), bits(ref_q))


def test_quantize_other_block_size_and_zero_tiles() -> None:
    x = random_weights(np.random.default_rng(3), (70, 45))
    x[:32, :16] = 0  # a zero tile gets scale 1.0 (and zero codes), as per-tensor does
    q, scales = transforms.quantize_fp8_block(jnp.asarray(x), (32, 16))
    ref_q, ref_s = ref_block(x, 32, 16)
    assert scales.shape == (3, 3) and float(scales[0, 0]) == 1.0
    np.testing.assert_array_equal(bits(scales), bits(ref_s))
    np.testing.assert_array_equal(bits(q), bits(ref_q))
    zero_q, zero_s = transforms.quantize_fp8_per_tensor(jnp.zeros((4, 4), jnp.bfloat16))
    assert float(zero_s) == 1.0 and not bits(zero_q).any()


def test_quantize_static_clips_and_rounds_half_to_even() -> None:
    x = jnp.asarray([1000.0, -1000.0, 2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, 464.0, 240.0, 232.0], jnp.float32)
    out = np.asarray(transforms.quantize_fp8_static(x, jnp.float32(1.0))).astype(F32)
    # 2^-10 ties to 0, 3*2^-10 to 2^-8 (even), 1.0625 to 1.0, 1.1875 to 1.25, 464 (between 448 and
    # the NaN slot) is clipped first
    np.testing.assert_array_equal(out, np.array([448, -448, 0, 2.0**-8, 1.0, 1.25, 448, 240, 224], dtype=F32))
    fnuz = np.asarray(transforms.quantize_fp8_static(x, jnp.float32(1.0), fnuz=True)).astype(F32)
    np.testing.assert_array_equal(fnuz[:2], [224, -224])  # vLLM's +-224 on FNUZ, not the format's 240
    assert fnuz[7] == 224 and fnuz[8] == 224


# Error bound of online FP8 (e4m3fn: 3 mantissa bits, smallest normal 2^-6, subnormal spacing 2^-9).
# With y = x / s the value in fp8 units (|y| <= 448 by construction of s = amax / 448), round to
# nearest gives |fp8(y) - y| <= half a spacing:
#   * normal range, y in [2^e, 2^(e+1)), e >= -6: spacing 2^(e-3), so the error is <= 2^(e-4) <= 2^-4 |y|;
#   * subnormal range, |y| < 2^-6: spacing 2^-9, so the error is <= 2^-10 (absolute).
# Both hold for any y, so |fp8(y) - y| <= 2^-4 |y| + 2^-10, and in weight units (times s)
#   |dequant - x| <= 2^-4 |x| + 2^-10 s.
# The float32 arithmetic (1/s, x * (1/s), the clip when that product lands a few ulps above 448,
# and q * s) adds at most a few 2^-24 relative errors: covered by 2^-20 |x|.


def _fp8_bound(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    x = np.abs(x.astype(np.float64))
    return 2.0**-4 * x + 2.0**-10 * scale.astype(np.float64) + 2.0**-20 * x


@pytest.mark.parametrize("shape", [(300, 200), (1000, 130), (64, 64)])
def test_per_tensor_error_within_rounding_bound(shape) -> None:
    x = random_weights(np.random.default_rng(11 + shape[0]), shape)
    q, scale = transforms.quantize_fp8_per_tensor(jnp.asarray(x))
    dequant = np.asarray(q).astype(F32).astype(np.float64) * np.float64(np.float32(scale))
    error = np.abs(dequant - x.astype(np.float64))
    bound = _fp8_bound(x, np.full(shape, np.float32(scale)))
    assert (error <= bound).all(), f"worst error / bound {np.max(error / bound):.4f}"
    assert np.max(error / bound) > 0.5  # the bound is tight (an off-by-one rounding would break it)
    y = np.abs(x.astype(np.float64)) / np.float64(np.float32(scale))
    assert (y < 2.0**-6).any() and (y > 2.0**-6).any()  # both parts of the bound are exercised


@pytest.mark.parametrize("shape", [(300, 200), (129, 257)])
def test_block_error_within_rounding_bound(shape) -> None:
    x = random_weights(np.random.default_rng(5 + shape[1]), shape)
    x[:, 128:] *= 50
    q, scales = transforms.quantize_fp8_block(jnp.asarray(x))
    per_element = np.repeat(np.repeat(np.asarray(scales), 128, axis=0), 128, axis=1)[: shape[0], : shape[1]]
    dequant = np.asarray(q).astype(F32).astype(np.float64) * per_element.astype(np.float64)
    error = np.abs(dequant - x.astype(np.float64))
    bound = _fp8_bound(x, per_element)
    assert (error <= bound).all(), f"worst error / bound {np.max(error / bound):.4f}"
    assert np.max(error / bound) > 0.5


def _bits32(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def test_divide_is_correctly_rounded() -> None:
    """``divide`` equals IEEE float32 division bit for bit (numpy's, as torch and vLLM's CUDA
    kernels divide) over random significands and exponents, exact quotients, ties, the FP8 scale
    ``amax / 448``, reciprocals, and the special values left to the hardware."""
    rng = np.random.default_rng(7)
    n = 200_000

    def floats(lo: int, hi: int) -> np.ndarray:
        bits = rng.integers(0, 1 << 23, n, dtype=np.uint32) | (rng.integers(lo, hi, n, dtype=np.uint32) << 23)
        return np.where(rng.random(n) < 0.2, bits | (1 << 31), bits).astype(np.uint32).view(np.float32)

    a, b = floats(70, 180), floats(70, 180)  # normal quotients (XLA flushes subnormal ones to zero)
    whole = rng.integers(1, 1 << 12, n).astype(np.float32)
    cases = [
        (a, b),
        (b * whole, b),  # exact quotients
        (np.abs(a), np.float32(448.0)),
        (np.float32(1.0), np.abs(b)),
        (np.float32([0.0, -0.0, 1.0, np.inf, 3.0, 1e38, np.nan]), np.float32([3.0, 2.0, 0.0, 2.0, np.inf, 1e-3, 1.0])),
    ]
    for x, y in cases:
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            want = np.divide(x, y)
        got = np.asarray(jax.jit(transforms.divide)(jnp.asarray(x), jnp.asarray(y)))
        same = (_bits32(got) == _bits32(want)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (np.asarray(x).reshape(-1)[:3], got[~same][:3], want[~same][:3])
    # the rounding itself is checked: a quotient truncated instead of rounded is one ulp off here
    assert _bits32(transforms.divide(np.float32(2.0), np.float32(3.0))) == _bits32(np.float32(2.0) / np.float32(3.0)) == 0x3F2AAAAB


def test_transpose() -> None:
    x = random_fp8(np.random.default_rng(0), (48, 80))
    out = transforms.transpose(jnp.asarray(x))
    assert out.shape == (80, 48)
    np.testing.assert_array_equal(bits(out), bits(x).T)


# ------------------------------------------------------------------------------------------
# Rotary permutation (Mistral consolidated / Meta layout <-> HF layout)


def transformers_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """transformers' ``permute`` of its Llama/Mistral conversion scripts (from
    ``convert_llama_weights_to_hf.py`` when importable; else the same one line, as in the script:
    ``w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)``)."""
    dim1, dim2 = w.shape
    try:  # transformers < 5 ships the conversion scripts
        from transformers.models.llama.convert_llama_weights_to_hf import permute  # type: ignore[import-not-found]
    except ImportError:
        return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)
    return permute(w, n_heads=n_heads, dim1=dim1, dim2=dim2)


def permute_rotary(weight: Any, heads: int) -> Any:
    """Mistral's interleaved rotary pairs -> HF's halves, per head (transformers' ``permute``)."""
    return to_halves(weight, weight.shape[0] // heads)


def unpermute_rotary(weight: Any, heads: int) -> Any:
    return to_pairs(weight, weight.shape[0] // heads)


@pytest.mark.parametrize(("heads", "head_dim", "cols"), [(1, 4, 3), (8, 8, 64), (2, 128, 16), (4, 64, 5)])
def test_rotary_permutation_round_trip_and_transformers(heads: int, head_dim: int, cols: int) -> None:
    w = torch.randn(heads * head_dim, cols, generator=torch.Generator().manual_seed(heads))
    hf = permute_rotary(w, heads)
    assert torch.equal(unpermute_rotary(hf, heads), w)
    assert torch.equal(hf, transformers_permute(w, heads))
    as_numpy = permute_rotary(w.numpy(), heads)  # einops works on any array type
    np.testing.assert_array_equal(as_numpy, hf.numpy())
    assert not torch.equal(hf, w) or head_dim == 2


def test_rotary_permutation_hand_example() -> None:
    # per head, interleaved pairs (x0, y0), (x1, y1) -> halves x0, x1 | y0, y1
    rows = torch.arange(8).reshape(8, 1)
    assert permute_rotary(rows, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert unpermute_rotary(rows, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert permute_rotary(torch.arange(8).reshape(8, 1), 1).flatten().tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


# ------------------------------------------------------------------------------------------
# Output targets on the FP8 fixtures

FP8_FIXTURES = ["ct_fp8_tensor", "quark_fp8", "llmc_fp8_kv", "ct_fp8_channel", "hf_fp8_block", "hf_fp8_block_ue8m0"]
_LOADS: dict[tuple[str, int, int, str], fl.LoadedState] = {}


def _load(name: str, tp: int, rank: int, target: str) -> fl.LoadedState:
    key = (name, tp, rank, target)
    if key not in _LOADS:
        _LOADS[key] = fl.load(FIXTURES / name, tp_size=tp, rank=rank, target=target, progress=False)
    return _LOADS[key]


def _segment_widths(name: str, module: str, tp: int) -> tuple[int, ...]:
    """Rank-local output rows of each logical shard, from config.json alone."""
    return segment_rows(json.loads((FIXTURES / name / "config.json").read_text()), module, tp)


def _ranks():
    return [(1, 0), (2, 0), (2, 1)]


@pytest.mark.parametrize(("tp", "rank"), _ranks(), ids=lambda v: str(v))
@pytest.mark.parametrize("target", ["cuda-fp8", "rocm-fp8"])
@pytest.mark.parametrize("name", FP8_FIXTURES)
def test_fp8_targets(name: str, target: str, tp: int, rank: int) -> None:
    ckpt = _load(name, tp, rank, "checkpoint")
    out = _load(name, tp, rank, target)
    fnuz = target == "rocm-fp8"
    assert out.target == target and ckpt.target == "checkpoint"
    modules = [m for m, s in out.plan.schemes.items() if s.format == "fp8"]
    assert len(modules) == 4  # qkv, o, gate_up, down of the one layer
    requantized_any = False
    for module in modules:
        scheme = out.plan.schemes[module]
        weight, scale = out[f"{module}.weight"], out[f"{module}.{scheme.scale_name}"]
        ck_weight, ck_scale = ckpt[f"{module}.weight"], ckpt[f"{module}.{scheme.scale_name}"]
        assert weight.dtype == (torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
        assert weight.is_contiguous()
        if scheme.strategy in ("tensor", "channel"):
            assert tuple(weight.shape) == tuple(ck_weight.shape)[::-1]  # [in, out] (K, N)
        else:
            assert tuple(weight.shape) == tuple(ck_weight.shape)
        factor = 2.0 if fnuz else 1.0
        # --- scales
        if scheme.strategy == "tensor":
            assert scale.dim() == 0 and scale.dtype == torch.float32
            assert float(scale) == factor * float(ck_scale.max())
        elif scale.dtype == torch.float8_e8m0fnu:
            expected = np.minimum(bits(ck_scale).astype(np.int32) + (1 if fnuz else 0), 254)
            np.testing.assert_array_equal(bits(scale), expected)
        else:
            assert scale.shape == ck_scale.shape and torch.equal(scale, ck_scale * factor)
        if f"{module}.input_scale" in out:
            assert out[f"{module}.input_scale"].dim() == 0
            assert float(out[f"{module}.input_scale"]) == factor * float(ckpt[f"{module}.input_scale"].max())
        # --- weight bits
        kernel = weight.T if scheme.strategy in ("tensor", "channel") else weight  # back to [out, in]
        expected = np.asarray(ck_weight.contiguous().view(torch.uint8).numpy())
        if scheme.strategy == "tensor":
            widths = _segment_widths(name, module, tp)
            assert sum(widths) == ck_weight.shape[0] and len(widths) == ck_scale.numel()
            ref, _ = ref_requant(ck_weight.view(torch.uint8).numpy().view(E4M3FN), ck_scale.numpy(), widths)
            expected = bits(ref)
            requantized_any |= not np.array_equal(expected, bits(ck_weight))
        if fnuz:
            expected = np.where(expected == 0x80, 0, expected)
        np.testing.assert_array_equal(bits(kernel), expected, err_msg=module)
        # --- dequantized weights
        dense, ck_dense = fl.dequantize(out, module), fl.dequantize(ckpt, module)
        assert dense.shape == ck_dense.shape == ck_weight.shape
        if scheme.strategy != "tensor" or bool((ck_scale == ck_scale.max()).all()):
            assert torch.equal(dense, ck_dense), module  # exact: transpose, or x/2 * 2s, or nothing
            continue
        # A fused per-tensor layer: rows of a segment with scale s_i < s_max were requantized.
        # With x = q * s_i (the checkpoint's value), the fp16 step gives dq = fp16(x), off by at
        # most 2^-11 |x| (normal) or 2^-25 (fp16 subnormal spacing 2^-24); the fp8 rounding of
        # dq / s_max is off by at most 2^-4 |dq| + 2^-10 s_max (see _fp8_bound). So
        #   |dequant' - x| <= (2^-11 + 2^-4 (1 + 2^-11)) |x| + 2^-25 (1 + 2^-4) + 2^-10 s_max
        #                  <  (2^-4 + 2^-10) |x| + 2^-24 + 2^-10 s_max,
        # plus float32 slack (2^-20 |x|). On FNUZ values halve and scales double: same bound.
        top, start = float(ck_scale.max()) * factor, 0
        for width, s in zip(_segment_widths(name, module, tp), ck_scale.tolist()):
            rows = slice(start, start + width)
            start += width
            if s == float(ck_scale.max()):
                assert torch.equal(dense[rows], ck_dense[rows]), module
                continue
            x = ck_dense[rows].double()
            bound = (2.0**-4 + 2.0**-10 + 2.0**-20) * x.abs() + 2.0**-24 + 2.0**-10 * top / factor
            error = (dense[rows].double() - x).abs()
            assert bool((error <= bound).all()), f"{module}: worst error / bound {float((error / bound).max()):.3f}"
    if name in ("ct_fp8_tensor", "quark_fp8", "llmc_fp8_kv"):
        assert requantized_any  # the fixtures' fused layers have unequal scales: requantization ran
    # --- KV-cache scales, as vLLM's BaseKVCacheMethod.process_weights_after_loading leaves them:
    # both loaded (positive): kept; neither (vLLM's -1.0): 1.0; one alone: used for both; FNUZ doubles
    kv = [n for n in ckpt if n.endswith((".attn.k_scale", ".attn.v_scale"))]
    assert kv
    for n in kv:
        k, v = (float(ckpt[n.rsplit(".", 1)[0] + f".{s}_scale"]) for s in ("k", "v"))
        want = (k if n.endswith("k_scale") else v) if k > 0 and v > 0 else 1.0 if k < 0 and v < 0 else max(k, v)
        assert out[n].shape == ckpt[n].shape and float(out[n]) == (2.0 if fnuz else 1.0) * want, (n, float(out[n]), k, v)
    # every other tensor is untouched
    untouched = [n for n in ckpt if not any(n.startswith(m + ".") for m in modules) and n not in kv]
    assert untouched
    for n in untouched:
        assert torch.equal(out[n], ckpt[n]), n


def test_unknown_target_is_a_config_error() -> None:
    with pytest.raises(fl.ConfigError, match="target"):
        fl.load(FIXTURES / "ct_fp8_tensor", target="tpu-fp8")


def test_targets_leave_unquantized_checkpoints_alone(tiny_checkpoint) -> None:
    directory = tiny_checkpoint("llama")
    ckpt = fl.load(directory, tp_size=2, rank=1, progress=False)
    for target in ("cuda-fp8", "rocm-fp8"):
        out = fl.load(directory, tp_size=2, rank=1, target=target, progress=False)
        assert out.keys() == ckpt.keys()
        for name in ckpt:
            assert torch.equal(out[name], ckpt[name]), name


# ------------------------------------------------------------------------------------------
# DLPack


DLPACK_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8, torch.uint8, torch.int32]


def _sample(dtype: torch.dtype, shape=(37, 64)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 10).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DLPACK_DTYPES, ids=str)
def test_to_jax_and_back_is_zero_copy(dtype: torch.dtype) -> None:
    t = _sample(dtype)
    a = to_jax(t)
    assert a.shape == tuple(t.shape) and np.dtype(a.dtype).itemsize == t.element_size()
    assert shares_memory(t, a)
    np.testing.assert_array_equal(bits(a), bits(t))
    back = to_torch(a)
    assert back.dtype == t.dtype and back.data_ptr() == t.data_ptr()
    t.view(torch.uint8)[0, 0] ^= 1  # a write through torch shows through the jax array
    np.testing.assert_array_equal(bits(a), bits(t))


NUMPY_DTYPES = {
    torch.float32: np.float32,
    torch.bfloat16: ml_dtypes.bfloat16,
    torch.float16: np.float16,
    torch.float8_e4m3fn: E4M3FN,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int32: np.int32,
}


@pytest.mark.parametrize("dtype", DLPACK_DTYPES, ids=str)
def test_to_torch_from_jax_is_zero_copy(dtype: torch.dtype) -> None:
    raw = np.random.default_rng(1).integers(0, 256, size=(37, 64 * _sample(dtype).element_size()), dtype=np.uint8)
    if dtype == torch.float8_e4m3fn:
        raw[(raw & 0x7F) == 0x7F] = 0  # no NaN bytes
    a = jnp.asarray(raw.view(NUMPY_DTYPES[dtype]))
    t = to_torch(a)
    assert t.dtype == dtype and tuple(t.shape) == a.shape == (37, 64)
    assert shares_memory(t, a)
    np.testing.assert_array_equal(bits(t), bits(a))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32], ids=str)
def test_non_contiguous_tensor_is_copied(dtype: torch.dtype) -> None:
    base = _sample(dtype, (16, 24))
    for view in (base.T, base[:, ::2], base[::3]):
        if view.is_contiguous():
            continue
        a = to_jax(view)
        assert not shares_memory(view, a)
        assert a.shape == tuple(view.shape)
        np.testing.assert_array_equal(bits(a), bits(view.contiguous()))


@pytest.mark.parametrize(
    ("name", "target"),
    [("ct_fp8_tensor", "checkpoint"), ("ct_fp8_tensor", "cuda-fp8"), ("hf_fp8_block_ue8m0", "rocm-fp8"), ("ct_fp8_channel", "rocm-fp8")],
)
def test_loaded_tensors_convert_to_jax_zero_copy(name: str, target: str, tiny_checkpoint) -> None:
    states = [_load(name, 2, 1, target), fl.load(tiny_checkpoint("llama"), tp_size=2, rank=0, progress=False)]
    for state in states:
        for key, tensor in state.items():
            assert tensor.is_contiguous(), key
            a = to_jax(tensor)
            assert shares_memory(tensor, a), key
            np.testing.assert_array_equal(bits(a), bits(tensor), err_msg=key)


# ------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")


def _jax_gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["ct_fp8_tensor", "hf_fp8_block_ue8m0"])
def test_load_to_cuda_equals_cpu_load(name: str) -> None:
    for target in ("checkpoint", "cuda-fp8"):
        cpu = fl.load(FIXTURES / name, tp_size=2, rank=1, target=target, progress=False)
        gpu = fl.load(FIXTURES / name, tp_size=2, rank=1, target=target, device="cuda", progress=False)
        assert gpu.keys() == cpu.keys() and gpu.target == target
        for key in cpu:
            assert gpu[key].is_cuda and gpu[key].dtype == cpu[key].dtype, key
            np.testing.assert_array_equal(bits(gpu[key]), bits(cpu[key]), err_msg=key)
        for alias, canonical in gpu.plan.aliases.items():
            assert gpu[alias] is gpu[canonical]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(_jax_gpu() is None, reason="jax has no GPU backend here (install jax[cuda12])")
def test_transforms_on_jax_gpu_match_reference() -> None:
    device = _jax_gpu()
    rng = np.random.default_rng(0)
    weight = random_fp8(rng, (96, 64))
    scales = np.array([1.7e-4, 1.9e-4, 1.6e-4], dtype=F32)
    out, _ = transforms.requantize_with_max_scale(jax.device_put(weight, device), jax.device_put(scales, device), (32, 32, 32))
    np.testing.assert_array_equal(bits(jax.device_get(out)), bits(ref_requant(weight, scales, (32, 32, 32))[0]))
    fnuz = transforms.e4m3fn_to_e4m3fnuz(jax.device_put(weight, device))
    np.testing.assert_array_equal(bits(jax.device_get(fnuz)), np.where(bits(weight) == 0x80, 0, bits(weight)))
    x = random_weights(rng, (300, 200))
    q, s = transforms.quantize_fp8_per_tensor(jax.device_put(x, device))
    ref_q, ref_s = ref_per_tensor(x)
    assert np.float32(jax.device_get(s)) == ref_s
    np.testing.assert_array_equal(bits(jax.device_get(q)), bits(ref_q))
    qb, sb = transforms.quantize_fp8_block(jax.device_put(x, device))
    ref_qb, ref_sb = ref_block(x)
    np.testing.assert_array_equal(bits(jax.device_get(sb)), bits(ref_sb))
    np.testing.assert_array_equal(bits(jax.device_get(qb)), bits(ref_qb))
