"""Quantized MoE experts against an independent dequantization of the checkpoint.

Every quantized MoE fixture of ``tests/fixtures/quant`` (written by the real tools, or derived and
labelled so) is loaded on every rank at tp 1, 2 and 4, with and without expert parallelism. On
each rank, ``fl.dequantize(state, "<layer>...experts")`` must equal, bit for bit, the rank's slice
of the experts that the reference dequantizer (``make/ref_dequant.py``: plain torch, no
functional_load) reads from the checkpoint, cut the way vLLM cuts them: expert parallelism keeps
whole experts; tensor parallelism gives rank ``r`` rows ``[r * I/tp, (r + 1) * I/tp)`` of gate
and of up (w13 = gate rows then up rows), or for gpt-oss a contiguous range of the interleaved
gate/up rows in whole 32-value blocks, and the same columns of down. Routers equal the checkpoint;
under expert parallelism a rank reads no byte of another rank's experts or their scales.
Configurations vLLM refuses are refused here with vLLM's message, listed explicitly.
"""

from __future__ import annotations

import json
import re
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_quant import QUANT, ckpt, ref_dequant

import functional_load as fl
from functional_load import CheckpointError, ConfigError, PlanError, ShardingError
from functional_load.io import ReadOptions, execute, reader_for

MOE = (
    "llmc_qwen3moe_fp8", "llmc_qwen3moe_fp8_block", "llmc_qwen3moe_w4a16_experts", "llmc_mixtral_fp8_block",
    "llmc_dsv3_fp8_block", "llmc_dsv3_w4a16_experts", "hf_fp8_dsv3", "hf_fp8_dsv3_mtp", "hf_fp8_qwen3moe",
    "ar_mixtral_gptq", "ar_qwen3moe_gptq", "ar_mixtral_awq", "gptoss_mxfp4",
    # the 2026 formats (llm-compressor, ModelOpt, Quark): FP8 per-channel experts, NVFP4, MXFP4, MXFP8
    "llmc_qwen3moe_fp8_dynamic", "llmc_qwen3moe_nvfp4", "llmc_qwen3moe_nvfp4a16", "llmc_qwen3moe_mxfp4",
    "llmc_qwen3moe_mxfp4a16", "llmc_qwen3moe_mxfp8", "llmc_qwen3moe_mxfp8a16", "modelopt_qwen3moe_fp8",
    "modelopt_qwen3moe_nvfp4", "modelopt_qwen3moe_w4a16_nvfp4", "modelopt_qwen3moe_mxfp8", "quark_qwen3moe_mxfp4",
)
CASES = [(name, tp, ep) for name in MOE for tp in (1, 2, 4) for ep in (False, True) if tp > 1 or not ep]

# What vLLM 0.32 refuses (its own words), and so does functional_load, on every rank.
GATE_UP_64 = "The output_size of gate's and up's weight = 64 is not divisible by weight quantization block_n = 128"
O_PROJ_64 = "Weight input_size_per_partition = 64 is not divisible by weight quantization block_k = 128"
REFUSED = {
    ("llmc_qwen3moe_fp8_block", 4, False): GATE_UP_64,
    ("llmc_mixtral_fp8_block", 4, False): GATE_UP_64,
    ("llmc_dsv3_fp8_block", 4, False): O_PROJ_64,
    ("llmc_dsv3_fp8_block", 4, True): O_PROJ_64,
    ("gptoss_mxfp4", 4, False): "2 KV heads (segment 'k') cannot divide over tp=4",
    ("gptoss_mxfp4", 4, True): "2 KV heads (segment 'k') cannot divide over tp=4",
}
PROJECTIONS = {"MixtralForCausalLM": ("w1", "w3", "w2")}
ROUTERS = (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".mlp.router.weight", ".mlp.router.bias")


@cache
def reference(name: str | Path) -> dict[str, torch.Tensor]:
    """{checkpoint linear: float32 [out, in]} as the reference reads it (group scales in the model
    dtype, as vLLM holds them)."""
    model = QUANT / name
    dtype = getattr(torch, json.loads((model / "config.json").read_text()).get("dtype", "bfloat16"))
    return {p: w for p, (w, _) in ref_dequant.dequantize(str(model), group_scale_dtype=dtype).items()}


@cache
def ranks(name: str, tp: int, ep: bool) -> tuple[fl.LoadedState, ...]:
    return tuple(fl.load(QUANT / name, tp_size=tp, rank=r, expert_parallel=ep) for r in range(tp))


def expert_modules(state: fl.LoadedState) -> list[str]:
    return sorted({n.split(".routed_experts.")[0] for n in state if ".routed_experts." in n})


def expected(name: str | Path, module: str, expert: int, tp: int, rank: int, ep: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s dense (w13, w2) of one expert, cut from the reference's gate, up and down."""
    arch = json.loads((QUANT / name / "config.json").read_text())["architectures"][0]
    gate, up, down = (reference(name)[f"{module}.{expert}.{p}"] for p in PROJECTIONS.get(arch, ("gate_proj", "up_proj", "down_proj")))
    inter = gate.shape[0]
    if ep:  # whole experts
        tp, rank = 1, 0
    if arch == "GptOssForCausalLM":  # interleaved rows, whole 32-value blocks per rank, the last ranks padded
        fused = torch.stack([gate, up], dim=1).reshape(2 * inter, -1)
        per = -(-(inter // 32) // tp) * 32
        lo, hi = min(rank * per, inter), min((rank + 1) * per, inter)
        w13 = torch.zeros(2 * per, fused.shape[1])
        w13[: 2 * (hi - lo)] = fused[2 * lo : 2 * hi]
        w2 = torch.zeros(down.shape[0], per)
        w2[:, : hi - lo] = down[:, lo:hi]
        return w13, w2
    per = inter // tp
    rows = slice(rank * per, (rank + 1) * per)
    return torch.cat([gate[rows], up[rows]]), down[:, rows]


@pytest.mark.parametrize(("name", "tp", "ep"), CASES, ids=[f"{n}-tp{t}{'-ep' if e else ''}" for n, t, e in CASES])
def test_experts_dequantize_to_the_reference(name: str, tp: int, ep: bool) -> None:
    refused = REFUSED.get((name, tp, ep))
    if refused is not None:
        for rank in range(tp):
            with pytest.raises(ShardingError, match=re.escape(refused)):
                fl.plan(QUANT / name, tp_size=tp, rank=rank, expert_parallel=ep)
        return
    states = ranks(name, tp, ep)
    held: dict[str, list[int]] = {}
    for rank, state in enumerate(states):
        modules = expert_modules(state)
        assert modules, f"{name}: no MoE layer loaded"
        for module in modules:
            w13, w2 = fl.dequantize(state, module)
            experts = next(p.spec.shape[0] for p in state.plan.params if p.spec.name.startswith(f"{module}.routed_experts."))
            slots = state.plan.parallel.expert_slots(experts)
            assert w13.shape[0] == w2.shape[0] == len(slots)
            held.setdefault(module, []).extend(slots)
            for slot, expert in enumerate(slots):
                want13, want2 = expected(name, module, expert, tp, rank, ep)
                assert torch.equal(w13[slot], want13), f"{name} tp{tp} rank {rank} {module} expert {expert}: w13"
                assert torch.equal(w2[slot], want2), f"{name} tp{tp} rank {rank} {module} expert {expert}: w2"
    for module, experts in held.items():  # every expert on exactly one rank (EP) or on every rank (TP)
        count = len(set(experts))
        assert sorted(experts) == (sorted(range(count)) if ep else sorted(list(range(count)) * tp)), module


@pytest.mark.parametrize("name", MOE)
def test_routers_equal_the_checkpoint(name: str) -> None:
    state = ranks(name, 2, False)[1]
    routers = [n for n in state if n.endswith(ROUTERS)]
    assert routers, f"{name}: no router"
    tensors = ckpt(name)
    dtype = getattr(torch, json.loads((QUANT / name / "config.json").read_text()).get("dtype", "bfloat16"))
    for router in routers:
        stored = tensors[router]
        assert stored.is_floating_point(), f"{router}: stored unquantized"
        # vLLM keeps routers unquantized, in the model dtype (ar_qwen3moe_gptq: bf16 stored, config float16)
        assert state[router].dtype == dtype, f"{router}: vLLM keeps routers unquantized, in the model dtype"
        assert torch.equal(state[router], stored.to(dtype)), router


@pytest.mark.parametrize("name", ["llmc_qwen3moe_w4a16_experts", "hf_fp8_dsv3_mtp", "gptoss_mxfp4", "ar_mixtral_awq"])
def test_expert_parallel_ranks_read_only_their_experts(name: str) -> None:
    tp = 2 if name == "gptoss_mxfp4" else 4
    expert_bytes_per_rank = []
    for rank in range(tp):
        plan = fl.plan(QUANT / name, tp_size=tp, rank=rank, expert_parallel=True)
        mine = set()
        for param in plan.params:
            if ".routed_experts." not in param.spec.name:
                continue
            slots = plan.parallel.expert_slots(param.spec.shape[0])
            mine.update(slots)
            for copy in param.copies:
                expert = _expert_of(copy.tensor)
                if expert is None:  # a fused tensor: the box's expert range is this rank's
                    assert set(range(*copy.src[0])) <= set(slots), (param.spec.name, copy.src)
                else:
                    assert expert in slots, (param.spec.name, copy.tensor)
        with reader_for(plan, ReadOptions(strategy="pread")) as reader:
            execute(plan, reader=reader, progress=False)
            assert reader.bytes_read == plan.bytes_to_read
        expert_bytes_per_rank.append(sum(plan.copy_bytes(c) for p in plan.params if ".routed_experts." in p.spec.name for c in p.copies))
    whole = sum(  # w1's weight_shape is not read: vLLM keeps the last part's (w3's, the same)
        v.numel() * v.element_size() for k, v in ckpt(name).items()
        if ".experts." in k and ".shared_expert" not in k and not k.startswith(_mtp_prefix(name))
        and not k.endswith("gate_proj.weight_shape")
    )
    assert sum(expert_bytes_per_rank) == whole  # every expert byte read once, by one rank


def _expert_of(tensor: str) -> int | None:
    parts = tensor.split(".experts.")[1].split(".")
    return int(parts[0]) if parts[0].isdigit() else None


def _mtp_prefix(name: str) -> str:
    config = json.loads((QUANT / name / "config.json").read_text())
    return f"model.layers.{config['num_hidden_layers']}." if config.get("num_nextn_predict_layers") else "\0"


def test_mxfp4_uneven_block_split_pads_the_last_rank(tmp_path: Path) -> None:
    """gpt-oss experts of 96 intermediate values (3 MXFP4 blocks) at tp 2: vLLM gives rank 0 two
    blocks and rank 1 one, padded with zeros to two. DERIVED checkpoint: the gptoss_mxfp4 fixture's
    experts cut to their first 96 intermediate values (whole blocks, so still a valid MXFP4 model)."""
    model = _copy("gptoss_mxfp4", tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] = 96
    (model / "config.json").write_text(json.dumps(config))
    for file in model.glob("*.safetensors"):
        tensors = load_file(file)
        for k, v in list(tensors.items()):
            if ".experts.gate_up_proj" in k:
                tensors[k] = v[:, :192].contiguous()
            elif ".experts.down_proj_" in k and not k.endswith("bias"):
                tensors[k] = v[:, :, :3].contiguous()
            elif k.endswith("down_proj_bias"):  # the fixture's biases are zero: give them values
                tensors[k] = torch.linspace(-1, 1, v.numel()).reshape(v.shape).to(v.dtype)
        save_file(tensors, file, metadata={"format": "pt"})
    for rank in (0, 1):
        state = fl.load(model, tp_size=2, rank=rank)
        w13, w2 = fl.dequantize(state, "model.layers.0.mlp.experts")
        assert tuple(w13.shape) == (4, 128, 256) and tuple(w2.shape) == (4, 256, 64)
        for expert in range(4):
            want13, want2 = expected(model, "model.layers.0.mlp.experts", expert, 2, rank, False)
            assert torch.equal(w13[expert], want13) and torch.equal(w2[expert], want2)
        bias = state["model.layers.0.mlp.experts.routed_experts.w2_bias"]
        stored = torch.linspace(-1, 1, bias.numel()).reshape(bias.shape).to(bias.dtype)
        assert torch.equal(bias, stored if rank == 0 else torch.zeros_like(bias))  # vLLM adds it on the first rank only


def test_mtp_layer_is_dropped_with_its_reason() -> None:
    for tp, ep in ((2, False), (4, True)):
        plan = fl.plan(QUANT / "hf_fp8_dsv3_mtp", tp_size=tp, rank=tp - 1, expert_parallel=ep)
        mtp = [(t, why) for t, why in plan.dropped if t.startswith("model.layers.2.")]
        assert mtp and all("multi-token-prediction" in why for _, why in mtp)
        assert not any(p.spec.name.startswith("model.layers.2.") for p in plan.params)


def test_refined_block_scales_repeat_the_checkpoint_blocks() -> None:
    """vLLM's fp8 method refines 128x128 expert scale blocks to 64x64 at tp 4 (I/tp = 64): each
    checkpoint scale fills 2x2 cells, and this rank's rows start on a checkpoint block or inside one."""
    state = ranks("hf_fp8_qwen3moe", 4, False)[1]
    scale = state["model.layers.0.mlp.experts.routed_experts.w13_weight_scale_inv"]
    assert tuple(scale.shape) == (4, 2, 4)
    stored = ckpt("hf_fp8_qwen3moe")["model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv"]
    assert torch.equal(scale[3, 0], stored[0].repeat_interleave(2))  # rank 1: rows 64:128, inside block 0


@pytest.mark.parametrize(("value", "why"), [(float("nan"), "not finite"), (-1.0, "positive"), (0.0, "positive")])
def test_a_bad_expert_scale_is_named_before_weights_are_read(tmp_path: Path, value: float, why: str) -> None:
    model = _copy("llmc_qwen3moe_fp8_block", tmp_path)
    bad = "model.layers.0.mlp.experts.2.down_proj.weight_scale"
    _edit(model, bad, lambda t: t.index_fill_(0, torch.tensor([0]), value))
    plan = fl.plan(model, tp_size=2, rank=0)
    weights = sum(plan.copy_bytes(c) for p in plan.params if p.spec.dtype == "float8_e4m3fn" for c in p.copies)
    with reader_for(plan, ReadOptions(strategy="pread")) as reader:
        with pytest.raises(CheckpointError, match=why) as info:
            execute(plan, reader=reader, progress=False)
        assert reader.bytes_read < weights / 10  # scales are checked first
    assert "w2_weight_scale" in str(info.value) and bad in str(info.value)


def test_a_missing_or_misshapen_expert_scale_is_a_plan_error(tmp_path: Path) -> None:
    model = _copy("llmc_qwen3moe_fp8", tmp_path)
    gone = "model.layers.0.mlp.experts.1.up_proj.weight_scale"
    _edit(model, gone, None)
    with pytest.raises(PlanError, match=r"w13_weight_scale.*expert 1 \(w3\)"):
        fl.plan(model, tp_size=2, rank=0)
    model = _copy("llmc_qwen3moe_fp8", tmp_path / "b")
    _edit(model, "model.layers.0.mlp.experts.0.down_proj.weight_scale", lambda t: torch.ones(2))
    with pytest.raises(PlanError, match=r"experts\.0\.down_proj\.weight_scale.*shape \[2\]"):
        fl.plan(model, tp_size=1, rank=0)


def test_unequal_w1_w3_input_scales_are_refused(tmp_path: Path) -> None:
    """vLLM keeps one input scale per expert for w1 and w3 (compressed-tensors refuses unequal ones)."""
    model = _copy("llmc_qwen3moe_fp8", tmp_path)
    _edit(model, "model.layers.0.mlp.experts.3.up_proj.input_scale", lambda t: t * 2)
    with pytest.raises(CheckpointError, match=r"experts\.3\.gate_proj\.input_scale.*experts\.3\.up_proj\.input_scale"):
        fl.load(model, tp_size=1, rank=0)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic-skips-router", "dtype-detected"])
def test_qwen3moe_gptq_bf16_router_loads_unquantized(tmp_path: Path, dynamic: bool) -> None:
    """Issue 23: GPTQ Qwen3-MoE checkpoints with a bf16 router were refused. auto-round also names the
    router in ``dynamic`` ("-:" skips it); without that entry vLLM learns the unquantized modules from
    the safetensors dtypes (AutoGPTQConfig.maybe_update_config). Both load, the router as a float
    ``mlp.gate.weight`` while attention and experts stay GPTQ (parity: identical to vLLM either way)."""
    model = _copy("ar_qwen3moe_gptq", tmp_path)
    if not dynamic:
        for file, key in (("config.json", "quantization_config"), ("quantization_config.json", None)):
            config = json.loads((model / file).read_text())
            del (config[key] if key else config)["dynamic"]
            (model / file).write_text(json.dumps(config))
    router = "model.layers.0.mlp.gate.weight"
    stored = ckpt("ar_qwen3moe_gptq")[router]
    assert stored.dtype == torch.bfloat16
    for tp in (1, 2):
        for rank in range(tp):
            state = fl.load(model, tp_size=tp, rank=rank)
            assert "model.layers.0.mlp.gate" not in state.plan.schemes
            assert {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.experts"} <= set(state.plan.schemes)
            assert not [n for n in state if n.startswith("model.layers.0.mlp.gate.") and n != router]
            assert state[router].dtype == torch.float16  # the config's dtype, as vLLM casts it
            assert torch.equal(state[router], stored.to(torch.float16))
            assert state["model.layers.0.mlp.experts.routed_experts.w13_qweight"].dtype == torch.int32


def test_modelopt_mxfp4_is_refused_as_vllm_refuses_it() -> None:
    with pytest.raises(ConfigError, match=re.escape("ModelOpt quant_algo 'mxfp4' is not supported: vLLM 0.32 supports only")):
        fl.plan(QUANT / "modelopt_qwen3moe_mxfp4", tp_size=2, rank=0)


def test_online_quantization_of_experts_is_refused() -> None:
    with pytest.raises(ConfigError, match="quantizing MoE experts while loading"):
        fl.layout(json.loads((QUANT / "llmc_qwen3moe_fp8" / "config.json").read_text()) | {"quantization_config": None},
                  tp_size=1, rank=0, quantization="fp8")


def test_an_unquantized_router_in_an_fp8_layer_names_the_ignore_list(tmp_path: Path) -> None:
    """transformers writes short names ("mlp.gate"), which vLLM does not match: refused, not cast."""
    model = _copy("hf_fp8_qwen3moe", tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "mlp.gate"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match="by its full name"):
        fl.plan(model, tp_size=1, rank=0)


@pytest.mark.parametrize("target", ["cuda-fp8", "rocm-fp8"])
@pytest.mark.parametrize("name", ["llmc_qwen3moe_fp8", "llmc_qwen3moe_fp8_block", "hf_fp8_dsv3"])
def test_fp8_expert_targets_keep_the_weights(name: str, target: str) -> None:
    """vLLM's FP8 MoE post-load processing changes the layout, never the dequantized weights
    (beyond FP8 rounding of w1/w3 requantized to their larger scale)."""
    state = fl.load(QUANT / name, tp_size=2, rank=1)
    served = fl.load(QUANT / name, tp_size=2, rank=1, target=target)
    for module in expert_modules(state):
        for before, after in zip(fl.dequantize(state, module), fl.dequantize(served, module)):
            torch.testing.assert_close(after, before, rtol=2**-3, atol=0)
        scheme = state.plan.schemes[module]
        if scheme.strategy == "tensor":
            scale = served[f"{module}.routed_experts.w13_weight_scale"]
            assert tuple(scale.shape) == (4,)
            stored = state[f"{module}.routed_experts.w13_weight_scale"].max(dim=1).values
            assert torch.equal(scale, stored * (2 if target == "rocm-fp8" else 1))
            assert served[f"{module}.routed_experts.w13_input_scale"].dim() == 0


def _copy(name: str, tmp: Path) -> Path:
    out = tmp / name
    shutil.copytree(QUANT / name, out)
    return out


def _edit(model: Path, tensor: str, change: Any) -> None:
    """Change (or with ``change=None`` remove) one tensor of a copied checkpoint."""
    index = json.loads((model / "model.safetensors.index.json").read_text())
    file = model / index["weight_map"][tensor]
    tensors = load_file(file)
    if change is None:
        del tensors[tensor]
        del index["weight_map"][tensor]
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        tensors[tensor] = change(tensors[tensor].clone())
    save_file(tensors, file, metadata={"format": "pt"})
