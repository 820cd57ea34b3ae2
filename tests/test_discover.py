"""Weight-file discovery follows vLLM's ``_prepare_weights`` on a local directory."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from functional_load.checkpoint.discover import WeightFiles, discover, natural_sort_key
from functional_load.errors import CheckpointError, ConfigError, MissingFileError


def make(directory: Path, *names: str) -> None:
    """Create weight files: real safetensors for ``*.safetensors``, placeholder bytes otherwise."""
    for name in names:
        if name.endswith(".safetensors"):
            save_file({"w": torch.zeros(2)}, str(directory / name))
        else:
            (directory / name).write_bytes(b"pickle")


def write_index(directory: Path, weight_map: dict[str, str], name: str = "model.safetensors.index.json") -> Path:
    path = directory / name
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def names(found: WeightFiles) -> list[str]:
    return [p.name for p in found.files]


@pytest.mark.parametrize(
    "present, load_format, expected_files, expected_kind",
    [
        (["a.safetensors", "b.bin", "c.pt"], "hf", ["a.safetensors"], "safetensors"),  # safetensors wins over bin
        (["b.bin", "c.pt"], "hf", ["b.bin"], "pickle"),  # bin wins over pt
        (["c.pt"], "hf", ["c.pt"], "pickle"),
        (["a.safetensors", "c.pt"], "pt", ["c.pt"], "pickle"),
        (["a.safetensors", "b.bin"], "safetensors", ["a.safetensors"], "safetensors"),
        (["a.safetensors", "b.bin"], "SafeTensors", ["a.safetensors"], "safetensors"),  # lower-cased
    ],
)
def test_first_pattern_that_yields_files_wins(tmp_path, present, load_format, expected_files, expected_kind):
    make(tmp_path, *present)
    found = discover(tmp_path, load_format)
    assert names(found) == expected_files
    assert found.kind == expected_kind
    assert found.directory == tmp_path


@pytest.mark.parametrize(
    "present, expected_format, expected_files",
    [
        (["consolidated.safetensors", "model.safetensors"], "mistral", ["consolidated.safetensors"]),
        (["model.safetensors"], "hf", ["model.safetensors"]),
        (["pytorch_model.bin"], "hf", ["pytorch_model.bin"]),
    ],
)
def test_auto_resolves_to_mistral_when_consolidated_present(tmp_path, present, expected_format, expected_files):
    make(tmp_path, *present)
    found = discover(tmp_path)
    assert found.load_format == expected_format
    assert names(found) == expected_files


def test_index_keeps_only_named_files(tmp_path):
    make(tmp_path, "consolidated.safetensors", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    index = write_index(tmp_path, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    found = discover(tmp_path, "hf")
    assert names(found) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert found.index_file == index
    assert dict(found.weight_map) == {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    with pytest.raises(TypeError):
        found.weight_map["c"] = "x"  # read-only


def test_mistral_uses_its_own_index(tmp_path):
    make(tmp_path, "consolidated-1.safetensors", "consolidated-2.safetensors", "model.safetensors")
    write_index(tmp_path, {"a": "model.safetensors"})  # hf index: ignored for mistral
    index = write_index(tmp_path, {"a": "consolidated-2.safetensors"}, "consolidated.safetensors.index.json")
    found = discover(tmp_path)
    assert (found.load_format, found.index_file, names(found)) == ("mistral", index, ["consolidated-2.safetensors"])


def test_no_index_means_no_weight_map(tmp_path):
    make(tmp_path, "model.safetensors")
    found = discover(tmp_path)
    assert found.index_file is None and found.weight_map is None


def test_index_ignored_when_bin_wins(tmp_path):
    make(tmp_path, "pytorch_model.bin")
    write_index(tmp_path, {"a": "model.safetensors"})
    found = discover(tmp_path)
    assert (found.kind, found.index_file, found.weight_map) == ("pickle", None, None)


def test_file_missing_from_index_raises(tmp_path):
    make(tmp_path, "model-00001-of-00002.safetensors")
    index = write_index(tmp_path, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    with pytest.raises(MissingFileError) as info:
        discover(tmp_path)
    assert isinstance(info.value, FileNotFoundError)
    assert "model-00002-of-00002.safetensors" in str(info.value)
    assert str(index) in str(info.value)


@pytest.mark.parametrize("shard", ["sub/model.safetensors", "../model.safetensors", "/abs/model.safetensors", "a\\b"])
def test_index_shard_must_be_a_plain_file_name(tmp_path, shard):
    make(tmp_path, "model.safetensors")
    write_index(tmp_path, {"layer.w": shard})
    with pytest.raises(CheckpointError, match=re.escape("layer.w")) as info:
        discover(tmp_path)
    assert repr(shard) in str(info.value) and "model.safetensors.index.json" in str(info.value)


@pytest.mark.parametrize(
    "text, found",
    [
        ('{"weight_map": {"a": "m.safetensors", "a": "m.safetensors"}}', "duplicate JSON key 'a'"),
        ('{"weight_map": {"a": "m.safetensors"}, "metadata": {"total_size": NaN}}', "NaN"),
        ('{"weight_map": {"a": "m.safetensors"}, "x": Infinity}', "Infinity"),
        ('{"weight_map": {"a": ', "invalid JSON"),
        ('["m.safetensors"]', "weight_map"),
        ('{"weight_map": {}}', "weight_map"),
        ('{"weight_map": {"a": 3}}', "found 3"),
    ],
)
def test_index_must_be_strict_json_with_a_weight_map(tmp_path, text, found):
    make(tmp_path, "m.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError) as info:
        discover(tmp_path)
    assert "model.safetensors.index.json" in str(info.value) and found in str(info.value)


def test_natural_sort():
    assert sorted(["model-10", "model-2", "model-1"], key=natural_sort_key) == ["model-1", "model-2", "model-10"]
    assert natural_sort_key("model-00010-of-00012") > natural_sort_key("model-00002-of-00012")


def test_files_are_naturally_sorted(tmp_path):
    make(tmp_path, "model-10.safetensors", "model-2.safetensors", "model-1.safetensors")
    assert names(discover(tmp_path)) == ["model-1.safetensors", "model-2.safetensors", "model-10.safetensors"]


def test_training_files_dropped(tmp_path):
    make(tmp_path, "pytorch_model.bin", "training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
    assert names(discover(tmp_path)) == ["pytorch_model.bin"]


def test_training_files_alone_do_not_win_a_pattern(tmp_path):
    make(tmp_path, "training_args.bin", "optimizer.bin", "model.pt")
    assert names(discover(tmp_path)) == ["model.pt"]


@pytest.mark.parametrize(
    "present, load_format, patterns",
    [
        ([], "auto", "['*.safetensors', '*.bin', '*.pt']"),
        (["model.bin"], "safetensors", "['*.safetensors']"),
        (["model.safetensors"], "pt", "['*.pt']"),
        (["training_args.bin"], "hf", "['*.safetensors', '*.bin', '*.pt']"),
    ],
)
def test_no_weights(tmp_path, present, load_format, patterns):
    make(tmp_path, *present)
    with pytest.raises(CheckpointError, match="Cannot find any model weights") as info:
        discover(tmp_path, load_format)
    assert str(tmp_path) in str(info.value) and patterns in str(info.value)


@pytest.mark.parametrize("load_format", ["npcache", "gguf", "", "bitsandbytes"])
def test_unknown_load_format(tmp_path, load_format):
    make(tmp_path, "model.safetensors")
    with pytest.raises(ConfigError) as info:
        discover(tmp_path, load_format)
    assert repr(load_format) in str(info.value)
    assert "auto, hf, safetensors, mistral, pt" in str(info.value)


def test_not_a_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(MissingFileError, match="nope"):
        discover(missing)
    make(tmp_path, "model.safetensors")
    with pytest.raises(FileNotFoundError, match=re.escape("model.safetensors")):
        discover(tmp_path / "model.safetensors")


def test_directory_named_like_weights_is_skipped(tmp_path):
    (tmp_path / "extra.safetensors").mkdir()
    make(tmp_path, "model.bin")
    assert names(discover(tmp_path)) == ["model.bin"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_is_rejected(tmp_path):
    make(tmp_path, "model-1.safetensors")
    os.mkfifo(tmp_path / "model-2.safetensors")
    with pytest.raises(CheckpointError, match=r"model-2\.safetensors.*not a regular file"):
        discover(tmp_path)


def test_broken_symlink_is_missing(tmp_path):
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(MissingFileError, match=re.escape("model.safetensors")):
        discover(tmp_path)
