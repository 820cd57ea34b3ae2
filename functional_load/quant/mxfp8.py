"""MXFP8: OCP microscaling FP8, e4m3 values with one e8m0 (power of two) scale per 32.

compressed-tensors ``mxfp8-quantized`` and ModelOpt ``MXFP8``: ``weight [out, in]`` e4m3 and
``weight_scale [out, in / 32]`` uint8 e8m0 bytes, split with the output rows or in whole groups
along the input (vLLM ``CompressedTensorsW8A8Mxfp8`` / ModelOpt's MXFP8 linear); fused experts
``w13_*`` / ``w2_*`` of the same. ``W = fp8 * 2^(e - 127)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..layout.parallel import Parallel
from ..layout.param import ParamSpec
from ..layout.quantized import FP8_DTYPES, Get, Linear, ParamDef
from ..paths import JsonObject
from .base import BaseScheme
from .codes import e8m0_values
from .microscaling import expand_groups, grouped_params

if TYPE_CHECKING:
    import torch

GROUP = 32


@dataclass(frozen=True, slots=True)
class Mxfp8Scheme(BaseScheme):
    @property
    def format(self) -> str:
        return "mxfp8"

    def linear_params(self, linear: Linear, model_dtype: str) -> list[ParamDef]:
        return grouped_params(linear, "weight", "float8_e4m3fn", FP8_DTYPES, 1, GROUP, "uint8", "e8m0")

    def dequantize(self, get: Get, specs: Mapping[str, ParamSpec], parallel: Parallel, target: str = "checkpoint") -> torch.Tensor:
        return expand_groups(get("weight").float(), e8m0_values(get("weight_scale")), GROUP)

    def dequantize_experts(self, get: Get, stem: str, specs: Mapping[str, ParamSpec], parallel: Parallel) -> torch.Tensor:
        return expand_groups(get(f"{stem}_weight").float(), e8m0_values(get(f"{stem}_weight_scale")), GROUP)


def compressed_tensors_mxfp8(weights: JsonObject, acts: JsonObject) -> Mxfp8Scheme:
    if weights.get("group_size") not in (None, GROUP):
        raise ConfigError(f"config.json: compressed-tensors MXFP8 has group_size {weights.get('group_size')!r}; MX groups are {GROUP}")
    return Mxfp8Scheme()
