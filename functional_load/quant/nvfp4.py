"""NVFP4: e2m1 values in groups of 16, each with an e4m3 scale, and a per-tensor global scale.

* compressed-tensors ``nvfp4-pack-quantized`` (vLLM ``CompressedTensorsW4A4Fp4``):
  ``weight_packed [out, in / 2]`` uint8, ``weight_scale [out, in / 16]`` e4m3,
  ``weight_global_scale`` and (W4A4) ``input_global_scale``, one per logical shard of a fused
  linear. ``W = fp4 * weight_scale / weight_global_scale``: the global scale is a divisor
  (``448 * 6 / amax``).
* ModelOpt ``NVFP4`` / ``W4A16_NVFP4``: ``weight``, ``weight_scale``, ``weight_scale_2`` and (W4A4)
  ``input_scale``; ``W = fp4 * weight_scale * weight_scale_2``: a multiplier.

Fused experts (vLLM's NVFP4 MoE methods): ``w13_*`` / ``w2_*`` of the same, the per-tensor
scales ``[E, 2]`` for w13 (w1, w3) and ``[E]`` for w2. Group and per-tensor scales must be
finite (group scales of all-zero groups are 0) and per-tensor ones positive.
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
from .codes import fp4_values
from .microscaling import expand_groups, grouped_params, per_expert_row, per_row, per_shard

if TYPE_CHECKING:
    import torch

GROUP = 16


@dataclass(frozen=True, slots=True)
class Nvfp4Scheme(BaseScheme):
    """``modelopt``: ModelOpt's names and its multiplying global scale (else compressed-tensors');
    ``activations``: the W4A4 form, with per-tensor input scales."""

    modelopt: bool = False
    activations: bool = True

    @property
    def format(self) -> str:
        return "nvfp4"

    @property
    def names(self) -> tuple[str, str, str]:
        """(weight, global weight scale, input scale) as the checkpoint (and vLLM) name them."""
        if self.modelopt:
            return "weight", "weight_scale_2", "input_scale"
        return "weight_packed", "weight_global_scale", "input_global_scale"

    def linear_params(self, linear: Linear, model_dtype: str) -> list[ParamDef]:
        weight, global_scale, input_scale = self.names
        params = grouped_params(linear, weight, "uint8", ("uint8",), 2, GROUP, "float8_e4m3fn", "finite")
        params[1] = params[1]._replace(stored=FP8_DTYPES)
        params.append(per_shard(global_scale, linear, "global_scale"))
        if self.activations:
            params.append(per_shard(input_scale, linear, "input_global_scale"))
        return params

    def _values(self, packed: torch.Tensor, scales: torch.Tensor, global_rows: torch.Tensor) -> torch.Tensor:
        """As vLLM's emulation: each group scale with the global one first, then the values."""
        combined = scales.float() * global_rows if self.modelopt else scales.float() / global_rows
        return expand_groups(fp4_values(packed), combined, GROUP)

    def dequantize(self, get: Get, specs: Mapping[str, ParamSpec], parallel: Parallel, target: str = "checkpoint") -> torch.Tensor:
        weight, global_scale, _ = self.names
        packed = get(weight)
        return self._values(packed, get("weight_scale"), per_row(get(global_scale), specs, weight, parallel, packed.shape[0]))

    def dequantize_experts(self, get: Get, stem: str, specs: Mapping[str, ParamSpec], parallel: Parallel) -> torch.Tensor:
        weight, global_scale, _ = self.names
        packed = get(f"{stem}_{weight}")
        rows = per_expert_row(get(f"{stem}_{global_scale}"), packed.shape[1], halves=stem == "w13")
        return self._values(packed, get(f"{stem}_weight_scale"), rows)


def compressed_tensors_nvfp4(weights: JsonObject, acts: JsonObject) -> Nvfp4Scheme:
    if weights.get("group_size") not in (None, GROUP):
        raise ConfigError(f"config.json: compressed-tensors NVFP4 has group_size {weights.get('group_size')!r}; NVFP4 groups are {GROUP}")
    return Nvfp4Scheme(modelopt=False, activations=bool(acts))
