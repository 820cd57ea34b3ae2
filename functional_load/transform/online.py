"""Online quantization: one rank-local dense weight becomes its scheme's quantized tensors.

Runs as soon as the weight is read, so a load holds one dense weight at a time, not the model.
The arithmetic is the format's (:meth:`functional_load.quant.base.BaseScheme.quantize`: FP8's in
:mod:`functional_load.quant.fp8_targets`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..plan.plan import ParamPlan, Plan

if TYPE_CHECKING:
    import torch


def is_online_weight(plan: Plan, param: ParamPlan) -> bool:
    """A weight that online quantization reads dense and quantizes as it is loaded."""
    scheme = plan.schemes.get(param.spec.module)
    return scheme is not None and scheme.online and param.spec.role == "weight"


def quantize_online(plan: Plan, param: ParamPlan, dense: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{full name: tensor}`` of ``param``'s module, quantized from ``dense`` (its rank-local weight)."""
    module = param.spec.module
    scheme = plan.schemes[module]
    specs = {p.spec.name[len(module) + 1 :]: p.spec for p in plan.params if p.spec.module == module}
    return {f"{module}.{suffix}": tensor for suffix, tensor in scheme.quantize(dense, specs, plan.parallel).items()}
