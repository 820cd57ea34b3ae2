"""Safetensors headers are parsed and validated without reading tensor data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from functional_load.checkpoint import FileStamp
from functional_load.checkpoint.discover import discover
from functional_load.checkpoint.index import MAX_HEADER_BYTES, _fast_entry, _parse_entry, index_checkpoint, read_header
from functional_load.errors import CheckpointError


def raw_file(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> Path:
    """A hand-made safetensors file: u64 header length, header bytes, data."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    size = len(body) if length is None else length
    path.write_bytes(size.to_bytes(8, "little") + body + data)
    return path


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def write_index(directory: Path, weight_map: dict[str, str]) -> Path:
    path = directory / "model.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": weight_map}))
    return path


# --- read_header -------------------------------------------------------------------------------


def test_offsets_point_at_the_tensor_bytes(tmp_path):
    tensors = {
        "embed": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "bias": torch.arange(5, dtype=torch.float32),
        "ids": torch.arange(7, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    infos = read_header(path)
    loaded = load_file(str(path))
    blob = path.read_bytes()

    assert set(infos) == set(tensors)
    for name, info in infos.items():
        assert info.name == name and info.file == path
        assert info.shape == tuple(loaded[name].shape)
        assert info.nbytes == loaded[name].numel() * loaded[name].element_size()
        assert blob[info.location.offset : info.location.offset + info.nbytes] == as_bytes(loaded[name])
    assert {n: i.dtype for n, i in infos.items()} == {
        "embed": "BF16", "bias": "F32", "ids": "I64", "flag": "BOOL", "empty": "F16"
    }
    offsets = [i.location.offset for i in infos.values()]
    assert offsets == sorted(offsets)  # header-offset order


def test_absolute_offset_is_8_plus_header_plus_begin(tmp_path):
    header = {"b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}, "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}
    body = json.dumps(header).encode()
    path = raw_file(tmp_path / "x.safetensors", body, b"\x01\x02\x03\x04")
    infos = read_header(path)
    assert list(infos) == ["a", "b"]
    assert infos["a"].location.offset == 8 + len(body) and infos["b"].location.offset == 8 + len(body) + 2


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "header, data, length, expected",
    [
        # (header, data, header length override, substrings the message must contain)
        (None, None, None, ["8-byte header length", "has 3 bytes"]),
        (b"{}", b"", 1000, ["header length 1000", "needs 1008 bytes", "has 10"]),
        (b"{}", b"", MAX_HEADER_BYTES + 1, [f"header length {MAX_HEADER_BYTES + 1}", f"cap of {MAX_HEADER_BYTES}"]),
        (b"\xff\xfe", b"", None, ["not valid UTF-8"]),
        (b'{"a": ', b"", None, ["invalid JSON"]),
        (b'{"a": 1, "a": 2}', b"", None, ["duplicate JSON key 'a'"]),
        (b'{"a": NaN}', b"", None, ["NaN"]),
        (b"[1, 2]", b"", None, ["must be a JSON object", "list"]),
        ({"__metadata__": {"k": 1}}, b"", None, ["__metadata__", "{'k': 1}"]),
        ({"__metadata__": ["k"]}, b"", None, ["__metadata__", "['k']"]),
        ({"w": [1]}, b"", None, ["'w'", "expected an object", "[1]"]),
        ({"w": {**F32x2, "dtype": "F128"}}, bytes(8), None, ["'w'", "dtype 'F128'", "BF16"]),
        ({"w": {**F32x2, "shape": [-2]}}, bytes(8), None, ["'w'", "non-negative", "[-2]"]),
        ({"w": {**F32x2, "shape": [True]}}, bytes(8), None, ["'w'", "shape", "[True]"]),
        ({"w": {**F32x2, "shape": 2}}, bytes(8), None, ["'w'", "shape", "found 2"]),
        ({"w": {**F32x2, "data_offsets": [0]}}, bytes(8), None, ["'w'", "[begin, end]", "[0]"]),
        ({"w": {**F32x2, "data_offsets": [0, 8.0]}}, bytes(8), None, ["'w'", "[begin, end]", "8.0"]),
        ({"w": {**F32x2, "data_offsets": [8, 0]}}, bytes(8), None, ["'w'", "[8, 0]", "0 <= begin <= end"]),
        ({"w": {**F32x2, "data_offsets": [-1, 7]}}, bytes(8), None, ["'w'", "[-1, 7]", "0 <= begin <= end"]),
        ({"w": {**F32x2, "data_offsets": [0, 4]}}, bytes(8), None, ["'w'", "span 4 bytes", "needs 8 bytes", "[2]"]),
        ({"w": F32x2}, bytes(4), None, ["'w'", "data ends at byte", "has only"]),
        (
            {"a": F32x2, "b": {**F32x2, "data_offsets": [4, 12]}},
            bytes(12),
            None,
            ["'b'", "[4, 12]", "overlaps tensor 'a'", "[0, 8]"],
        ),
    ],
)
def test_malformed_header_names_file_and_numbers(tmp_path, header, data, length, expected):
    path = tmp_path / "bad-00001.safetensors"
    if header is None:
        path.write_bytes(b"\x01\x02\x03")
    else:
        raw_file(path, header, data, length)
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    message = str(info.value)
    assert str(path) in message
    for part in expected:
        assert part in message


def test_data_end_message_has_exact_numbers(tmp_path):
    body = json.dumps({"w": F32x2}).encode()
    path = raw_file(tmp_path / "t.safetensors", body, bytes(4))
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    assert f"data ends at byte {8 + len(body) + 8}" in str(info.value)
    assert f"has only {8 + len(body) + 4} bytes" in str(info.value)


def test_zero_size_tensor_overlaps_nothing(tmp_path):
    header = {"a": F32x2, "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}}
    infos = read_header(raw_file(tmp_path / "z.safetensors", header, bytes(8)))
    assert infos["e"].nbytes == 0 and infos["a"].nbytes == 8


# --- index_checkpoint --------------------------------------------------------------------------


def test_without_index_tensors_in_file_then_offset_order(tmp_path):
    save_file({"b": torch.ones(2), "a": torch.ones(3)}, str(tmp_path / "model-2.safetensors"))
    save_file({"z": torch.ones(1)}, str(tmp_path / "model-1.safetensors"))
    checkpoint = index_checkpoint(discover(tmp_path))
    first = read_header(tmp_path / "model-1.safetensors")
    second = read_header(tmp_path / "model-2.safetensors")
    assert list(checkpoint.tensors) == [*first, *second]
    assert checkpoint.files == (tmp_path / "model-1.safetensors", tmp_path / "model-2.safetensors")
    assert (checkpoint.directory, checkpoint.load_format, checkpoint.index_file) == (tmp_path, "hf", None)
    assert checkpoint.total_bytes == 4 * (1 + 2 + 3)


def test_without_index_duplicate_names_both_files(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointError) as info:
        index_checkpoint(discover(tmp_path))
    message = str(info.value)
    assert "'w'" in message and str(tmp_path / "a.safetensors") in message and str(tmp_path / "b.safetensors") in message


def test_index_decides_which_shard_and_ignores_unlisted(tmp_path):
    save_file({"u": torch.ones(1), "w": torch.zeros(2), "extra": torch.ones(1)}, str(tmp_path / "model-1.safetensors"))
    save_file({"w": torch.ones(2), "v": torch.ones(3)}, str(tmp_path / "model-2.safetensors"))
    index = write_index(tmp_path, {"w": "model-2.safetensors", "v": "model-2.safetensors", "u": "model-1.safetensors"})
    checkpoint = index_checkpoint(discover(tmp_path))
    assert set(checkpoint.tensors) == {"w", "v", "u"}  # "extra" is not in the index
    assert checkpoint.tensors["w"].file == tmp_path / "model-2.safetensors"
    assert checkpoint.tensors["u"].file == tmp_path / "model-1.safetensors"
    assert next(iter(checkpoint.tensors)) == "u"  # file order first
    assert checkpoint.index_file == index


def test_index_entry_missing_from_its_shard(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "model-1.safetensors"))
    save_file({"v": torch.ones(2)}, str(tmp_path / "model-2.safetensors"))
    index = write_index(tmp_path, {"w": "model-1.safetensors", "v": "model-1.safetensors"})
    with pytest.raises(CheckpointError) as info:
        index_checkpoint(discover(tmp_path))
    message = str(info.value)
    assert "'v'" in message and str(index) in message and "'model-1.safetensors'" in message


def test_pickle_checkpoints_are_not_indexed(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="pickle") as info:
        index_checkpoint(discover(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_checkpoint_tensors_are_read_only(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    checkpoint = index_checkpoint(discover(tmp_path))
    with pytest.raises(TypeError):
        checkpoint.tensors["x"] = checkpoint.tensors["w"]


# ---- the fast and the strict entry parsers agree ----------------------------------------------------

_VALUES = st.one_of(st.integers(-3, 2**40), st.booleans(), st.none(), st.text(max_size=3), st.floats(allow_nan=False))
_ENTRIES = st.fixed_dictionaries(
    {"dtype": st.one_of(st.sampled_from(["F32", "BF16", "F8_E4M3", "I64", "U8", "BOOL", "F4"]), _VALUES),
     "shape": st.one_of(st.lists(st.one_of(st.integers(0, 6), _VALUES), max_size=3), _VALUES),
     "data_offsets": st.one_of(st.lists(st.one_of(st.integers(0, 200), _VALUES), min_size=0, max_size=3), _VALUES)},
    optional={"extra": _VALUES},
)


@settings(max_examples=400, deadline=None)
@given(entry=_ENTRIES, data=st.data())
def test_the_fast_entry_parser_accepts_exactly_what_the_strict_one_accepts(entry: dict, data: st.DataObject) -> None:
    """Where the strict parser accepts an entry, the fast one returns the same TensorInfo; where
    it refuses, the fast one returns None (and the strict one names the problem)."""
    sizes = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "I64": 8, "U8": 1, "BOOL": 1}
    shape, dtype = entry.get("shape"), entry.get("dtype")
    plain = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
    if data.draw(st.booleans()) and plain and isinstance(dtype, str) and dtype in sizes:  # often consistent: both paths run
        begin = data.draw(st.integers(0, 2))
        offsets = [begin, begin + sizes[dtype] * math.prod(shape)]
        # the same numbers in another type (True == 1, 1.0 == 1): only the type tells them apart
        disguise = data.draw(st.sampled_from([None, "bool", "float"]))
        i = data.draw(st.integers(0, 1))
        if disguise == "bool" and offsets[i] in (0, 1):
            offsets[i] = bool(offsets[i])
        elif disguise == "float":
            offsets[i] = float(offsets[i])
        entry = {**entry, "data_offsets": offsets}
    stamp, path = FileStamp(10_000, 0, 0, 0), Path("/x/model.safetensors")
    fast = _fast_entry(path, "t", entry, 8, 10_000, stamp)
    try:
        strict = _parse_entry(path, "t", entry, 8, 10_000, stamp)
    except CheckpointError:
        assert fast is None, entry
    else:
        assert fast == strict, entry
