"""A straightforward numpy / ml_dtypes reference of the FP8 conventions, shared by the transform
and online-quantization tests (vLLM's: fp16 dequant, reciprocal-scale static quant, amax / 448)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

E4M3FN = ml_dtypes.float8_e4m3fn
E4M3FNUZ = ml_dtypes.float8_e4m3fnuz
F32 = np.float32


def ref_dequant(q: np.ndarray, scale) -> np.ndarray:
    with np.errstate(over="ignore"):  # fp16 overflows to inf, then clips to 448 in ref_quant
        return (q.astype(F32) * F32(scale)).astype(np.float16)


def ref_quant(x: np.ndarray, scale, fnuz: bool = False) -> np.ndarray:
    limit, dtype = (F32(224), E4M3FNUZ) if fnuz else (F32(448), E4M3FN)
    inverse = F32(1) / np.asarray(scale, dtype=F32)
    return np.clip(x.astype(F32) * inverse, -limit, limit).astype(dtype)


def ref_requant(q: np.ndarray, scales: np.ndarray, widths) -> tuple[np.ndarray, np.float32]:
    fnuz = q.dtype == E4M3FNUZ
    scales = np.asarray(scales, dtype=F32)
    top = scales.max()
    out, start = [], 0
    for scale, width in zip(scales, widths):
        segment = q[start : start + width]
        out.append(segment if scale == top else ref_quant(ref_dequant(segment, scale), top, fnuz))
        start += width
    return np.concatenate(out, axis=0), top


def ref_scale(amax) -> np.float32:
    amax = F32(amax)
    return amax / F32(448) if amax > 0 else F32(1)


def ref_per_tensor(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    scale = ref_scale(np.max(np.abs(x.astype(F32))))
    return ref_quant(x, scale), scale


def ref_block(x: np.ndarray, bn: int = 128, bk: int = 128) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = x.shape
    nr, nc = math.ceil(rows / bn), math.ceil(cols / bk)
    q = np.zeros((rows, cols), dtype=E4M3FN)
    scales = np.zeros((nr, nc), dtype=F32)
    for i in range(nr):
        for j in range(nc):
            tile = x[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            scales[i, j] = ref_scale(np.max(np.abs(tile.astype(F32))))
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = ref_quant(tile, scales[i, j])
    return q, scales
