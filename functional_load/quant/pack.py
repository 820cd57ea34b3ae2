"""compressed-tensors pack-quantized integer weights (W4A16, W8A16 packed; Kimi-K2's int4 experts).

Manifest (vLLM's ``CompressedTensorsWNA16``): ``weight_packed [out, in / pf]`` int32 (``pf =
32 / bits`` fields per word, least significant first, along the input), ``weight_scale [out,
groups]`` in the model dtype, asymmetric ``weight_zero_point [out / pf, groups]`` (packed along
the output), ``weight_shape`` (each part's ``[out, in]``; vLLM keeps the last part it loads).
Fields are signed, stored ``+ 2^(bits - 1)``: ``W = (q - zp) * scale`` per group of the input.
Group scales may be negative (some producers store them so): they are checked finite.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..layout.parallel import Parallel
from ..layout.param import ParamSpec
from ..layout.quantized import Get, Linear, ParamDef, groups_of
from ..layout.scales import Pick
from ..layout.sharding import Replicated, Sharding
from .base import BaseScheme
from .codes import unpack_int32

if TYPE_CHECKING:
    import torch

INTEGERS = ("int64", "int32", "int16", "int8", "uint8")


@dataclass(frozen=True, slots=True)
class PackScheme(BaseScheme):
    bits: int = 4
    group_size: int = -1  # -1: one group (per channel)
    symmetric: bool = True
    act_order: bool = False

    @property
    def format(self) -> str:
        return "pack"

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    def linear_params(self, linear: Linear, model_dtype: str) -> list[ParamDef]:
        out, inp, pf = linear.out_size, linear.in_size, self.pack_factor
        groups = groups_of(self.group_size, linear)
        params = [
            ParamDef("weight_packed", (out, inp // pf), linear.weight_split(inputs=inp // pf, label="packed input columns"), "int32"),
            ParamDef("weight_scale", (out, groups), per_group(linear, 0, 1, groups), model_dtype, check="finite", role="scale"),
        ]
        if not self.symmetric:
            zero: Sharding = linear.out_split(0, pf) if linear.column else linear.in_split(1, groups, "quantization groups")
            params.append(ParamDef("weight_zero_point", (-(-out // pf), groups), zero, "int32", role="zero"))
        ids = linear.slot_ids()  # the checkpoint's [out, in] of each part; vLLM keeps the last part it loads
        params.append(ParamDef("weight_shape", (2,), Pick(ids, ids[-1]) if len(ids) > 1 else Replicated(), "int64",
                               stored=INTEGERS, role="shape"))
        return params

    def dequantize(self, get: Get, specs: Mapping[str, ParamSpec], parallel: Parallel, target: str = "checkpoint") -> torch.Tensor:
        offset = 1 << (self.bits - 1)
        scale = get("weight_scale").float()
        q = unpack_int32(get("weight_packed"), self.bits, dim=1) - offset
        out = scale.shape[0]
        in_size = q.shape[1] if scale.shape[1] == 1 else scale.shape[1] * self.group_size
        q = q[:, :in_size]
        g = group_index(in_size, self.group_size, scale.shape[1])
        zero: torch.Tensor | int = 0
        if not self.symmetric:
            zero = (unpack_int32(get("weight_zero_point"), self.bits, dim=0)[:out] - offset)[:, g]
        return (q - zero).float() * scale[:, g]


def group_index(n: int, group_size: int, groups: int) -> torch.Tensor:
    """The quantization group of each of ``n`` input positions."""
    import torch

    if groups == 1:
        return torch.zeros(n, dtype=torch.int64)
    return torch.arange(n) // group_size


def per_group(linear: Linear, out_dim: int, in_dim: int, groups: int, replicate_in: bool = False) -> Sharding:
    """Per-group tensors: split with the outputs (column) or over the groups (row)."""
    if linear.column:
        return linear.out_split(out_dim)
    return group_split(linear, in_dim, groups, replicate_in)


def group_split(linear: Linear, dim: int, groups: int, replicate: bool) -> Sharding:
    """Row-parallel tensors indexed by quantization group. With act-order (``g_idx``) every rank
    keeps all groups, since its input rows may belong to any of them (vLLM does the same)."""
    if replicate or groups == 1:
        return Replicated()
    return linear.in_split(dim, groups, "quantization groups")
