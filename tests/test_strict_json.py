"""``strict_json_loads``: its fast path (plain ``json.loads`` and a count of ``:``) returns exactly
what the strict parse returns, and every duplicate key or NaN is still refused."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from functional_load import paths
from functional_load.errors import FormatError
from functional_load.paths import strict_json_loads

keys = st.text(alphabet=st.sampled_from('ab:."\\\u00e9 '), max_size=4)
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | keys
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4), max_leaves=20)


def _pairs(value: object) -> object:
    """``value`` as nested lists of key/value pairs (to write texts with repeated keys)."""
    if isinstance(value, dict):
        return [(k, _pairs(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [_pairs(v) for v in value]
    return value


def _text(pairs: object, repeat: str | None = None) -> str:
    if isinstance(pairs, list) and pairs and all(isinstance(p, tuple) for p in pairs):
        items = [f"{json.dumps(k)}:{_text(v, repeat)}" for k, v in pairs]
        if repeat is not None:
            items.append(f"{json.dumps(pairs[0][0])}:{_text(pairs[0][1])}")  # the first key again
        return "{" + ",".join(items) + "}"
    if isinstance(pairs, list):
        return "[" + ",".join(_text(p, repeat) for p in pairs) + "]"
    return json.dumps(pairs)


@given(values, st.booleans())
def test_same_value_as_the_strict_parse(value: object, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert strict_json_loads(text, "t") == json.loads(text)
    assert strict_json_loads(text.encode(), "t") == json.loads(text)


@given(st.dictionaries(keys, values, min_size=1, max_size=4), st.integers(0, 3))
def test_a_repeated_key_is_refused_at_any_depth(value: dict[str, object], depth: int) -> None:
    inner = _text(_pairs(value), repeat="yes")
    text = inner
    for _ in range(depth):
        text = '{"outer": [' + text + "]}"
    with pytest.raises(FormatError, match="duplicate JSON key"):
        strict_json_loads(text, "t")


def test_the_fast_path_takes_an_ordinary_index_and_declines_the_rest() -> None:
    index = json.dumps({"metadata": {"total_size": 1}, "weight_map": {f"layers.{i}.w": "model-1.safetensors" for i in range(100)}})
    assert paths._plain_json(index) == json.loads(index)
    for unusual in ('{"a": NaN}', '{"a": 1, "a": 2}', '{"a\\u003a": 1, "a": 2}', '{"a": Infinity}', b"\xff"):
        assert paths._plain_json(unusual) is paths._UNSURE
    assert strict_json_loads('{"a\\u003a": 1, "a": 2}', "t") == {"a:": 1, "a": 2}  # the strict parse decides
    with pytest.raises(FormatError, match="JSON constant NaN"):
        strict_json_loads('{"a": NaN}', "t")
    assert math.isinf(strict_json_loads("1e400", "t"))
