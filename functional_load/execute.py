"""Run a plan: allocate each rank-local parameter once and fill it in place from the checkpoint.

This is the only stage that reads tensor data. Copies whose destination is a contiguous slot
of the same dtype are read straight into the parameter's memory; a cast or a transpose goes
through one box-sized temporary.
"""

from __future__ import annotations

from typing import Any

from .checkpoint.read import PreadReader
from .dtypes import to_torch, torch_name
from .plan import Plan
from .sharding import Box


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _bytes(tensor: Any) -> memoryview:
    """The memory of a contiguous CPU tensor as a writable byte buffer."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def execute(plan: Plan, *, reader: PreadReader | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Materialise ``plan`` as rank-local CPU torch tensors, in the plan's parameter order.

    Tied aliases map to the very same tensor object as their canonical parameter.
    ``progress=None`` shows a bar when the plan reads more than a few files.
    """
    import torch

    own_reader = reader is None
    reader = reader or PreadReader()
    files = {info.file for info in plan.tensors.values()}
    show = progress if progress is not None else len(files) > 4
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=plan.bytes_to_read, unit="B", unit_scale=True, desc=f"rank {plan.parallel.rank} load")
    out: dict[str, Any] = {}
    try:
        for param in plan.params:
            tensor = torch.empty(param.spec.local_shape, dtype=to_torch(param.spec.dtype))
            for box in param.zeros:
                tensor[_index(box)].zero_()
            for copy in param.copies:
                info = plan.tensors[copy.tensor]
                dst = tensor[_index(copy.dst)]
                source_dtype = to_torch(torch_name(info.dtype))
                if not copy.transpose and source_dtype == tensor.dtype and dst.is_contiguous():
                    reader.read_into(info, copy.src, _bytes(dst))
                else:
                    tmp = torch.empty(tuple(b - a for a, b in copy.src), dtype=source_dtype)
                    reader.read_into(info, copy.src, _bytes(tmp))
                    dst.copy_(tmp.T if copy.transpose else tmp)
                if bar is not None:
                    bar.update(plan.copy_bytes(copy))
            out[param.spec.name] = tensor
    finally:
        if bar is not None:
            bar.close()
        if own_reader:
            reader.close()
    for alias, target in plan.aliases.items():
        out[alias] = out[target]
    return out
