"""A spec's module tables are typed: a field its kind does not take, or a missing required one,
is a ConfigError naming the file, the module, the field and the closest valid name."""

from __future__ import annotations

from pathlib import Path

import pytest

from functional_load.errors import ConfigError
from functional_load.model.spec import load_spec

HEAD = 'name = "typo"\narchitectures = ["TypoForCausalLM"]\nlayers = "num_hidden_layers"\n'


def _spec(tmp_path: Path, modules: str, head: str = HEAD) -> Path:
    path = tmp_path / "typo.toml"
    path.write_text(head + modules)
    return path


def test_a_mistyped_field_is_refused_with_the_closest_name(tmp_path: Path) -> None:
    path = _spec(tmp_path, '[modules."model.layers.{layer}.mlp.down_proj"]\nkind = "row"\nin = "i"\nout = "h"\nbais = true\n')
    with pytest.raises(ConfigError) as info:
        load_spec(path)
    text = str(info.value)
    assert str(path) in text and "model.layers.{layer}.mlp.down_proj" in text
    assert "unknown field 'bais' (did you mean 'bias'?)" in text


def test_a_missing_required_field_is_a_config_error_not_a_key_error(tmp_path: Path) -> None:
    modules = (
        '[modules."model.layers.{layer}.mlp.down_proj"]\nkind = "row"\nout = "h"\n'
        '[modules."model.layers.{layer}.mlp.experts"]\nkind = "experts"\nexperts = "e"\nin = "h"\n'
        '[modules."model.norm"]\nkind = "params"\nparams = { weight = { shap = ["h"] } }\n'
    )
    with pytest.raises(ConfigError) as info:
        load_spec(_spec(tmp_path, modules))
    for needle in (
        "4 problems",
        "down_proj' (kind row): missing the required field 'in'",
        "experts' (kind experts): missing the required field 'intermediate'",
        "parameter 'weight': unknown field 'shap' (did you mean 'shape'?)",
        "parameter 'weight': missing the required field 'shape'",
    ):
        assert needle in str(info.value), (needle, str(info.value))


def test_extends_with_another_kind_keeps_only_the_fields_that_kind_takes(tmp_path: Path) -> None:
    """MiniMax-M2's router is Mixtral's replicated linear made a float32 ``replicated`` module: its
    ``in``/``out``/``quantized`` are not carried over (they would be unknown fields)."""
    head = 'name = "router32"\nextends = "mixtral"\narchitectures = ["Router32ForCausalLM"]\n'
    module = '[modules."model.layers.{layer}.block_sparse_moe.gate"]\nkind = "replicated"\nparams = { weight = ["experts", "hidden"] }\n'
    spec = load_spec(_spec(tmp_path, module, head))
    gate = next(m for m in spec.modules if m.pattern.endswith("block_sparse_moe.gate"))
    assert gate.kind == "replicated" and set(gate.fields) == {"params"}
