"""A shard id that is a list of consecutive segments (``[[0, 1, 2]]`` in a spec): one checkpoint
tensor holding those segments of a fused parameter back to back, each split over the ranks as
its own segment (vLLM's tuple shard id of MergedColumnParallelLinear; Qwen3.5's in_proj_qkv
filling q, k and v of in_proj_qkvz). A plain list of ids keeps its meaning: the tensor fills each
of them whole (Gemma 4's k_proj filling k and v)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import functional_load as fl
from functional_load.errors import PlanError, ShardingError
from functional_load.layout.parallel import Parallel
from functional_load.layout.segments import Segment
from functional_load.layout.sharding import Split
from functional_load.model.mapping import MappingTable
from functional_load.model.spec import parse_spec

_SPEC = {
    "name": "tiny_gdn",
    "architectures": ["TinyGdn"],
    "layers": "1",
    "stages": [{"stacked": {".in_qkv": [".in_qkvz", [[0, 1, 2]]], ".in_z": [".in_qkvz", 3]}}],
    "modules": {"proj.in_qkvz": {"kind": "merged", "in": "4", "outs": ["8", "8", "16", "16"]}},
}


def test_a_nested_list_is_one_shard_id_of_consecutive_segments() -> None:
    (stage,) = parse_spec(_SPEC).stages
    rules = {r.pattern: r.shard_ids for r in stage.table.rules}
    assert rules == {".in_qkv": ((0, 1, 2),), ".in_z": (3,)}
    table = MappingTable.from_dicts(stacked={".in_qkv": (".in_qkvz", [[0, 1, 2]]), ".kv": (".qkv", ["k", "v"])})
    assert table.map("a.in_qkv.weight").shard_ids == ((0, 1, 2),)  # type: ignore[union-attr]
    assert table.map("a.kv.weight").shard_ids == ("k", "v")  # type: ignore[union-attr]


def test_split_part_of_consecutive_segments() -> None:
    split = Split(0, (Segment(0, 8), Segment(1, 8), Segment(2, 16), Segment(3, 16)))
    part = split.part((48, 4), (0, 1, 2), None, Parallel(2, 1), (32, 4))
    assert part.expected == (32, 4)  # the tensor holds segments 0..2 only
    # rank 1 of 2: the second half of each of them, at its place in the rank's [0; 1; 2; 3]
    assert [(src[0], dst[0], slot) for src, dst, slot in part.pairs] == [((4, 8), (0, 4), 0), ((12, 16), (4, 8), 1), ((24, 32), (8, 16), 2)]
    assert split.part((48, 4), (1, 2), None, Parallel(2, 0), (24, 4)).pairs[0][0][0] == (0, 4)  # offsets from the first
    with pytest.raises(ShardingError, match="should be consecutive"):
        split.part((48, 4), (0, 2), None, Parallel(2, 0), (24, 4))
    with pytest.raises(ShardingError, match="between 0 and 3"):
        split.part((48, 4), (3, 4), None, Parallel(2, 0), (24, 4))


def _checkpoint(tmp_path: Path) -> dict[str, torch.Tensor]:
    tensors = {
        "proj.in_qkv.weight": torch.arange(32 * 4, dtype=torch.float32).reshape(32, 4),
        "proj.in_z.weight": -torch.arange(16 * 4, dtype=torch.float32).reshape(16, 4),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["TinyGdn"], "torch_dtype": "float32"}))
    return tensors


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_load_fills_each_segment_from_its_rows(tmp_path: Path, tp: int) -> None:
    tensors = _checkpoint(tmp_path)
    qkv, z = tensors["proj.in_qkv.weight"], tensors["proj.in_z.weight"]
    sections = (qkv[:8], qkv[8:16], qkv[16:], z)
    for rank in range(tp):
        state = fl.load(tmp_path, tp_size=tp, rank=rank, spec=parse_spec(_SPEC))
        expected = torch.cat([s.chunk(tp)[rank] for s in sections])
        assert torch.equal(state["proj.in_qkvz.weight"], expected)


def test_a_tensor_of_the_wrong_size_is_a_plan_error(tmp_path: Path) -> None:
    save_file({"proj.in_qkv.weight": torch.zeros(24, 4), "proj.in_z.weight": torch.zeros(16, 4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["TinyGdn"], "torch_dtype": "float32"}))
    with pytest.raises(PlanError, match=r"has shape \[24, 4\], expected \[32, 4\]"):
        fl.plan(tmp_path, tp_size=2, rank=0, spec=parse_spec(_SPEC))
