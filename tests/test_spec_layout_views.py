"""Layout kinds added for the unjudged families: a split parameter stored with extra size-1
dimensions (``squeeze``: Kimi-Linear's A_log), segments padded per rank (``pad``: Kimi's experts),
experts stored flat ``[E * rows, cols]`` (DBRX), non-gated experts (``gated = false``: Nemotron-H)
and one input-major expert tensor (``input_major = "w2"``)."""

from __future__ import annotations

from functional_load.layout.expert_sharding import ExpertSplit
from functional_load.layout.experts import expert_params
from functional_load.layout.parallel import Parallel
from functional_load.layout.segments import Segment, segment_pieces, segment_width
from functional_load.layout.sharding import Split
from functional_load.model.expressions import Scope
from functional_load.model.spec import ModuleSpec


def test_split_squeeze_reads_a_viewed_tensor() -> None:
    split = Split(0, (Segment(0, 8),), squeeze=True)
    part = split.part((8,), None, None, Parallel(4, 1), (1, 1, 8, 1))
    assert part.expected == (1, 1, 8, 1)
    assert part.pairs[0][:2] == (((0, 1), (0, 1), (2, 4), (0, 1)), ((0, 2),))
    plain = split.part((8,), None, None, Parallel(4, 1), (8,))  # the 1-D form vLLM also accepts
    assert plain.expected == (8,) and plain.pairs[0][0] == ((2, 4),)
    assert Split(0, (Segment(0, 8),)).part((8,), None, None, Parallel(4, 1), (1, 1, 8, 1)).expected == (8,)  # no squeeze


def test_segment_pad() -> None:
    seg = Segment("w1", 32, pad=8)
    assert [segment_width(seg, tp) for tp in (1, 2, 4, 8)] == [32, 16, 8, 8]  # 32 / 8 = 4 rows padded to 8
    pieces = segment_pieces((seg, Segment("w3", 32, pad=8)), 8, 3)
    assert [(p.src, p.dst) for p in pieces] == [((12, 16), (0, 4)), ((12, 16), (8, 12))]
    part = Split(0, (seg,)).part((32, 4), None, None, Parallel(8, 3), (32, 4))
    assert part.zeros == (((4, 8), (0, 4)),)


def _experts(**fields: object) -> dict[str, object]:
    module = ModuleSpec("m.experts", "experts", {"experts": 4, "in": 8, "intermediate": 6, **fields})
    return {p.suffix: p for p in expert_params(module, Scope({}, {}), "bfloat16", None)}


def test_flat_experts_fold_the_expert_into_rows() -> None:
    params = _experts(flat=True, input_major="w2")
    w13, w2 = params["routed_experts.w13_weight"], params["routed_experts.w2_weight"]
    assert isinstance(w13.sharding, ExpertSplit) and w13.sharding.flat and not w13.sharding.input_major
    assert w2.sharding.input_major
    part = w13.sharding.part(w13.shape, "w1", None, Parallel(2, 1), (24, 8))  # w1: [E * I, H]
    assert part.expected == (24, 8)
    assert [src for src, _, _ in part.pairs] == [((6 * e + 3, 6 * e + 6), (0, 8)) for e in range(4)]
    down = w2.sharding.part(w2.shape, None, None, Parallel(2, 1), (24, 8))  # [E * I, H], input-major
    assert down.expected == (8, 24) and down.transpose
    assert [src for src, _, _ in down.pairs] == [((0, 8), (6 * e + 3, 6 * e + 6)) for e in range(4)]


def test_non_gated_and_padded_experts() -> None:
    w13 = _experts(gated=False)["routed_experts.w13_weight"]
    assert w13.shape == (4, 6, 8) and w13.sharding.local_shape(w13.shape, Parallel(2, 0)) == (4, 3, 8)
    padded = _experts(pad=4)
    assert padded["routed_experts.w13_weight"].sharding.local_shape((4, 12, 8), Parallel(2, 0)) == (4, 8, 8)
    assert padded["routed_experts.w2_weight"].sharding.local_shape((4, 8, 6), Parallel(2, 0)) == (4, 8, 4)
    ep = Parallel(2, 0, expert_parallel=True)  # whole experts: no padding
    assert padded["routed_experts.w13_weight"].sharding.local_shape((4, 12, 8), ep) == (2, 12, 8)
