"""One planned copy: a box of one checkpoint tensor, what happens to the block read, where it lands.

Both planners emit this one form. ``make_plan`` compiles vLLM's slice descriptors (a slice, a
transposed one, repeated refined scale cells, Llama 4's rotary rows, Mamba's ``-exp``) for a
rank's tensors; ``plan_target`` compiles a target map's einops rearrangement for any box of a
JAX leaf (a device's shard). The executor (:mod:`functional_load.io.copies`) reads ``src`` and calls
:meth:`Copy.arrange`; a plain copy (no operation) is read straight into its destination.

A block is read as a box over the source's *axes*: each stored dimension split as ``view`` says
(``()``: one axis per dimension). Then, in order: the value ``transform``; per axis a
:class:`~functional_load.layout.axes.Step` (rotary permutation, repetition, a slice, zero
padding); the axes moved to the destination's order (``perm``); a float32 ``scale``; the result
reshaped to the destination box (merging adjacent axes) and cast to its dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import numpy as np

from ..layout.axes import Step, view_to_dims
from ..layout.param import Transform
from ..layout.quantized import BoxDequantizer
from ..layout.segments import Box, box_volume
from .rotary import to_halves, to_pairs

if TYPE_CHECKING:
    import torch

# What a copy reads and writes: a torch tensor (a rank's parameters), or a numpy array (a JAX
# target leaf's block: JAX stacks load without torch).
Block = TypeVar("Block", "torch.Tensor", np.ndarray)


@dataclass(frozen=True, slots=True)
class Dequantize:
    """The source is a quantized weight: its box is read with the boxes of its scale tensors
    (``scales``: suffix -> checkpoint tensor) and dequantized to float32 by ``format``."""

    format: BoxDequantizer
    scales: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Copy:
    """Read box ``src`` of checkpoint tensor ``tensor`` (over its axes, ``view``), rearrange the
    block (``transform``, ``steps`` per axis, ``perm``, ``scale``: see the module) and write it
    into box ``dst`` of the destination."""

    tensor: str
    src: Box
    dst: Box
    view: tuple[tuple[int, ...], ...] = ()
    steps: tuple[Step | None, ...] = ()  # per axis; None (or no entry): as read
    perm: tuple[int, ...] = ()  # the axes in the destination's order; (): as read
    transform: Transform | None = None  # "neg_exp": -exp(stored) in float32 (Mamba's A from A_log)
    scale: float | None = None
    dequantize: Dequantize | None = None

    @property
    def plain(self) -> bool:
        """The block lands as it is stored (it may be read straight into its destination)."""
        return not (self.view or self.steps or self.perm or self.transform or self.scale is not None or self.dequantize)

    @property
    def transposed(self) -> bool:
        """The only operation swaps the last two dimensions."""
        n = len(self.src)
        swap = tuple(range(n - 2)) + (n - 1, n - 2)
        return n >= 2 and self.perm == swap and replace(self, perm=()).plain

    @property
    def stored_src(self) -> Box:
        """The box of the tensor's own dimensions that holds ``src`` (its bounding box)."""
        return view_to_dims(self.view, self.src)[0] if self.view else self.src

    @property
    def shape(self) -> tuple[int, ...]:
        """The block read: ``src``'s extents over the axes."""
        return tuple(b - a for a, b in self.src)

    def take(self, whole: Block) -> Block:
        """The block of a whole source tensor (a reference read)."""
        axes = tuple(n for dim in self.view for n in dim) if self.view else tuple(whole.shape)
        return whole.reshape(axes)[tuple(slice(a, b) for a, b in self.src)]

    def arrange(self, block: Block, shape: tuple[int, ...]) -> Block:
        """``block`` (read as ``src``, or dequantized; any shape of its size) rearranged into a
        destination box of ``shape``: a torch tensor (rank loads) or a numpy array (JAX target
        leaves, which need no torch), the same operations on either."""
        if isinstance(block, np.ndarray):
            return _arrange(self, _NUMPY, block, shape)
        return _arrange(self, _TORCH, block, shape)

    def split(self, element_bytes: int, chunk: int) -> list[Copy]:
        """This copy cut along its first axis into pieces of about ``chunk`` bytes, where that
        axis lands as the outer part of one destination dimension; else whole (so are copies
        that repeat elements or dequantize: small, or boxes of their own)."""
        rows = self.src[0][1] - self.src[0][0] if self.src else 0
        parts = min(rows, -(-box_volume(self.src) * element_bytes // chunk)) if rows else 1
        if parts <= 1 or self.dequantize or any(s is not None and (s.repeat > 1 or s.zeros) for s in self.steps):
            return [self]
        if self.steps and self.steps[0] is not None:
            return [self]
        where = _outer_dim(self)
        if where is None:
            return [self]
        dim, unit = where
        (s0, s1), d0 = self.src[0], self.dst[dim][0]
        cuts = [s0 + (s1 - s0) * i // parts for i in range(parts)] + [s1]
        return [
            replace(self, src=((a, b),) + self.src[1:], dst=_with(self.dst, dim, (d0 + (a - s0) * unit, d0 + (b - s0) * unit)))
            for a, b in zip(cuts, cuts[1:])
            if b > a
        ]

    def describe(self) -> list[str]:
        """The operations, in words (the plan's JSON and table)."""
        out = [f"view {[list(d) for d in self.view]}"] if self.view else []
        out += [f"{'-exp' if self.transform == 'neg_exp' else self.transform}"] if self.transform else []
        for axis, step in enumerate(self.steps):
            if step is not None:
                out.append(f"axis {axis}: " + _step_words(step))
        out += [f"perm {list(self.perm)}"] if self.perm else []
        out += [f"scale {self.scale:g}"] if self.scale is not None else []
        out += [f"dequantize with {[t for _, t in self.dequantize.scales]}"] if self.dequantize else []
        return out


class Destination(Protocol):
    """The box plan of one destination (a rank's parameter, a device's box of a JAX leaf): the
    copies that fill it and the boxes that are zero."""

    @property
    def copies(self) -> tuple[Copy, ...]: ...

    @property
    def zeros(self) -> tuple[Box, ...]: ...


@dataclass(frozen=True, slots=True)
class BoxPlan:
    """The box plan of one box of a JAX target leaf (see :class:`Destination`)."""

    copies: tuple[Copy, ...]
    zeros: tuple[Box, ...] = ()


def slice_copy(
    tensor: str, shape: tuple[int, ...], src: Box, dst: Box, *, transpose: bool = False, repeat: tuple[int, ...] = (),
    rotary: int = 0, transform: Transform | None = None,
) -> Copy:
    """A copy of vLLM's loaders, from ``src`` (a box of the stored tensor of ``shape``) to ``dst``:
    ``transpose`` swaps the last two dimensions; ``repeat[d]`` repeats each element along
    destination-order dimension ``d`` (refined block scales), keeping the destination's extent;
    ``rotary``: the rows are heads of this many rows with their rotary pairs interleaved, the
    destination holds each head's halves (vLLM's Llama 4 loader)."""
    n = len(src)
    order = list(range(n))
    if transpose:
        order[-2:] = order[-1], order[-2]
    axes_of = [[d + (1 if rotary and d else 0)] for d in range(n)]
    view: tuple[tuple[int, ...], ...] = ()
    steps: list[Step | None] = [None] * n
    box = src
    if rotary:
        (a, b) = src[0]
        view = ((shape[0] // rotary, rotary),) + tuple((m,) for m in shape[1:])
        box = ((a // rotary, b // rotary), (0, rotary)) + src[1:]
        axes_of[0] = [0, 1]
        steps = [None, Step("halves", 1, 0, rotary, 0)] + steps[1:]
    extents = [b - a for a, b in dst][len(dst) - n :]
    for d, factor in enumerate(repeat):
        if factor > 1:
            (axis,) = axes_of[order[d]]
            steps[axis] = Step(None, factor, 0, extents[d], 0)
    perm = tuple(a for d in order for a in axes_of[d]) if transpose else ()
    kept = tuple(steps) if any(s is not None for s in steps) else ()
    return Copy(tensor, box, dst, view, kept, perm, transform)


def merge_expert_runs(copies: list[Copy]) -> list[Copy]:
    """Join copies of consecutive experts from a 3-D tensor into one box (fewer, longer reads)."""
    merged: list[Copy] = []
    for c in copies:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.tensor == c.tensor
            and replace(last, src=c.src, dst=c.dst) == c
            and not c.view
            and (not c.steps or c.steps[0] is None)
            and len(c.src) == len(c.dst) >= 3
            and last.src[1:] == c.src[1:]
            and last.dst[1:] == c.dst[1:]
            and last.src[0][1] == c.src[0][0]
            and last.dst[0][1] == c.dst[0][0]
        ):
            src = ((last.src[0][0], c.src[0][1]),) + c.src[1:]
            dst = ((last.dst[0][0], c.dst[0][1]),) + c.dst[1:]
            merged[-1] = replace(c, src=src, dst=dst)
        else:
            merged.append(c)
    return merged


def _arrange(copy: Copy, ops: _Ops[Block], block: Block, shape: tuple[int, ...]) -> Block:
    block = block.reshape(copy.shape)
    if copy.transform == "neg_exp":
        block = ops.neg_exp(block)  # as vLLM's loader: -torch.exp(loaded.float())
    for dim, step in enumerate(copy.steps):
        if step is not None:
            block = _apply(ops, step, block, dim)
    if copy.perm:
        block = ops.permute(block, copy.perm)
    if copy.scale is not None:
        block = ops.scale(block, copy.scale)
    return block.reshape(shape)


def _apply(ops: _Ops[Block], step: Step, block: Block, dim: int) -> Block:
    if step.rotary is not None:
        moved = ops.movedim(block, dim, 0)
        moved = to_pairs(moved, moved.shape[0]) if step.rotary == "pairs" else to_halves(moved, moved.shape[0])
        block = ops.movedim(moved, 0, dim)
    if step.repeat > 1:
        block = ops.repeat(block, step.repeat, dim)
    if step.skip or block.shape[dim] != step.length:
        block = block[(slice(None),) * dim + (slice(step.skip, step.skip + step.length),)]
    if step.zeros:
        block = ops.pad(block, dim, step.zeros)
    return block


class _Ops(Protocol, Generic[Block]):
    """The few array operations a copy's steps need, for torch tensors and numpy arrays alike."""

    def neg_exp(self, block: Block) -> Block: ...

    def movedim(self, block: Block, source: int, destination: int) -> Block: ...

    def repeat(self, block: Block, times: int, dim: int) -> Block: ...

    def pad(self, block: Block, dim: int, zeros: int) -> Block: ...

    def permute(self, block: Block, perm: tuple[int, ...]) -> Block: ...

    def scale(self, block: Block, scale: float) -> Block: ...


class _TorchOps:
    """The operations on torch tensors (vLLM's own: its loaders compute -exp and casts in torch)."""

    def neg_exp(self, block: torch.Tensor) -> torch.Tensor:
        return -block.float().exp()

    def movedim(self, block: torch.Tensor, source: int, destination: int) -> torch.Tensor:
        return block.movedim(source, destination)

    def repeat(self, block: torch.Tensor, times: int, dim: int) -> torch.Tensor:
        return block.repeat_interleave(times, dim=dim)

    def pad(self, block: torch.Tensor, dim: int, zeros: int) -> torch.Tensor:
        import torch

        shape = list(block.shape)
        shape[dim] = zeros
        return torch.cat([block, block.new_zeros(shape)], dim=dim)

    def permute(self, block: torch.Tensor, perm: tuple[int, ...]) -> torch.Tensor:
        return block.permute(perm)

    def scale(self, block: torch.Tensor, scale: float) -> torch.Tensor:
        import torch

        return block.float() * torch.tensor(scale, dtype=torch.float32)


class _NumpyOps:
    """The same operations on numpy arrays (einops and ml_dtypes cover the rest)."""

    def neg_exp(self, block: np.ndarray) -> np.ndarray:
        raise ValueError("-exp is vLLM's transform of a rank's tensor, computed in torch")

    def movedim(self, block: np.ndarray, source: int, destination: int) -> np.ndarray:
        return np.moveaxis(block, source, destination)

    def repeat(self, block: np.ndarray, times: int, dim: int) -> np.ndarray:
        return np.repeat(block, times, axis=dim)

    def pad(self, block: np.ndarray, dim: int, zeros: int) -> np.ndarray:
        widths = [(0, 0)] * block.ndim
        widths[dim] = (0, zeros)
        return np.pad(block, widths)

    def permute(self, block: np.ndarray, perm: tuple[int, ...]) -> np.ndarray:
        return block.transpose(perm)

    def scale(self, block: np.ndarray, scale: float) -> np.ndarray:
        return block.astype(np.float32) * np.float32(scale)


_TORCH, _NUMPY = _TorchOps(), _NumpyOps()


def _outer_dim(copy: Copy) -> tuple[int, int] | None:
    """The destination dimension whose outer part the copy's first axis is, and the destination
    elements per element of that axis; None when it is not one."""
    extents = [s.length + s.zeros if s is not None else b - a for s, (a, b) in zip(list(copy.steps) + [None] * len(copy.src), copy.src)]
    order = list(copy.perm) or list(range(len(extents)))
    q = order.index(0)
    prefix = math.prod(extents[i] for i in order[:q])
    dst = [b - a for a, b in copy.dst]
    for d in range(len(dst)):
        if math.prod(dst[:d]) != prefix:
            continue
        if dst[d] % extents[0] == 0:  # then the axes after it fill the rest of the dimension, ``unit`` per element
            return d, dst[d] // extents[0]
    return None


def _with(box: Box, dim: int, rng: tuple[int, int]) -> Box:
    return box[:dim] + (rng,) + box[dim + 1 :]


def _step_words(step: Step) -> str:
    words = [f"{step.rotary} rotary"] if step.rotary else []
    words += [f"repeat x{step.repeat}"] if step.repeat > 1 else []
    words += [f"keep {step.skip}:{step.skip + step.length}"]
    words += [f"+{step.zeros} zeros"] if step.zeros else []
    return ", ".join(words)
