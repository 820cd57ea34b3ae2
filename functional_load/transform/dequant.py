"""``dequantize``: the dense float32 weight of a loaded rank-local linear (or an MoE layer's experts).

For inspection, notebooks and tests. It reads the rank's own tensors and the plan that
:func:`functional_load.load` attaches to the state it returns (``state.plan``), which knows each
module's scheme; the scheme's format module (:mod:`functional_load.quant`) does the arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import LoadError
from ..layout.param import ParamSpec

if TYPE_CHECKING:
    import torch


def dequantize(state: Mapping[str, torch.Tensor], module_prefix: str) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The dense float32 weight ``[out_local, in_local]`` of a rank-local linear module, or for an
    MoE layer's experts (``"model.layers.1.mlp.experts"``) the pair ``(w13, w2)``: ``w13
    [E_local, 2 * I_local, H]`` (gate rows then up rows, or interleaved as gpt-oss stores them)
    and ``w2 [E_local, H, I_local]``.

    ``state`` is what :func:`functional_load.load` returned (quantized modules need its
    ``state.plan``); ``module_prefix`` names the module, e.g. ``"model.layers.0.self_attn.qkv_proj"``.
    """
    plan = getattr(state, "plan", None)
    scheme = plan.schemes.get(module_prefix) if plan is not None else None
    parallel = plan.parallel if plan is not None else None
    experts = f"{module_prefix}.routed_experts."
    if any(name.startswith(experts) for name in state):
        if scheme is None:
            return tuple(state[f"{experts}{stem}_weight"].float() for stem in ("w13", "w2"))
        specs = _specs(plan, experts)
        return tuple(scheme.dequantize_experts(_getter(state, experts[:-1]), stem, specs, parallel) for stem in ("w13", "w2"))
    if scheme is None:
        weight = state.get(f"{module_prefix}.weight")
        if weight is None:
            near = sorted(k for k in state if k.startswith(module_prefix + "."))
            raise LoadError(
                f"dequantize: no linear module {module_prefix!r} in this state (no {module_prefix}.weight); "
                f"its parameters: {near or 'none'}"
            )
        if weight.is_floating_point() and weight.element_size() > 1:
            return weight.float()
        raise LoadError(
            f"dequantize: {module_prefix}.weight is {weight.dtype} but the state carries no plan that says how it "
            f"was quantized; pass the state returned by functional_load.load"
        )
    target = getattr(state, "target", "checkpoint")
    specs = _specs(plan, module_prefix + ".")
    get = _getter(state, module_prefix)
    return scheme.dequantize(get, specs, parallel, target)


def _specs(plan: Any, prefix: str) -> dict[str, ParamSpec]:  # a Plan; the caller knows it is there only from the scheme
    """The plan's ParamSpecs under ``prefix``, by the rest of their names."""
    return {p.spec.name[len(prefix):]: p.spec for p in plan.params if p.spec.name.startswith(prefix)}


def _getter(state: Mapping[str, torch.Tensor], module: str) -> Callable[[str], torch.Tensor]:
    def get(suffix: str) -> torch.Tensor:
        try:
            return state[f"{module}.{suffix}"]
        except KeyError:
            raise LoadError(f"dequantize: {module}.{suffix} is missing from the state") from None

    return get
