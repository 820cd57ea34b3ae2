"""A load finds its spec by architecture parsing only the spec files that mention it, and finds
the same spec the full table gives, for every architecture of every shipped spec."""

from __future__ import annotations

import pytest

from functional_load.model import spec as spec_module
from functional_load.model.spec import available_specs, spec_for_config


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """No parsed specs cached (a fresh process); the sources of the files parsed are recorded."""
    monkeypatch.setattr(spec_module, "_PARSED", {})
    parsed: list[str] = []
    real = spec_module._read_toml

    def counting(text: str, source: str):
        parsed.append(source)
        return real(text, source)

    monkeypatch.setattr(spec_module, "_read_toml", counting)
    return parsed


def test_a_load_parses_only_the_files_that_name_its_architecture(fresh: list[str]) -> None:
    spec = spec_for_config({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"})
    assert spec.name == "qwen3_moe"
    assert 1 <= len(fresh) <= 6, fresh  # the files mentioning it and its extends chain, not all of them
    assert len(available_specs()) > 50 and len(fresh) > 50  # the full table still parses every file


def test_the_quick_lookup_finds_what_the_full_table_finds(monkeypatch: pytest.MonkeyPatch) -> None:
    table = available_specs()
    architectures = sorted({a for s in table.values() for a in s.architectures})
    assert len(architectures) > 90
    for arch in architectures:
        monkeypatch.setattr(spec_module, "_PARSED", {})
        quick = spec_for_config({"architectures": [arch]})
        full = spec_for_config({"architectures": [arch]}, table)
        assert quick == full, arch


def test_an_unknown_architecture_still_gets_the_full_error(fresh: list[str]) -> None:
    with pytest.raises(spec_module.ConfigError, match="no architecture spec for"):
        spec_for_config({"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"})
