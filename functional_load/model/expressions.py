"""The safe expression language of the architecture specs.

A tiny subset of Python over config keys and earlier dims: names, numbers, ``+ - * / // % **``,
comparisons (``in`` a list: a config list or a literal ``['M', 'mamba']``; never a string, whose
substrings would match), ``and``/``or``/``not``, ``x if c else y``, attribute access into a nested
config (``vision_config.hidden_size``), items of config lists (``layer_types[layer]``),
``len(x)`` of a config list (0 when missing) and ``int(x)`` (a float truncated, as Python's). A
missing config key is ``None``, so ``"num_key_value_heads or num_attention_heads"`` is a
fallback; a key the config lacks at the top level is read from its ``text_config`` (multimodal
models). A dim is a named binding, evaluated per layer where it uses ``layer``.
"""

from __future__ import annotations

import ast
import functools
import keyword
import operator
from collections.abc import Iterator, Mapping
from typing import Any, TypeAlias, TypeGuard

from ..errors import ConfigError
from ..paths import JsonObject

Expr = str | int | float | bool  # a spec expression: a string to evaluate, or a literal that is its own value
# What an expression evaluates to: a number, string, bool, None (a missing key), a literal list (a tuple), or a
# config value as config.json holds it (a list, or a nested config, looked up by any key)
Value: TypeAlias = "int | float | bool | str | tuple[Value, ...] | list[Value] | Mapping[object, Value] | None"


def _power(base: float, exponent: float) -> float:
    """``**`` with a small exponent only (a target map's ``head_dim ** -0.5``): a huge one would
    take unbounded time and memory."""
    if abs(exponent) > 64:
        raise OverflowError(f"exponent {exponent} is too large (at most 64)")
    return base**exponent


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}
def _member(a: Value, b: Any) -> bool:
    """``a in b`` over a list (a config list, or a literal ``['M', 'mamba']``); a string on the right
    would match substrings ('attention' in 'M linear_attention'), so it is refused."""
    if isinstance(b, str):
        raise TypeError(f"{a!r} in {b!r} would match a substring; write a list: in [{', '.join(map(repr, b.split()))}]")
    return a in (b or ())


_CMPOPS = {
    ast.In: _member,
    ast.NotIn: lambda a, b: not _member(a, b),
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}


def evaluate(expr: Expr, lookup: Mapping[str, Value]) -> Value:
    """Evaluate a spec expression; ``lookup[name]`` gives a value or ``None`` when absent."""
    if not isinstance(expr, str):
        return expr
    if expr.isidentifier() and not keyword.iskeyword(expr):  # a bare name, as most spec expressions are
        return lookup[expr]
    tree = _parse(expr)
    try:
        return _value(tree, expr, lookup)
    except (TypeError, ZeroDivisionError, OverflowError) as exc:  # config values of the wrong type, or 0
        raise ConfigError(f"spec expression {expr!r} fails on the values in config.json: {exc}") from None


def _value(node: ast.AST, expr: str, lookup: Mapping[str, Value]) -> Value:
    """What ``node`` of the spec expression ``expr`` evaluates to (the language's constructs; anything else raises)."""
    if isinstance(node, ast.Expression):
        return _value(node.body, expr, lookup)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool, str)):
        return node.value
    if isinstance(node, ast.Name):
        return lookup[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):  # a literal list: layer_type in ['M', 'mamba']
        return tuple(_value(e, expr, lookup) for e in node.elts)
    if isinstance(node, ast.Attribute):  # a key of a nested config: vision_config.hidden_size
        return _key(_value(node.value, expr, lookup), node, expr)
    if isinstance(node, ast.BoolOp):
        values = (_value(v, expr, lookup) for v in node.values)
        if isinstance(node.op, ast.Or):
            result = None
            for result in values:
                if result:
                    return result
            return result
        result = True
        for result in values:
            if not result:
                return result
        return result
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        value = _value(node.operand, expr, lookup)
        return (not value) if isinstance(node.op, ast.Not) else -_number(value, node.operand, expr)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](
            _number(_value(node.left, expr, lookup), node.left, expr), _number(_value(node.right, expr, lookup), node.right, expr)
        )
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
        return _CMPOPS[type(node.ops[0])](_value(node.left, expr, lookup), _value(node.comparators[0], expr, lookup))
    if isinstance(node, ast.IfExp):
        return _value(node.body, expr, lookup) if _value(node.test, expr, lookup) else _value(node.orelse, expr, lookup)
    if _is_call(node, "len"):  # the length of a config list (vision_config.deepstack_visual_indexes); missing: 0
        return _length(_value(node.args[0], expr, lookup), node.args[0], expr)
    if _is_call(node, "int"):  # Python's int(): a float truncated (LFM2's int(2 * ff / 3))
        return _integer(_number(_value(node.args[0], expr, lookup), node.args[0], expr), node.args[0], expr)
    if isinstance(node, ast.Subscript):  # an item of a config list, string or dict: layer_types[layer]
        return _item(_value(node.value, expr, lookup), _value(node.slice, expr, lookup), node.value, expr)
    raise ConfigError(f"unsupported construct {ast.dump(node)[:60]} in spec expression {expr!r}")


def _number(value: Value, node: ast.AST, expr: str) -> Any:
    """``value``, an operand of arithmetic (Any: a wrong type raises TypeError there); a missing config key raises."""
    if value is None:
        raise ConfigError(f"config.json has no {ast.unparse(node)!r}, needed by spec expression {expr!r}")
    return value


def _is_call(node: ast.AST, name: str) -> TypeGuard[ast.Call]:
    """Whether ``node`` calls the function ``name`` with one positional argument."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name and len(node.args) == 1 \
        and not node.keywords


def _key(outer: Value, node: ast.Attribute, expr: str) -> Value:
    """The key ``node.attr`` of the nested config ``outer`` (None when ``outer`` is missing)."""
    if outer is None:
        return None
    if not isinstance(outer, Mapping):
        raise ConfigError(
            f"spec expression {expr!r}: {ast.unparse(node.value)!r} is {outer!r:.60}, not a nested config, "
            f"so it has no key {node.attr!r}"
        )
    return outer.get(node.attr)


def _length(value: Value, node: ast.AST, expr: str) -> int:
    """``len(value)`` of a config list (0 when missing); ``node`` is the argument, for the error."""
    if value is None:
        return 0
    if not isinstance(value, (list, tuple, Mapping, str)):
        raise ConfigError(f"spec expression {expr!r}: {ast.unparse(node)!r} is {value!r:.60}, which has no length")
    return len(value)


def _integer(value: Value, node: ast.AST, expr: str) -> int:
    """``int(value)`` of a number; ``node`` is the argument, for the error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"spec expression {expr!r}: {ast.unparse(node)!r} is {value!r:.60}, not a number")
    return int(value)


def _item(outer: Value, key: Value, node: ast.AST, expr: str) -> Value:
    """``outer[key]`` of a config list, string or dict (None when ``outer`` is missing); ``node`` is ``outer``'s, for the error."""
    if isinstance(outer, (list, tuple, str)) and isinstance(key, int) and not isinstance(key, bool) and -len(outer) <= key < len(outer):
        return outer[key]
    if outer is None:  # a missing config list or dict has no items: None, as a missing key
        return None
    if isinstance(outer, Mapping):  # JSON keys a dict by layer number as strings: per_layer_config[layer]
        return outer.get(key) if key in outer or not isinstance(key, int) else outer.get(str(key))
    raise ConfigError(
        f"spec expression {expr!r}: {ast.unparse(node)!r} is {outer!r:.60}, which has no item {key!r}; check config.json"
    )


@functools.lru_cache(maxsize=4096)
def _parse(expr: str) -> ast.Expression:
    """An expression's tree, parsed once (a layout of 60 layers evaluates each expression per layer)."""
    try:
        return ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ConfigError(f"invalid spec expression {expr!r}: {exc.msg}") from None


class Scope(Mapping[str, Value]):
    """Name lookup for spec expressions: ``layer``, then dims (evaluated lazily), then config keys."""

    def __init__(
        self, config: JsonObject, dims: Mapping[str, str], layer: int | None = None, extra: Mapping[str, Value] | None = None
    ):
        self._config, self._dims, self._layer = config, dims, layer
        self._extra = dict(extra or {})
        # dims evaluated once per (name, layer, extra values), shared by the scopes derived from
        # this one: a dim may depend on ``layer`` (``layer * 2``) or on an extra name
        self._cache: dict[tuple[str, int | None, str], Value] = {}
        self._values = repr(sorted(self._extra.items()))
        self._busy: set[str] = set()

    def with_layer(self, layer: int) -> Scope:
        scope = Scope(self._config, self._dims, layer, self._extra)
        scope._cache = self._cache
        return scope

    def with_values(self, **values: Value) -> Scope:
        """This scope with more names (``tp_size`` for a spec's refusals)."""
        scope = Scope(self._config, self._dims, self._layer, {**self._extra, **values})
        scope._cache = self._cache
        return scope

    def __getitem__(self, name: str) -> Value:
        if name == "layer":
            return self._layer
        if name in self._extra:
            return self._extra[name]
        if name in self._dims and name not in self._busy:  # inside its own expression a dim means the config key
            key = (name, self._layer, self._values)
            if key not in self._cache:
                self._busy.add(name)
                try:
                    self._cache[key] = evaluate(self._dims[name], self)
                finally:
                    self._busy.discard(name)
            return self._cache[key]
        value = self._config.get(name)
        text = self._config.get("text_config")
        if value is None and isinstance(text, Mapping):  # a multimodal model's language model (Llama 4)
            value = text.get(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._dims)

    def __len__(self) -> int:
        return len(self._dims)

    def int(self, expr: Any, what: str) -> int:  # expr: a spec field as parsed
        value = evaluate(expr, self)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            dim = f" (dim {expr} = {self._dims[expr]!r})" if isinstance(expr, str) and expr in self._dims else ""
            raise ConfigError(f"{what} = {expr!r}{dim} evaluated to {value!r}; expected a non-negative integer from config.json")
        return value
