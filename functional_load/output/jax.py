"""Global ``jax.Array``s with a ``NamedSharding``, built from the same per-rank plans as torch.

The tensor-parallel rank of a device is its coordinate along the mesh's ``tp_axis``. A
parameter split over ranks becomes one global array whose shards along that axis are exactly
the rank-local blocks of the torch path (rank-major: ``[rank 0 block; rank 1 block; ...]``), so
a ``shard_map`` kernel sees what a torch rank sees. Replicated parameters are replicated.
Arrays are built with ``jax.make_array_from_callback``: each process plans and reads only the
ranks its addressable devices hold, through the one reader of every load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, ShardingError
from ..io.fill import load_param
from ..io.reader import Reader
from ..plan.plan import Plan
from ..transform.dlpack import to_jax


def local_tp_ranks(mesh: Any, tp_axis: str) -> list[int]:
    """The tensor-parallel ranks of this process's devices (their coordinates along ``tp_axis``)."""
    import numpy as np

    if tp_axis not in mesh.axis_names:
        raise ConfigError(f"mesh axes {mesh.axis_names} have no tensor-parallel axis {tp_axis!r}; pass tp_axis=")
    axis = mesh.axis_names.index(tp_axis)
    return sorted({int(np.argwhere(mesh.devices == d)[0][axis]) for d in mesh.local_devices})


def global_arrays(plan_of: Callable[[int], Plan], mesh: Any, tp_axis: str, reader: Reader) -> dict[str, Any]:
    """Every parameter as a global array sharded over ``mesh`` (other mesh axes replicate);
    ``plan_of(rank)`` is the plan of a tensor-parallel rank, asked only for local ranks."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    tp_size = mesh.shape[tp_axis]
    local_ranks = local_tp_ranks(mesh, tp_axis)
    first = plan_of(local_ranks[0])
    out: dict[str, Any] = {}
    for param in first.params:
        spec = param.spec
        dim = spec.sharding.tp_dim(first.parallel)
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

        size = local[dim] if dim is not None else 0

        def block(
            index: Any, name: str = spec.name, dim: int | None = dim, size: int = size, cache: dict[int, Any] = cache
        ) -> Any:
            rank = local_ranks[0] if dim is None else (index[dim].start or 0) // size
            if rank not in cache:
                plan = plan_of(rank)
                cache[rank] = np.asarray(to_jax(load_param(plan, plan.param(name), reader)))
            data = cache[rank]
            if dim is None:
                return data[index]
            return data[tuple(slice(None) if d == dim else index[d] for d in range(len(index)))]

        out[spec.name] = jax.make_array_from_callback(global_shape, NamedSharding(mesh, pspec), block)
        cache.clear()
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
