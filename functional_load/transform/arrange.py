"""One device's block of a target leaf, from the source boxes its rule reads (numpy).

:func:`arrange_block` asks ``read`` for each piece of the block (a box of one source tensor over
its axes, see :mod:`functional_load.layout.axes`), stacks the pieces of stacked sources, applies
each axis' rotary permutation, repetition, slice and zero padding, moves the axes to the target's
order, merges them into the target's dimensions, scales (in float32) and casts to the leaf's
dtype, and writes each piece at its place. Only layout operations and one cast happen here; the
rearrangement is einops' (its pattern grammar), so the block equals ``rearrange`` of the whole
source followed by slicing, element for element (the tests check it).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from ..layout.axes import Arrangement, AxisRead, Range, read_axes
from ..plan.rotary import to_halves, to_pairs

# (stacked index, box over the source tensor's axes) -> that box of the source, shaped as its axes
Read = Callable[[tuple[int, ...], tuple[Range, ...]], np.ndarray]


def _axis_ops(block: np.ndarray, reads: tuple[AxisRead, ...]) -> np.ndarray:
    for dim, read in enumerate(reads):
        if read.rotary is not None:
            moved = np.moveaxis(block, dim, 0)
            size = moved.shape[0]
            moved = to_pairs(moved, size) if read.rotary == "pairs" else to_halves(moved, size)
            block = np.moveaxis(moved, 0, dim)
        if read.repeat > 1:
            block = np.repeat(block, read.repeat, axis=dim)
        if read.skip or block.shape[dim] != read.length:
            block = np.take(block, np.arange(read.skip, read.skip + read.length), axis=dim)
        if read.zeros:
            widths = [(0, 0)] * block.ndim
            widths[dim] = (0, read.zeros)
            block = np.pad(block, widths)
    return block


def arrange_block(
    arrangement: Arrangement, index: tuple[Range, ...], read: Read, dtype: npt.DTypeLike, scale: float | None = None
) -> np.ndarray:
    """The block of the leaf at ``index`` (one range per target dimension), as ``dtype``."""
    out = np.zeros(tuple(b - a for a, b in index), dtype=dtype)
    k = arrangement.stacked
    order = [i for group in arrangement.target for i in group]
    for place, reads in arrangement.boxes(index):
        axis_reads = read_axes(reads)
        if axis_reads is None:
            continue  # all padding: zeros
        stacked = [range(*r.src) for r in axis_reads[:k]]
        box = tuple(r.src for r in axis_reads[k:])
        parts = [read(which, box) for which in itertools.product(*stacked)]
        lead = tuple(len(r) for r in stacked)
        block = np.stack(parts).reshape(lead + parts[0].shape) if k else parts[0]
        block = _axis_ops(block, axis_reads)
        block = np.transpose(block, [i for i in order] + [i for i in range(len(axis_reads)) if i not in order])
        block = block.reshape(tuple(b - a for a, b in place))
        if scale is not None:
            block = block.astype(np.float32) * np.float32(scale)
        out[tuple(slice(a, b) for a, b in place)] = block.astype(dtype, copy=False)
    return out


def block_bytes(index: tuple[Range, ...], dtype: npt.DTypeLike) -> int:
    return math.prod(b - a for a, b in index) * np.dtype(dtype).itemsize
