"""Structured fuzzing of ``quantization_config`` (reliability.md §1.4, §4).

``test_fuzz.py`` swaps whole config values; here Hypothesis edits the *inside* of each real
quantization_config of the Llama fixtures in ``tests/fixtures/quant`` (fp8 ``weight_block_size``,
compressed-tensors ``config_groups`` / ``weights`` / ``input_activations`` / ``kv_cache_scheme``,
GPTQ / AWQ fields, Quark ``global_quant_config``...): a nested leaf replaced by a hostile value, a
key deleted, an unknown (or misplaced known) key added, a container's type changed. Then
``functional_load.layout(config, tp_size=t, rank=0)`` for t in (1, 2, 4) must either succeed or
raise a :class:`LoadError` with a message; any other exception fails the example.

Examples are derandomized (reproducible, CI-stable). For a longer hunt:
``FL_FUZZ_EXAMPLES=5000 FL_FUZZ_RANDOM=1``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_load as fl
from functional_load.errors import ConfigError, LoadError

QUANT = Path(__file__).parent / "fixtures" / "quant"
FIXTURES = {
    p.parent.name: json.loads(p.read_text())
    for p in sorted(QUANT.glob("*/config.json"))
    if json.loads(p.read_text()).get("architectures") == ["LlamaForCausalLM"]
}
TPS = (1, 2, 4)

FUZZ = settings(
    max_examples=int(os.environ.get("FL_FUZZ_EXAMPLES", "600")),
    deadline=None,
    derandomize=not os.environ.get("FL_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Values that broke (or could break) a parser that trusts the config's types.
HOSTILE: list[Any] = [
    0, -1, 1, 2, 3, 4, 8, 16, 32, 64, 128, 2**31, 2**63, 2**64, -(2**64), 1.5, 0.0, -0.0, 128.0,
    math.inf, -math.inf, math.nan, True, False, None, "", "x", "8", "128", "-1",
    [], {}, [0], [0, 128], [128, 0], [128], [1, 2, 3], [128, 128, 128], [-128, 128], [1.5, 128],
    [True, 128], [None, None], ["128", "128"], [[128], [128]], [2**64, 128], [1, 1], [7, 3],
    {"a": 1}, {"a": {"b": {"c": None}}}, {"weights": {}}, [{}], [[]],
    # domain values: reach deeper code than random junk does
    "tensor", "channel", "group", "block", "token", "float", "int", "static", "dynamic", "Linear",
    "re:.*", "re:(", "re:.*proj", "lm_head", "model.layers.0.self_attn.q_proj", ["Linear"], ["re:("],
    ["lm_head", 0], [None], [["lm_head"]], "fp8", "gptq", "awq", "compressed-tensors", "quark",
    "auto-round", "pack-quantized", "float-quantized", "int-quantized", "naive-quantized", "gemm",
    "gemv", "gptq_v2", "fp8_e4m3", "per_tensor", "per_channel", "per_group", "ue8m0", "inverse",
]
# Keys to add: unknown ones, and known ones in the wrong place.
ADDED_KEYS = [
    "unknown_key", "", "weight_block_size", "group_size", "block_structure", "strategy", "dynamic",
    "format", "targets", "config_groups", "ignore", "actorder", "type", "num_bits", "bits", "qscheme",
    "dtype", "weight", "input_tensors", "kv_cache_scheme", "desc_act", "sym", "checkpoint_format",
    "zero_point", "version", "packing_format", "activation_scheme", "quant_method",
    "modules_to_not_convert", "ignored_layers", "exclude", "input_activations", "weights",
]

Path_ = tuple[Any, ...]  # keys (str) and list indices (int) from the quantization_config root


def paths(node: Any, prefix: Path_ = ()) -> Iterator[Path_]:
    """Every node under ``node`` (``node`` itself as ``()``), depth first."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, prefix + (i,))


def get(root: Any, path: Path_) -> Any:
    for key in path:
        root = root[key]
    return root


def retype(value: Any) -> list[Any]:
    """The same content in another container or type (JSON types only)."""
    if isinstance(value, dict):
        return [list(value.values()), list(value), [value], json.dumps(value), [list(kv) for kv in value.items()]]
    if isinstance(value, list):
        return [{str(i): v for i, v in enumerate(value)}, {"0": value}, [value], value[:1], value[::-1], ",".join(map(str, value))]
    if isinstance(value, bool):
        return [int(value), str(value).lower(), [value], {"value": value}]
    if isinstance(value, int):
        return [float(value), str(value), [value], {"value": value}, value + 1, -value]
    if isinstance(value, str):
        return [value.upper(), [value], {value: value}, value + "x", value[:-1]]
    return [[value], {"value": value}]


def mutate(data: st.DataObject, qc: dict) -> tuple[dict, list[str]]:
    """1-3 structured edits of a deep copy of ``qc``; returns it and a log of the edits."""
    qc = copy.deepcopy(qc)
    log: list[str] = []
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        if not isinstance(qc, dict):  # an earlier edit replaced the root: stop there
            break
        all_paths = list(paths(qc))
        op = data.draw(st.sampled_from(["replace", "replace", "delete", "add", "retype"]), label="op")
        if op == "add":
            dicts = [p for p in all_paths if isinstance(get(qc, p), dict)]
            path = data.draw(st.sampled_from(dicts), label="dict")
            key = data.draw(st.sampled_from(ADDED_KEYS), label="key")
            value = data.draw(st.sampled_from(HOSTILE), label="value")
            get(qc, path)[key] = copy.deepcopy(value)  # HOSTILE's containers must stay as they are
            log.append(f"add {path + (key,)} = {value!r}")
            continue
        path = data.draw(st.sampled_from(all_paths[1:] or [()]), label="path")
        if not path:
            break
        parent, key = get(qc, path[:-1]), path[-1]
        if op == "delete":
            del parent[key]
            log.append(f"delete {path}")
            continue
        if op == "retype":
            value = data.draw(st.sampled_from(retype(parent[key])), label="retyped")
        else:
            value = data.draw(st.sampled_from(HOSTILE), label="value")
        parent[key] = copy.deepcopy(value)
        log.append(f"{op} {path} = {value!r}")
    return qc, log


def check_layouts(config: dict, what: str = "") -> list[str]:
    """``layout`` at every tp size: a success or a LoadError with a message; the outcomes."""
    outcomes = []
    for tp in TPS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fl.layout(config, tp_size=tp, rank=0)
            outcomes.append("ok")
        except LoadError as exc:
            assert str(exc).strip(), f"{what}: a LoadError must say what is wrong"
            outcomes.append(type(exc).__name__)
    return outcomes


def with_quant(name: str, qc: Any) -> dict:
    config = copy.deepcopy(FIXTURES[name])
    config["quantization_config"] = qc
    return config


# --- the fuzzer ----------------------------------------------------------------------------------


# Fixtures vLLM refuses at tp 1 too, with the same error here: block scales off the block grid,
# and ModelOpt's mxfp4 export (vLLM 0.32's ModelOpt config accepts no MXFP4).
REFUSED_AT_TP1 = {"ct_fp8_block": "ShardingError", "modelopt_mxfp4": "ConfigError"}


def test_fixtures_found_and_load_unmutated():
    """The fuzzer's bases: every Llama fixture lays out unmutated, or fails with a LoadError where
    vLLM refuses it too (REFUSED_AT_TP1, and the FP8 block fixtures at tp 4)."""
    assert len(FIXTURES) >= 10 and {"hf_fp8_block", "ct_w4a16_sym", "gptq_v1", "awq_gemm", "quark_fp8", "llmc_nvfp4"} <= set(FIXTURES)
    outcomes = {name: check_layouts(config, name) for name, config in FIXTURES.items()}
    refused = {name: got[0] for name, got in outcomes.items() if got[0] != "ok"}
    assert refused == REFUSED_AT_TP1, outcomes


@pytest.mark.timeout(max(120, FUZZ.max_examples // 5))  # ~40 ms an example; a long hunt gets longer
@FUZZ
@given(data=st.data())
def test_quantization_config_mutations(data):
    name = data.draw(st.sampled_from(sorted(FIXTURES)), label="fixture")
    qc, log = mutate(data, FIXTURES[name]["quantization_config"])
    check_layouts(with_quant(name, qc), f"{name}: {log}")


# --- regressions (each once raised something other than a LoadError) ---------------------------


def _raises_config_error(config: dict, *words: str) -> None:
    for tp in TPS:
        with pytest.raises(ConfigError) as info:
            fl.layout(config, tp_size=tp, rank=0)
        for word in words:
            assert word in str(info.value), f"{word!r} not in {info.value}"


def test_weight_block_size_with_a_zero_is_a_config_error():
    """``weight_block_size: [0, 128]`` raised ZeroDivisionError in the block-scale shapes."""
    config = with_quant("hf_fp8_block", {**FIXTURES["hf_fp8_block"]["quantization_config"], "weight_block_size": [0, 128]})
    _raises_config_error(config, "block size", "positive")


@pytest.mark.parametrize(
    "name, key, value, words",
    [
        pytest.param(
            "hf_fp8_block", "modules_to_not_convert", ["lm_head", 0], ("modules_to_not_convert", "strings", "0"), id="ignore-int-entry"
        ),
        pytest.param("ct_fp8_tensor", "ignore", [None], ("ignore", "strings", "None"), id="ignore-null-entry"),
        pytest.param("quark_fp8", "ignored_layers", ["re:("], ("ignored_layers", "invalid regex", "'re:('"), id="ignore-bad-regex"),
        pytest.param(
            "awq_gemm",
            "modules_to_not_convert",
            "lm_head",
            ("modules_to_not_convert", "must be a list", '["lm_head"]'),
            id="ignore-bare-string",
        ),
        pytest.param("gptq_v2", "exclude", {"lm_head": True}, ("exclude", "must be a list"), id="ignore-object"),
    ],
)
def test_malformed_ignore_list_is_a_config_error(name, key, value, words):
    """A non-string entry of an ignore list raised AttributeError (``int.startswith``) and an invalid
    ``re:`` pattern ``re.error`` when modules were matched against it, while the layout was built."""
    config = with_quant(name, {**FIXTURES[name]["quantization_config"], key: value})
    _raises_config_error(config, *words)


@pytest.mark.parametrize(
    "targets, words",
    [
        pytest.param(["Linear", 0], ("config_groups.group_0.targets", "strings", "0"), id="int-target"),
        pytest.param(["re:[q"], ("config_groups.group_0.targets", "invalid regex"), id="bad-regex-target"),
        pytest.param("Linear", ("config_groups.group_0.targets", "must be a list"), id="bare-string-targets"),
    ],
)
def test_malformed_compressed_tensors_targets_are_a_config_error(targets, words):
    """compressed-tensors ``targets`` are matched like ignore entries: the same two crashes."""
    qc = copy.deepcopy(FIXTURES["ct_w4a16_sym"]["quantization_config"])
    qc["config_groups"]["group_0"]["targets"] = targets
    _raises_config_error(with_quant("ct_w4a16_sym", qc), *words)


def test_valid_ignore_forms_still_load():
    """The checks let through what real configs write: null, an empty list, names and regexes."""
    for value in (None, [], ["lm_head"], ["re:.*lm_head$", "model.layers.0.mlp.down_proj"]):
        config = with_quant("ct_w8a8", {**FIXTURES["ct_w8a8"]["quantization_config"], "ignore": value})
        assert check_layouts(config, repr(value)) == ["ok"] * len(TPS), value
