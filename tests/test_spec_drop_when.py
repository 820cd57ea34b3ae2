"""Spec language: per-layer ``when`` on ``[[drop]]`` rules, and items of config strings in expressions
(DeepSeek-V3.2 / GLM-5's index_topk_pattern "FSSF...")."""

from __future__ import annotations

import pytest

from functional_load.errors import ConfigError
from functional_load.layout.build import _drops
from functional_load.model.expressions import Scope, evaluate
from functional_load.model.spec import parse_spec

SPEC = {
    "name": "t", "layers": "n", "modules": {"m.{layer}.w": {"kind": "replicated", "params": {"weight": [4]}}},
    "drop": [
        {"prefix": "m.{layer}.extra.", "stop": "n", "when": "pattern[layer] == 'S'", "reason": "shared"},
        {"prefix": "vision.", "when": "not text", "reason": "no vision"},
    ],
}


def test_drop_when_per_layer() -> None:
    spec = parse_spec(SPEC)
    assert _drops(spec, Scope({"n": 4, "pattern": "FSSF", "text": True}, spec.dims)) == (
        ("m.1.extra.", "shared"), ("m.2.extra.", "shared"),
    )
    assert _drops(spec, Scope({"n": 2, "pattern": "FF", "text": False}, spec.dims)) == (("vision.", "no vision"),)


def test_drop_without_when_keeps_every_layer() -> None:
    spec = parse_spec({**SPEC, "drop": [{"prefix": "m.{layer}.x.", "first": 1, "stop": "n", "reason": "r"}]})
    assert [p for p, _ in _drops(spec, Scope({"n": 3}, spec.dims))] == ["m.1.x.", "m.2.x."]


def test_string_items() -> None:
    config = {"pattern": "FSF", "types": ["a", "b"]}
    assert evaluate("pattern[1]", config) == "S"
    assert evaluate("types[layer] == 'b'", {**config, "layer": 1}) is True
    with pytest.raises(ConfigError, match="has no item"):
        evaluate("pattern[3]", config)
