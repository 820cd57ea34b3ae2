"""vLLM's layout as a JAX target: one global ``jax.Array`` per vLLM parameter.

The tensor-parallel rank of a device is its coordinate along the mesh's ``tp_axes`` (several
axes: their row-major flattened coordinate, as a ``PartitionSpec`` entry naming them shards). A
parameter's placement (:mod:`functional_load.layout.placement`) decides its global form: the
same on every rank, replicated (``P()``); split along dimension ``d``, the rank blocks back to
back along ``d`` (rank-major: ``[rank 0 block; rank 1 block; ...]``, so a fused ``qkv_proj``'s
rows are each rank's ``[q; k; v]`` with vLLM's KV-head replication, not the checkpoint's rows);
different per rank (gpt-oss ``w2_bias``), a new leading dimension of one entry per rank. Each
process plans and reads only the ranks its devices hold, through :mod:`.arrays`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..dtypes import to_numpy
from ..errors import ConfigError, ShardingError
from ..io.fill import load_param
from ..io.reader import Reader
from ..layout.axes import Range
from ..layout.placement import Along, PerRank, Placement
from ..plan.plan import Plan
from ..plan.target import Leaf
from ..transform.online import is_online_weight, quantize_online
from .arrays import Progress, build_arrays

if TYPE_CHECKING:
    import jax
    import torch
    from jax.sharding import Mesh, PartitionSpec


def tp_axes_of(mesh: Mesh, tp_axis: str | Sequence[str]) -> tuple[str, ...]:
    """The mesh axes that carry tensor parallelism (checked against the mesh)."""
    axes = (tp_axis,) if isinstance(tp_axis, str) else tuple(tp_axis)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing or not axes:
        raise ConfigError(f"mesh axes {tuple(mesh.axis_names)} have no tensor-parallel axis {missing or axes}; pass tp_axis=")
    return axes


def tp_rank(mesh: Mesh, axes: tuple[str, ...], device: jax.Device) -> int:
    """The tensor-parallel rank of ``device``: its row-major coordinate over ``axes``."""
    where = np.argwhere(mesh.devices == device)[0]
    rank = 0
    for axis in axes:
        i = mesh.axis_names.index(axis)
        rank = rank * mesh.shape[axis] + int(where[i])
    return rank


def local_tp_ranks(mesh: Mesh, tp_axis: str | Sequence[str]) -> list[int]:
    """The tensor-parallel ranks of this process's devices."""
    axes = tp_axes_of(mesh, tp_axis)
    return sorted({tp_rank(mesh, axes, d) for d in mesh.local_devices})


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU torch tensor's memory as a numpy array of the same dtype (bfloat16, float8 included)."""
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    flat = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return flat.view(to_numpy(name)).reshape(tuple(tensor.shape))


def _global_leaves(
    plan_of: Callable[[int], Plan], first: Plan, local: list[int], mesh: Mesh, axes: tuple[str, ...], tp_size: int
) -> tuple[list[Leaf], list[tuple[str, Placement]]]:
    """The global array of every parameter of ``first`` (its shape, dtype and sharding over ``mesh``)
    and each parameter's placement; ``ShardingError`` if this process's ranks hold blocks of different shapes."""
    from jax.sharding import NamedSharding

    leaves: list[Leaf] = []
    forms: list[tuple[str, Placement]] = []
    for param in first.params:
        spec = param.spec
        shapes = {plan_of(r).param(spec.name).spec.local_shape for r in local}
        if len(shapes) > 1:
            raise ShardingError(
                f"{spec.name}: ranks hold blocks of different shapes {sorted(shapes)}, which one global array "
                f"cannot shard evenly (e.g. a number of experts that does not divide over the ranks)"
            )
        placement = spec.placement(first.parallel)
        global_shape, pspec = _global_form(spec.local_shape, placement, axes, tp_size)
        leaves.append(Leaf(spec.name, global_shape, spec.dtype, NamedSharding(mesh, pspec)))
        forms.append((spec.name, placement))
    return leaves, forms


def _global_form(
    shape: tuple[int, ...], placement: Placement, axes: tuple[str, ...], tp_size: int
) -> tuple[tuple[int, ...], PartitionSpec]:
    """A rank block's global shape and ``PartitionSpec``: blocks back to back along the split
    dimension, one entry per rank in a new leading one, or replicated."""
    from jax.sharding import PartitionSpec

    entry: str | tuple[str, ...] = axes[0] if len(axes) == 1 else axes
    if isinstance(placement, Along):
        d = placement.dim
        return shape[:d] + (shape[d] * tp_size,) + shape[d + 1 :], PartitionSpec(*([None] * d + [entry]))
    if isinstance(placement, PerRank):
        return (tp_size, *shape), PartitionSpec(entry)
    return shape, PartitionSpec()


def vllm_arrays(
    plan_of: Callable[[int], Plan], mesh: Mesh, tp_axis: str | Sequence[str], reader: Reader, *, threads: int = 4,
    bar: Progress | None = None,
) -> dict[str, jax.Array]:
    """Every parameter of vLLM's layout as a global array over ``mesh``; ``plan_of(rank)`` is
    the plan of a tensor-parallel rank, asked only for this process's ranks."""
    axes = tp_axes_of(mesh, tp_axis)
    tp_size = math.prod(mesh.shape[a] for a in axes)
    local = local_tp_ranks(mesh, axes)
    first = plan_of(local[0])
    leaves, forms = _global_leaves(plan_of, first, local, mesh, axes, tp_size)
    quantized: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # online quantization: (rank, module) -> its tensors
    lock = threading.Lock()

    def rank_param(name: str, rank: int) -> np.ndarray:  # each distinct box asks once (see .arrays)
        plan = plan_of(rank)
        param = plan.param(name)
        if not param.spec.derived and not is_online_weight(plan, param):
            return as_numpy(load_param(plan, param, reader))
        module = param.spec.module
        with lock:  # a weight and its scales come from one quantization; kept until both are used
            key = (rank, module)
            if key not in quantized:
                weight = plan.param(f"{module}.weight")
                quantized[key] = quantize_online(plan, weight, load_param(plan, weight, reader, dtype=plan.dtype))
            tensors = quantized[key]
            tensor = tensors.pop(name)
            if not tensors:
                del quantized[key]
        return as_numpy(tensor)

    def block(i: int, box: tuple[Range, ...]) -> np.ndarray:
        name, placement = forms[i]
        if isinstance(placement, Along):
            d, size = placement.dim, leaves[i].shape[placement.dim] // tp_size
            data = rank_param(name, box[d][0] // size)
            return data[tuple(slice(0, size) if j == d else slice(a, b) for j, (a, b) in enumerate(box))]
        if isinstance(placement, PerRank):
            data = rank_param(name, box[0][0])[None]
            return data[(slice(0, 1), *(slice(a, b) for a, b in box[1:]))]
        return rank_param(name, local[0])[tuple(slice(a, b) for a, b in box)]

    arrays = build_arrays(leaves, block, threads=threads, bar=bar)
    out = {leaf.key: array for leaf, array in zip(leaves, arrays)}
    for alias, target in first.aliases.items():
        out[alias] = out[target]
    return out


def rank_from_torch_distributed() -> tuple[int, int]:
    """``(tp_size, rank)`` from an initialized ``torch.distributed`` process group, for callers
    that want the library's explicit arguments filled from their launcher."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialized; call init_process_group first or pass tp_size/rank")
    return dist.get_world_size(), dist.get_rank()
