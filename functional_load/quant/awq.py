"""AWQ GEMM integer weights (AutoAWQ; auto-round's AWQ packing).

Manifest (vLLM ``AWQLinearMethod``): ``qweight [in, out / pf]`` int32 packed along the output
with the interleave ``[0, 2, 4, 6, 1, 3, 5, 7]``, ``qzeros [groups, out / pf]`` likewise,
``scales [groups, out]`` in the model dtype; ``W = (q - z) * s`` per group of the input.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..layout.parallel import Parallel
from ..layout.param import ParamSpec
from ..layout.quantized import Get, Linear, ParamDef, groups_of
from ..paths import JsonObject
from .base import BaseScheme
from .codes import unpack_int32
from .config import QuantConfig, ignore_list
from .gptq import OPTIONAL_BIAS, bits_and_group
from .kv import CACHE_SCALES, OPTIONAL_KV
from .pack import group_index, group_split, per_group

if TYPE_CHECKING:
    import torch

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # element e of a word sits in field AWQ_REVERSE_ORDER[e]


@dataclass(frozen=True, slots=True)
class AwqScheme(BaseScheme):
    bits: int = 4
    group_size: int = -1
    symmetric: bool = False

    @property
    def format(self) -> str:
        return "awq"

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    def linear_params(self, linear: Linear, model_dtype: str) -> list[ParamDef]:
        out, inp, pf = linear.out_size, linear.in_size, self.pack_factor
        groups = groups_of(self.group_size, linear)
        packed = linear.out_split(1, pf) if linear.column else linear.in_split(0, inp, "input rows")
        zeros = linear.out_split(1, pf) if linear.column else group_split(linear, 0, groups, False)
        return [
            ParamDef("qweight", (inp, out // pf), packed, "int32"),
            ParamDef("qzeros", (groups, out // pf), zeros, "int32", role="zero"),
            ParamDef("scales", (groups, out), per_group(linear, 1, 0, groups), model_dtype, check="finite", role="scale"),
        ]

    def dequantize(self, get: Get, specs: Mapping[str, ParamSpec], parallel: Parallel, target: str = "checkpoint") -> torch.Tensor:
        q = unpack_int32(get("qweight"), self.bits, dim=1, interleave=AWQ_REVERSE_ORDER)  # [in, out]
        zeros = unpack_int32(get("qzeros"), self.bits, dim=1, interleave=AWQ_REVERSE_ORDER)
        scales = get("scales").float()
        g = group_index(q.shape[0], self.group_size, scales.shape[0])
        return ((q - zeros[g]).float() * scales[g]).T.contiguous()


def parse_awq(qc: JsonObject) -> QuantConfig:
    bits, group = bits_and_group(qc)
    version = str(qc.get("version", qc.get("format", "gemm"))).lower()
    if version != "gemm":
        raise ConfigError(f"config.json: AWQ version {version!r} is not supported (GEMM only)")
    scheme = AwqScheme(bits, group, symmetric=not qc.get("zero_point", True))
    return QuantConfig("awq", scheme, ignore_list(qc), mapping=(CACHE_SCALES,), optional=OPTIONAL_KV + OPTIONAL_BIAS)
