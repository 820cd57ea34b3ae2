"""Target maps: which checkpoint tensors fill each leaf of a JAX stack's parameter tree, and how.

A map is data, in Python (a dict from a leaf's key path to a :class:`Rule`) or in a TOML file
(``targets/<name>.toml``, the same spelling). A key path is the leaf's ``jax.tree_util`` keys
joined with ``"."`` (a dict key as it is, an attribute by name, a sequence position as its
number); ``{layer}`` / ``{expert}`` (any ``{name}``) in a key match a number and are substituted
into the rule's source. A source placeholder the key does not bind is a stacking axis: the
pattern's left side starts with it, and the tensors it enumerates (0, 1, ... as the checkpoint
holds them) are stacked along it. ``Rule(source, pattern, **sizes)``::

    Rule("model.layers.{layer}.self_attn.q_proj.weight", "layer (n h) d -> d layer n h", n=32)

Keywords besides axis sizes (reserved names, not axes): ``fuse`` (the axis that enumerates a
list of sources of one shape), ``take`` (an axis -> one index, dropping the axis, or a
``(start, stop)`` range), ``rotary`` (an axis -> ``"pairs"``: HF's rotary halves to interleaved
pairs, or ``"halves"``), ``repeat`` (an axis -> how many times each element repeats, e.g. KV
heads; or a list of axes, sized from the target), ``pad`` (an axis -> its size with zeros
appended; or a list of axes, sized from the target), ``scale`` (every value multiplied, in
float32), ``dequantize`` (a quantized source is dequantized, its scales read too). Values may be
numbers or expressions over ``config.json`` and the map's ``[dims]`` (``"num_attention_heads"``,
``"head_dim ** -0.5"``). The leaf's dtype is the target's: values are cast to it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType

from ..errors import ConfigError
from ..paths import JsonObject
from .pattern import Pattern, parse_pattern

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

RESERVED = ("fuse", "take", "rotary", "repeat", "pad", "scale", "dequantize")
Value = int | float | str
Take = Value | tuple[Value, Value]  # one index of an axis, or a (start, stop) range
AxesOrSizes = Mapping[str, Value] | Sequence[str]  # axis -> a size, or axes sized from the target
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def placeholders(template: str) -> tuple[str, ...]:
    """The ``{name}`` placeholders of a key or source template, in order."""
    return tuple(_PLACEHOLDER.findall(template))


def _axes_or_sizes(value: AxesOrSizes | None, what: str, where: str) -> Mapping[str, Value] | tuple[str, ...]:
    if value is None:
        return MappingProxyType({})
    if isinstance(value, Mapping):
        return MappingProxyType(dict(value))
    if isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"{where}: {what} must map axes to values, or list axes sized from the target; got {value!r}")


@dataclass(frozen=True, init=False)
class Rule:
    """How one target leaf (or one per ``{layer}``) is made from checkpoint tensors; see the module."""

    source: tuple[str, ...]
    pattern: Pattern
    sizes: Mapping[str, Value]
    fuse: str | None
    take: Mapping[str, Take]
    rotary: Mapping[str, str]
    repeat: Mapping[str, Value] | tuple[str, ...]
    pad: Mapping[str, Value] | tuple[str, ...]
    scale: Value | None
    dequantize: bool

    def __init__(
        self, source: str | Sequence[str], pattern: str, *, fuse: str | None = None, take: Mapping[str, Take] | None = None,
        rotary: Mapping[str, str] | None = None, repeat: AxesOrSizes | None = None, pad: AxesOrSizes | None = None,
        scale: Value | None = None, dequantize: bool = False, **sizes: Value,
    ) -> None:
        sources = (source,) if isinstance(source, str) else tuple(source)
        where = f"Rule({sources[0]!r}{', ...' if len(sources) > 1 else ''})" if sources else "Rule()"
        if not sources or not all(isinstance(s, str) and s for s in sources):
            raise ConfigError(f"{where}: source must be a checkpoint tensor name or a list of them")
        parsed = parse_pattern(pattern, where)
        if (len(sources) > 1) != (fuse is not None):
            raise ConfigError(f"{where}: several sources need fuse='<axis>' (the axis that enumerates them), and fuse needs several")
        left = parsed.left_axes
        if fuse is not None and (fuse not in left or (fuse,) not in parsed.left):
            raise ConfigError(f"{where}: fuse axis {fuse!r} must be an axis of its own on the pattern's left side")
        values = {
            "source": sources, "pattern": parsed, "sizes": MappingProxyType(dict(sizes)), "fuse": fuse,
            "take": MappingProxyType(dict(take or {})), "rotary": MappingProxyType(dict(rotary or {})),
            "repeat": _axes_or_sizes(repeat, "repeat", where), "pad": _axes_or_sizes(pad, "pad", where),
            "scale": scale, "dequantize": bool(dequantize),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
        named = set(sizes) | set(self.take) | set(self.rotary) | set(self.repeat) | set(self.pad)
        unknown = sorted(named - set(left))
        if unknown:
            raise ConfigError(f"{where}: {unknown} are not axes of {pattern!r} (axes: {list(left)}; reserved words: {list(RESERVED)})")
        missing = sorted(a for a in left if a not in parsed.right_axes and a not in self.take)
        if missing:
            raise ConfigError(f"{where}: axis {missing[0]!r} is not on the right side of {pattern!r}; take one index of it (take=)")
        for axis, how in self.rotary.items():
            if how not in ("pairs", "halves"):
                raise ConfigError(f"{where}: rotary[{axis!r}] = {how!r}; use 'pairs' (HF halves -> interleaved) or 'halves'")

    @property
    def where(self) -> str:
        return f"Rule({self.source[0]!r}, {self.pattern.text!r})"


@dataclass(frozen=True, slots=True)
class Drop:
    """Checkpoint tensors no leaf takes, on purpose: names matching ``pattern`` (a regex)."""

    pattern: str
    reason: str

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ConfigError(f"drop pattern {self.pattern!r} is not a regex: {exc}") from None


@dataclass(frozen=True, slots=True)
class TargetMap:
    """Rules by leaf key (placeholders allowed), named sizes (``dims``) and intended drops."""

    rules: Mapping[str, Rule]
    dims: Mapping[str, str] = field(default_factory=dict)
    drops: tuple[Drop, ...] = ()
    name: str = "<map>"
    source: str = "<python>"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", MappingProxyType(dict(self.rules)))
        object.__setattr__(self, "dims", MappingProxyType(dict(self.dims)))
        for key, rule in self.rules.items():
            if not isinstance(rule, Rule):
                raise ConfigError(f"{self.source}: the value for leaf {key!r} must be a functional_load.Rule, got {type(rule).__name__}")


def as_target_map(mapping: TargetMap | Mapping[str, Rule] | str | Path) -> TargetMap:
    """A :class:`TargetMap` from a map, a dict of rules, a ``.toml`` path or a shipped map's name."""
    if isinstance(mapping, TargetMap):
        return mapping
    if isinstance(mapping, Mapping):
        return TargetMap(dict(mapping))
    if isinstance(mapping, (str, Path)):
        path = Path(mapping)
        if path.suffix == ".toml":
            if not path.is_file():
                raise ConfigError(f"target map file {path} does not exist")
            return parse_target_map(tomllib.loads(path.read_text()), str(path))
        shipped = shipped_maps()
        if str(mapping) not in shipped:
            raise ConfigError(f"no shipped target map named {str(mapping)!r}; shipped: {sorted(shipped)} (a file path must end in .toml)")
        return shipped[str(mapping)]
    raise ConfigError(f"mapping must be a TargetMap, a dict of leaf key -> Rule, a .toml path or a shipped map name, got {mapping!r:.80}")


def parse_target_map(data: JsonObject, source: str) -> TargetMap:
    """A map from parsed TOML: ``name``, ``[dims]``, ``[[drop]]`` and ``[leaves."<key>"]`` tables of
    :class:`Rule` fields."""
    known = {"name", "description", "dims", "drop", "leaves"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown top-level keys {unknown}; expected {sorted(known)}")
    rules = {}
    for key, fields in (data.get("leaves") or {}).items():
        fields = dict(fields)
        if "source" not in fields or "pattern" not in fields:
            raise ConfigError(f"{source}: leaf {key!r} needs source and pattern")
        if isinstance(fields.get("take"), Mapping):
            fields["take"] = {a: tuple(v) if isinstance(v, list) else v for a, v in fields["take"].items()}
        try:
            rules[key] = Rule(fields.pop("source"), fields.pop("pattern"), **fields)
        except ConfigError as exc:
            raise ConfigError(f"{source}: leaf {key!r}: {exc}") from None
    drops = tuple(Drop(str(d["pattern"]), str(d.get("reason", ""))) for d in data.get("drop", []))
    return TargetMap(rules, dict(data.get("dims") or {}), drops, str(data.get("name", source)), source)


def shipped_maps() -> dict[str, TargetMap]:
    """The maps in ``targets/``, by name."""
    out = {}
    for entry in resources.files("functional_load.targets").iterdir():
        if entry.name.endswith(".toml"):
            source = f"targets/{entry.name}"
            target_map = parse_target_map(tomllib.loads(entry.read_text()), source)
            out[target_map.name] = target_map
    return out
