"""Online FP8 quantization: turn one rank-local dense weight into FP8 plus its scales.

Runs as soon as the weight is read, so a load holds one dense weight at a time, not the model.
The kernels are the jitted JAX functions of :mod:`.kernels`; tensors cross over by DLPack.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

from ..plan.plan import ParamPlan, Plan
from .dlpack import to_jax, to_torch


def is_online_weight(plan: Plan, param: ParamPlan) -> bool:
    """A weight that online quantization reads dense and quantizes as it is loaded."""
    scheme = plan.schemes.get(param.spec.module)
    return scheme is not None and scheme.online and param.spec.name.endswith(".weight")


def quantize_online(plan: Plan, param: ParamPlan, dense: Any) -> dict[str, Any]:
    """``{weight, scale}`` tensors of ``param``'s module, quantized from ``dense`` (its rank-local weight).

    Per-tensor: one ``amax / 448`` scale for the whole local weight, stored in every shard slot
    (the checkpoint FP8 layout). Block: ``128 x 128`` tiles per output segment, so each
    segment's scale rows line up with its own rows, as for block-quantized checkpoints.
    """
    import torch

    from . import kernels

    module = param.spec.module
    scheme = plan.schemes[module]
    _release_freed_memory()
    weight = to_jax(dense)
    scale_spec = plan.param(f"{module}.{scheme.scale_name}").spec
    if scheme.strategy == "tensor":
        quantized, scale = kernels.quantize_fp8_per_tensor(weight)
        scales = torch.full(scale_spec.local_shape, float(scale), dtype=torch.float32)
        return {f"{module}.weight": to_torch(quantized), f"{module}.{scheme.scale_name}": scales}
    ranges = [rng for _, rng in param.spec.local_pieces(plan.parallel)]  # 128 x 128 tiles per output segment
    parts = [kernels.quantize_fp8_block(weight[a:b], scheme.block) for a, b in ranges]
    quantized = torch.cat([to_torch(q) for q, _ in parts])
    scales = torch.cat([to_torch(s) for _, s in parts]).to(torch.float32)
    if tuple(scales.shape) != tuple(scale_spec.local_shape):
        raise AssertionError(f"{module}: block scales {tuple(scales.shape)} vs layout {scale_spec.local_shape}")
    return {f"{module}.weight": quantized, f"{module}.{scheme.scale_name}": scales}


@cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (AttributeError, OSError, TypeError):
        return None


def _release_freed_memory() -> None:
    """Hand the free heap pages back to the OS (glibc ``malloc_trim``; nothing elsewhere).

    glibc keeps freed blocks mapped: the previous dense weight, and XLA's temporaries, which are
    allocated on its worker threads' arenas. Without trimming, the resident size of an online
    load grows by about a dense layer per layer, to the size of the unquantized model."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
