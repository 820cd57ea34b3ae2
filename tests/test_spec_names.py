"""A module's ``names``: placeholders of its pattern besides ``{layer}``, each an expression of
``layer`` (Zamba2's shared transformer blocks, which vLLM names after the first hybrid layer that
runs them, and the adapters of every hybrid layer they serve, under that same layer)."""

from __future__ import annotations

import pytest

from functional_load.errors import ConfigError
from functional_load.layout.build import build_layout
from functional_load.layout.parallel import Parallel
from functional_load.model.spec import parse_spec

_FIRST = {"first": "hybrid_layer_ids[layer % num_mem_blocks]"}
_SPEC = {
    "name": "tiny_shared",
    "layers": "num_hidden_layers",
    "modules": {
        "layers.{layer}.norm": {"kind": "replicated", "params": {"weight": ["8"]}},
        # one per block, under its first hybrid layer: no {layer} in the pattern
        "layers.{first}.shared.proj": {"kind": "column", "in": "8", "out": "8", "layers": "num_mem_blocks",
                                       "names": {"first": "hybrid_layer_ids[layer]"}},
        # one per hybrid layer, held by its block
        "layers.{first}.shared.adapters.{layer}.A": {"kind": "column", "in": "8", "out": "4",
                                                     "layers": "len(hybrid_layer_ids)", "names": _FIRST},
    },
}


def _names(**config: object) -> list[str]:
    layout = build_layout({"num_hidden_layers": 6, **config}, parse_spec(_SPEC), Parallel(2, 0), "bfloat16")
    return [n for n in layout.params if ".shared." in n]


def test_names_place_a_module_under_the_layer_an_expression_gives() -> None:
    assert _names(hybrid_layer_ids=[1, 3, 5], num_mem_blocks=2) == [
        "layers.1.shared.proj.weight",
        "layers.3.shared.proj.weight",
        "layers.1.shared.adapters.0.A.weight",  # block 0 serves hybrid layers 0 and 2
        "layers.3.shared.adapters.1.A.weight",
        "layers.1.shared.adapters.2.A.weight",
    ]
    assert _names(hybrid_layer_ids=[2, 4], num_mem_blocks=1) == [
        "layers.2.shared.proj.weight", "layers.2.shared.adapters.0.A.weight", "layers.2.shared.adapters.1.A.weight",
    ]


def test_a_name_that_is_no_number_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"names\.first"):
        _names(hybrid_layer_ids=["a", "b"], num_mem_blocks=1)
