"""The lazily indexed checkpoint (``functional_load.checkpoint.lazy``).

* A checkpoint indexed lazily holds exactly what the strict reader gives (names in the same order,
  equal infos), and an expert-parallel rank's plan builds the infos of the tensors it reads only.
* A whole-file problem is caught at indexing as before (a hole, an overlap, data past the end);
  a malformed entry is an error naming file, tensor and field as soon as a plan looks at it, and
  an entry no plan looks at costs nothing (its bytes are never read).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import functional_load as fl
from functional_load.checkpoint import index as index_module
from functional_load.checkpoint.discover import discover
from functional_load.checkpoint.index import index_checkpoint, read_header
from functional_load.checkpoint.lazy import LazyTensors
from functional_load.errors import FormatError, IntegrityError
from functional_load.testing.checkpoints import write_checkpoint


def raw_file(path: Path, header: dict, data: bytes) -> Path:
    body = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(len(body).to_bytes(8, "little") + body + data)
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe"), kv_heads=2)


def test_the_lazy_index_equals_the_strict_reader(moe):
    checkpoint = index_checkpoint(discover(moe))
    assert isinstance(checkpoint.tensors, LazyTensors)
    strict = {}
    for path in checkpoint.files:
        strict.update(read_header(path))
    assert list(checkpoint.tensors) == [n for n in strict if n in checkpoint.tensors]  # file order, then data order
    assert set(checkpoint.tensors) == set(strict)
    assert {n: checkpoint.tensors[n] for n in checkpoint.tensors} == strict
    assert checkpoint.dtypes() == {n: i.dtype for n, i in strict.items()}


def test_an_expert_parallel_rank_builds_only_the_infos_it_reads(moe, monkeypatch):
    built: list[str] = []
    real = index_module._build
    monkeypatch.setattr(index_module, "_build", lambda header, name: built.append(name) or real(header, name))
    the_plan = fl.plan(moe, tp_size=4, rank=1, expert_parallel=True)
    total = len(index_checkpoint(discover(moe)).tensors)
    assert set(built) == set(the_plan.tensors)  # what it reads, nothing else
    experts = [n for n in index_checkpoint(discover(moe)).tensors if ".experts." in n]
    assert len([n for n in built if ".experts." in n]) * 4 == len(experts)  # 2 of 8 experts per layer
    not_held = [n for n, why in the_plan.dropped if "is not held by rank 1" in why]
    assert len(not_held) + len(built) == total


def test_whole_file_problems_are_caught_at_indexing(tmp_path):
    ok = {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}
    gap = {**ok, "b": {"dtype": "U8", "shape": [4], "data_offsets": [5, 9]}}
    overlap = {**ok, "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}
    for name, header, data, error, match in [
        ("gap", gap, bytes(9), FormatError, "leaving a hole"),
        ("overlap", overlap, bytes(8), FormatError, "overlaps"),
        ("short", ok, bytes(6), IntegrityError, "file has only"),
        ("appended", ok, bytes(12), FormatError, "not fully covered"),
    ]:
        directory = tmp_path / name
        directory.mkdir()
        raw_file(directory / "model.safetensors", header, data)
        with pytest.raises(error, match=match):
            index_checkpoint(discover(directory))


def test_a_malformed_entry_is_an_error_when_a_plan_looks_at_it(tmp_path):
    path = raw_file(
        tmp_path / "model.safetensors",
        {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "b": {"dtype": "U8", "shape": [3], "data_offsets": [4, 8]}},
        bytes(8),
    )
    checkpoint = index_checkpoint(discover(tmp_path))
    assert checkpoint.tensors["a"].shape == (4,)  # its neighbour's bad shape does not matter to it
    with pytest.raises(FormatError, match=rf"{path}: tensor 'b': data_offsets \[4, 8\] span 4 bytes but U8 shape \[3\] needs 3"):
        checkpoint.tensors["b"]


def test_a_plan_names_the_malformed_tensor_it_needs(tmp_path):
    weights = {"model.embed_tokens.weight": torch.zeros(8, 4, dtype=torch.bfloat16)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    blob = (tmp_path / "model.safetensors").read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    header["model.embed_tokens.weight"]["dtype"] = "BF17"
    body = json.dumps(header, separators=(",", ":")).encode()
    (tmp_path / "model.safetensors").write_bytes(len(body).to_bytes(8, "little") + body + blob[8 + n :])
    checkpoint = index_checkpoint(discover(tmp_path))
    with pytest.raises(FormatError, match=r"'model\.embed_tokens\.weight': dtype 'BF17' is not one of"):
        checkpoint.tensors["model.embed_tokens.weight"]


def test_tiles_takes_integer_pairs_only_and_any_header_order():
    from functional_load.checkpoint.lazy import tiles

    a, b = {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}
    assert tiles({"a": a, "b": b}, 8) == ["a", "b"]
    assert tiles({"b": b, "a": a}, 8) == ["a", "b"]  # names in data order, whatever the header's order
    for bad in ([0.0, 4], [False, 4], [0, 4, 4], (0, 4), [0, "4"], None, [0, 2**70]):
        assert tiles({"a": {**a, "data_offsets": bad}, "b": b}, 8) is None, bad
    assert tiles({"a": a, "b": {"dtype": "U8", "shape": [4]}}, 8) is None


def test_a_header_out_of_data_order_indexes_as_the_strict_reader(tmp_path):
    entries = {f"t{i}": {"dtype": "U8", "shape": [2], "data_offsets": [2 * i, 2 * i + 2]} for i in range(5)}
    shuffled = {name: entries[name] for name in ("t3", "t0", "t4", "t1", "t2")}
    raw_file(tmp_path / "model.safetensors", shuffled, bytes(range(10)))
    checkpoint = index_checkpoint(discover(tmp_path))
    strict = read_header(tmp_path / "model.safetensors")
    assert list(checkpoint.tensors) == list(strict) == [f"t{i}" for i in range(5)]
    assert {n: checkpoint.tensors[n] for n in checkpoint.tensors} == strict
