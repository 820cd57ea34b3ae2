"""One planned copy into its destination: the executor every output shares.

A destination is a torch tensor (a rank's parameter, in the arena) or a numpy array (a device's
block of a JAX target leaf: JAX stacks load without torch). A plain copy into a contiguous slot
of the source's dtype is read straight into it; any other goes through the thread's staging
buffer and :meth:`~functional_load.plan.copy.Copy.arrange` (a quantized source through its
format's box dequantizer) and is cast as it is written.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt

from ..checkpoint import TensorInfo
from ..dtypes import to_numpy, to_torch, torch_name
from ..layout.axes import view_to_dims
from ..layout.segments import Box, box_volume
from ..plan.copy import Copy, Destination
from .reader import Reader

if TYPE_CHECKING:
    import torch

Tensors: TypeAlias = Mapping[str, TensorInfo]  # a plan's checkpoint tensors by name
Array = TypeVar("Array", "torch.Tensor", np.ndarray)

_STAGING_BYTES = 32 << 20  # a thread keeps its staging buffer up to this size
_stage = threading.local()


def index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def as_bytes(array: torch.Tensor | np.ndarray) -> memoryview:
    """The memory of a contiguous CPU tensor or array as a writable byte buffer."""
    if isinstance(array, np.ndarray):
        return array.reshape(-1).view(np.uint8).data.cast("B")
    import torch

    return array.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def direct_bytes(tensors: Tensors, array: torch.Tensor | np.ndarray, copy: Copy) -> memoryview | None:
    """The bytes of ``copy``'s destination in ``array`` when the source can be read straight into
    them (a plain copy into a contiguous slot of the source's dtype), else None."""
    if not copy.plain:
        return None
    region = array[index(copy.dst)]
    name = torch_name(tensors[copy.tensor].dtype)
    if isinstance(region, np.ndarray):
        same = region.flags.c_contiguous and region.dtype == to_numpy(name)
    else:
        same = region.is_contiguous() and region.dtype == to_torch(name)
    return as_bytes(region) if same else None


def copy_into(tensors: Tensors, array: Array, copy: Copy, reader: Reader) -> None:
    """Fill one planned box of ``array`` (``tensors``: the plan's checkpoint tensors by name)."""
    info = tensors[copy.tensor]
    direct = direct_bytes(tensors, array, copy)
    if direct is not None:
        reader.read_into(info, copy.src, direct)
        return
    region = array[index(copy.dst)]
    if copy.dequantize is not None:
        block = dequantized(tensors, copy, reader)
    else:
        stored = np.dtype(to_numpy(torch_name(info.dtype)))
        raw = _staging(box_volume(copy.src) * stored.itemsize)
        if copy.view:
            reader.read_view(info, copy.view, copy.src, as_bytes(raw))
        else:
            reader.read_into(info, copy.src, as_bytes(raw))
        block = raw.view(stored).reshape(copy.shape)
    if isinstance(region, np.ndarray):
        np.copyto(region, copy.arrange(block, region.shape), casting="unsafe")
    else:
        region.copy_(copy.arrange(torch_view(block), tuple(region.shape)))


def torch_view(array: np.ndarray) -> torch.Tensor:
    """A C-contiguous numpy array as a torch tensor over the same memory (bfloat16 and float8
    included, which ``torch.from_numpy`` refuses)."""
    import torch

    return torch.from_numpy(array.reshape(-1).view(np.uint8)).view(to_torch(array.dtype.name)).view(array.shape)


def dequantized(tensors: Tensors, copy: Copy, reader: Reader) -> np.ndarray:
    """The float32 values of a quantized weight's box: the bounding box of ``copy.src`` in the
    weight's own ``[out, in]`` and its scales' boxes read, dequantized, the box picked."""
    how = copy.dequantize
    if how is None:
        raise ValueError(f"{copy.tensor}: not a dequantizing copy")
    info = tensors[copy.tensor]
    outer, picks = view_to_dims(copy.view or tuple((n,) for n in info.shape), copy.src)
    weight = _read(info, outer, reader)
    scales = {}
    for suffix, name in how.scales:
        scale = tensors[name]
        scales[suffix] = _read(scale, how.format.scale_box(suffix, outer, scale.shape), reader)
    dense = how.format.apply(weight, scales, outer)
    return np.ascontiguousarray(dense[np.ix_(*picks)], dtype=np.float32).reshape(copy.shape)


def _read(info: TensorInfo, box: Box, reader: Reader) -> np.ndarray:
    out = np.empty(tuple(b - a for a, b in box), dtype=to_numpy(torch_name(info.dtype)))
    reader.read_into(info, box, as_bytes(out))
    return out


def fill(tensors: Tensors, array: np.ndarray, destination: Destination, reader: Reader) -> None:
    """Fill ``array`` (fresh, C-contiguous memory) as a destination's box plan says: its zero
    boxes, then its copies. The copies run on a torch tensor over the same memory where torch is
    installed (its strided copies are several times faster: 2.3x on a whole tpu-inference-like
    tree), else on the numpy array itself: the same operations, the same values."""
    target = _torch_over(array)
    for box in destination.zeros:
        array[index(box)] = 0
    for copy in destination.copies:
        if target is None:
            copy_into(tensors, array, copy, reader)
        else:
            copy_into(tensors, target, copy, reader)


def fresh_memory(nbytes: int) -> mmap.mmap:
    """Private anonymous memory, page-aligned, advised against transparent huge pages (numpy's
    own large arrays ask for them: faulting 2 MiB pages from several threads made a whole
    tpu-inference-like tree load 1.6x slower here, a rank's arena 1.6x: see :func:`.fill.allocate`)."""
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            memory.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:
            pass
    return memory


def fresh_array(shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """A new C-contiguous array in :func:`fresh_memory` (page-aligned: JAX places it on a CPU
    device without copying it)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    return np.frombuffer(fresh_memory(nbytes), dtype=np.uint8, count=nbytes).view(dtype).reshape(shape)


def _torch_over(array: np.ndarray) -> torch.Tensor | None:
    """A torch tensor over ``array``'s memory (any dtype torch has), or None without torch."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    return torch_view(array)


def _staging(nbytes: int) -> np.ndarray:
    """A byte buffer to read a cast or rearranged copy into: the thread's own, reused (fresh
    memory would be page-faulted again for every copy), or a new one past ``_STAGING_BYTES``."""
    if nbytes > _STAGING_BYTES:
        return np.empty(nbytes, dtype=np.uint8)
    buffer = getattr(_stage, "buffer", None)
    if buffer is None or buffer.size < nbytes:
        buffer = _stage.buffer = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buffer[:nbytes]
