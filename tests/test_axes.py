"""The index maths of target leaves (``layout/axes.py``), against whole-tensor rearrangements.

A box of a target leaf must be exactly what einops' ``rearrange`` of the whole source (after the
takes, rotary permutations, repeats and padding) holds there. Worked examples first (the layouts
the JAX stacks use: MaxText's scanned q kernel, tpu-inference's padded head_dim and repeated KV
heads), then hypothesis properties over random arrangements and boxes: the pieces tile the box
exactly once, each piece reads no element outside what it needs (rotary axes aside), and the
assembled block equals the reference.
"""

from __future__ import annotations

import itertools
import math

import einops
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_load.errors import ConfigError
from functional_load.layout.axes import Arrangement, Axis, split_range
from functional_load.plan.copy import BoxPlan
from functional_load.plan.rotary import to_halves, to_pairs


def reference(arrangement: Arrangement, sources: np.ndarray) -> np.ndarray:
    """The whole leaf: sources ``[stacked..., axes...]`` taken, permuted, repeated, padded, moved."""
    block = sources.reshape(tuple(a.size for a in arrangement.axes))
    for dim, axis in enumerate(arrangement.axes):
        if axis.take is not None:
            lo, hi = (axis.take, axis.take + 1) if isinstance(axis.take, int) else axis.take
            block = np.take(block, np.arange(lo, hi), axis=dim)
        if axis.rotary:
            moved = np.moveaxis(block, dim, 0)
            moved = to_pairs(moved, moved.shape[0]) if axis.rotary == "pairs" else to_halves(moved, moved.shape[0])
            block = np.moveaxis(moved, 0, dim)
        block = np.repeat(block, axis.repeat, axis=dim)
        if axis.pad is not None:
            widths = [(0, 0)] * block.ndim
            widths[dim] = (0, axis.pad - block.shape[dim])
            block = np.pad(block, widths)
    order = [i for group in arrangement.target for i in group]
    rest = [i for i in range(len(arrangement.axes)) if i not in order]
    block = np.transpose(block, order + rest)
    return block.reshape(arrangement.shape)


def box_plan(arrangement: Arrangement, box: tuple[tuple[int, int], ...]) -> BoxPlan:
    """The box plan a target leaf of ``arrangement`` compiles for ``box`` (sources named by their stacked index)."""
    from functional_load.plan.target import Leaf, LeafPlan

    k = arrangement.stacked
    infos = {which: _Info(str(which)) for which in itertools.product(*(range(a.size) for a in arrangement.axes[:k]))}
    leaf = LeafPlan(Leaf("x", arrangement.shape, "int64", None), "x", arrangement, infos)  # type: ignore[arg-type]
    return leaf.box_plan(box)


class _Info:
    def __init__(self, name: str) -> None:
        self.name = name


def assemble(arrangement: Arrangement, sources: np.ndarray, box: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The block through the compiled box plan and the executor's ``Copy.arrange``, each copy
    reading its box from the full sources array; on numpy blocks (a JAX target's) and on torch
    tensors (a rank's), which must agree."""
    import torch

    k = arrangement.stacked
    stacked = tuple(a.size for a in arrangement.axes[:k])
    flat = sources.reshape(stacked + (-1,))
    stored = tuple(math.prod(arrangement.axes[i].size for i in g) for g in arrangement.source)
    plan = box_plan(arrangement, box)
    blocks = []
    for wrap in (np.asarray, torch.from_numpy):
        out = wrap(np.full(tuple(b - a for a, b in box), -1, dtype=np.int64))
        for zero in plan.zeros:
            out[tuple(slice(a, b) for a, b in zero)] = 0
        for copy in plan.copies:
            which = tuple(int(i) for i in copy.tensor.strip("(),").split(",") if i.strip()) if k else ()
            block = copy.take(wrap(np.ascontiguousarray(flat[which]).reshape(stored)))
            assert tuple(block.shape) == copy.shape
            dst = out[tuple(slice(a, b) for a, b in copy.dst)]
            dst[...] = copy.arrange(block, tuple(dst.shape))
        blocks.append(np.asarray(out))
    assert np.array_equal(blocks[0], blocks[1]), "numpy and torch blocks differ"
    return blocks[0]


def test_split_range_worked_example() -> None:
    # rows 3..13 of a (4 x 4) merged dimension: the rest of row 0, whole rows 1-2, the start of row 3
    assert split_range(3, 13, (4, 4)) == [((0, 1), (3, 4)), ((1, 3), (0, 4)), ((3, 4), (0, 1))]
    assert split_range(4, 8, (4, 4)) == [((1, 2), (0, 4))]
    assert split_range(0, 16, (4, 4)) == [((0, 4), (0, 4))]
    assert split_range(5, 6, (2, 3, 4)) == [((0, 1), (1, 2), (1, 2))]
    assert split_range(2, 2, (4,)) == []


@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
@settings(max_examples=300, deadline=None)
def test_split_range_tiles_the_range_in_order(sizes: list[int], data: st.DataObject) -> None:
    total = math.prod(sizes)
    start = data.draw(st.integers(0, total - 1))
    stop = data.draw(st.integers(start + 1, total))
    flat = []
    for box in split_range(start, stop, tuple(sizes)):
        indices = [int(np.ravel_multi_index(p, sizes)) for p in itertools.product(*(range(a, b) for a, b in box))]
        assert indices == list(range(indices[0], indices[0] + len(indices))), "a piece is not one contiguous run"
        flat += indices
    assert flat == list(range(start, stop))


def test_maxtext_scanned_query_kernel() -> None:
    """``layer (n h) d -> d layer n h``: MaxText's scanned q kernel, sharded (fsdp on d, tensor on n)."""
    L, N, H, D = 3, 4, 6, 8
    arrangement = Arrangement(
        (Axis("layer", L), Axis("n", N), Axis("h", H, rotary="pairs"), Axis("d", D)), ((1, 2), (3,)), ((3,), (0,), (1,), (2,)), 1
    )
    sources = np.arange(L * N * H * D, dtype=np.float32).reshape(L, N * H, D)
    want = einops.rearrange(sources, "layer (n h) d -> d layer n h", n=N)
    want = einops.rearrange(want, "d l n (two x) -> d l n (x two)", two=2)  # HF halves -> interleaved pairs
    assert np.array_equal(reference(arrangement, sources), want)
    box = ((2, 6), (0, 3), (2, 4), (0, 6))  # device (fsdp 1 of 2, tensor 1 of 2)
    assert np.array_equal(assemble(arrangement, sources, box), want[2:6, :, 2:4, :])


def test_tpu_inference_padded_and_repeated_kv() -> None:
    """``(k h) d -> d k h``: 2 KV heads repeated to 4 (a model axis of 4), head_dim 6 padded to 8."""
    K, H, D = 2, 6, 4
    arrangement = Arrangement((Axis("k", K, repeat=2), Axis("h", H, pad=8), Axis("d", D)), ((0, 1), (2,)), ((2,), (0,), (1,)))
    sources = np.arange(K * H * D, dtype=np.float32).reshape(K * H, D) + 1
    want = einops.rearrange(sources, "(k h) d -> d k h", k=K).repeat(2, axis=1)
    want = np.pad(want, [(0, 0), (0, 0), (0, 2)])
    assert np.array_equal(reference(arrangement, sources), want)
    for rank in range(4):  # model rank r holds KV head r // 2, as vLLM replicates it
        block = assemble(arrangement, sources, ((0, D), (rank, rank + 1), (0, 8)))
        assert np.array_equal(block, want[:, rank : rank + 1, :])
    # a shard of padding only is zeros and reads nothing
    assert all(reads[0] is None for _, reads in arrangement.boxes(((0, D), (0, 4), (6, 8))))


def test_take_splits_a_fused_tensor() -> None:
    """Phi-3's fused ``qkv_proj`` rows ``[q; k; v]`` into the k leaf: ``take`` a range of heads."""
    N, K, H, D = 4, 2, 3, 5
    arrangement = Arrangement((Axis("n", N + 2 * K, take=(N, N + K)), Axis("h", H), Axis("d", D)), ((0, 1), (2,)), ((2,), (0,), (1,)))
    sources = np.arange((N + 2 * K) * H * D, dtype=np.float32).reshape(-1, D)
    want = einops.rearrange(sources, "(n h) d -> d n h", h=H)[:, N : N + K]
    assert np.array_equal(reference(arrangement, sources), want)
    assert np.array_equal(assemble(arrangement, sources, ((1, 3), (1, 2), (0, 3))), want[1:3, 1:2, :])


def test_axis_checks() -> None:
    with pytest.raises(ConfigError, match="outside"):
        Axis("e", 4, take=4)
    with pytest.raises(ConfigError, match="pad to 3 is less"):
        Axis("h", 4, pad=3)
    with pytest.raises(ConfigError, match="even size"):
        Axis("h", 5, rotary="pairs")


@st.composite
def arrangements(draw: st.DrawFn) -> tuple[Arrangement, np.ndarray]:
    stacked = draw(st.integers(0, 2))
    count = draw(st.integers(1, 4))
    axes = []
    for i in range(stacked + count):
        size = draw(st.integers(1, 4))
        take = draw(st.sampled_from([None, "index", "range"])) if size > 1 else None
        taken: int | tuple[int, int] | None = None
        if take == "index":
            taken = draw(st.integers(0, size - 1))
        elif take == "range":
            lo = draw(st.integers(0, size - 1))
            taken = (lo, draw(st.integers(lo + 1, size)))
        length = 1 if isinstance(taken, int) else (taken[1] - taken[0] if taken else size)
        rotary = draw(st.sampled_from([None, "pairs", "halves"])) if i >= stacked and length % 2 == 0 else None
        repeat = draw(st.integers(1, 3)) if not isinstance(taken, int) else 1
        pad = draw(st.sampled_from([None, length * repeat + draw(st.integers(0, 3))])) if not isinstance(taken, int) else None
        axes.append(Axis(f"a{i}", size, taken, rotary, repeat, pad))
    kept = [i for i, a in enumerate(axes) if not a.dropped]
    if not kept:
        axes[0] = Axis(axes[0].name, axes[0].size)
        kept = [0]
    order = draw(st.permutations(kept))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(order) - 1)), max_size=len(order) - 1))) if len(order) > 1 else []
    target = tuple(tuple(order[a:b]) for a, b in zip([0, *cuts], [*cuts, len(order)]))
    own = list(range(stacked, len(axes)))
    splits = sorted(draw(st.sets(st.integers(1, max(1, len(own) - 1)), max_size=len(own) - 1))) if len(own) > 1 else []
    source = tuple(tuple(own[a:b]) for a, b in zip([0, *splits], [*splits, len(own)]))
    arrangement = Arrangement(tuple(axes), source, target, stacked)
    sources = np.arange(math.prod(a.size for a in axes), dtype=np.int64) + 1
    return arrangement, sources


@given(arrangements(), st.data())
@settings(max_examples=400, deadline=None)
def test_any_box_equals_the_whole_rearrangement(case: tuple[Arrangement, np.ndarray], data: st.DataObject) -> None:
    arrangement, sources = case
    want = reference(arrangement, sources)
    box = []
    for n in arrangement.shape:
        lo = data.draw(st.integers(0, n - 1))
        box.append((lo, data.draw(st.integers(lo + 1, n))))
    got = assemble(arrangement, sources, tuple(box))
    assert np.array_equal(got, want[tuple(slice(a, b) for a, b in box)])
    # the pieces tile the box exactly once
    cover = np.zeros(tuple(b - a for a, b in box), dtype=np.int64)
    for place, _ in arrangement.boxes(tuple(box)):
        cover[tuple(slice(a, b) for a, b in place)] += 1
    assert (cover == 1).all()


@given(arrangements(), st.data())
@settings(max_examples=200, deadline=None)
def test_pieces_read_only_what_they_need(case: tuple[Arrangement, np.ndarray], data: st.DataObject) -> None:
    """Outside rotary axes, a box reads at most the source elements its values come from."""
    arrangement, _ = case
    if any(a.rotary for a in arrangement.axes):
        return
    box = []
    for n in arrangement.shape:
        lo = data.draw(st.integers(0, n - 1))
        box.append((lo, data.draw(st.integers(lo + 1, n))))
    read = sum(math.prod(r.src[1] - r.src[0] for r in reads) for _, reads in arrangement.boxes(tuple(box)) if reads[0] is not None)
    distinct = math.prod(b - a for a, b in box)
    assert read <= distinct


def test_rotary_on_a_stacked_axis_is_refused() -> None:
    """A stacked axis enumerates source tensors (layers, experts): rotary permutes the elements of one tensor's axis."""
    with pytest.raises(ConfigError, match="'layer' enumerates source tensors"):
        Arrangement((Axis("layer", 2, rotary="halves"), Axis("d", 4)), ((1,),), ((0,), (1,)), 1)
