"""Output layouts for a named target: the post-load transforms a kernel family expects.

``load(..., target=...)``:

* ``"checkpoint"`` (default): rank shards in checkpoint orientation, what vLLM holds right after
  ``load_weights``.
* ``"cuda-fp8"`` / ``"rocm-fp8"``: what vLLM's CUDA / ROCm methods hold after
  ``process_weights_after_loading``; each quantized module's format does its part
  (:meth:`functional_load.layout.quantized.Scheme.apply_target`: FP8's in
  :mod:`functional_load.quant.fp8_targets`), then the KV-cache scales follow vLLM's KV-cache
  method (:func:`functional_load.quant.kv.kv_to_target`).

:func:`functional_load.dequantize` gives the same dense weight for every target.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..plan.plan import Plan
from ..quant.kv import kv_to_target

if TYPE_CHECKING:
    import torch

TARGETS = ("checkpoint", "cuda-fp8", "rocm-fp8")


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise ConfigError(f"target={target!r} is not a known output layout; use one of {TARGETS}")


def apply_target(plan: Plan, tensors: Mapping[str, torch.Tensor], target: str) -> dict[str, torch.Tensor]:
    """New tensors with the transforms of ``target`` applied (the input is not modified)."""
    check_target(target)
    if target == "checkpoint":
        return dict(tensors)
    out = dict(tensors)
    for module, scheme in plan.schemes.items():
        specs = {p.spec.name[len(module) + 1 :]: p.spec for p in plan.params if p.spec.module == module}
        scheme.apply_target(target, module, out, specs, plan.parallel)
    kv_modules = sorted({p.spec.module for p in plan.params if p.spec.role == "kv_scale"})
    for module in kv_modules:
        kv_to_target(target, module, out)
    return out
