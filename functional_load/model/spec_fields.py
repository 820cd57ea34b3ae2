"""The fields each module kind of a spec takes: a field no kind reads is an error, not ignored.

``check_module(pattern, kind, fields)`` lists the problems of one ``[modules."..."]`` table:
unknown fields (with the closest valid name), missing required ones, and the entries of its
``params`` (a ``replicated``, ``heads`` or ``params`` module) checked the same way.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from ..paths import JsonDict, JsonObject

COMMON = ("when", "layers", "prefix", "vision", "names", "transposed")  # any module (layout/build.py)
_LINEAR = ("bias", "quantized", "disable_tp", "stored")
_COLUMN = (("in", "out"), (*_LINEAR, "unit", "label", "replicate"))
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # kind -> (required fields, optional fields)
    "vocab": (("size", "dim"), ("padding", "bias")),
    "column": _COLUMN,
    "row": _COLUMN,
    "replicated_linear": _COLUMN,
    "merged": (("in", "outs"), (*_LINEAR, "units", "replicate")),
    "qkv": (("in", "heads", "kv_heads", "head_dim"), (*_LINEAR, "v_head_dim", "replicate_kv")),
    "replicated": (("params",), ()),
    "heads": (("heads", "params"), ()),
    "params": (("params",), ()),
    "kv_cache": ((), ()),
    "experts": (("experts", "in", "intermediate"), ("bias", "interleaved", "input_major", "flat", "gated", "pad", "groups")),
}
PARAM_FIELDS = {  # a parameter given as a table, by module kind
    "replicated": (("shape",), ("dtype", "when", "squeeze")),
    "params": (("shape",), ("split", "sections", "units", "replicate", "dtype", "transform", "when", "squeeze")),
}


def _closest(name: str, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check(where: str, fields: JsonObject, required: tuple[str, ...], optional: tuple[str, ...]) -> list[str]:
    valid = required + optional
    problems = [f"{where}: unknown field {k!r}{_closest(k, valid)}; its fields are {list(valid)}" for k in fields if k not in valid]
    return problems + [f"{where}: missing the required field {k!r}" for k in required if k not in fields]


def check_module(pattern: str, kind: str, fields: JsonObject) -> list[str]:
    """The problems of one module table (empty when none); an unknown kind is checked elsewhere."""
    if kind not in KINDS:
        return []
    required, optional = KINDS[kind]
    where = f"module {pattern!r} (kind {kind})"
    problems = _check(where, fields, required, (*optional, *COMMON))
    params = fields.get("params")
    if kind in PARAM_FIELDS and isinstance(params, Mapping):
        for suffix, value in params.items():
            if isinstance(value, Mapping):
                problems += _check(f"{where} parameter {suffix!r}", value, *PARAM_FIELDS[kind])
            elif kind == "params" or not isinstance(value, list):
                problems.append(f"{where} parameter {suffix!r}: expected a table (shape = [...], ...), got {value!r}")
    return problems


def carried(base: JsonObject, kind: str | None) -> JsonDict:
    """The fields of a base spec's module that an ``extends`` keeps: all of them, unless the module
    is given another kind, whose fields only (a ``column`` made ``replicated`` drops ``in``/``out``)."""
    if kind is None or kind == base.get("kind") or kind not in KINDS:
        return dict(base)
    required, optional = KINDS[kind]
    return {k: v for k, v in base.items() if k in (*required, *optional, *COMMON)}
