"""Per-layer mapping stages and the expressions the 2026 multimodal families need.

* A ``[[stages]]`` table with ``layers`` is instantiated layer by layer: its ``{layer}`` rules
  exist for each layer its ``when`` holds for, as vLLM's Gemma 4 mapper is built (k_proj filling
  both k and v on attention_k_eq_v layers; k/v dropped on KV-shared layers).
* ``len(x)`` of a config list (Qwen3-VL's deepstack mergers), 0 when missing.
* ``d[layer]`` of a dict JSON keys by layer number as strings (Gemma 4's ``per_layer_config``);
  an item of a missing list or dict is None, as a missing key is.
"""

from __future__ import annotations

import pytest

from functional_load.errors import ConfigError
from functional_load.layout.build import build_layout
from functional_load.layout.parallel import Parallel
from functional_load.model.expressions import evaluate
from functional_load.model.mapping import map_name
from functional_load.model.spec import parse_spec

_QKV = {"kind": "qkv", "in": "16", "heads": "4", "kv_heads": "2", "head_dim": "4"}
_SPEC = {
    "name": "tiny",
    "layers": "num_hidden_layers",
    "stages": [
        {"layers": "num_hidden_layers", "when": "layer >= shared_from", "substr": {"layers.{layer}.k_proj.": False}},
        {
            "layers": "num_hidden_layers",
            "when": "layer < shared_from and k_eq_v[layer]",
            "stacked": {"layers.{layer}.k_proj.": ["layers.{layer}.qkv.", ["k", "v"]]},
        },
        {"stacked": {".k_proj.": [".qkv.", "k"], ".v_proj.": [".qkv.", "v"], ".q_proj.": [".qkv.", "q"]}},
    ],
    "modules": {"layers.{layer}.qkv": _QKV},
}


def _mapped(name: str, **config: object) -> tuple[str, tuple[object, ...]] | None:
    layout = build_layout({"num_hidden_layers": 3, "shared_from": 2, "k_eq_v": [False, True, True], **config},
                          parse_spec(_SPEC), Parallel(1, 0), "bfloat16")
    mapped = map_name(layout.mapping, name)
    return None if mapped is None else (mapped.name, mapped.shard_ids)


def test_per_layer_stage_applies_to_the_layers_its_when_holds_for() -> None:
    assert _mapped("layers.0.k_proj.weight") == ("layers.0.qkv.weight", ("k",))  # the global rule
    assert _mapped("layers.1.k_proj.weight") == ("layers.1.qkv.weight", ("k", "v"))  # k fills k and v
    assert _mapped("layers.2.k_proj.weight") is None  # a shared layer's k_proj is dropped
    assert _mapped("layers.1.k_proj.weight", k_eq_v=[False, False, False]) == ("layers.1.qkv.weight", ("k",))
    assert _mapped("layers.2.k_proj.weight", shared_from=3) == ("layers.2.qkv.weight", ("k", "v"))


def test_per_layer_stage_does_not_touch_other_layer_numbers() -> None:
    spec = parse_spec({**_SPEC, "layers": "12"})
    layout = build_layout({"num_hidden_layers": 12, "shared_from": 12, "k_eq_v": [i == 1 for i in range(12)]},
                          spec, Parallel(1, 0), "bfloat16")
    mapped = map_name(layout.mapping, "layers.11.k_proj.weight")  # layers.1. is not a part of layers.11.
    assert mapped is not None and mapped.shard_ids == ("k",)


def test_per_layer_stage_count_is_checked() -> None:
    config = {"num_hidden_layers": 10**9, "shared_from": 2, "k_eq_v": []}
    with pytest.raises(ConfigError, match="mapping stage's layers"):
        build_layout(config, parse_spec({**_SPEC, "layers": "3"}), Parallel(1, 0), "bfloat16")


def test_len_of_a_config_list() -> None:
    config = {"vision_config": {"deepstack_visual_indexes": [8, 16, 24]}}
    assert evaluate("len(vision_config.deepstack_visual_indexes)", config) == 3
    assert evaluate("len(vision_config.missing)", config) == 0
    with pytest.raises(ConfigError, match="no length"):
        evaluate("len(vision_config.deepstack_visual_indexes[0])", config)


def test_items_of_a_dict_keyed_by_layer_number() -> None:
    config = {"per_layer_config": {"1": {"head_dim": 16}}, "layer": 1}
    assert evaluate("per_layer_config[layer].head_dim", config) == 16
    assert evaluate("per_layer_config[0].head_dim or 8", {**config, "layer": 0}) == 8
    assert evaluate("missing[layer].head_dim or 8", {**config, "missing": None}) == 8  # no dict at all


def test_a_dim_that_depends_on_the_layer_is_evaluated_per_layer() -> None:
    """Scopes derived with ``with_layer`` share the dims' cache, keyed by the layer: a dim
    ``layer * 2`` is 2 on layer 1 and 6 on layer 3, whichever layer asked first."""
    from functional_load.model.expressions import Scope

    scope = Scope({"hidden_size": 8}, {"width": "layer * 2", "half": "hidden_size // 2"})
    assert [scope.with_layer(n)["width"] for n in (1, 3, 1)] == [2, 6, 2]
    assert scope.with_layer(3).with_values(tp_size=2)["width"] == 6 and scope.with_layer(5)["half"] == 4
    assert scope.with_values(extra=1).with_layer(2)["width"] == 4


def test_membership_is_on_lists_and_a_string_on_the_right_is_refused() -> None:
    from functional_load.errors import ConfigError
    from functional_load.model.expressions import evaluate

    scope = {"kind": "attention", "types": ["mamba", "attention"]}
    assert evaluate("kind in ['M', 'linear_attention', 'mamba']", scope) is False
    assert evaluate("kind in types and kind not in ('mlp', 'moe')", scope) is True
    with pytest.raises(ConfigError, match=r"would match a substring; write a list: in \['M', 'linear_attention'\]"):
        evaluate("kind in 'M linear_attention'", scope)
