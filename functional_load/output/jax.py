"""``load_jax``: global ``jax.Array``s with a ``NamedSharding``, from the same per-rank plans.

The tensor-parallel rank of a device is its coordinate along the mesh's ``tp_axis``. A
parameter split over ranks becomes one global array whose shards along that axis are exactly
the rank-local blocks of the torch path (rank-major: ``[rank 0 block; rank 1 block; ...]``), so
a ``shard_map`` kernel sees what a torch rank sees. Replicated parameters are replicated.
Arrays are built with ``jax.make_array_from_callback``: each process plans and reads only the
ranks its addressable devices hold.
"""

from __future__ import annotations

import os
from typing import Any

from .checkpoint.read import PreadReader
from .errors import ConfigError, ShardingError
from .execute import load_param
from .layout import ParamSpec
from .materialize import to_jax
from .plan import Plan
from .sharding import Blocked, ExpertSplit, Split, VocabSplit


def sharded_dim(spec: ParamSpec, expert_parallel: bool) -> int | None:
    """The dimension along which ranks hold different blocks (``None``: the same everywhere)."""
    s = spec.sharding
    if isinstance(s, Split):
        return None if s.disable_tp else s.dim
    if isinstance(s, VocabSplit):
        return 0
    if isinstance(s, Blocked):
        return None if s.split.disable_tp else s.split.dim
    if isinstance(s, ExpertSplit):
        return 0 if expert_parallel else s.inner.dim + 1
    return None


def load_jax(
    model_dir: str | os.PathLike,
    mesh: Any,
    *,
    tp_axis: str = "tp",
    dtype: Any = None,
    load_format: str = "auto",
    expert_parallel: bool = False,
    expert_placement: str = "linear",
    num_redundant_experts: int = 0,
    reader: PreadReader | None = None,
) -> dict[str, Any]:
    """Every parameter as a global ``jax.Array`` sharded over ``mesh`` (``tp_size`` is the size of
    ``tp_axis``; other mesh axes replicate). ``reader`` (optional) is used for every read, e.g.
    to count the bytes this process reads."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from .api import plan as make_plan

    if tp_axis not in mesh.axis_names:
        raise ConfigError(f"mesh axes {mesh.axis_names} have no tensor-parallel axis {tp_axis!r}; pass tp_axis=")
    tp_size = mesh.shape[tp_axis]
    axis = mesh.axis_names.index(tp_axis)
    local_ranks = sorted({int(np.argwhere(mesh.devices == d)[0][axis]) for d in mesh.local_devices})
    plans: dict[int, Plan] = {}

    def plan_of(rank: int) -> Plan:
        if rank not in plans:
            plans[rank] = make_plan(
                model_dir, tp_size=tp_size, rank=rank, dtype=dtype, load_format=load_format,
                expert_parallel=expert_parallel, expert_placement=expert_placement,
                num_redundant_experts=num_redundant_experts,
            )
        return plans[rank]

    own_reader = reader is None
    reader = reader or PreadReader()
    out: dict[str, Any] = {}
    try:
        first = plan_of(local_ranks[0])
        for param in first.params:
            spec = param.spec
            dim = sharded_dim(spec, expert_parallel)
            shapes = {plan_of(r).param(spec.name).spec.local_shape for r in local_ranks}
            if len(shapes) > 1:
                raise ShardingError(
                    f"{spec.name}: ranks hold blocks of different shapes {sorted(shapes)}, which one global array "
                    f"cannot shard evenly (e.g. a number of experts that does not divide over the ranks)"
                )
            local = spec.local_shape
            if dim is None:
                global_shape, pspec = local, PartitionSpec()
            else:
                global_shape = local[:dim] + (local[dim] * tp_size,) + local[dim + 1 :]
                pspec = PartitionSpec(*([None] * dim + [tp_axis]))
            cache: dict[int, Any] = {}

            def block(index: tuple[slice, ...], name: str = spec.name, dim: int | None = dim, size: int = local[dim] if dim is not None else 0, cache: dict[int, Any] = cache) -> Any:
                rank = local_ranks[0] if dim is None else (index[dim].start or 0) // size
                if rank not in cache:
                    tensor = load_param(plan_of(rank), plan_of(rank).param(name), reader)
                    cache[rank] = np.asarray(to_jax(tensor))
                data = cache[rank]
                if dim is None:
                    return data[index]
                rest = tuple(slice(None) if d == dim else index[d] for d in range(len(index)))
                return data[rest]

            out[spec.name] = jax.make_array_from_callback(global_shape, NamedSharding(mesh, pspec), block)
            cache.clear()
        for alias, target in first.aliases.items():
            out[alias] = out[target]
    finally:
        if own_reader:
            reader.close()
    return out


def rank_from_torch_distributed() -> tuple[int, int]:
    """``(tp_size, rank)`` from an initialized ``torch.distributed`` process group, for callers
    that want the library's explicit arguments filled from their launcher."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialized; call init_process_group first or pass tp_size/rank")
    return dist.get_world_size(), dist.get_rank()

