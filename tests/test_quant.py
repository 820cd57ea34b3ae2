"""Quantized checkpoints, end to end, against the fixtures in ``tests/fixtures/quant`` (written by
the real tools: compressed-tensors, llm-compressor, auto-round, GPTQModel, transformers, Quark).

What is checked, for every fixture and tp in (1, 2, 4), every rank:

* ``dequantize`` of each rank-local linear, reassembled over the ranks, equals an independent
  dequantization of the checkpoint (``tests/fixtures/quant/make/ref_dequant.py``: plain torch, no
  quantization library and no ``functional_load`` code).
* every raw quantized tensor / scale lands bit for bit in its rank-local slot; the expected slices
  are computed here from the layout rules written out below (vLLM's conventions), not from the plan.

Plus KV-cache scales, the reference's block-scale and packing offset examples (pure functions),
``unpack_int32`` round trips (hypothesis), and the error cases (each on a broken copy of a fixture).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import functional_load as fl
from functional_load import CheckpointError, ConfigError, PlanError, ShardingError
from functional_load.layout.parallel import Parallel
from functional_load.layout.quantized import Linear, pack_segments
from functional_load.layout.scales import Blocked
from functional_load.layout.segments import Segment
from functional_load.layout.sharding import Split
from functional_load.quant.awq import AWQ_REVERSE_ORDER, AwqScheme
from functional_load.quant.codes import unpack_int32
from functional_load.quant.gptq import GptqScheme
from functional_load.quant.pack import PackScheme

QUANT = Path(__file__).parent / "fixtures" / "quant"
# The dense (Llama) fixtures; a fixture directory is usable once it has its config.json. The MoE
# fixtures of the same directory are tested in test_quant_moe.py.
FIXTURES = sorted(
    p.parent.name for p in QUANT.glob("*/config.json") if json.loads(p.read_text())["architectures"] == ["LlamaForCausalLM"]
)
TPS = (1, 2, 4)
L0 = "model.layers.0"
INDEX = "model.safetensors.index.json"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # quant-fixtures.md 5.4: nibble k of a word holds column 8c + AWQ_ORDER[k]

# vLLM module -> (parallel style, its checkpoint parts with their shard ids)
MODULES: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    "self_attn.qkv_proj": ("column", (("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v"))),
    "mlp.gate_up_proj": ("column", (("mlp.gate_proj", 0), ("mlp.up_proj", 1))),
    "self_attn.o_proj": ("row", (("self_attn.o_proj", None),)),
    "mlp.down_proj": ("row", (("mlp.down_proj", None),)),
}


# --- the independent reference ---------------------------------------------------------------


def _import_by_path(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ref_dequant = _import_by_path("quant_fixture_ref_dequant", QUANT / "make" / "ref_dequant.py")


def test_reference_is_independent() -> None:
    source = (QUANT / "make" / "ref_dequant.py").read_text()
    assert "functional_load" not in source


@cache
def ref_weights(name: str, gptq_mode: str = "word") -> dict[str, torch.Tensor]:
    """{checkpoint linear prefix: float32 [out, in]} from the reference dequantizer, with group
    scales held in the model dtype as vLLM holds them."""
    deq = ref_dequant.dequantize(str(QUANT / name), gptq_mode, group_scale_dtype=model_dtype(name))
    return {p: w for p, (w, _) in deq.items()}


@cache
def ckpt(name: str) -> dict[str, torch.Tensor]:
    return ref_dequant.load_tensors(str(QUANT / name))


@cache
def config(name: str) -> dict[str, Any]:
    return json.loads((QUANT / name / "config.json").read_text())


@cache
def loaded(name: str, tp: int, rank: int) -> fl.LoadedState:
    return fl.load(QUANT / name, tp_size=tp, rank=rank, progress=False)


# --- geometry and the per-format layout rules (independent of functional_load's plan) -------


def geometry(name: str) -> dict[str, int]:
    c = config(name)
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    return {
        "heads": heads,
        "kv": kv,
        "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
        "hidden": c["hidden_size"],
        "inter": c["intermediate_size"],
    }


def out_rows(name: str, part_id: Any, tp: int, rank: int) -> tuple[int, int]:
    """Checkpoint output rows of one part of a column-parallel layer on ``rank`` (vLLM 1.7.4/1.7.5):
    q by heads, k/v by KV heads (replicated when tp > kv heads: rank r reads head r // replicas)."""
    g = geometry(name)
    if part_id == "q":
        per, shard = g["heads"] // tp * g["head_dim"], rank
    elif part_id in ("k", "v"):
        if tp >= g["kv"]:
            per, shard = g["head_dim"], rank // (tp // g["kv"])
        else:
            per, shard = g["kv"] // tp * g["head_dim"], rank
    else:
        per, shard = g["inter"] // tp, rank
    return shard * per, shard * per + per


def in_cols(name: str, module: str, tp: int, rank: int) -> tuple[int, int]:
    g = geometry(name)
    width = g["heads"] * g["head_dim"] if module == "self_attn.o_proj" else g["inter"]
    per = width // tp
    return rank * per, rank * per + per


def quant_format(name: str) -> dict[str, Any]:
    """Format facts from config.json + tensor names, read here without functional_load."""
    qc = config(name)["quantization_config"]
    method = qc["quant_method"]
    t = ckpt(name)
    probe = f"{L0}.mlp.down_proj"
    info: dict[str, Any] = {"method": method}
    if method == "compressed-tensors":
        group = next(iter(qc["config_groups"].values()))
        weights = group["weights"]
        info["group"] = weights.get("group_size")
        info["block"] = weights.get("block_structure")
        microscaling = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4", "mxfp8-quantized": "mxfp8"}
        if (group.get("format") or qc.get("format")) in microscaling:
            info["fmt"] = microscaling[group.get("format") or qc["format"]]
        elif f"{probe}.weight_packed" in t:
            info["fmt"] = "pack"
        elif weights["strategy"] == "block":
            info["fmt"] = "block"
        else:
            info["fmt"] = weights["strategy"]  # tensor | channel
        return info
    if method in ("gptq", "awq"):
        info.update(fmt=method, group=qc["group_size"], act_order=bool(qc.get("desc_act", False)))
        return info
    if method == "modelopt":  # quant_algo FP8: per-tensor weights and static inputs; NVFP4; MXFP8
        algo = qc["quant_algo"].upper()
        info["fmt"] = {"FP8": "tensor", "NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "MXFP8": "mxfp8"}.get(algo, "refused")
        info["group"] = 16 if info["fmt"] == "nvfp4" else 32
        return info
    if method == "quark" and qc["global_quant_config"]["weight"]["dtype"] == "fp4":
        info.update(fmt="mxfp4", group=32)
        return info
    # fp8 (transformers / vLLM per-tensor) and quark
    if f"{probe}.weight_scale_inv" in t:
        info.update(fmt="block", block=qc["weight_block_size"])
    else:
        info["fmt"] = "tensor" if t[f"{probe}.weight_scale"].numel() == 1 else "channel"
    return info


# A rule says how a loaded tensor is cut from its checkpoint part:
#   ("div", dim, unit)   rows [lo, hi) of the weight are elements [lo/unit, hi/unit) along dim
#   ("block", dim, bn)   blocks [lo // bn, lo // bn + ceil((hi - lo) / bn)) along dim
#   ("full",)            the whole tensor (replicated)
#   ("slot",)            per-tensor scale: slot i holds part i's scalar (float32)
#   ("shared",)          one copy that every part stores identically (act-order g_idx)
Rule = tuple


def rules(name: str, suffix: str) -> tuple[Rule, Rule]:
    """(column-parallel rule, row-parallel rule) of parameter ``suffix``: the loaded layout facts."""
    f = quant_format(name)
    fmt, g = f["fmt"], f.get("group")
    if fmt in ("tensor", "channel", "block"):
        if suffix == "weight":
            return ("div", 0, 1), ("div", 1, 1)
        if fmt == "tensor" or suffix == "input_scale":
            return ("slot",), ("slot",)
        if fmt == "channel":
            return ("div", 0, 1), ("full",)
        bn, bk = f["block"]
        return ("block", 0, bn), ("block", 1, bk)
    if suffix == "weight_shape":  # compressed-tensors: vLLM keeps the last part's [out, in]
        return ("last",), ("full",)
    if fmt in ("nvfp4", "mxfp4", "mxfp8"):  # VLLM_2026.md: weights and group scales split, per-tensor scales slots
        pack = 1 if fmt == "mxfp8" else 2
        group = 16 if fmt == "nvfp4" else 32
        if suffix in ("weight", "weight_packed"):
            return ("div", 0, 1), ("div", 1, pack)
        if suffix == "weight_scale":
            return ("div", 0, 1), ("div", 1, group)
        return ("slot",), ("slot",)  # weight_global_scale, input_global_scale, weight_scale_2, input_scale
    if fmt == "pack":
        return {
            "weight_packed": (("div", 0, 1), ("div", 1, 8)),
            "weight_scale": (("div", 0, 1), ("div", 1, g)),
            "weight_zero_point": (("div", 0, 8), ("div", 1, g)),
        }[suffix]
    if fmt == "gptq":
        per_group = ("full",) if f["act_order"] else ("div", 0, g)
        return {
            "qweight": (("div", 1, 1), ("div", 0, 8)),
            "qzeros": (("div", 1, 8), per_group),
            "scales": (("div", 1, 1), per_group),
            "g_idx": (("shared",), ("div", 0, 1)),
        }[suffix]
    assert fmt == "awq"
    return {
        "qweight": (("div", 1, 8), ("div", 0, 1)),
        "qzeros": (("div", 1, 8), ("div", 0, g)),
        "scales": (("div", 1, 1), ("div", 0, g)),
    }[suffix]


def cut(t: torch.Tensor, rule: Rule, lo: int, hi: int) -> torch.Tensor:
    kind = rule[0]
    if kind == "full":
        return t
    _, dim, unit = rule
    if kind == "div":
        assert lo % unit == 0 and hi % unit == 0, (lo, hi, unit)
        return t.narrow(dim, lo // unit, (hi - lo) // unit)
    assert kind == "block"
    return t.narrow(dim, lo // unit, -(-(hi - lo) // unit))


def expected_suffixes(name: str, module: str) -> set[str]:
    """Parameter suffixes of a module: what its first checkpoint part stores, less the tensors vLLM
    drops (GPTQ ``g_idx`` without act-order)."""
    prefix = f"{L0}.{MODULES[module][1][0][0]}."
    found = {k[len(prefix) :] for k in ckpt(name) if k.startswith(prefix)}
    f = quant_format(name)
    if f["fmt"] == "gptq" and not f["act_order"]:
        found.discard("g_idx")
    return found


def model_dtype(name: str) -> torch.dtype:
    c = config(name)
    return getattr(torch, c.get("dtype") or c["torch_dtype"])


def expected_dtype(name: str, suffix: str, source: torch.dtype) -> torch.dtype:
    """FP8 / int8 scales are float32 parameters (e8m0 block scales too: vLLM casts them); the
    int formats' group scales take the model dtype; packs stay int32, ``weight_shape`` int64."""
    fmt = quant_format(name)["fmt"]
    if fmt in ("tensor", "channel", "block") and suffix != "weight":
        return torch.float32
    if fmt in ("nvfp4", "mxfp4", "mxfp8"):  # as stored: uint8 / e4m3 values and scales, float32 per-tensor scales
        return source
    if suffix in ("scales", "weight_scale") and source.is_floating_point:
        return model_dtype(name)
    return source


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert torch.equal(bits(got), bits(want)), f"{what}: bits differ"


def tp_problem(name: str, tp: int) -> str | None:
    """Why ``tp`` cannot shard this fixture (the phrase the error must contain), else None."""
    g = geometry(name)
    f = quant_format(name)
    if g["heads"] % tp:
        return "attention heads"
    if g["kv"] % tp if tp < g["kv"] else tp % g["kv"]:
        return "KV heads"
    if g["inter"] % tp:
        return "output rows"
    inputs = (g["heads"] * g["head_dim"], g["inter"])  # of the row-parallel o_proj, down_proj
    if f["fmt"] in ("pack", "gptq", "awq") and not f.get("act_order") and any((width // f["group"]) % tp for width in inputs):
        return "quantization groups"
    if f["fmt"] == "block":  # vLLM's validate_fp8_block_shape, as vLLM 0.32 applies it
        bn, bk = f["block"]
        for width in inputs:  # row-parallel: every rank's input slice a whole number of blocks
            if tp > 1 and (width // tp) % bk:
                return "is not divisible by weight quantization block_k"
        for parts in (("q", "k", "v"), (0, 1)):  # column-parallel qkv_proj and gate_up_proj
            sizes = [hi - lo for lo, hi in (out_rows(name, p if p in ("q", "k", "v") else 0, tp, 0) for p in parts)]
            if f["method"] == "fp8" and any(n % bn for n in sizes):
                continue  # vLLM's fp8 config lets a merged layer off the block grid through unchecked
            total = sum(out_rows(name, p if p in ("q", "k", "v") else 0, 1, 0)[1] for p in parts)
            split = tp > 1 and total // sum(sizes) == tp  # False when KV heads are replicated
            if any(n % bn for n in (sizes if split else sizes[:-1])):
                return "is not divisible by weight quantization block_n"
    return None


# --- 1. every fixture, every tp, every rank ------------------------------------------------


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_loads_raw_slices_bit_exact_and_dequantizes(name: str, tp: int) -> None:
    if quant_format(name)["fmt"] == "refused":  # ModelOpt's mxfp4 export: vLLM 0.32 refuses its config
        with pytest.raises(ConfigError, match=re.escape("ModelOpt quant_algo 'mxfp4' is not supported: vLLM 0.32 supports only")):
            fl.load(QUANT / name, tp_size=tp, rank=0, progress=False)
        return
    problem = tp_problem(name, tp)
    if problem is not None:
        with pytest.raises(ShardingError, match=problem):
            fl.load(QUANT / name, tp_size=tp, rank=0, progress=False)
        return
    states = [loaded(name, tp, r) for r in range(tp)]
    tensors = ckpt(name)
    refs = ref_weights(name)
    for module, (style, parts) in MODULES.items():
        vname = f"{L0}.{module}"
        # (b) raw tensors and scales, bit for bit, rank by rank
        suffixes = expected_suffixes(name, module)
        for rank, state in enumerate(states):
            have = {k[len(vname) + 1 :] for k in state if k.startswith(vname + ".")}
            assert have == suffixes, f"{name} tp={tp} rank {rank} {vname}: parameters {sorted(have)}"
            for suffix in sorted(suffixes):
                got = state[f"{vname}.{suffix}"]
                sources = [tensors[f"{L0}.{p}.{suffix}"] for p, _ in parts]
                dtype = expected_dtype(name, suffix, sources[0].dtype)
                col_rule, row_rule = rules(name, suffix)
                rule = col_rule if style == "column" else row_rule
                what = f"{name} tp={tp} rank {rank} {vname}.{suffix}"
                if rule[0] == "slot":
                    want = torch.stack([s.reshape(()).to(dtype) for s in sources])
                elif rule[0] == "shared":
                    for s in sources[1:]:
                        assert torch.equal(s, sources[0])
                    want = sources[0].to(dtype)
                elif rule[0] == "last":
                    want = sources[-1].to(dtype)
                elif style == "column":
                    pieces = [cut(s, rule, *out_rows(name, pid, tp, rank)) for s, (_, pid) in zip(sources, parts)]
                    want = torch.cat(pieces, dim=rule[1]).to(dtype)
                else:
                    want = cut(sources[0], rule, *in_cols(name, module, tp, rank)).to(dtype)
                assert_bit_exact(got, want, what)
        # (a) dequantized, reassembled over the ranks, equals the reference. Same float32 products
        # in the same order (q - z as small exact integers, times the scale cast exactly to
        # float32; FP8 and e8m0 values are exact in float32), so the comparison is exact.
        deq = [fl.dequantize(state, vname) for state in states]
        for part, whole in reassemble(name, module, deq).items():
            assert torch.equal(whole, refs[f"{L0}.{part}"]), f"{name} tp={tp} {vname} part {part}"


def reassemble(name: str, module: str, deq: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """{checkpoint part: its global [out, in]} from every rank's local dequantized module: row-parallel
    ranks concatenated on the input dim; column-parallel local rows cut into q|k|v (gate|up) and put
    back at their checkpoint rows, replicated KV heads checked equal across the ranks sharing them."""
    style, parts = MODULES[module]
    tp = len(deq)
    for d in deq:
        assert d.dtype == torch.float32
    if style == "row":
        return {parts[0][0]: torch.cat(deq, dim=1)}
    out = {}
    for part, pid in parts:
        width = deq[0].shape[1]
        glued: torch.Tensor | None = None
        for rank, d in enumerate(deq):
            offset = 0
            for _, other in parts:
                lo, hi = out_rows(name, other, tp, rank)
                if other == pid:
                    rows = d[offset : offset + hi - lo]
                    if glued is None:
                        total = max(out_rows(name, pid, tp, r)[1] for r in range(tp))
                        glued = torch.full((total, width), float("nan"))
                    already = glued[lo:hi]
                    if not torch.isnan(already).all():
                        assert torch.equal(already, rows), f"{name} tp={tp} rank {rank} {part}: replicas differ"
                    glued[lo:hi] = rows
                offset += hi - lo
            assert offset == d.shape[0], f"{name} tp={tp} rank {rank} {module}: {d.shape[0]} local rows, expected {offset}"
        assert glued is not None
        out[part] = glued
    return out


@pytest.mark.parametrize("name", FIXTURES)
def test_tp_that_does_not_divide_says_why(name: str) -> None:
    """tp = twice the attention heads (8 over 4, 16 over 8): a ShardingError that names the heads and the tp."""
    if quant_format(name)["fmt"] == "refused":
        return  # refused at its config (test_fixture_loads_raw_slices_bit_exact_and_dequantizes)
    heads = geometry(name)["heads"]
    tp = 2 * heads
    assert tp_problem(name, tp) is not None
    with pytest.raises(ShardingError) as info:
        fl.load(QUANT / name, tp_size=tp, rank=0, progress=False)
    assert f"{heads} attention heads" in str(info.value) and f"tp={tp}" in str(info.value)


def test_reference_fixtures_cover_every_format() -> None:
    """The matrix above is only as good as the fixtures it runs on."""
    formats = {quant_format(n)["fmt"] for n in FIXTURES}
    assert {"tensor", "channel", "block", "pack", "gptq", "awq", "nvfp4", "mxfp4", "mxfp8", "refused"} <= formats, formats


# --- 2. KV-cache scales ----------------------------------------------------------------------

K_SCALE, V_SCALE = f"{L0}.self_attn.attn.k_scale", f"{L0}.self_attn.attn.v_scale"
KV_SOURCES = {  # fixture -> checkpoint names of its k and v scales
    "llmc_fp8_kv": (f"{L0}.self_attn.k_scale", f"{L0}.self_attn.v_scale"),
    "quark_fp8": (f"{L0}.self_attn.k_scale", f"{L0}.self_attn.v_scale"),
    "quark_native_kv": (f"{L0}.self_attn.k_proj.output_scale", f"{L0}.self_attn.v_proj.output_scale"),
}
# The attention layer's KV-cache parameters as each vLLM 0.32 quantization method creates them:
# name -> (shape, dtype (None: the model dtype), the value it keeps when the checkpoint lacks it).
# compressed-tensors: CompressedTensorsKVCacheMethod; fp8 / quark: BaseKVCacheMethod (-1.0 means
# "not in the checkpoint" to its process_weights_after_loading); GPTQ / AWQ: none.
_BASE_KV = {f"{n}_scale": ((), None, -1.0) for n in ("q", "k", "v", "prob")}
KV_PARAMS: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype | None, float]]] = {
    "compressed-tensors": {
        **{f"{n}_scale": ((1,), torch.float32, 1.0) for n in ("k", "v", "q")},
        **{f"{n}_zero_point": ((1,), None, 0.0) for n in ("k", "v", "q")},
    },
    "fp8": _BASE_KV,
    "quark": _BASE_KV,
    "modelopt": _BASE_KV,  # VLLM_2026.md: attn.{q,k,v}_scale and prob_scale, never written without a KV-cache scheme
    "gptq": {},
    "awq": {},
}


def _kv(state: fl.LoadedState, name: str) -> dict[str, torch.Tensor]:
    """The attention KV-cache parameters of layer 0, checked against the method's manifest."""
    prefix = f"{L0}.self_attn.attn."
    have = {k[len(prefix) :]: t for k, t in state.items() if k.startswith(prefix)}
    manifest = KV_PARAMS[quant_format(name)["method"]]
    assert set(have) == set(manifest), f"{name}: KV-cache parameters {sorted(have)}"
    for param, (shape, dtype, _) in manifest.items():
        assert tuple(have[param].shape) == shape, f"{name} {param}: shape {tuple(have[param].shape)}"
        assert have[param].dtype == (dtype or model_dtype(name)), f"{name} {param}: {have[param].dtype}"
    return have


@pytest.mark.parametrize("name", [n for n in FIXTURES if tp_problem(n, 1) is None and quant_format(n)["fmt"] != "refused"])
def test_kv_cache_scales(name: str) -> None:
    manifest = KV_PARAMS[quant_format(name)["method"]]
    for tp in [tp for tp in (1, 2) if tp_problem(name, tp) is None]:
        for rank in range(tp):
            kv = _kv(loaded(name, tp, rank), name)
            sources = dict(zip(("k_scale", "v_scale"), KV_SOURCES.get(name, ())))
            for param, (shape, _dtype, absent) in manifest.items():
                got = kv[param]
                if param in sources:  # the calibrated value, cast to the parameter's dtype as vLLM copies it
                    want = ckpt(name)[sources[param]].reshape(shape).to(got.dtype)
                    assert_bit_exact(got, want, f"{name} {param}")
                    assert float(got.reshape(-1)[0]) not in (1.0, -1.0)  # a real value, not a default
                else:
                    assert torch.equal(got, torch.full(shape, absent, dtype=got.dtype)), f"{name} {param}: {got}"


def test_kv_fixture_list_matches_checkpoints() -> None:
    with_kv = {n for n in FIXTURES if any(k.endswith(("k_scale", "k_proj.output_scale")) for k in ckpt(n))}
    assert with_kv == set(KV_SOURCES) & set(FIXTURES)


# --- helpers that edit a copy of a fixture ---------------------------------------------------


def edited_copy(name: str, tmp_path: Path, edits: dict[str, torch.Tensor | None] | None = None,
                rename: dict[str, str] | None = None, config_edit: Callable[[dict], None] | None = None) -> Path:
    """A copy of fixture ``name`` with tensors replaced (a tensor), deleted (None), renamed, or
    added (a new name in ``edits``: written to the first shard); the index is kept consistent."""
    dst = tmp_path / name
    shutil.copytree(QUANT / name, dst)
    edits, rename = dict(edits or {}), dict(rename or {})
    shards = sorted(dst.glob("*.safetensors"))
    contents = {}
    for shard in shards:
        with safe_open(shard, "pt") as fh:
            contents[shard] = (fh.metadata() or {}, {k: fh.get_tensor(k) for k in fh.keys()})
    existing = {k for _, tensors in contents.values() for k in tensors}
    unknown = (set(rename) | {k for k, v in edits.items() if v is None}) - existing
    assert not unknown, f"cannot delete or rename tensors that {name} does not have: {sorted(unknown)}"
    added = {k: v for k, v in edits.items() if k not in existing}
    placed: dict[str, str] = {}
    for i, shard in enumerate(shards):
        metadata, tensors = contents[shard]
        out: dict[str, torch.Tensor] = {}
        for key, value in tensors.items():
            value = edits.get(key, value)
            if value is not None:
                out[rename.get(key, key)] = value
        if i == 0:
            out.update(added)
        save_file(out, shard, metadata={**metadata, "format": "pt"})
        placed.update({k: shard.name for k in out})
    index = dst / INDEX
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = dict(sorted(placed.items()))
        index.write_text(json.dumps(data, indent=2))
    if config_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def test_only_k_scale_present_leaves_v_at_vllm_value(tmp_path: Path) -> None:
    """vLLM loads only what the checkpoint has: v_scale keeps its created value (1.0 for
    compressed-tensors); duplicating k into v is its process_weights_after_loading's job."""
    k_name, v_name = KV_SOURCES["llmc_fp8_kv"]
    d = edited_copy("llmc_fp8_kv", tmp_path, edits={v_name: None})
    want = ckpt("llmc_fp8_kv")[k_name].float()
    for tp in (1, 2):
        for rank in range(tp):
            kv = _kv(fl.load(d, tp_size=tp, rank=rank, progress=False), "llmc_fp8_kv")
            assert_bit_exact(kv["k_scale"], want, "k_scale")
            assert torch.equal(kv["v_scale"], torch.ones(1)), kv["v_scale"]


@pytest.mark.parametrize("drop_v", [False, True])
def test_deprecated_kv_scale_name_maps_to_k_scale(tmp_path: Path, drop_v: bool) -> None:
    """DERIVED: no CPU tool writes ``.kv_scale`` (quant-fixtures.md 5.7), so this renames a real
    fixture's ``self_attn.k_scale`` to ``self_attn.kv_scale`` (vLLM: kv_scale -> attn.k_scale)."""
    k_name, v_name = KV_SOURCES["llmc_fp8_kv"]
    kv_name = k_name.replace("k_scale", "kv_scale")
    d = edited_copy("llmc_fp8_kv", tmp_path, edits={v_name: None} if drop_v else None, rename={k_name: kv_name})
    kv = _kv(fl.load(d, progress=False), "llmc_fp8_kv")
    assert_bit_exact(kv["k_scale"], ckpt("llmc_fp8_kv")[k_name].float(), "k_scale from kv_scale")
    want_v = torch.ones(1) if drop_v else ckpt("llmc_fp8_kv")[v_name].float()
    assert_bit_exact(kv["v_scale"], want_v, "v_scale")


def test_fused_on_disk_per_tensor_scale_fills_every_slot(tmp_path: Path) -> None:
    """A per-tensor scale stored once for the fused module fills all of its slots (vLLM v2 path)."""
    parts = ("q_proj", "k_proj", "v_proj")
    fused = torch.tensor([0.03125], dtype=torch.bfloat16)
    edits: dict[str, torch.Tensor | None] = {f"{L0}.self_attn.{p}.weight_scale": None for p in parts}
    edits[f"{L0}.self_attn.qkv_proj.weight_scale"] = fused
    d = edited_copy("ct_fp8_tensor", tmp_path, edits=edits)
    for rank in range(2):
        state = fl.load(d, tp_size=2, rank=rank, progress=False)
        assert_bit_exact(state[f"{L0}.self_attn.qkv_proj.weight_scale"], torch.full((3,), 0.03125), "fused scale slots")
        w = state[f"{L0}.self_attn.qkv_proj.weight"].float() * 0.03125
        assert torch.equal(fl.dequantize(state, f"{L0}.self_attn.qkv_proj"), w)


# --- 3. reference 2.3: block-scale and packing offsets (pure functions) ----------------------


def _pieces(pieces) -> list[tuple[Any, tuple[int, int], tuple[int, int]]]:
    return [(p.segment, p.src, p.dst) for p in pieces]


@pytest.mark.parametrize("rank", range(8))
def test_block_scale_rows_merged_gate_up(rank: int) -> None:
    """gate_up 18432 global per part at tp=8, bn=128: per rank 2304 rows -> 18 scale rows per shard,
    at offsets 0 and 18 (param ceil(4608/128) = 36 rows); the checkpoint rows read are 18r.. of each."""
    blocked = Blocked(Split(0, (Segment(0, 18432), Segment(1, 18432))), 128)
    assert _pieces(blocked.pieces(Parallel(8, rank), fused=False)) == [
        (0, (18 * rank, 18 * rank + 18), (0, 18)),
        (1, (18 * rank, 18 * rank + 18), (18, 36)),
    ]
    assert blocked.local_shape((288, 56), Parallel(8, rank)) == (36, 56)


@pytest.mark.parametrize("rank", range(8))
def test_block_scale_rows_qkv_2_1(rank: int) -> None:
    """2.1 (heads 32, kv 8, head_dim 128, tp 8): per rank q 512, k 128, v 128 -> scale rows
    (4, off 0), (1, off 4), (1, off 5); 6 rows; checkpoint k-scale row read: r."""
    split = Split(0, (Segment("q", 32, 128), Segment("k", 8, 128, replicate=True), Segment("v", 8, 128, replicate=True)))
    assert _pieces(Blocked(split, 128).pieces(Parallel(8, rank), fused=False)) == [
        ("q", (4 * rank, 4 * rank + 4), (0, 4)),
        ("k", (rank, rank + 1), (4, 5)),
        ("v", (rank, rank + 1), (5, 6)),
    ]
    # fused on disk (one scale tensor for q|k|v): the same rows, offset by the parts before them
    assert _pieces(Blocked(split, 128).pieces(Parallel(8, rank), fused=True)) == [
        ("q", (4 * rank, 4 * rank + 4), (0, 4)),
        ("k", (32 + rank, 33 + rank), (4, 5)),
        ("v", (40 + rank, 41 + rank), (5, 6)),
    ]


@pytest.mark.parametrize("rank", range(8))
def test_packing_offsets_merged_gate_up(rank: int) -> None:
    """2.3 packing: per-rank shard 1792 rows with pack factor 8 -> 224, offsets 0 and 224."""
    packed = pack_segments((Segment(0, 14336), Segment(1, 14336)), 8)
    assert [s.rows for s in packed] == [1792, 1792]
    assert _pieces(Split(1, packed).pieces(Parallel(8, rank))) == [
        (0, (224 * rank, 224 * rank + 224), (0, 224)),
        (1, (224 * rank, 224 * rank + 224), (224, 448)),
    ]
    # the same through a scheme manifest: AWQ qweight [in, out/8] of a merged layer
    linear = Linear("merged", 4096, (Segment(0, 14336, label="output rows"), Segment(1, 14336, label="output rows")))
    scheme = AwqScheme(bits=4, group_size=128)
    qweight = {p.suffix: p.sharding for p in scheme.linear_params(linear, "float16")}["qweight"]
    assert isinstance(qweight, Split) and qweight.dim == 1
    assert _pieces(qweight.pieces(Parallel(8, rank)))[1] == (1, (224 * rank, 224 * rank + 224), (224, 448))


def test_packing_of_qkv_heads() -> None:
    """Packed by 8 rows, q/k/v keep head units (128 -> 16), so KV-head replication still works."""
    segs = (Segment("q", 32, 128), Segment("k", 4, 128, replicate=True), Segment("v", 4, 128, replicate=True))
    packed = pack_segments(segs, 8)
    assert [(s.count, s.unit, s.replicate) for s in packed] == [(32, 16, False), (4, 16, True), (4, 16, True)]
    assert _pieces(Split(1, packed).pieces(Parallel(8, 3))) == [
        ("q", (192, 256), (0, 64)),
        ("k", (16, 32), (64, 80)),
        ("v", (16, 32), (80, 96)),
    ]


def test_block_cut_crossing_a_block_raises_vllm_wording_row() -> None:
    """Row-parallel input 384 at tp=2, bk=128: rank 1 holds columns 192:384, which start inside
    block 1 and cross into block 2."""
    blocked = Blocked(Split(1, (Segment(0, 384, label="input columns"),)), 128)
    with pytest.raises(ShardingError, match="input_size_per_partition = 192 is not divisible by weight quantization block_k = 128"):
        blocked.pieces(Parallel(2, 1), fused=False)


def test_block_cut_crossing_a_block_raises_vllm_wording_column() -> None:
    blocked = Blocked(Split(0, (Segment(0, 384),)), 128)
    with pytest.raises(ShardingError, match="output_partition_size = 192 is not divisible by weight quantization block_n = 128"):
        blocked.pieces(Parallel(2, 1), fused=False)


@pytest.mark.parametrize("dim", [0, 1])
def test_block_cut_inside_one_block_keeps_that_blocks_scale(dim: int) -> None:
    """256 wide at tp=4, block 128: every slice (64) lies inside one block, so ranks 0 and 1 keep
    scale block 0, ranks 2 and 3 block 1 (vLLM refuses this shape; functional_load loads it)."""
    blocked = Blocked(Split(dim, (Segment(0, 256),)), 128)
    for rank in range(4):
        assert _pieces(blocked.pieces(Parallel(4, rank), fused=False)) == [(0, (rank // 2, rank // 2 + 1), (0, 1))]


def test_block_cut_crossing_a_block_in_a_real_layout(tmp_path: Path) -> None:
    """hf_fp8_block with intermediate_size 384: at tp=2, gate/up (192 rows per rank) and down_proj
    (192 input columns per rank) cannot keep block-aligned scales; the layout says so in vLLM's words."""
    d = edited_copy("hf_fp8_block", tmp_path, config_edit=lambda c: c.update(intermediate_size=384))
    with pytest.raises(ShardingError) as info:
        fl.load(d, tp_size=2, rank=1, progress=False)
    message = str(info.value)
    assert "output_partition_size = 192 is not divisible by weight quantization block_n = 128" in message
    assert "input_size_per_partition = 192 is not divisible by weight quantization block_k = 128" in message


@pytest.mark.parametrize(("name", "tp"), [("hf_fp8_block", 2), ("hf_fp8_block_ue8m0", 2)])
def test_cut_inside_a_single_block_loads_right_scale_rows(name: str, tp: int) -> None:
    """Slices that start inside a block but stay in it: k/v of these shapes at tp 2 (64 rows of a
    128-row block; vLLM's fp8 config lets such a merged layer through its block check, then
    crashes loading it, see docs/parity.md). Every rank keeps the scale row of its block."""
    scale = "weight_scale_inv" if name.startswith("hf_") else "weight_scale"
    bn, bk = 128, 128
    tensors = ckpt(name)
    refs = ref_weights(name)
    starts_inside = False
    for rank in range(tp):
        state = loaded(name, tp, rank)
        got = state[f"{L0}.self_attn.qkv_proj.{scale}"]
        rows = []
        for part, pid in MODULES["self_attn.qkv_proj"][1]:
            lo, hi = out_rows(name, pid, tp, rank)
            assert lo // bn == (hi - 1) // bn  # inside one block (or aligned, single block)
            starts_inside |= lo % bn != 0
            rows.append(tensors[f"{L0}.{part}.{scale}"][lo // bn])
        assert_bit_exact(got, torch.stack(rows).to(got.dtype), f"{name} rank {rank} qkv scale rows")
        lo, hi = in_cols(name, "mlp.down_proj", tp, rank)
        down = state[f"{L0}.mlp.down_proj.{scale}"]
        assert down.shape[1] == -(-(hi - lo) // bk)
        assert_bit_exact(down, tensors[f"{L0}.mlp.down_proj.{scale}"][:, lo // bk : lo // bk + down.shape[1]].to(down.dtype), "down scale")
        w = fl.dequantize(state, f"{L0}.mlp.down_proj")
        assert torch.equal(w, refs[f"{L0}.mlp.down_proj"][:, lo:hi])
    assert starts_inside


# --- 4. unpack_int32 round trips (hypothesis) -------------------------------------------------


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The test's own packer: ``32 // bits`` unsigned fields per int32 along ``dim``, LSB first;
    with ``order``, field k of word c holds element ``pf * c + order[k]`` (AWQ)."""
    pf = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // pf, pf)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for k in range(pf):
        element = order[k] if order is not None else k
        word |= v[..., element] << (bits * k)
    word = torch.where(word >= 2**31, word - 2**32, word)  # reinterpret as signed int32
    return word.to(torch.int32).movedim(-1, dim)


@settings(max_examples=60, deadline=None)
@given(
    bits_=st.sampled_from([2, 4, 8]),
    dim=st.sampled_from([0, 1]),
    rows=st.integers(1, 5),
    words=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_unpack_int32_round_trip(bits_: int, dim: int, rows: int, words: int, seed: int) -> None:
    pf = 32 // bits_
    gen = torch.Generator().manual_seed(seed)
    shape = [rows, rows]
    shape[dim] = words * pf
    values = torch.randint(0, 1 << bits_, tuple(shape), generator=gen)
    values.view(-1)[0] = (1 << bits_) - 1  # the top field sets the int32 sign bit somewhere
    packed = pack_int32(values, bits_, dim)
    assert packed.dtype == torch.int32
    assert torch.equal(unpack_int32(packed, bits_, dim), values)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), words=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_unpack_int32_awq_interleave_round_trip(rows: int, words: int, seed: int) -> None:
    values = torch.randint(0, 16, (rows, words * 8), generator=torch.Generator().manual_seed(seed))
    packed = pack_int32(values, 4, 1, AWQ_ORDER)
    assert torch.equal(unpack_int32(packed, 4, 1, interleave=AWQ_REVERSE_ORDER), values)


def test_unpack_int32_known_words() -> None:
    words = torch.tensor([[0x76543210, -0x789ABCE0]], dtype=torch.int32)  # -0x789ABCE0 == 0x87654320
    assert unpack_int32(words, 4, 1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 3, 4, 5, 6, 7, 8]]
    # AWQ: field k (value k here) holds column AWQ_ORDER[k], so column c reads the field k with
    # AWQ_ORDER[k] == c: columns [0, 4, 1, 5, 2, 6, 3, 7]
    assert unpack_int32(words[:, :1], 4, 1, interleave=AWQ_REVERSE_ORDER).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]


@pytest.mark.parametrize(("name", "tensor", "dim", "order"), [
    ("gptq_v2", "self_attn.q_proj.qweight", 0, None),
    ("awq_gemm", "self_attn.q_proj.qweight", 1, AWQ_ORDER),
    ("ct_w4a16_asym", "self_attn.q_proj.weight_packed", 1, None),
    ("ct_w4a16_asym", "self_attn.q_proj.weight_zero_point", 0, None),
])
def test_repacking_real_checkpoint_words_gives_them_back(name: str, tensor: str, dim: int, order) -> None:
    assert name in FIXTURES, f"fixture {name} is missing from tests/fixtures/quant"
    words = ckpt(name)[f"{L0}.{tensor}"]
    interleave = AWQ_REVERSE_ORDER if order else None
    assert torch.equal(pack_int32(unpack_int32(words, 4, dim, interleave), 4, dim, order), words)


# --- 5. errors --------------------------------------------------------------------------------


def test_missing_weight_scale_is_a_plan_error(tmp_path: Path) -> None:
    missing = f"{L0}.mlp.down_proj.weight_scale"
    d = edited_copy("ct_fp8_tensor", tmp_path, edits={missing: None})
    with pytest.raises(PlanError) as info:
        fl.plan(d)
    assert missing in str(info.value)
    assert "not initialized" in str(info.value)


BAD_SCALES = [  # (fixture, checkpoint tensor, index to poison, loaded parameter)
    ("ct_fp8_tensor", f"{L0}.self_attn.k_proj.weight_scale", (0,), f"{L0}.self_attn.qkv_proj.weight_scale"),
    ("ct_fp8_tensor", f"{L0}.self_attn.o_proj.input_scale", (0,), f"{L0}.self_attn.o_proj.input_scale"),
    ("quark_fp8", f"{L0}.mlp.up_proj.weight_scale", (), f"{L0}.mlp.gate_up_proj.weight_scale"),
    ("ct_fp8_channel", f"{L0}.mlp.down_proj.weight_scale", (5, 0), f"{L0}.mlp.down_proj.weight_scale"),
    ("hf_fp8_block", f"{L0}.mlp.gate_proj.weight_scale_inv", (1, 0), f"{L0}.mlp.gate_up_proj.weight_scale_inv"),
    ("hf_fp8_block", f"{L0}.self_attn.v_proj.weight_scale_inv", (0, 0), f"{L0}.self_attn.qkv_proj.weight_scale_inv"),
    ("llmc_fp8_kv", f"{L0}.self_attn.k_scale", (0,), K_SCALE),
]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -0.5], ids=["nan", "inf", "zero", "negative"])
@pytest.mark.parametrize(("name", "tensor", "index", "param"), BAD_SCALES, ids=[f"{b[0]}:{b[1].split('.', 3)[-1]}" for b in BAD_SCALES])
def test_bad_fp8_scale_is_a_checkpoint_error(tmp_path: Path, name: str, tensor: str, index: tuple, param: str, value: float) -> None:
    bad = ckpt(name)[tensor].clone()
    bad[index] = value
    d = edited_copy(name, tmp_path, edits={tensor: bad})
    fl.plan(d)  # the plan reads no data: the bad value is found at load
    with pytest.raises(CheckpointError) as info:
        fl.load(d, progress=False)
    message = str(info.value)
    assert param in message and tensor in message


WRONG_SHAPES = [  # (fixture, checkpoint tensor, wrong shape, parameter, right shape)
    ("ct_fp8_channel", f"{L0}.self_attn.q_proj.weight_scale", (127, 1), f"{L0}.self_attn.qkv_proj.weight_scale", [128, 1]),
    ("hf_fp8_block", f"{L0}.mlp.down_proj.weight_scale_inv", (2, 3), f"{L0}.mlp.down_proj.weight_scale_inv", [2, 4]),
    ("hf_fp8_block", f"{L0}.mlp.up_proj.weight_scale_inv", (3, 2), f"{L0}.mlp.gate_up_proj.weight_scale_inv", [4, 2]),
    ("ct_fp8_tensor", f"{L0}.mlp.gate_proj.weight_scale", (2,), f"{L0}.mlp.gate_up_proj.weight_scale", [1]),
    ("gptq_v2", f"{L0}.self_attn.o_proj.scales", (3, 128), f"{L0}.self_attn.o_proj.scales", [4, 128]),
    ("ct_w4a16_asym", f"{L0}.self_attn.k_proj.weight_zero_point", (16, 4), f"{L0}.self_attn.qkv_proj.weight_zero_point", [8, 4]),
]


@pytest.mark.parametrize(
    ("name", "tensor", "shape", "param", "want"), WRONG_SHAPES, ids=[w[0] + ":" + w[1].split(".")[-2] for w in WRONG_SHAPES]
)
def test_wrong_scale_shape_is_a_plan_error(tmp_path: Path, name: str, tensor: str, shape: tuple, param: str, want: list) -> None:
    original = ckpt(name)[tensor]
    d = edited_copy(name, tmp_path, edits={tensor: torch.ones(shape, dtype=original.dtype)})
    with pytest.raises(PlanError) as info:
        fl.plan(d)
    message = str(info.value)
    assert tensor in message and param in message
    assert str(list(shape)) in message and str(want) in message


@pytest.mark.parametrize("name", ["gptq_v2", "gptq_v1", "awq_gemm", "ct_w4a16_asym", "ct_w4a16_sym"])
def test_quantization_groups_that_do_not_divide_over_tp(name: str) -> None:
    """o_proj: 128 inputs in groups of 32 = 4 groups, which cannot be split over tp=8."""
    assert name in FIXTURES, f"fixture {name} is missing from tests/fixtures/quant"
    with pytest.raises(ShardingError) as info:
        fl.plan(QUANT / name, tp_size=8, rank=0)
    message = str(info.value)
    assert "4 quantization groups" in message and "tp=8" in message
    assert "self_attn.o_proj" in message


def test_quantization_groups_unit() -> None:
    """The same, on the scheme manifests alone: row-parallel group tensors of 4 groups at tp=8."""
    linear = Linear("row", 128, (Segment(0, 128, label="output rows"),))
    grouped = {
        GptqScheme(4, 32, symmetric=False): ("qzeros", "scales"),
        AwqScheme(4, 32, symmetric=False): ("qzeros", "scales"),
        PackScheme(4, 32, symmetric=False): ("weight_scale", "weight_zero_point"),
    }
    for scheme, suffixes in grouped.items():
        params = {p.suffix: (p.shape, p.sharding) for p in scheme.linear_params(linear, "bfloat16")}
        for suffix in suffixes:
            shape, sharding = params[suffix]
            with pytest.raises(ShardingError, match="4 quantization groups"):
                sharding.local_shape(shape, Parallel(8, 0))
            assert 1 in sharding.local_shape(shape, Parallel(4, 0))  # one group per rank at tp=4


def _set(path: list[str], value: Any) -> Callable[[dict], None]:
    def edit(cfg: dict) -> None:
        node = cfg["quantization_config"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


@pytest.mark.parametrize(("name", "edit", "words"), [
    ("ct_fp8_tensor", _set(["quant_method"], "bitsandbytes"), ["'bitsandbytes'", "not supported"]),
    ("hf_fp8_block", _set(["weight_scale_semantics"], "inverse"), ["inverse", "weight_scale_inv"]),
    (
        "ct_fp8_tensor",
        _set(["ignore"], ["lm_head", f"{L0}.self_attn.q_proj"]),
        [f"{L0}.self_attn.qkv_proj", f"{L0}.self_attn.q_proj", "ignore"],
    ),
    ("hf_fp8_block", _set(["modules_to_not_convert"], ["lm_head", f"{L0}.mlp.up_proj"]), [f"{L0}.mlp.gate_up_proj", f"{L0}.mlp.up_proj"]),
], ids=["unsupported-method", "gptqmodel-fp8-inverse", "qkv-partly-ignored", "gate-up-partly-ignored"])
def test_config_errors(tmp_path: Path, name: str, edit: Callable[[dict], None], words: list[str]) -> None:
    d = edited_copy(name, tmp_path, config_edit=edit)
    with pytest.raises(ConfigError) as info:
        fl.plan(d)
    for word in words:
        assert word in str(info.value)


def test_ignoring_every_part_of_a_fused_layer_is_fine(tmp_path: Path) -> None:
    """The control for the partly-ignored case: q, k and v all ignored is a consistent config
    (the load then fails only because the tensors are FP8, not because of the ignore list)."""
    parts = [f"{L0}.self_attn.{p}_proj" for p in "qkv"]
    d = edited_copy("ct_fp8_tensor", tmp_path, config_edit=_set(["ignore"], ["lm_head", *parts]))
    with pytest.raises(PlanError) as info:
        fl.plan(d)
    assert f"{L0}.self_attn.q_proj.weight_scale" in str(info.value) and "no destination" in str(info.value)


def test_act_order_g_idx_parts_that_differ(tmp_path: Path) -> None:
    q, k = f"{L0}.self_attn.q_proj.g_idx", f"{L0}.self_attn.k_proj.g_idx"
    edited = ckpt("gptq_actorder")[k].clone()
    edited[[0, 1]] = edited[[1, 0]] if edited[0] != edited[1] else edited[[0, 1]] + 1
    assert not torch.equal(edited, ckpt("gptq_actorder")[k])
    d = edited_copy("gptq_actorder", tmp_path, edits={k: edited})
    fl.plan(d, tp_size=2, rank=1)  # names and shapes are fine: found when the bytes are read
    with pytest.raises(CheckpointError) as info:
        fl.load(d, tp_size=2, rank=1, progress=False)
    message = str(info.value)
    assert q in message and k in message and f"{L0}.self_attn.qkv_proj.g_idx" in message


def test_act_order_fixture_really_is_act_order() -> None:
    g_idx = ckpt("gptq_actorder")[f"{L0}.mlp.down_proj.g_idx"].long()
    assert not torch.equal(g_idx, torch.arange(g_idx.numel()) // config("gptq_actorder")["quantization_config"]["group_size"])


# --- 6. GPTQ v1 with a true zero of 0 --------------------------------------------------------


@pytest.mark.parametrize("tp", TPS)
def test_gptq_v1_zero0_adds_0x11111111_to_whole_words(tp: int) -> None:
    name = "gptq_v1_zero0"
    assert name in FIXTURES, f"fixture {name} is missing from tests/fixtures/quant"
    tensors = ckpt(name)
    # A true zero of 0 is stored as -1 (nibble 0xF) with a borrow from the next field: the fixture has some.
    assert any(
        bool((unpack_int32(t, 4, 1) == 0xF).any()) for k, t in tensors.items() if k.endswith(".qzeros")
    )
    word, field = ref_weights(name, "word"), ref_weights(name, "field")
    # ... so per-field +1 (what vLLM's v1 GPTQ kernels do) gives a different, wrong weight
    assert any(not torch.equal(word[p], field[p]) for p in word)
    for module in MODULES:
        deq = [fl.dequantize(loaded(name, tp, r), f"{L0}.{module}") for r in range(tp)]
        for part, whole in reassemble(name, module, deq).items():
            assert torch.equal(whole, word[f"{L0}.{part}"]), f"{module} {part}"


def test_gptq_dynamic_rules_leave_modules_unquantized_as_vllm_matches_them():
    """GPTQ's ``dynamic`` "-:" rules (auto-round writes one for the Qwen3-MoE router) are matched
    on vLLM's module names: the module is built unquantized even with no checkpoint to learn the
    dtypes from (a dummy load); overrides of bits or group size are refused, not ignored."""
    from functional_load.quant.gptq import dynamic_skips, parse_gptq

    base = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True}
    quant = parse_gptq({**base, "dynamic": {r"-:.*model\.layers\.0\.mlp\.gate.*": {}}})
    assert quant.scheme_for("model.layers.0.mlp.gate", ["model.layers.0.mlp.gate"]) is None
    assert quant.scheme_for("model.layers.1.mlp.gate", ["model.layers.1.mlp.gate"]) is not None
    # vLLM matches the fused module's own name: gate_up_proj matches ".*mlp\.gate.*" as a whole
    assert quant.scheme_for("model.layers.0.mlp.gate_up_proj", ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]) is None
    with pytest.raises(ConfigError, match="per-module GPTQ overrides are not supported"):
        dynamic_skips({r"+:.*down_proj.*": {"bits": 8}})
    with pytest.raises(ConfigError, match="follows the positive rule"):
        dynamic_skips({r"+:.*q_proj.*": {}, r"-:.*mlp.*": {}})
    assert dynamic_skips({r"+:.*q_proj.*": {}}) == ()
    plan = fl.plan(QUANT / "ar_qwen3moe_gptq", load_format="dummy")  # no headers read: the rule alone decides
    assert "model.layers.0.mlp.gate.weight" in {p.spec.name for p in plan.params}
    assert "model.layers.0.mlp.gate.qweight" not in {p.spec.name for p in plan.params}
