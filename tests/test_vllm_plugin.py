"""The ``functional_load`` vLLM load format.

Without vLLM: the options vLLM passes through ``model_loader_extra_config``, and the matching of a
plan against a live model's parameters (every mismatch listed, nothing silently skipped). In real
vLLM (CI's oracle stage, ``harness.plugin_record``): greedy generation with
``load_format="functional_load"`` gives the same tokens and logprobs as vLLM's default loader's
recorded ones, at tp 1 and 2, on a dense GQA model, a Qwen3 model and a Qwen3-MoE model, and each
worker reads exactly its planned share; here, that record must be current.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_load as fl
from functional_load.errors import ConfigError, PlanError
from functional_load.integrations.vllm import ExtraConfig, MoePlacement, check_supported, fill_model, live_tensors, match_model
from functional_load.testing import records
from functional_load.testing.checkpoints import write_checkpoint
from harness import plugin_record
from harness.plugin_record import SMALL


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("llama", tmp_path_factory.mktemp("plugin") / "llama", kv_heads=2, intermediate_size=512, **SMALL)


def _params(plan: fl.Plan) -> dict[str, torch.Tensor]:
    """Parameters shaped as the plan says, named as vLLM names them (tied names share a tensor)."""
    out = {p.spec.name: torch.full(p.spec.local_shape, float("nan"), dtype=getattr(torch, p.spec.dtype)) for p in plan.params}
    out.update({alias: out[target] for alias, target in plan.aliases.items()})
    return out


# ---- options -------------------------------------------------------------------------------------------


def test_extra_config_options() -> None:
    """The extra config holds the library's one LoadOptions value (and where reports go)."""
    extra = ExtraConfig.parse({"threads": 2, "read": {"strategy": "pread"}, "verify_hashes": True, "progress": False,
                               "spec": "llama", "report_dir": "/tmp/r"})
    read = fl.ReadOptions(strategy="pread", threads=2, verify_hashes=True)
    assert extra.options == fl.LoadOptions(read=read, progress=False, spec="llama")
    assert extra.report_dir == "/tmp/r" and extra.expert_placement is None
    assert ExtraConfig.parse({}) == ExtraConfig() == ExtraConfig.parse(None)
    assert ExtraConfig.parse({"expert_placement": "round_robin"}).expert_placement == "round_robin"
    assert ExtraConfig.parse({"weights": "s3://models/llama"}).weights == "s3://models/llama"  # vLLM refuses s3:// models
    with pytest.raises(ConfigError, match=r"\['weights'\] must be a directory or a URI"):
        ExtraConfig.parse({"weights": ["s3://models/llama"]})


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"thread": 2}, ["unknown key", "'thread'", "threads"]),
        ({"read": {"stratgy": "x"}}, ["ReadOptions", "'stratgy'"]),
        ({"threads": 0}, ["threads must be a positive integer"]),
        ("threads=2", ["must be a dict"]),
        ({"dtype": "float32", "text_only": True}, ["['dtype', 'text_only']", "are set by vLLM's --dtype"]),
    ],
)
def test_bad_extra_config_is_refused(extra: Any, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        ExtraConfig.parse(extra)
    for word in words:
        assert word in str(info.value)


def test_unsupported_settings_are_refused_before_reading() -> None:
    check_supported(None)
    with pytest.raises(ConfigError, match=r"quantization='fp8'.*default load format"):
        check_supported("fp8")


# ---- matching a plan against a live model -------------------------------------------------------------


@pytest.mark.parametrize("tp_rank", [(1, 0), (2, 1), (4, 3)])
def test_fill_model_fills_every_parameter_in_place(tiny: Path, tp_rank: tuple[int, int]) -> None:
    tp, rank = tp_rank
    plan = fl.plan(tiny, tp_size=tp, rank=rank, dtype="float32")
    params = _params(plan)
    params["model.layers.0.self_attn.alias.weight"] = params["model.layers.0.self_attn.o_proj.weight"]  # vLLM's extra names
    before = {n: t.data_ptr() for n, t in params.items()}
    stats = fill_model(plan, params, fl.LoadOptions())
    expected = fl.load(tiny, tp_size=tp, rank=rank, dtype="float32")
    assert set(params) - set(expected) == {"model.layers.0.self_attn.alias.weight"}
    for name, tensor in params.items():
        assert tensor.data_ptr() == before[name], f"{name} was replaced, not filled in place"
        assert torch.equal(tensor, expected[name.replace(".alias.", ".o_proj.")]), name
    assert stats.bytes_read == plan.bytes_to_read


def test_a_pipeline_stage_fills_its_model_and_reports_its_global_rank(tiny: Path, tmp_path: Path) -> None:
    """Stage 1 of 2 at tp 2 (vLLM's global rank 3): vLLM's model of the stage has only its layers
    (PPMissingLayer elsewhere); the plan fills them and the report carries every coordinate. A
    stage-0 plan against the stage-1 model lists what differs instead of loading it."""
    from functional_load.integrations.vllm_model import write_report

    plan = fl.plan(tiny, tp_size=2, rank=1, pp_size=2, pp_rank=1, dtype="float32")
    params = _params(plan)
    assert "lm_head.weight" in params and not any(n.startswith("model.layers.0.") for n in params)
    stats = fill_model(plan, params, fl.LoadOptions())
    expected = fl.load(tiny, tp_size=2, rank=1, pp_size=2, pp_rank=1, dtype="float32")
    assert set(params) == set(expected) and all(torch.equal(params[n], expected[n]) for n in params)
    write_report(str(tmp_path), plan, stats, 0.1)
    report = json.loads((tmp_path / "rank3.json").read_text())
    assert {k: report[k] for k in ("rank", "tp_size", "pp_rank", "pp_size", "dp_rank", "dp_size")} == {
        "rank": 1, "tp_size": 2, "pp_rank": 1, "pp_size": 2, "dp_rank": 0, "dp_size": 1}
    assert report["bytes_read"] == plan.bytes_to_read
    with pytest.raises(PlanError, match=r"model.layers.0.mlp.down_proj.weight: planned float32 .* vLLM.s model has no such"):
        match_model(fl.plan(tiny, tp_size=2, rank=1, pp_size=2, pp_rank=0, dtype="float32"), _params(plan))


def test_buffers_the_checkpoint_fills_are_filled_too(tmp_path: Path) -> None:
    """A persistent buffer vLLM's loader fills from the checkpoint (Gemma 4's ``layer_scalar``)
    is one of the live tensors the plugin fills; other buffers (rotary caches) are not."""
    from functional_load.testing.checkpoints import write_checkpoint

    model_dir = write_checkpoint("gemma4_text", tmp_path / "gemma4", kv_heads=2)
    plan = fl.plan(model_dir, tp_size=2, rank=1, dtype="float32")
    params = _params(plan)
    buffers = {n: params.pop(n) for n in list(params) if n.endswith(".layer_scalar")}
    assert buffers, "the plan fills no layer_scalar"

    class Model:  # vLLM's model as the plugin sees it: parameters, and buffers beside them
        def named_parameters(self, remove_duplicate: bool = True):
            return iter(params.items())

        def named_buffers(self, remove_duplicate: bool = True):
            return iter({**buffers, "model.rotary_emb.cos_sin_cache": torch.zeros(4)}.items())

    live = live_tensors(Model(), plan)
    assert set(live) == set(params) | set(buffers)
    fill_model(plan, live, fl.LoadOptions())
    expected = fl.load(model_dir, tp_size=2, rank=1, dtype="float32")
    for name, tensor in buffers.items():
        assert torch.equal(tensor, expected[name]) and not torch.equal(tensor, torch.full_like(tensor, 1.0)), name


def test_non_contiguous_parameters_are_filled_from_a_copy(tiny: Path) -> None:
    plan = fl.plan(tiny, tp_size=2, rank=0, dtype="float32")
    params = _params(plan)
    name = "model.layers.0.self_attn.o_proj.weight"
    params[name] = torch.empty(tuple(reversed(params[name].shape))).t()  # same shape, not contiguous
    fill_model(plan, params, fl.LoadOptions())
    assert torch.equal(params[name], fl.load(tiny, tp_size=2, rank=0, dtype="float32")[name])


def test_every_mismatch_is_listed(tiny: Path) -> None:
    plan = fl.plan(tiny, tp_size=2, rank=0, dtype="float32")
    params = _params(plan)
    del params["model.norm.weight"]
    params["model.layers.0.mlp.extra.weight"] = torch.empty(3, 4)
    params["model.layers.0.mlp.copy.weight"] = params["model.layers.0.mlp.down_proj.weight"].clone()  # not an alias
    params["model.layers.1.self_attn.qkv_proj.weight"] = torch.empty(7, 256)
    params["model.layers.1.mlp.down_proj.weight"] = params["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16)
    with pytest.raises(PlanError) as info:
        fill_model(plan, params, fl.LoadOptions())
    text = str(info.value)
    assert "model.norm.weight: planned float32 [256], but vLLM's model has no such parameter" in text
    assert "model.layers.0.mlp.extra.weight: vLLM's model has float32 [3, 4], the plan fills nothing" in text
    assert "model.layers.1.self_attn.qkv_proj.weight: vLLM's model has float32 [7, 256], the plan gives float32 [256, 256]" in text
    assert "model.layers.1.mlp.down_proj.weight: vLLM's model has bfloat16" in text
    assert "model.layers.0.mlp.copy.weight: vLLM's model has float32 [256, 256], the plan fills nothing" in text
    assert len(info.value.problems) == 6  # five problems and where the model came from
    replaced = {"model.layers.0.mlp.extra.weight", "model.layers.0.mlp.copy.weight", "model.layers.1.self_attn.qkv_proj.weight"}
    untouched = set(params) - replaced
    assert all(torch.isnan(params[n]).all() for n in untouched), "nothing is read"


def test_expert_placement_must_match_vllms(tmp_path: Path) -> None:
    moe = write_checkpoint("qwen3_moe", tmp_path / "moe", kv_heads=2)
    plan = fl.plan(moe, tp_size=2, rank=1, expert_parallel=True)
    n = json.loads((moe / "config.json").read_text())["num_local_experts"]
    prefix = "model.layers.0.mlp.experts"
    right = MoePlacement("linear", n, plan.parallel.expert_slots(n))
    match_model(plan, _params(plan), {prefix: right})
    with pytest.raises(PlanError, match=r"vLLM put experts \[0, 1"):
        match_model(plan, _params(plan), {prefix: MoePlacement("linear", n, tuple(range(n // 2)))})
    with pytest.raises(PlanError, match="vLLM placed experts 'round_robin', the plan 'linear'"):
        match_model(plan, _params(plan), {prefix: MoePlacement("round_robin", n, right.local)})


# ---- end to end in real vLLM ----------------------------------------------------------------------------
# The functional_load load format generates in real vLLM in CI's oracle stage (``python -m
# harness.plugin_record --sample``), against vLLM's default loader's generations
# recorded in tests/oracle/vllm-generate.json; here, that record must be current.


def test_the_recorded_generations_are_current(tmp_path: Path) -> None:
    todo = plugin_record.stale(plugin_record.CONFIGS, tmp_path)
    if todo:
        raise records.stale_error("vLLM generation", todo, plugin_record.COMMAND)
    recorded = records.read(plugin_record.STORE)["generations"]
    assert set(recorded) == set(plugin_record.CONFIGS)
    for config in plugin_record.CONFIGS:
        answer, layout = recorded[config]["auto"], plugin_record.layout_of(config)
        assert len(answer["digests"]) == layout["tp"] * layout["pp"] * layout["dp"] and all(answer["digests"]), config
        assert len(answer["engines"]) == layout["dp"], config
        for engine in answer["engines"]:
            if layout["pp"] * layout["dp"] > 1:  # vLLM's CPU build loads these layouts but cannot run them
                assert engine["generations"] is None and engine["error"], config
            else:
                generations = engine["generations"]
                assert len(generations) == 3 and all(len(g["tokens"]) == 8 and len(g["logprobs"]) == 8 for g in generations), config
