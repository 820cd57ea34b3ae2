"""Filling one rank's parameters: the arena they live in, and one planned copy at a time.

Every parameter of a rank lives in one 64-byte-aligned arena (so DLPack hands them to JAX
without copies). A copy whose destination slot is contiguous and of the checkpoint's dtype is
read straight into it; a cast or transpose goes through one box-sized temporary. Scales are
checked as they are read, and parts of a fused layer that must be identical are compared.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

from ..checkpoint import TensorInfo
from ..dtypes import to_numpy, to_torch, torch_itemsize, torch_name
from ..errors import CheckpointError
from ..layout.axes import view_to_dims
from ..layout.param import ParamSpec
from ..layout.segments import Box, box_volume, full_box
from ..plan.copy import Copy, Destination
from ..plan.plan import ParamPlan, Plan
from .dummy import initialize_dummy
from .reader import Reader

if TYPE_CHECKING:
    import numpy as np
    import torch

Tensors: TypeAlias = Mapping[str, TensorInfo]  # a plan's checkpoint tensors by name

ALIGN = 64


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _bytes(tensor: Any) -> memoryview:  # a torch.Tensor (untyped: numpy's 3.11 stubs give ndarray no __buffer__)
    """The memory of a contiguous CPU tensor as a writable byte buffer."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def allocate(specs: list[ParamSpec]) -> dict[str, torch.Tensor]:
    """One arena for all ``specs``: each tensor starts on a 64-byte boundary. The arena is
    private anonymous memory advised against transparent huge pages. Measured here with
    ``fl.load`` of a 2.1 GB checkpoint (fresh processes, medians of 3, quiet machine): hot tp 1
    1.17 s so, 1.55 s in ``mmap``'s default shared mapping (shared memory) and 1.89 s with huge
    pages (faulting 2 MiB pages from several reading threads); cold tp 1 2.94 s vs 2.98 s and
    3.65 s. Its pages are faulted in by the reads themselves, on several threads at once
    (measured faster here than pre-faulting it first with ``MADV_POPULATE_WRITE``, which runs
    serially)."""
    import torch

    offsets, total = {}, 0
    for spec in specs:
        offsets[spec.name] = total
        nbytes = box_volume(full_box(spec.local_shape)) * torch_itemsize(spec.dtype)
        total += -(-max(nbytes, 1) // ALIGN) * ALIGN
    if total == 0:
        return {}
    arena = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            arena.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:
            pass
    memory = torch.frombuffer(arena, dtype=torch.uint8)
    out = {}
    for spec in specs:
        start = offsets[spec.name]
        nbytes = box_volume(full_box(spec.local_shape)) * torch_itemsize(spec.dtype)
        out[spec.name] = memory[start : start + nbytes].view(to_torch(spec.dtype)).view(spec.local_shape)
    return out


def direct_bytes(tensors: Tensors, tensor: torch.Tensor, copy: Copy) -> memoryview | None:
    """The bytes of ``copy``'s destination in ``tensor`` when the source can be read straight into
    them (a plain copy into a contiguous slot of the source dtype), else None."""
    if not copy.plain:
        return None
    dst = tensor[_index(copy.dst)]
    if not dst.is_contiguous() or to_torch(torch_name(tensors[copy.tensor].dtype)) != tensor.dtype:
        return None
    return _bytes(dst)


def copy_into(tensors: Tensors, tensor: torch.Tensor, copy: Copy, reader: Reader) -> None:
    """Fill one planned box of ``tensor`` (``tensors``: the plan's checkpoint tensors by name)."""
    info = tensors[copy.tensor]
    direct = direct_bytes(tensors, tensor, copy)
    if direct is not None:
        reader.read_into(info, copy.src, direct)
        return
    dst = tensor[_index(copy.dst)]
    if copy.dequantize is not None:
        block = dequantized(tensors, copy, reader)
    else:
        block = _staging(copy.shape, to_torch(torch_name(info.dtype)))
        if copy.view:
            reader.read_view(info, copy.view, copy.src, _bytes(block))
        else:
            reader.read_into(info, copy.src, _bytes(block))
    dst.copy_(copy.arrange(block, tuple(dst.shape)))


def dequantized(tensors: Tensors, copy: Copy, reader: Reader) -> torch.Tensor:
    """The float32 values of a quantized weight's box: the bounding box of ``copy.src`` in the
    weight's own ``[out, in]`` and its scales' boxes read, dequantized, the box picked."""
    import numpy as np
    import torch

    how = copy.dequantize
    if how is None:
        raise ValueError(f"{copy.tensor}: not a dequantizing copy")
    info = tensors[copy.tensor]
    outer, picks = view_to_dims(copy.view or tuple((n,) for n in info.shape), copy.src)
    weight = _read_numpy(info, outer, reader)
    scales = {}
    for suffix, name in how.scales:
        scale = tensors[name]
        scales[suffix] = _read_numpy(scale, how.format.scale_box(suffix, outer, scale.shape), reader)
    dense = how.format.apply(weight, scales, outer)
    return torch.from_numpy(np.ascontiguousarray(dense[np.ix_(*picks)])).reshape(copy.shape)


def _read_numpy(info: TensorInfo, box: Box, reader: Reader) -> np.ndarray:
    import numpy as np

    out = np.empty(tuple(b - a for a, b in box), dtype=to_numpy(torch_name(info.dtype)))
    reader.read_into(info, box, out.reshape(-1).view(np.uint8).data)
    return out


def fill(tensors: Tensors, tensor: torch.Tensor, destination: Destination, reader: Reader) -> None:
    """Fill ``tensor`` (fresh memory) as a destination's box plan says: its zero boxes, then its copies."""
    for box in destination.zeros:
        tensor[_index(box)].zero_()
    for copy in destination.copies:
        copy_into(tensors, tensor, copy, reader)


_STAGING_BYTES = 32 << 20  # a thread keeps its staging buffer up to this size
_stage = threading.local()


def _staging(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A box-sized buffer to read a cast or rearranged copy into: the thread's own, reused (fresh
    memory would be page-faulted again for every copy), or a new one past ``_STAGING_BYTES``."""
    import torch

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes > _STAGING_BYTES:
        return torch.empty(shape, dtype=dtype)
    buffer = getattr(_stage, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _stage.buffer = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
    return buffer[:nbytes].view(dtype).view(shape)


def prepare(param: ParamPlan, tensor: torch.Tensor) -> None:
    """Defaults, zero boxes (vocabulary padding) and dummy values, before any copy."""
    if param.dummy is not None:
        initialize_dummy(tensor, param.dummy)
    if param.fill is not None:
        tensor.fill_(param.fill)
    for box in param.zeros:
        tensor[_index(box)].zero_()


def verify_shared(plan: Plan, param: ParamPlan, tensor: torch.Tensor, reader: Reader) -> None:
    """Parts of a fused layer that must be identical (act-order ``g_idx``) are compared."""
    import torch

    for check in param.checks:
        info = plan.tensors[check.tensor]
        tmp = torch.empty(tuple(b - a for a, b in check.src), dtype=to_torch(torch_name(info.dtype)))
        reader.read_into(info, check.src, _bytes(tmp))
        if not torch.equal(tmp.to(tensor.dtype).reshape(-1), tensor[_index(check.dst)].reshape(-1)):
            first = next((c.tensor for c in param.copies if c.dst == check.dst), "?")
            raise CheckpointError(
                f"{param.spec.name}: checkpoint tensors {first!r} and {check.tensor!r} (in {info.file.name}) must be "
                f"identical for the fused parameter (vLLM keeps one value for both), but differ; re-export the checkpoint"
            )


def check_scale(plan: Plan, param: ParamPlan, tensor: torch.Tensor) -> None:
    """A NaN, infinite, zero or negative scale would silently corrupt every dequantized weight: a
    parameter's ``check`` (data its format put on it) says what its values must be: ``"positive"``
    (finite and > 0), ``"finite"`` (integer group scales: some producers store negative ones on
    purpose) or ``"e8m0"`` (exponent bytes, 0xFF is NaN)."""
    import torch

    check = param.spec.check
    values = tensor.view(torch.uint8).float() if tensor.dtype == torch.float8_e8m0fnu and check == "e8m0" else tensor.float()
    if check == "e8m0":
        bad = values == 255
    elif check == "finite":
        bad = ~torch.isfinite(values)
    else:
        bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        sources = sorted({c.tensor for c in param.copies}) or ["(default)"]
        first = values[bad].flatten()[0].item()
        what = {"e8m0": "valid e8m0 exponents (not 0xFF)", "finite": "finite"}.get(str(check), "finite and positive")
        raise CheckpointError(
            f"{param.spec.name}: {int(bad.sum())} of {values.numel()} scale values are not {what} "
            f"(e.g. {first}); from checkpoint tensor(s) {sources} in "
            f"{sorted({plan.tensors[t].file.name for t in sources if t in plan.tensors})}. The checkpoint is corrupt "
            f"or was exported wrongly; re-export it"
        )


def load_param(plan: Plan, param: ParamPlan, reader: Reader, dtype: str | None = None) -> torch.Tensor:
    """One parameter of the plan's rank as a fresh CPU torch tensor (``dtype``: override the
    parameter's own, for online quantization); scales are checked."""
    import torch

    if param.spec.derived:
        raise ValueError(f"{param.spec.name} is computed with its weight by online quantization, not loaded alone")
    tensor = torch.empty(param.spec.local_shape, dtype=to_torch(dtype or param.spec.dtype))
    prepare(param, tensor)
    for copy in param.copies:
        copy_into(plan.tensors, tensor, copy, reader)
    verify_shared(plan, param, tensor, reader)
    if is_scale(param):
        check_scale(plan, param, tensor)
    return tensor


def is_scale(param: ParamPlan) -> bool:
    """A checked parameter (a scale) read from the checkpoint (a default, like vLLM's -1.0 "absent"
    KV scale, is not data)."""
    return param.spec.check is not None and bool(param.copies)
