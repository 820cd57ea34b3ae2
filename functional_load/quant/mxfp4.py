"""MXFP4: OCP microscaling FP4, 32 e2m1 values per block with one e8m0 (power of two) scale.

Linears and per-expert tensors (compressed-tensors ``mxfp4-pack-quantized``: ``weight_packed``;
AMD Quark ``fp4`` per-group e8m0: ``weight``): the weight ``[out, in / 2]`` uint8 (two codes a
byte, low nibble first) and ``weight_scale [out, in / 32]`` uint8 e8m0 bytes, split with the
output rows or in whole groups along the input (vLLM ``CompressedTensorsW4A4Mxfp4`` /
``QuarkOCP_MX``); fused experts ``w13_*`` / ``w2_*`` of the same. ``W = fp4 * 2^(e - 127)``.

gpt-oss's ``quant_method: "mxfp4"`` (vLLM ``Mxfp4Config``) quantizes fused MoE experts only:
``_blocks [E, 2I, H/32, 16]`` (gate/up rows interleaved) become ``w13_weight [E, 2I, H/2]``
uint8, ``_scales`` ``[E, 2I, H/32]`` uint8 e8m0; the down projection likewise along its input.
The intermediate splits in whole 32-value blocks, ``ceil(blocks / tp)`` per rank (the last ranks
shorter, zero-padded: vLLM's CPU/emulation layout), and so does w13's bias. ``W = fp4 * 2^(e-127)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..layout.expert_sharding import Grouped
from ..layout.experts import biases, w2_split, w13_split
from ..layout.parallel import Parallel
from ..layout.param import ParamSpec
from ..layout.quantized import Experts, Get, Linear, ParamDef
from ..layout.sharding import Sharding
from ..paths import JsonObject
from .base import BaseScheme
from .codes import e8m0_values, fp4_values
from .config import QuantConfig, ignore_list
from .microscaling import expand_groups, grouped_params

if TYPE_CHECKING:
    import torch

BLOCK = 32  # values per MXFP4 block: one e8m0 scale, 16 bytes of packed 4-bit values


@dataclass(frozen=True, slots=True)
class Mxfp4Scheme(BaseScheme):
    """MXFP4 linears and experts; ``weight``: the checkpoint's name of the packed weight."""

    weight: str = "weight_packed"

    @property
    def format(self) -> str:
        return "mxfp4"

    def linear_params(self, linear: Linear, model_dtype: str) -> list[ParamDef]:
        return grouped_params(linear, self.weight, "uint8", ("uint8",), 2, BLOCK, "uint8", "e8m0")

    def dequantize(self, get: Get, specs: Mapping[str, ParamSpec], parallel: Parallel, target: str = "checkpoint") -> torch.Tensor:
        return mx_values(fp4_values(get(self.weight)), get("weight_scale"))

    def dequantize_experts(self, get: Get, stem: str, specs: Mapping[str, ParamSpec], parallel: Parallel) -> torch.Tensor:
        return mx_values(fp4_values(get(f"{stem}_{self.weight}")), get(f"{stem}_weight_scale"))


def compressed_tensors_mxfp4(weights: JsonObject, acts: JsonObject) -> Mxfp4Scheme:
    _check_group(weights.get("group_size"), "compressed-tensors MXFP4")
    return Mxfp4Scheme("weight_packed")


def quark_mxfp4(weight: JsonObject, inputs: JsonObject) -> Mxfp4Scheme:
    if weight.get("qscheme") != "per_group" or weight.get("scale_format") != "e8m0":
        raise ConfigError(f"config.json: Quark fp4 weights need per_group e8m0 scales (MXFP4), got {dict(weight)}")
    _check_group(weight.get("group_size"), "Quark MXFP4")
    return Mxfp4Scheme("weight")


def _check_group(group: object, what: str) -> None:
    if group not in (None, BLOCK):
        raise ConfigError(f"config.json: {what} has group_size {group!r}; the OCP MX format has {BLOCK}-value groups")


@dataclass(frozen=True, slots=True)
class Mxfp4ExpertsScheme(BaseScheme):
    """gpt-oss's MXFP4 experts (its checkpoint's ``_blocks`` / ``_scales``)."""

    @property
    def format(self) -> str:
        return "mxfp4"

    def linear_params(self, linear: Linear, model_dtype: str) -> list[ParamDef]:
        raise ConfigError("the mxfp4 method quantizes MoE experts only; linear layers are unquantized")

    def expert_params(self, experts: Experts, model_dtype: str) -> list[ParamDef]:
        hidden, inter = experts.hidden, experts.intermediate
        if hidden % BLOCK or inter % BLOCK:
            raise ConfigError(f"MXFP4 experts need hidden ({hidden}) and intermediate ({inter}) sizes in whole blocks of {BLOCK}")
        half = BLOCK // 2
        w13: Sharding = w13_split(inter, True, BLOCK, uneven=True)
        params = [
            ParamDef("w13_weight", (2 * inter, hidden // 2), Grouped(w13, half), "uint8"),
            ParamDef("w13_weight_scale", (2 * inter, hidden // BLOCK), w13, "uint8", check="e8m0", role="scale"),
            ParamDef("w2_weight", (hidden, inter // 2), Grouped(w2_split(inter // 2, 1, half, uneven=True), half), "uint8"),
            ParamDef("w2_weight_scale", (hidden, inter // BLOCK), w2_split(inter // BLOCK, 1, uneven=True), "uint8", check="e8m0",
                     role="scale"),
        ]
        if experts.bias != "none":
            params += biases(experts, model_dtype, experts.bias, w13_split(inter, experts.interleaved, BLOCK, uneven=True))
        return params

    def dequantize(self, get: Get, specs: Mapping[str, ParamSpec], parallel: Parallel, target: str = "checkpoint") -> torch.Tensor:
        raise ConfigError("the mxfp4 method quantizes MoE experts only; dequantize the experts module")

    def dequantize_experts(self, get: Get, stem: str, specs: Mapping[str, ParamSpec], parallel: Parallel) -> torch.Tensor:
        return mx_values(fp4_values(get(f"{stem}_weight")), get(f"{stem}_weight_scale"))


def mx_values(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Values ``[..., n]`` times their e8m0 block scales ``[..., n / 32]``."""
    return expand_groups(values, e8m0_values(scales), BLOCK)


def parse_gpt_oss_mxfp4(qc: JsonObject) -> QuantConfig:
    return QuantConfig("mxfp4", Mxfp4ExpertsScheme(), ignore_list(qc), kinds=("experts",))
