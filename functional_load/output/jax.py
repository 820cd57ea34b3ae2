"""vLLM's layout as a JAX target: one global ``jax.Array`` per vLLM parameter.

The tensor-parallel rank of a device is its coordinate along the mesh's ``tp_axes`` (several
axes: their row-major flattened coordinate, as a ``PartitionSpec`` entry naming them shards), its
data-parallel rank its coordinate along ``dp_axes`` (:class:`MeshRanks`). A parameter's placement
(:mod:`functional_load.layout.placement`) decides its global form: the same on every rank,
replicated (``P()``); split along dimension ``d``, the rank blocks back to back along ``d``
(rank-major: ``[rank 0 block; rank 1 block; ...]``, so a fused ``qkv_proj``'s rows are each
rank's ``[q; k; v]`` with vLLM's KV-head replication, not the checkpoint's rows); different per
rank (gpt-oss ``w2_bias``), a new leading dimension of one entry per rank. The ranks are the
tensor-parallel ones (the data-parallel axes replicate), except for fused MoE experts, which vLLM
splits or spreads over the ``dp_size x tp_size`` ranks ``dp_rank * tp_size + tp_rank``: their
ranks lie along ``(*dp_axes, *tp_axes)``. Each process plans and reads only the ranks its devices
hold, through :mod:`.arrays`. One pipeline stage is one such mesh (``load_jax`` cuts a mesh's
pipeline axis into one sub-mesh per stage).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


def tp_axes_of(mesh: Mesh, tp_axis: str | Sequence[str], what: str = "tensor-parallel", option: str = "tp_axis") -> tuple[str, ...]:
    """The mesh axes that carry tensor (or data) parallelism (checked against the mesh)."""
    axes = (tp_axis,) if isinstance(tp_axis, str) else tuple(tp_axis)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing or not axes:
        raise ConfigError(f"mesh axes {tuple(mesh.axis_names)} have no {what} axis {missing or axes}; pass {option}=")
    return axes


def coordinate(mesh: Mesh, axes: tuple[str, ...], device: jax.Device) -> int:
    """``device``'s row-major coordinate over ``axes`` (as a ``PartitionSpec`` entry naming them shards)."""
    where = np.argwhere(mesh.devices == device)[0]
    rank = 0
    for axis in axes:
        rank = rank * mesh.shape[axis] + int(where[mesh.axis_names.index(axis)])
    return rank


Rank = tuple[int, int]  # a vLLM worker of one stage: (dp_rank, tp_rank)


@dataclass(frozen=True, slots=True)
class MeshRanks:
    """Which vLLM worker ``(dp_rank, tp_rank)`` each device of ``mesh`` is.

    The tensor-parallel rank is a device's row-major coordinate over ``tp_axes``, the
    data-parallel rank its coordinate over ``dp_axes``; without ``dp_axes`` every device is
    replica ``dp_rank`` (the ``dp_size``/``dp_rank`` options: one replica's layout over the mesh).
    Parameters on the MoE ranks (``ParamSpec.on_moe_ranks``) lie along ``axes(moe=True)``:
    ``(*dp_axes, *tp_axes)``, the row-major rank ``dp_rank * tp_size + tp_rank`` as vLLM flattens
    them; every other parameter over ``tp_axes``, replicated over the data-parallel axes.
    """

    mesh: Mesh
    tp_axes: tuple[str, ...]
    dp_axes: tuple[str, ...] = ()
    dp_rank: int = 0

    @property
    def tp_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.tp_axes)

    def of(self, device: jax.Device) -> Rank:
        dp = coordinate(self.mesh, self.dp_axes, device) if self.dp_axes else self.dp_rank
        return dp, coordinate(self.mesh, self.tp_axes, device)

    def local(self) -> list[Rank]:
        """The workers of this process's devices."""
        return sorted({self.of(d) for d in self.mesh.local_devices})

    def axes(self, moe: bool) -> tuple[tuple[str, ...], int]:
        """The mesh axes a parameter's ranks lie along, and how many ranks that is."""
        axes = (*self.dp_axes, *self.tp_axes) if moe else self.tp_axes
        return axes, math.prod(self.mesh.shape[a] for a in axes)

    def owner(self, index: int, moe: bool, local: list[Rank]) -> Rank:
        """The worker at ``index`` along :meth:`axes`; for a parameter every replica holds alike,
        one of this process's workers with that tensor-parallel rank."""
        if moe and self.dp_axes:
            return divmod(index, self.tp_size)
        if self.dp_axes:
            return min(r for r in local if r[1] == index)
        return self.dp_rank, index


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU torch tensor's memory as a numpy array of the same dtype (bfloat16, float8 included)."""
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    flat = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return flat.view(to_numpy(name)).reshape(tuple(tensor.shape))


Form = tuple[str, Placement, bool]  # a parameter's name, placement, and whether it is on the MoE ranks


def _global_leaves(plan_of: Callable[[Rank], Plan], first: Plan, local: list[Rank], ranks: MeshRanks) -> tuple[list[Leaf], list[Form]]:
    """The global array of every parameter of ``first`` (its shape, dtype and sharding over the
    mesh) and each parameter's form; ``ShardingError`` if this process's ranks hold blocks of different shapes."""
    from jax.sharding import NamedSharding

    leaves: list[Leaf] = []
    forms: list[Form] = []
    for param in first.params:
        spec = param.spec
        shapes = {plan_of(r).param(spec.name).spec.local_shape for r in local}
        if len(shapes) > 1:
            raise ShardingError(
                f"{spec.name}: ranks hold blocks of different shapes {sorted(shapes)}, which one global array "
                f"cannot shard evenly (e.g. a number of experts that does not divide over the ranks)"
            )
        placement = spec.placement(first.parallel)
        axes, size = ranks.axes(spec.on_moe_ranks)
        global_shape, pspec = _global_form(spec.local_shape, placement, axes, size)
        leaves.append(Leaf(spec.name, global_shape, spec.dtype, NamedSharding(ranks.mesh, pspec)))
        forms.append((spec.name, placement, spec.on_moe_ranks))
    return leaves, forms


def _global_form(
    shape: tuple[int, ...], placement: Placement, axes: tuple[str, ...], size: int
) -> tuple[tuple[int, ...], PartitionSpec]:
    """A rank block's global shape and ``PartitionSpec`` over ``size`` ranks along ``axes``: blocks
    back to back along the split dimension, one entry per rank in a new leading one, or replicated."""
    from jax.sharding import PartitionSpec

    entry: str | tuple[str, ...] = axes[0] if len(axes) == 1 else axes
    if isinstance(placement, Along):
        d = placement.dim
        return shape[:d] + (shape[d] * size,) + shape[d + 1 :], PartitionSpec(*([None] * d + [entry]))
    if isinstance(placement, PerRank):
        return (size, *shape), PartitionSpec(entry)
    return shape, PartitionSpec()


def vllm_arrays(
    plan_of: Callable[[Rank], Plan], ranks: MeshRanks, reader: Reader, *, threads: int = 4, bar: Progress | None = None,
) -> dict[str, jax.Array]:
    """Every parameter of vLLM's layout as a global array over ``ranks.mesh``; ``plan_of((dp_rank,
    tp_rank))`` is the plan of a worker, asked only for this process's workers."""
    local = ranks.local()
    first = plan_of(local[0])
    leaves, forms = _global_leaves(plan_of, first, local, ranks)
    quantized: dict[tuple[Rank, str], dict[str, torch.Tensor]] = {}  # online quantization: (rank, module) -> its tensors
    lock = threading.Lock()

    def rank_param(name: str, rank: Rank) -> np.ndarray:  # each distinct box asks once (see .arrays)
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
        name, placement, moe = forms[i]
        if isinstance(placement, Along):
            d, size = placement.dim, leaves[i].shape[placement.dim] // ranks.axes(moe)[1]
            data = rank_param(name, ranks.owner(box[d][0] // size, moe, local))
            return data[tuple(slice(0, size) if j == d else slice(a, b) for j, (a, b) in enumerate(box))]
        if isinstance(placement, PerRank):
            data = rank_param(name, ranks.owner(box[0][0], moe, local))[None]
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
