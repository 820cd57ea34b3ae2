"""Index maths of tensor-parallel splits, checked against the worked examples of vLLM 0.33.0.

Sections refer to /work/shared/reference/vllm-loading-semantics.md (2.1 QKV, 2.2 replicated KV
heads, 2.3 merged gate_up, 2.4 vocab padding). Ranges are half-open ``(start, stop)``.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_load.errors import LoadError, ShardingError
from functional_load.layout.parallel import Parallel
from functional_load.layout.segments import Piece, Segment, pad_vocab_size, segment_offsets, segment_rows, vocab_shard
from functional_load.layout.sharding import Split


def split_local_rows(split: Split, tp: int) -> int:
    return split.local_shape((split.rows, 1) if split.dim == 0 else (1, split.rows), Parallel(tp, 0))[split.dim]


def qkv(heads: int, kv: int, head_dim: int = 128) -> Split:
    """A QKV parameter as the layout builds it (``QKVParallelLinear``)."""
    return Split(
        0,
        (
            Segment("q", heads, head_dim, label="attention heads"),
            Segment("k", kv, head_dim, replicate=True, label="KV heads"),
            Segment("v", kv, head_dim, replicate=True, label="KV heads"),
        ),
    )


def merged(*outs: int) -> Split:
    """A merged column parameter (``MergedColumnParallelLinear``, output_sizes = outs)."""
    return Split(0, tuple(Segment(i, out, label="output rows") for i, out in enumerate(outs)))


def pieces_by_segment(split: Split, tp: int, rank: int) -> dict:
    return {p.segment: (p.src, p.dst) for p in split.pieces(Parallel(tp, rank))}


# --- 2.1 QKV, heads=32, kv=8, head_dim=128, tp=8 -------------------------------------------------

LLAMA3_8B_TP8 = [
    # rank, q (ckpt -> param[0:512]), k (ckpt -> param[512:640]), v (ckpt -> param[640:768])
    (0, (0, 512), (0, 128), (0, 128)),
    (1, (512, 1024), (128, 256), (128, 256)),
    (2, (1024, 1536), (256, 384), (256, 384)),
    (3, (1536, 2048), (384, 512), (384, 512)),
    (4, (2048, 2560), (512, 640), (512, 640)),
    (5, (2560, 3072), (640, 768), (640, 768)),
    (6, (3072, 3584), (768, 896), (768, 896)),
    (7, (3584, 4096), (896, 1024), (896, 1024)),
]


@pytest.mark.parametrize("rank, q, k, v", LLAMA3_8B_TP8)
def test_qkv_heads32_kv8_tp8(rank, q, k, v):
    split = qkv(heads=32, kv=8)
    assert split.pieces(Parallel(8, rank)) == (
        Piece("q", q, (0, 512)),
        Piece("k", k, (512, 640)),
        Piece("v", v, (640, 768)),
    )


def test_qkv_heads32_kv8_tp8_sizes_and_fused_offsets():
    split = qkv(heads=32, kv=8)
    assert split.rows == 6144
    assert split_local_rows(split, 8) == 768
    # Fused on disk: q [0:4096], k [4096:5120], v [5120:6144].
    assert segment_offsets(split.segments) == {"q": 0, "k": 4096, "v": 5120}


# --- 2.2 QKV with replicated KV heads -------------------------------------------------------------

KV4_TP8 = [
    # rank, kv head, ckpt rows of k and v
    (0, 0, (0, 128)),
    (1, 0, (0, 128)),
    (2, 1, (128, 256)),
    (3, 1, (128, 256)),
    (4, 2, (256, 384)),
    (5, 2, (256, 384)),
    (6, 3, (384, 512)),
    (7, 3, (384, 512)),
]


@pytest.mark.parametrize("rank, kv_head, kv_rows", KV4_TP8)
def test_qkv_heads32_kv4_tp8_replicates_each_kv_head_on_two_ranks(rank, kv_head, kv_rows):
    split = qkv(heads=32, kv=4)
    assert kv_rows == (kv_head * 128, (kv_head + 1) * 128)
    assert split.pieces(Parallel(8, rank)) == (
        Piece("q", (512 * rank, 512 * rank + 512), (0, 512)),  # q as in 2.1
        Piece("k", kv_rows, (512, 640)),
        Piece("v", kv_rows, (640, 768)),
    )


def test_qkv_heads32_kv4_tp8_sizes():
    split = qkv(heads=32, kv=4)
    assert split.rows == 4096 + 512 + 512  # the checkpoint holds 512 k rows, not vLLM's "global" 1024
    assert split_local_rows(split, 8) == 768
    assert segment_offsets(split.segments) == {"q": 0, "k": 4096, "v": 4608}


@pytest.mark.parametrize("rank", range(16))
def test_qkv_heads64_kv8_tp16_ranks_2h_and_2h_plus_1_hold_kv_head_h(rank):
    split = qkv(heads=64, kv=8)
    head = rank // 2
    assert split.pieces(Parallel(16, rank)) == (
        Piece("q", (512 * rank, 512 * rank + 512), (0, 512)),
        Piece("k", (128 * head, 128 * head + 128), (512, 640)),
        Piece("v", (128 * head, 128 * head + 128), (640, 768)),
    )


KV8_TP2 = [
    # rank, (segment, ckpt rows, param rows)...
    (0, ("q", (0, 2048), (0, 2048)), ("k", (0, 512), (2048, 2560)), ("v", (0, 512), (2560, 3072))),
    (1, ("q", (2048, 4096), (0, 2048)), ("k", (512, 1024), (2048, 2560)), ("v", (512, 1024), (2560, 3072))),
]


@pytest.mark.parametrize("rank, q, k, v", KV8_TP2)
def test_qkv_heads32_kv8_tp2(rank, q, k, v):
    split = qkv(heads=32, kv=8)
    assert split.pieces(Parallel(2, rank)) == tuple(Piece(*row) for row in (q, k, v))
    assert split_local_rows(split, 2) == 3072


QKV_ERRORS = [
    # heads, kv, tp, fragments the message must contain
    pytest.param(32, 3, 8, ["3 KV heads", "'k'", "tp=8", "replicated"], id="kv3-tp8"),
    pytest.param(32, 32, 3, ["32 attention heads", "'q'", "tp=3"], id="heads32-tp3"),
    # num_heads = 8 passes; then 8 KV heads neither divide over nor are replicated over 3 ranks.
    pytest.param(24, 8, 3, ["8 KV heads", "'k'", "tp=3"], id="heads24-kv8-tp3"),
]


@pytest.mark.parametrize("heads, kv, tp, fragments", QKV_ERRORS)
def test_qkv_that_does_not_divide_raises_sharding_error(heads, kv, tp, fragments):
    split = qkv(heads, kv)
    with pytest.raises(ShardingError) as excinfo:
        split.pieces(Parallel(tp, 0))
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message
    assert "valid tp sizes" in message
    assert isinstance(excinfo.value, LoadError) and isinstance(excinfo.value, ValueError)


def test_error_lists_the_valid_tp_sizes():
    with pytest.raises(ShardingError, match=r"valid tp sizes: \[1, 2, 4, 8, 16, 32\]"):
        segment_rows(Segment("q", 32, 128, label="attention heads"), 3, 0)
    with pytest.raises(ShardingError, match=r"valid tp sizes: \[1, 3, 6, 9, 12,"):
        segment_rows(Segment("k", 3, 128, replicate=True, label="KV heads"), 8, 0)


def test_error_is_raised_for_every_rank_not_only_rank_0():
    with pytest.raises(ShardingError):
        qkv(32, 3).pieces(Parallel(8, 7))


# --- 2.3 merged gate_up ----------------------------------------------------------------------------

GATE_UP_14336_TP8 = [
    # rank, gate ckpt rows -> param[0:1792], up ckpt rows -> param[1792:3584]
    (0, (0, 1792), (0, 1792)),
    (1, (1792, 3584), (1792, 3584)),
    (2, (3584, 5376), (3584, 5376)),
    (7, (12544, 14336), (12544, 14336)),
]


@pytest.mark.parametrize("rank, gate, up", GATE_UP_14336_TP8)
def test_merged_gate_up_14336_tp8(rank, gate, up):
    split = merged(14336, 14336)
    assert split_local_rows(split, 8) == 3584
    assert split.pieces(Parallel(8, rank)) == (Piece(0, gate, (0, 1792)), Piece(1, up, (1792, 3584)))


PHI3_GATE_UP_11008_TP2 = [
    # rank, rows of the fused 22016-row checkpoint tensor: gate -> param[0:5504], up -> param[5504:11008]
    (0, (0, 5504), (11008, 16512)),
    (1, (5504, 11008), (16512, 22016)),
]


@pytest.mark.parametrize("rank, gate, up", PHI3_GATE_UP_11008_TP2)
def test_fused_on_disk_gate_up_11008_tp2(rank, gate, up):
    split = merged(11008, 11008)
    assert split.rows == 22016
    offsets = segment_offsets(split.segments)
    assert offsets == {0: 0, 1: 11008}  # gate [0:11008], up [11008:22016]
    fused = {
        p.segment: ((offsets[p.segment] + p.src[0], offsets[p.segment] + p.src[1]), p.dst)
        for p in split.pieces(Parallel(2, rank))
    }
    assert fused == {0: (gate, (0, 5504)), 1: (up, (5504, 11008))}


def test_merged_output_size_that_does_not_divide():
    with pytest.raises(ShardingError, match=r"100 output rows \(segment 1\) cannot divide over tp=8"):
        merged(64, 100).pieces(Parallel(8, 0))


# --- 2.4 vocab padding -----------------------------------------------------------------------------

VOCAB = [
    # org, added, padding, tp, rank, org_padded, padded total, per rank, org range, padded_added, added
    (32000, 0, 192, 3, 2, 32064, 32064, 10688, (21376, 32000), (32000, 32000), (32000, 32000)),
    (32000, 0, 192, 3, 0, 32064, 32064, 10688, (0, 10688), (32000, 32000), (32000, 32000)),
    (32000, 0, 64, 2, 0, 32000, 32000, 16000, (0, 16000), (32000, 32000), (32000, 32000)),
    (32000, 0, 64, 2, 1, 32000, 32000, 16000, (16000, 32000), (32000, 32000), (32000, 32000)),
    (32001, 0, 64, 2, 0, 32064, 32064, 16032, (0, 16032), (32001, 32001), (32001, 32001)),
    (32001, 0, 64, 2, 1, 32064, 32064, 16032, (16032, 32001), (32001, 32001), (32001, 32001)),
    (128256, 0, 64, 8, 0, 128256, 128256, 16032, (0, 16032), (128256, 128256), (128256, 128256)),
    (128256, 0, 64, 8, 5, 128256, 128256, 16032, (80160, 96192), (128256, 128256), (128256, 128256)),
    (128256, 0, 64, 8, 7, 128256, 128256, 16032, (112224, 128256), (128256, 128256), (128256, 128256)),
    (151936, 0, 64, 4, 3, 151936, 151936, 37984, (113952, 151936), (151936, 151936), (151936, 151936)),
    (1010, 16, 64, 1, 0, 1024, 1088, 1088, (0, 1010), (1010, 1074), (1010, 1026)),
    (1010, 16, 64, 2, 0, 1024, 1088, 544, (0, 512), (1010, 1042), (1010, 1026)),
    (1010, 16, 64, 2, 1, 1024, 1088, 544, (512, 1010), (1042, 1074), (1026, 1026)),
    (248320, 0, 192, 3, 0, 248448, 248448, 82816, (0, 82816), (248320, 248320), (248320, 248320)),
    (248320, 0, 192, 3, 2, 248448, 248448, 82816, (165632, 248320), (248320, 248320), (248320, 248320)),
]


@pytest.mark.parametrize(
    "org, added, padding, tp, rank, org_padded, padded, per_rank, org_range, padded_added, added_range", VOCAB
)
def test_vocab_padding(org, added, padding, tp, rank, org_padded, padded, per_rank, org_range, padded_added, added_range):
    assert pad_vocab_size(org, padding) == org_padded
    assert pad_vocab_size(org_padded + added, padding) == padded
    shard = vocab_shard(org, tp, rank, padding=padding, added_vocab=added)
    assert shard.per_partition == per_rank
    assert shard.padded_org == (rank * org_padded // tp, (rank + 1) * org_padded // tp)
    assert shard.org == org_range
    assert shard.padded_added == padded_added
    assert shard.added == added_range


VOCAB_ZERO_ROWS = [
    # org, added, padding, tp, rank, real org rows, org padding rows (zero-filled by the loader)
    (32000, 0, 192, 3, 2, 10624, 64),
    (32001, 0, 64, 2, 0, 16032, 0),
    (32001, 0, 64, 2, 1, 15969, 63),
    (1010, 16, 64, 1, 0, 1010, 14),
    (1010, 16, 64, 2, 1, 498, 14),
]


@pytest.mark.parametrize("org, added, padding, tp, rank, num_org, num_padding", VOCAB_ZERO_ROWS)
def test_vocab_real_rows_and_padding_rows(org, added, padding, tp, rank, num_org, num_padding):
    shard = vocab_shard(org, tp, rank, padding=padding, added_vocab=added)
    assert shard.num_org == num_org
    assert shard.num_org_padding == num_padding


def test_vocab_added_tokens_on_tp2():
    r0 = vocab_shard(1010, 2, 0, added_vocab=16)
    r1 = vocab_shard(1010, 2, 1, added_vocab=16)
    assert (r0.num_added, r1.num_added) == (16, 0)


def test_vocab_32000_tp3_padding_64_does_not_divide():
    with pytest.raises(ShardingError) as excinfo:
        vocab_shard(32000, 3, 0, padding=64)
    message = str(excinfo.value)
    for fragment in ("32000", "tp=3", "lcm(64, 3) = 192"):
        assert fragment in message


# --- properties ------------------------------------------------------------------------------------

PROPERTY = settings(deadline=None, max_examples=200)


@st.composite
def splits(draw):
    """A tp size and a Split of 1-4 segments, each of which divides over (or replicates onto) it."""
    tp = draw(st.integers(1, 16))
    divisors = [d for d in range(1, tp + 1) if tp % d == 0]
    segments = []
    for i in range(draw(st.integers(1, 4))):
        unit = draw(st.integers(1, 8))
        replicate = draw(st.booleans())
        if replicate and draw(st.booleans()):
            count = draw(st.sampled_from(divisors))  # fewer KV heads than ranks (or exactly tp)
        else:
            count = tp * draw(st.integers(0, 4))
        segments.append(Segment(i, count, unit, replicate=replicate))
    return tp, Split(0, tuple(segments))


def replicated(segment: Segment, tp: int) -> bool:
    return segment.replicate and 0 < segment.count < tp


@PROPERTY
@given(splits())
def test_dst_ranges_tile_the_local_rows(case):
    tp, split = case
    local_rows = split_local_rows(split, tp)
    for rank in range(tp):
        pieces = split.pieces(Parallel(tp, rank))
        assert [p.segment for p in pieces] == [s.id for s in split.segments]
        position = 0
        for piece in pieces:
            assert piece.dst[0] == position
            assert piece.dst[1] - piece.dst[0] == piece.src[1] - piece.src[0]
            position = piece.dst[1]
        assert position == local_rows


@PROPERTY
@given(splits())
def test_split_segments_partition_their_rows_over_ranks(case):
    tp, split = case
    for segment in split.segments:
        if replicated(segment, tp):
            continue
        ranges = [segment_rows(segment, tp, rank) for rank in range(tp)]
        assert ranges[0][0] == 0
        assert ranges[-1][1] == segment.rows
        for (_, stop), (start, _) in zip(ranges, ranges[1:]):
            assert stop == start  # disjoint and gap-free, in rank order
        widths = {stop - start for start, stop in ranges}
        assert widths == {segment.rows // tp}


@PROPERTY
@given(splits())
def test_replicated_kv_segments_give_each_rank_one_head(case):
    tp, split = case
    for segment in split.segments:
        if not replicated(segment, tp):
            continue
        replicas = tp // segment.count
        covered = set()
        for rank in range(tp):
            start, stop = segment_rows(segment, tp, rank)
            assert stop - start == segment.unit
            assert start % segment.unit == 0
            assert start // segment.unit == rank // replicas  # consecutive ranks share a head
            covered.update(range(start, stop))
        assert covered == set(range(segment.rows))


@st.composite
def vocabs(draw):
    """org/added vocab sizes, a tp size and a padding that makes the padded sizes divide."""
    tp = draw(st.integers(1, 16))
    padding = draw(st.sampled_from([math.lcm(64, tp), tp * draw(st.integers(1, 40))]))
    org = draw(st.integers(1, 300_000))
    added = draw(st.sampled_from([0, draw(st.integers(1, 600))]))
    return org, added, tp, padding


@PROPERTY
@given(vocabs())
def test_vocab_shards_cover_the_vocab(case):
    org, added, tp, padding = case
    shards = [vocab_shard(org, tp, rank, padding=padding, added_vocab=added) for rank in range(tp)]
    org_padded = pad_vocab_size(org, padding)
    total_padded = pad_vocab_size(org_padded + added, padding)

    # Real token ids: org ranges contiguous from 0 to org; added ranges sum to added.
    assert shards[0].org[0] == 0 and shards[-1].org[1] == org
    for a, b in zip(shards, shards[1:]):
        assert a.org[1] == b.org[0]
    assert sum(s.num_org for s in shards) == org
    assert sum(s.num_added for s in shards) == added
    assert all(org <= s.added[0] <= s.added[1] <= org + added for s in shards)

    # Padded rows: every rank the same size, tp of them make the padded total.
    assert {s.per_partition for s in shards} == {total_padded // tp}
    assert shards[0].per_partition * tp == total_padded
    for s in shards:
        width = (s.padded_org[1] - s.padded_org[0]) + (s.padded_added[1] - s.padded_added[0])
        assert width == s.per_partition
        assert s.num_org + s.num_org_padding == s.padded_org[1] - s.padded_org[0]

    # Padded ranges of one kind are disjoint and tile their span (padded_added starts at org, as in vLLM).
    for kind, start, stop in (("padded_org", 0, org_padded), ("padded_added", org, org + total_padded - org_padded)):
        ranges = [getattr(s, kind) for s in shards]
        assert ranges[0][0] == start and ranges[-1][1] == stop, kind
        for (_, a_stop), (b_start, _) in zip(ranges, ranges[1:]):
            assert a_stop == b_start, kind
