"""What the microscaling formats share (MXFP4, MXFP8, NVFP4): a weight with one scale per group of
its input, and for NVFP4 a per-tensor global scale per logical shard.

The weight is ``[out, in / pack]`` (two FP4 codes per byte, or one FP8 value each) and the
group scales ``[out, in / group]``; both split with the output rows of a column-parallel layer,
or along the input of a row-parallel one, where a rank's input must be whole groups. A
per-tensor scale is one value per logical shard of a fused linear (``Slots``, the same on every
rank), one per expert and shard for fused experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..layout.parallel import Parallel
from ..layout.param import Check, ParamSpec, Role
from ..layout.quantized import Linear, ParamDef
from ..layout.scales import Slots

if TYPE_CHECKING:
    import torch


def grouped_params(
    linear: Linear, weight: str, weight_dtype: str, stored: tuple[str, ...], pack: int, group: int, scale_dtype: str, check: Check,
) -> list[ParamDef]:
    """The weight ``[out, in / pack]`` and its group scales ``[out, in / group]``."""
    out, inp = linear.out_size, linear.in_size
    if inp % group:
        raise ConfigError(f"input size {inp} is not a whole number of {group}-value quantization groups")
    return [
        ParamDef(weight, (out, inp // pack), linear.weight_split(inputs=inp // pack, label="packed input columns"), weight_dtype,
                 stored=stored),
        ParamDef("weight_scale", (out, inp // group), linear.weight_split(inputs=inp // group, label="quantization groups"),
                 scale_dtype, check=check, role="scale"),
    ]


def per_shard(name: str, linear: Linear, role: Role) -> ParamDef:
    """A per-tensor scale of each logical shard of a fused linear (one for a plain one)."""
    ids = linear.slot_ids()
    return ParamDef(name, (len(ids),), Slots(ids), "float32", check="positive", role=role)


def expand_groups(values: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """Values ``[..., n]`` times their group scales ``[..., n / group]`` (float32)."""
    return values * scales.float().repeat_interleave(group, dim=-1)[..., : values.shape[-1]]


def per_row(scales: torch.Tensor, specs: Mapping[str, ParamSpec], weight: str, parallel: Parallel, rows: int) -> torch.Tensor:
    """One per-shard scale per row of a rank-local fused weight (``[rows, 1]``), from its segments."""
    import torch

    out = torch.empty(rows)
    for k, (_, (start, stop)) in enumerate(specs[weight].local_pieces(parallel)):
        out[start:stop] = scales.reshape(-1)[k].float()
    return out[:, None]


def per_expert_row(scales: torch.Tensor, rows: int, halves: bool) -> torch.Tensor:
    """Per-expert scales (``[E, 2]``: w1's then w3's, over each half of the rows; or ``[E]``) as ``[E, rows, 1]``."""
    if halves and scales.dim() == 2:
        return scales.float().repeat_interleave(rows // 2, dim=1)[:, :, None]
    return scales.float().reshape(-1, 1, 1)
