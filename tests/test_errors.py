"""Every error the loader promises: the exception type (a LoadError subclass) and a message that
names the tensor / file / parameter and the numbers involved.

One real tiny llama checkpoint (GQA, 2 KV heads) is built per module; each case breaks a copy of
it in ``tmp_path`` by rewriting shards with safetensors and fixing the index to match.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from functional_load import (
    CheckpointError,
    ConfigError,
    LoadError,
    MissingFileError,
    PlanError,
    ShardingError,
    load,
    plan,
)
from functional_load.cli import main as cli_main
from functional_load.io import execute
from functional_load.testing.checkpoints import write_checkpoint

INDEX = "model.safetensors.index.json"
KV_HEADS = 2
HEAD_DIM = 8
HIDDEN = 64


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return write_checkpoint("llama", tmp_path_factory.mktemp("llama") / "ckpt", kv_heads=KV_HEADS)


# --- helpers that break a copy of the checkpoint -----------------------------------------------


def copy_checkpoint(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    return dst


def read_index(directory: Path) -> dict:
    return json.loads((directory / INDEX).read_text())


def shard_of(directory: Path, tensor: str) -> str:
    return read_index(directory)["weight_map"][tensor]


def edit_shard(directory: Path, shard: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Load ``shard``, let ``edit`` change its tensor dict in place, save it back and make the
    index's weight map agree with the shard's new contents."""
    path = directory / shard
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    index = read_index(directory)
    weight_map = {name: f for name, f in index["weight_map"].items() if f != shard or name in tensors}
    weight_map.update({name: shard for name in tensors})
    index["weight_map"] = dict(sorted(weight_map.items()))
    all_tensors = {}
    for f in sorted(set(weight_map.values())):
        all_tensors.update(load_file(str(directory / f)))
    index["metadata"]["total_size"] = sum(t.numel() * t.element_size() for t in all_tensors.values())
    (directory / INDEX).write_text(json.dumps(index, indent=2))


def remove_tensor(directory: Path, name: str) -> None:
    edit_shard(directory, shard_of(directory, name), lambda t: t.pop(name))


def put_tensor(directory: Path, name: str, tensor: torch.Tensor, next_to: str) -> None:
    """Add (or replace) ``name`` in the shard that holds ``next_to``."""
    edit_shard(directory, shard_of(directory, next_to), lambda t: t.__setitem__(name, tensor))


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config, indent=2))


def plan_error(directory: Path, **kwargs) -> PlanError:
    with pytest.raises(PlanError) as info:
        plan(directory, **kwargs)
    return info.value


# --- the intact checkpoint loads (so every failure below is caused by the edit) ----------------


def test_intact_checkpoint_plans_cleanly(llama_dir):
    the_plan = plan(llama_dir, tp_size=2, rank=1)
    assert the_plan.dropped == ()
    assert "model.layers.0.self_attn.qkv_proj.weight" in {p.spec.name for p in the_plan.params}


def test_error_hierarchy():
    for cls in (PlanError, ShardingError, ConfigError, CheckpointError, MissingFileError):
        assert issubclass(cls, LoadError) and issubclass(cls, ValueError)
    assert issubclass(MissingFileError, CheckpointError) and issubclass(MissingFileError, FileNotFoundError)


# --- plan validation: missing, partial, unexpected and mis-shaped tensors -----------------------


def test_missing_parameter(llama_dir, tmp_path):
    d = copy_checkpoint(llama_dir, tmp_path)
    remove_tensor(d, "model.layers.1.mlp.down_proj.weight")
    err = plan_error(d)
    assert len(err.problems) == 1
    message = str(err)
    assert "Following weights were not initialized from checkpoint" in message
    assert "model.layers.1.mlp.down_proj.weight" in message
    assert "model.layers.0.mlp.down_proj.weight" not in message  # only the one that is missing
    assert str(d) in message


def test_fused_parameter_partly_missing(llama_dir, tmp_path):
    d = copy_checkpoint(llama_dir, tmp_path)
    remove_tensor(d, "model.layers.0.self_attn.v_proj.weight")
    err = plan_error(d)
    message = str(err)
    assert "model.layers.0.self_attn.qkv_proj.weight" in message
    assert "partly" in message
    # the missing segment is named, and the tensors that were found
    assert "segment 'v' not found" in message and "segment 'q'" not in message
    assert "model.layers.0.self_attn.q_proj.weight" in message and "model.layers.0.self_attn.k_proj.weight" in message
    assert "model.layers.1.self_attn.qkv_proj.weight" not in message


def test_unexpected_tensor_lists_neighbouring_parameters(llama_dir, tmp_path):
    d = copy_checkpoint(llama_dir, tmp_path)
    name = "model.layers.0.mlp.extra_proj.weight"
    put_tensor(d, name, torch.zeros(128, HIDDEN, dtype=torch.bfloat16), next_to="model.layers.0.mlp.down_proj.weight")
    err = plan_error(d)
    assert len(err.problems) == 1
    message = err.problems[0]
    assert name in message
    assert shard_of(d, name) in message  # the file it sits in
    assert "'model.layers.0.mlp'" in message  # the prefix whose parameters are listed
    assert "model.layers.0.mlp.down_proj.weight" in message
    assert "model.layers.0.mlp.gate_up_proj.weight" in message
    assert "model.layers.0.self_attn" not in message  # only the parameters under model.layers.0.mlp


def test_a_bias_the_spec_lacks_is_an_error(llama_dir, tmp_path):
    """A checkpoint bias no parameter takes is a plan error (a qwen2 checkpoint planned with the
    llama spec lost its q/k/v biases silently before): only a quantization method whose
    checkpoints carry such biases (GPTQ) drops them, with the reason."""
    d = copy_checkpoint(llama_dir, tmp_path)
    name = "model.layers.0.self_attn.o_proj.bias"
    put_tensor(d, name, torch.ones(HIDDEN, dtype=torch.bfloat16), next_to="model.layers.0.self_attn.o_proj.weight")
    with pytest.raises(PlanError, match=re.escape(f"checkpoint tensor {name!r}") + ".*has no destination in llama"):
        plan(d, tp_size=2, rank=0)


def test_a_gptq_checkpoint_bias_the_model_lacks_is_dropped_with_the_reason(tmp_path):
    """GPTQ checkpoints may carry a bias for every linear; vLLM skips those its model has none
    for, and so does the plan, saying why."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "gptq"
    shutil.copytree(Path(__file__).parent / "fixtures" / "quant" / "gptq_v1", d)
    shard = next(d.glob("*.safetensors"))
    tensors = load_file(shard)
    name = "model.layers.0.self_attn.o_proj.bias"
    tensors[name] = torch.zeros(tensors["model.layers.0.self_attn.o_proj.scales"].shape[1], dtype=torch.float16)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = d / INDEX
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"][name] = shard.name
        index.write_text(json.dumps(data))
    dropped = dict(plan(d, tp_size=2, rank=0).dropped)
    assert "GPTQ checkpoints carry one for every linear" in dropped[name]


def test_rotary_cache_is_dropped(llama_dir, tmp_path):
    d = copy_checkpoint(llama_dir, tmp_path)
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    put_tensor(d, name, torch.rand(HEAD_DIM // 2), next_to="model.layers.0.self_attn.q_proj.weight")
    the_plan = plan(d)
    assert [t for t, _ in the_plan.dropped] == [name]
    assert "rotary" in dict(the_plan.dropped)[name]
    assert name not in load(d)


def test_shape_mismatch_names_tensor_file_and_shapes(llama_dir, tmp_path):
    d = copy_checkpoint(llama_dir, tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    put_tensor(d, name, torch.zeros(24, HIDDEN, dtype=torch.bfloat16), next_to=name)
    err = plan_error(d)
    problems = [p for p in err.problems if name in p]
    assert len(problems) == 1
    message = problems[0]
    assert shard_of(d, name) in message
    assert "[24, 64]" in message
    assert "[16, 64]" in message  # KV_HEADS * HEAD_DIM rows
    assert "model.layers.0.self_attn.qkv_proj.weight" in message
    # the one wrong tensor is the one problem: its parameter is not reported again as partly filled
    assert len(err.problems) == 1, err.problems


def test_all_problems_are_reported_at_once(llama_dir, tmp_path):
    d = copy_checkpoint(llama_dir, tmp_path)
    remove_tensor(d, "model.layers.1.mlp.down_proj.weight")
    put_tensor(d, "model.layers.0.mlp.extra_proj.weight", torch.zeros(4, 4, dtype=torch.bfloat16),
               next_to="model.layers.0.mlp.up_proj.weight")
    put_tensor(d, "model.layers.0.self_attn.k_proj.weight", torch.zeros(24, HIDDEN, dtype=torch.bfloat16),
               next_to="model.layers.0.self_attn.k_proj.weight")
    err = plan_error(d)
    assert len(err.problems) >= 2
    message = str(err)
    assert message.startswith(f"{len(err.problems)} problems found")
    for needle in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.extra_proj.weight", "[24, 64]"):
        assert any(needle in p for p in err.problems), needle
        assert needle in message


# --- tensor-parallel settings -----------------------------------------------------------------


def test_tp_that_does_not_divide_the_heads(llama_dir):
    with pytest.raises(ShardingError) as info:
        plan(llama_dir, tp_size=3)
    message = str(info.value)
    assert "tp=3" in message
    assert "8 attention heads" in message
    assert "qkv_proj" in message
    assert "1024" in message  # the padded vocab (1000 -> 1024) does not divide over 3 either


def test_tp_larger_than_the_heads(llama_dir):
    with pytest.raises(ShardingError) as info:
        plan(llama_dir, tp_size=16)
    message = str(info.value)
    assert "tp=16" in message
    assert "8 attention heads" in message
    assert "KV heads" not in message  # 2 KV heads replicate fine over 16 ranks; only q fails


def test_gqa_kv_heads_replicate_over_more_ranks(llama_dir):
    """tp=8 > 2 KV heads: each KV head is replicated on 4 ranks, no error."""
    for rank in range(8):
        the_plan = plan(llama_dir, tp_size=8, rank=rank)
        qkv = next(p for p in the_plan.params if p.spec.name == "model.layers.0.self_attn.qkv_proj.weight")
        assert qkv.spec.local_shape == (HEAD_DIM + 2 * HEAD_DIM, HIDDEN)  # 1 q head + the shared k and v head
        k = next(c for c in qkv.copies if c.tensor.endswith("k_proj.weight"))
        head = rank // (8 // KV_HEADS)
        assert k.src == ((head * HEAD_DIM, (head + 1) * HEAD_DIM), (0, HIDDEN))


@pytest.mark.parametrize(
    ("tp_size", "rank", "needles"),
    [
        (4, 4, ["rank", "[0, 4)", "tp_size=4", "got 4"]),
        (4, -1, ["rank", "got -1"]),
        (0, 0, ["tp_size", "got 0"]),
        (-2, 0, ["tp_size", "got -2"]),
    ],
)
def test_invalid_parallel_settings(llama_dir, tp_size, rank, needles):
    with pytest.raises(ShardingError) as info:
        plan(llama_dir, tp_size=tp_size, rank=rank)
    for needle in needles:
        assert needle in str(info.value)


# --- tied embeddings ---------------------------------------------------------------------------


def test_tied_alias_without_its_target(llama_dir, tmp_path):
    d = copy_checkpoint(llama_dir, tmp_path)
    edit_config(d, tie_word_embeddings=True)
    remove_tensor(d, "model.embed_tokens.weight")  # lm_head.weight stays
    err = plan_error(d)
    tied = [p for p in err.problems if "is tied to" in p]
    assert len(tied) == 1
    assert "lm_head.weight" in tied[0] and "model.embed_tokens.weight" in tied[0]
    assert "model.embed_tokens.weight" in str(err) and "not initialized" in str(err)


@pytest.mark.parametrize(("tp_size", "rank"), [(1, 0), (4, 3)])
def test_tied_alias_is_the_same_tensor(llama_dir, tmp_path, tp_size, rank):
    d = copy_checkpoint(llama_dir, tmp_path)
    edit_config(d, tie_word_embeddings=True)  # both tensors stay in the checkpoint
    the_plan = plan(d, tp_size=tp_size, rank=rank)
    assert dict(the_plan.aliases) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert [t for t, _ in the_plan.dropped] == ["lm_head.weight"]
    assert "lm_head.weight" not in the_plan.tensors
    state = load(d, tp_size=tp_size, rank=rank)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    embed = load_file(str(d / shard_of(d, "model.embed_tokens.weight")))["model.embed_tokens.weight"]
    rows = 1024 // tp_size
    start, stop = min(rank * rows, 1000), min((rank + 1) * rows, 1000)
    assert torch.equal(state["lm_head.weight"][: stop - start], embed[start:stop])


# --- config.json and dtype ---------------------------------------------------------------------


def test_missing_config(llama_dir, tmp_path):
    d = copy_checkpoint(llama_dir, tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(ConfigError) as info:
        plan(d)
    assert str(d / "config.json") in str(info.value)


def test_config_with_duplicate_key(llama_dir, tmp_path):
    d = copy_checkpoint(llama_dir, tmp_path)
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text.replace('"hidden_size": 64,', '"hidden_size": 64,\n  "hidden_size": 128,', 1))
    assert text.count('"hidden_size"') == 1
    with pytest.raises(ConfigError) as info:
        plan(d)
    message = str(info.value)
    assert "config.json" in message and "duplicate" in message and "'hidden_size'" in message


def test_unknown_architecture(llama_dir, tmp_path):
    d = copy_checkpoint(llama_dir, tmp_path)
    # model_type too: an unknown architecture with model_type "llama" falls back to the llama spec
    edit_config(d, architectures=["FooForCausalLM"], model_type="foo")
    with pytest.raises(ConfigError) as info:
        plan(d)
    message = str(info.value)
    assert "FooForCausalLM" in message
    assert "supported" in message
    for arch in ("LlamaForCausalLM", "GPT2LMHeadModel"):
        assert arch in message


@pytest.mark.parametrize("dtype", ["int8", "float8", "nonsense"])
def test_unsupported_dtype_argument(llama_dir, dtype):
    with pytest.raises(ConfigError) as info:
        plan(llama_dir, dtype=dtype)
    assert repr(dtype) in str(info.value)


# --- the weight files ---------------------------------------------------------------------------


def test_shard_truncated_after_planning(llama_dir, tmp_path):
    d = copy_checkpoint(llama_dir, tmp_path)
    the_plan = plan(d)  # tp=1: every byte of every tensor is read
    # the tensor whose data ends the file of lm_head.weight
    shard = the_plan.tensors["lm_head.weight"].file
    last = max((t for t in the_plan.tensors.values() if t.file == shard), key=lambda t: t.location.offset)
    assert last.location.offset + last.nbytes == shard.stat().st_size
    os.truncate(shard, shard.stat().st_size - 3)
    with pytest.raises(CheckpointError) as info:
        execute(the_plan)
    message = str(info.value)
    assert str(shard) in message
    # caught before reading: the file is shorter than its header promised (a tensor of it named)
    assert "truncated" in message
    assert f"now has {shard.stat().st_size}" in message
    assert any(repr(t.name) in message for t in the_plan.tensors.values() if t.file == shard)


def test_short_read_inside_a_tensor_is_an_error(tmp_path):
    """The reader's own check, when a file shrinks between the size check and the read."""
    from functional_load.checkpoint import FileSpan, TensorInfo
    from functional_load.io.files import _pread_full

    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 10)
    info = TensorInfo("t", "U8", (16,), FileSpan(path, 0, 16))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match=r"ends early: read 10 of 16 bytes"):
            _pread_full(fd, memoryview(bytearray(16)), 0, info)
    finally:
        os.close(fd)


def test_shard_truncated_before_planning(llama_dir, tmp_path):
    """Caught from the header, before any tensor data is read."""
    d = copy_checkpoint(llama_dir, tmp_path)
    shard = d / shard_of(d, "lm_head.weight")
    os.truncate(shard, shard.stat().st_size - 3)
    with pytest.raises(CheckpointError) as info:
        plan(d)
    message = str(info.value)
    assert str(shard) in message and "truncated" in message


def test_no_weights_in_directory(llama_dir, tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    shutil.copy(llama_dir / "config.json", d / "config.json")
    with pytest.raises(CheckpointError) as info:
        plan(d)
    message = str(info.value)
    assert "Cannot find any model weights" in message and str(d) in message


def test_shard_named_in_index_is_missing(llama_dir, tmp_path):
    d = copy_checkpoint(llama_dir, tmp_path)
    shard = shard_of(d, "lm_head.weight")
    (d / shard).unlink()
    with pytest.raises(MissingFileError) as info:
        plan(d)
    assert shard in str(info.value) and INDEX in str(info.value)


def test_model_directory_does_not_exist(tmp_path):
    # config.json is read first, so today this is a ConfigError ("no config.json"); the promise
    # is only that it is a LoadError naming the path.
    with pytest.raises(LoadError) as info:
        plan(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(info.value)


# --- the command line ---------------------------------------------------------------------------


def test_cli_reports_errors_without_a_traceback(llama_dir, capsys):
    assert cli_main(["plan", str(llama_dir), "--tp", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("functional-load: error:")
    assert "tp=3" in captured.err and "8 attention heads" in captured.err
    assert "Traceback" not in captured.err


def test_cli_plan_error_exit_status(llama_dir, tmp_path, capsys):
    d = copy_checkpoint(llama_dir, tmp_path)
    remove_tensor(d, "model.layers.1.mlp.down_proj.weight")
    assert cli_main(["plan", str(d)]) == 2
    err = capsys.readouterr().err
    assert "model.layers.1.mlp.down_proj.weight" in err and "Traceback" not in err


def test_a_tensor_cut_from_a_shard_and_the_index_names_the_files_and_the_fix(tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    import functional_load as fl

    model = tmp_path / "m"
    shutil.copytree(Path(__file__).resolve().parents[1] / "examples" / "tiny-llama", model)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    name = "model.layers.0.mlp.down_proj.weight"
    shard = index["weight_map"].pop(name)
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    tensors = load_file(model / shard)
    del tensors[name]
    save_file(tensors, model / shard, metadata={"format": "pt"})
    with pytest.raises(fl.PlanError) as info:
        fl.plan(model, tp_size=2)
    text = str(info.value)
    assert name in text and str(model) in text and "model.safetensors.index.json" in text
    assert "download the checkpoint again" in text and "spec=" in text
