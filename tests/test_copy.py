"""The plan's one copy form (``plan/copy.py``): vLLM's slice operations compiled into it equal
their definitions, and cutting a copy into chunks (the executor's threads) changes no value.

``slice_copy`` is checked against the operations written out directly on the whole tensor
(torch: transpose, ``repeat_interleave`` then the destination's extent, rotary halves per head);
``Copy.split`` against the whole copy, for vLLM's copies and for the copies a JAX target leaf's
box compiles to (any arrangement, any box).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_axes import arrangements, box_plan

from functional_load.layout.axes import Arrangement
from functional_load.plan.copy import Copy, slice_copy
from functional_load.plan.rotary import to_halves


def run(copies: list[Copy], whole: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """The destination the copies fill (-1 where none writes), each reading from ``whole``."""
    out = torch.full(shape, -1, dtype=torch.int64)
    for copy in copies:
        dst = out[tuple(slice(a, b) for a, b in copy.dst)]
        dst.copy_(copy.arrange(copy.take(whole[copy.tensor]), tuple(dst.shape)))
    return out


@st.composite
def vllm_copies(draw: st.DrawFn) -> tuple[Copy, torch.Tensor, torch.Tensor]:
    """A slice copy of vLLM's kinds with its stored tensor and the destination it must give."""
    kind = draw(st.sampled_from(["plain", "transpose", "rotary", "repeat", "experts"]))
    lead = draw(st.integers(0, 1)) if kind != "experts" else 0
    if kind == "rotary":
        head = 2 * draw(st.integers(1, 3))
        heads, cols = draw(st.integers(1, 4)), draw(st.integers(1, 3))
        h0 = draw(st.integers(0, heads - 1))
        h1 = draw(st.integers(h0 + 1, heads))
        shape = (heads * head, cols)
        src = ((h0 * head, h1 * head), (0, cols))
    else:
        ndim = 3 if kind == "experts" else 2
        shape = tuple(draw(st.integers(1, 5)) for _ in range(ndim))
        src = []
        for n in shape:
            a = draw(st.integers(0, n - 1))
            src.append((a, draw(st.integers(a + 1, n))))
        src = tuple(src)
    whole = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape) + 1
    block = whole[tuple(slice(a, b) for a, b in src)]
    transpose = kind == "transpose" or (kind == "experts" and draw(st.booleans()))
    repeat: tuple[int, ...] = ()
    if transpose:
        block = block.transpose(-1, -2)
    if kind == "rotary":
        block = to_halves(block, head)
    if kind == "repeat":
        repeat = tuple(draw(st.integers(1, 3)) for _ in block.shape)
        for d, f in enumerate(repeat):
            block = block.repeat_interleave(f, dim=d)
        keep = tuple(draw(st.integers(max(1, n - f + 1), n)) for n, f in zip(block.shape, repeat))
        block = block[tuple(slice(0, k) for k in keep)]
    want = block.reshape((1,) * lead + tuple(block.shape))
    dst = tuple((0, 1) for _ in range(lead)) + tuple((0, n) for n in block.shape)
    copy = slice_copy("t", shape, src, dst, transpose=transpose, repeat=repeat, rotary=head if kind == "rotary" else 0)
    return copy, whole, want


@given(vllm_copies(), st.integers(1, 64))
@settings(max_examples=400, deadline=None)
def test_slice_copies_and_their_chunks_equal_the_operations(case: tuple[Copy, torch.Tensor, torch.Tensor], chunk: int) -> None:
    copy, whole, want = case
    shape = tuple(want.shape)
    assert torch.equal(run([copy], {"t": whole}, shape), want)
    pieces = copy.split(8, chunk)
    assert torch.equal(run(pieces, {"t": whole}, shape), want), pieces
    assert sum(math.prod(b - a for a, b in p.src) for p in pieces) == math.prod(b - a for a, b in copy.src)


def test_a_transposed_copy_splits_along_the_destination_columns() -> None:
    copy = slice_copy("t", (8, 4), ((0, 8), (0, 4)), ((0, 4), (0, 8)), transpose=True)
    pieces = copy.split(1, 8)
    assert [p.src for p in pieces] == [((0, 2), (0, 4)), ((2, 4), (0, 4)), ((4, 6), (0, 4)), ((6, 8), (0, 4))]
    assert [p.dst for p in pieces] == [((0, 4), (0, 2)), ((0, 4), (2, 4)), ((0, 4), (4, 6)), ((0, 4), (6, 8))]
    rotary = slice_copy("q", (16, 2), ((8, 16), (0, 2)), ((0, 8), (0, 2)), rotary=4)  # two heads of 4 rows
    assert [p.dst for p in rotary.split(1, 8)] == [((0, 4), (0, 2)), ((4, 8), (0, 2))], "cut in whole heads"
    assert slice_copy("s", (1, 2), ((0, 1), (0, 2)), ((0, 1), (0, 4)), repeat=(1, 2)).split(1, 1) == [
        slice_copy("s", (1, 2), ((0, 1), (0, 2)), ((0, 1), (0, 4)), repeat=(1, 2))
    ], "a repeating copy stays whole"


@given(arrangements(), st.data(), st.integers(1, 64))
@settings(max_examples=300, deadline=None)
def test_target_box_copies_split_like_the_whole(case: tuple[Arrangement, np.ndarray], data: st.DataObject, chunk: int) -> None:
    """Chunks of the copies a target leaf's box compiles to fill the box as the whole copies do."""
    arrangement, sources = case
    box = []
    for n in arrangement.shape:
        lo = data.draw(st.integers(0, n - 1))
        box.append((lo, data.draw(st.integers(lo + 1, n))))
    plan = box_plan(arrangement, tuple(box))
    k = arrangement.stacked
    stacked = tuple(a.size for a in arrangement.axes[:k])
    flat = torch.from_numpy(sources.reshape(stacked + (-1,)))
    stored = tuple(math.prod(arrangement.axes[i].size for i in g) for g in arrangement.source)
    whole = {c.tensor: flat[_which(c.tensor)].reshape(stored) for c in plan.copies}
    shape = tuple(b - a for a, b in box)
    want = run(list(plan.copies), whole, shape)
    got = run([p for c in plan.copies for p in c.split(8, chunk)], whole, shape)
    assert torch.equal(got, want)


def _which(name: str) -> tuple[int, ...]:
    return tuple(int(i) for i in name.strip("(),").split(",") if i.strip())


@pytest.mark.parametrize("transpose", [False, True])
def test_plain_and_transposed(transpose: bool) -> None:
    copy = slice_copy("t", (4, 6), ((0, 4), (2, 6)), ((0, 4), (0, 4)), transpose=transpose)
    assert copy.plain is not transpose and copy.transposed is transpose
    assert copy.stored_src == ((0, 4), (2, 6))
    rotary = slice_copy("q", (16, 2), ((8, 16), (0, 2)), ((0, 8), (0, 2)), rotary=4)
    assert not rotary.plain and not rotary.transposed and rotary.stored_src == ((8, 16), (0, 2))
