"""Planning a full-width DeepSeek-V3 (FP8 block, 256 experts) from sparse safetensors files:
the header-only path of ``benchmarks/sparse_checkpoint.py`` with a few layers, no timing."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest

import functional_load as fl
from functional_load.checkpoint import FileSpan, FileStamp, TensorInfo, span_info
from functional_load.errors import CheckpointError
from functional_load.model.mapping import NameMapper, map_name

GENERATOR = Path(__file__).resolve().parent.parent / "benchmarks" / "sparse_checkpoint.py"
TP = 8
REPLICATED = re.compile(r"(layernorm|norm|q_a_proj|kv_a_proj_with_mqa|mlp\.gate)\.")  # whole on every rank


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("sparse_checkpoint", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sparse_checkpoint", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 layers (the first dense), then the MTP layer: 4,700 tensors, 36 GB that take no disk."""
    out = tmp_path_factory.mktemp("sparse") / "deepseek-v3"
    return _generator().write_sparse("deepseek-v3", out, layers=3, shards=5, first_k_dense_replace=1)


def _expected_share(directory: Path, rank: int) -> int:
    """Bytes rank ``rank`` of tp 8 with expert parallelism reads, counted from the tensor names
    alone: its 32 experts whole, replicated tensors whole, every split tensor an eighth (all
    DeepSeek-V3's split dimensions are whole 128-blocks per rank), the MTP layer nothing."""
    gen = _generator()
    config = gen.config_for("deepseek-v3", 3, first_k_dense_replace=1)
    held = range(32 * rank, 32 * rank + 32)
    total = 0
    for name, dtype, shape in gen.tensors_for(config):
        size = math.prod(shape) * gen.ITEMSIZE[dtype]
        expert = re.search(r"\.experts\.(\d+)\.", name)
        if name.startswith("model.layers.3."):
            continue  # num_nextn_predict_layers: dropped
        if expert:
            total += size if int(expert.group(1)) in held else 0
        elif REPLICATED.search(name) or name.endswith("e_score_correction_bias"):
            total += size
        else:
            assert size % TP == 0, name
            total += size // TP
    return total


@pytest.mark.parametrize("rank", [0, 5])
def test_deepseek_v3_ep_plan_reads_its_share(deepseek: Path, rank: int) -> None:
    plan = fl.plan(deepseek, tp_size=TP, rank=rank, expert_parallel=True)
    assert plan.bytes_to_read == _expected_share(deepseek, rank)
    w13 = plan.param("model.layers.1.mlp.experts.routed_experts.w13_weight")
    assert w13.spec.local_shape == (32, 2 * 2048, 7168)
    assert {c.tensor.split(".experts.")[1].split(".")[0] for c in w13.copies} == {str(e) for e in range(32 * rank, 32 * rank + 32)}
    scale = plan.param("model.layers.2.mlp.experts.routed_experts.w2_weight_scale_inv")
    assert scale.spec.local_shape == (32, 56, 16)
    not_held = [name for name, why in plan.dropped if "is not held by rank" in why]
    assert len(not_held) == 2 * 224 * 6  # two MoE layers, 224 other experts, 3 projections x (weight, scale)


def test_sparse_llama_loads_zeros_at_tp16(tmp_path: Path) -> None:
    """Loading reads the sparse files' holes as zeros: a narrow Llama-3.1-405B-shaped checkpoint
    (16 heads, 8 KV heads, so tp 16 replicates KV heads), the last rank of tp 16."""
    out = _generator().write_sparse(
        "llama-405b", tmp_path / "llama", layers=2, shards=3, hidden_size=256, intermediate_size=512,
        num_attention_heads=16, num_key_value_heads=8, vocab_size=1000,
    )
    state = fl.load(out, tp_size=16, rank=15, progress=False)
    qkv = state["model.layers.1.self_attn.qkv_proj.weight"]
    assert tuple(qkv.shape) == (16 + 2 * 16, 256)
    assert len(state) == 2 * 6 + 3 and all(not t.any() for t in state.values())


def test_deepseek_v3_subset_of_a_rank_loads(deepseek: Path) -> None:
    """A bounded load of the full-width model: a few parameters of one EP rank (a whole rank is
    4.5 GB even at 3 layers), through the same executor as fl.load."""
    from dataclasses import replace

    from functional_load.io import execute

    plan = fl.plan(deepseek, tp_size=TP, rank=7, expert_parallel=True)
    keep = {"model.layers.0.self_attn.q_b_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias", "model.norm.weight"}
    out, _ = execute(replace(plan, params=tuple(p for p in plan.params if p.spec.name in keep)), progress=False)
    assert set(out) == keep
    assert tuple(out["model.layers.0.self_attn.q_b_proj.weight"].shape) == (128 // TP * 192, 1536)
    assert all(not t.float().any() for t in out.values())
    # a block scale of zeros is refused: the holes of a sparse FP8 checkpoint plan, but do not load
    scale = "model.layers.2.mlp.experts.routed_experts.w2_weight_scale_inv"
    with pytest.raises(CheckpointError, match="scale values are not finite and positive"):
        execute(replace(plan, params=(plan.param(scale),)), progress=False)


def test_name_mapper_agrees_with_map_name(deepseek: Path) -> None:
    layout = fl.layout(deepseek, tp_size=TP, rank=0, expert_parallel=True)
    mapper = NameMapper(layout.mapping)
    assert mapper.blind
    names = [n for n, _, _ in _generator().tensors_for(_generator().config_for("deepseek-v3", 3, first_k_dense_replace=1))]
    names += ["model.layers.007.mlp.experts.012.up_proj.weight", "model.layers.1.self_attn.k_proj.k_scale", "x.rotary_emb.inv_freq"]
    for name in names:
        assert mapper(name) == map_name(layout.mapping, name), name


def test_span_info_equals_the_dataclasses() -> None:
    stamp = FileStamp(10, 2, 3, 4)
    fast = span_info("w", "BF16", (2, 3), Path("/m/a.safetensors"), 8, 12, stamp)
    slow = TensorInfo("w", "BF16", (2, 3), FileSpan(Path("/m/a.safetensors"), 8, 12, stamp))
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
