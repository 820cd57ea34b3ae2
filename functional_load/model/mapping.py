"""Name mapping tables: checkpoint names to destination names (vLLM ``WeightsMapper`` semantics).

A table is data: an ordered tuple of rules. Rule kinds apply in a fixed order
(interleaved -> rename -> regex -> substr -> expert -> stacked -> prefix -> suffix); within a kind
every matching rule applies, each one seeing the previous result. A rule whose replacement is
``None`` drops the tensor. A stacked rule also tags the tensor with the shard id(s) it fills in a
fused parameter; an expert rule (``.experts.{e}.w1.weight``) also records which expert the tensor
belongs to; an interleaved rule (a regex) renames nothing and marks a q/k tensor whose rows hold
each head's rotary pairs interleaved, which vLLM permutes to halves as it loads them (Llama 4,
Mistral's own format).

Tables compose with ``|`` (later rules replace earlier ones with the same pattern) and run in
stages with :func:`map_name`, which is how vLLM keeps cache-scale renames ahead of the stacked
``.k_proj -> .qkv_proj`` rule.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cache
from typing import Any, Literal, cast

from ..paths import JsonDict

# which part of a fused parameter a tensor fills: "q", "k", "v", 0, 1...; a tuple of consecutive
# segments (0, 1, 2): one tensor holding them back to back (vLLM's tuple shard id, Qwen3.5's in_proj_qkv)
ShardId = int | str | tuple[int, ...]

RuleKind = Literal["interleaved", "rename", "regex", "substr", "expert", "stacked", "prefix", "suffix"]
RULE_KINDS: tuple[RuleKind, ...] = ("interleaved", "rename", "regex", "substr", "expert", "stacked", "prefix", "suffix")
_TAGGING = ("expert", "stacked")  # kinds that carry shard ids and cannot drop


@cache
def _expert_regex(pattern: str) -> re.Pattern[str]:
    before, after = pattern.split("{e}")
    return re.compile(re.escape(before) + r"(\d+)" + re.escape(after))


@dataclass(frozen=True, slots=True)
class Rule:
    """One mapping rule. ``replacement=None`` drops the tensor (not allowed for stacked rules).

    * rename: the whole name equals ``pattern``.
    * regex: ``re.search(pattern)``; every occurrence is substituted (``re.sub``).
    * substr: ``pattern in name``; the first occurrence is replaced.
    * expert: ``pattern`` holds ``{e}``, which matches an expert number; like stacked (shard ids
      optional), and also records the expert id (vLLM's ``make_expert_params_mapping`` as data).
    * stacked: like substr, and tags the result with ``shard_ids``.
    * prefix: ``name.startswith(pattern)``; the first occurrence is replaced.
    * suffix: ``name.endswith(pattern)``; the last occurrence is replaced.
    """

    kind: RuleKind
    pattern: str
    replacement: str | None
    shard_ids: tuple[ShardId, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise ValueError(f"unknown rule kind {self.kind!r}; expected one of {RULE_KINDS}")
        if self.kind in _TAGGING:
            if self.replacement is None:
                raise ValueError(f"{self.kind} rule {self.pattern!r} cannot drop a tensor (replacement None)")
            if not self.shard_ids and self.kind == "stacked":
                raise ValueError(f"stacked rule {self.pattern!r} needs at least one shard id")
        elif self.shard_ids:
            raise ValueError(f"only stacked and expert rules carry shard ids, not {self.kind} rule {self.pattern!r}")
        if self.kind == "expert" and self.pattern.count("{e}") != 1:
            raise ValueError(f"expert rule {self.pattern!r} must contain {{e}} exactly once")
        if self.kind in ("regex", "interleaved"):
            re.compile(self.pattern)
        if self.kind == "interleaved" and self.replacement is not None:
            raise ValueError(f"interleaved rule {self.pattern!r} renames nothing (replacement must be None)")

    def _expert_regex(self) -> re.Pattern[str]:
        return _expert_regex(self.pattern)

    def expert_id(self, name: str) -> int:
        """The expert number an expert rule matched in ``name``."""
        match = self._expert_regex().search(name)
        if match is None:
            raise ValueError(f"expert rule {self.pattern!r} does not match {name!r}")
        return int(match.group(1))

    def matches(self, name: str) -> bool:
        if self.kind == "expert":
            return self._expert_regex().search(name) is not None
        if self.kind == "rename":
            return name == self.pattern
        if self.kind in ("regex", "interleaved"):
            return re.search(self.pattern, name) is not None
        if self.kind == "prefix":
            return name.startswith(self.pattern)
        if self.kind == "suffix":
            return name.endswith(self.pattern)
        return self.pattern in name

    def apply(self, name: str) -> str:
        """The renamed ``name`` (the rule must match and must not drop)."""
        new = self.replacement
        if new is None:
            raise ValueError(f"{self.kind} rule {self.pattern!r} drops {name!r}; it renames nothing")
        if self.kind == "rename":
            return new
        if self.kind == "regex":
            return re.sub(self.pattern, new, name)
        if self.kind == "suffix":
            return new.join(name.rsplit(self.pattern, 1))
        if self.kind == "expert":
            return self._expert_regex().sub(new.replace("\\", "\\\\"), name, count=1)
        return name.replace(self.pattern, new, 1)


def shard_id_tuple(ids: Any) -> tuple[ShardId, ...]:
    """A rule's shard ids from its spec value: one id, or a list of them; a list inside the list is
    one id of consecutive segments (``[[0, 1, 2]]``: a tensor holding segments 0, 1 and 2)."""
    items = ids if isinstance(ids, (list, tuple)) else [ids]
    return tuple(tuple(i) if isinstance(i, (list, tuple)) else i for i in items)


@dataclass(frozen=True, slots=True)
class Mapped:
    """Where a checkpoint tensor goes. Empty ``shard_ids``: it fills the whole parameter (or all
    of its segments at once, when the checkpoint stores them fused). ``expert`` is the expert
    a per-expert tensor belongs to (``None``: not an expert tensor, or all experts fused)."""

    name: str
    shard_ids: tuple[ShardId, ...] = ()
    expert: int | None = None
    interleaved: bool = False  # rows hold rotary pairs interleaved per head: permute to halves on load


@dataclass(frozen=True, slots=True)
class MappingTable:
    """An ordered, immutable set of rules."""

    rules: tuple[Rule, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))

    @classmethod
    def from_dicts(cls, **kinds: Mapping[str, object]) -> MappingTable:
        """Build from one ``{pattern: replacement}`` dict per kind, in vLLM's spelling.

        Stacked and expert values are ``(replacement, shard_id)`` or ``(replacement, [shard_ids])``;
        an expert value may be the replacement alone (a projection that is not part of a fused one).
        """
        rules = []
        for kind in RULE_KINDS:
            for pattern, value in kinds.pop(kind, {}).items():
                if kind == "expert" and isinstance(value, str):
                    rules.append(Rule(kind, pattern, value))
                elif kind == "interleaved":
                    rules.append(Rule(kind, pattern, None))
                elif kind in _TAGGING:
                    new, ids = cast(tuple[str, Any], value)
                    shard_ids = shard_id_tuple(ids)
                    rules.append(Rule(kind, pattern, new, shard_ids))
                elif value is None or isinstance(value, str):  # a replacement, or None to drop
                    rules.append(Rule(kind, pattern, value))
                else:
                    raise ValueError(f"{kind} rule {pattern!r}: the replacement must be a string (or None to drop), not {value!r}")
        if kinds:
            raise ValueError(f"unknown rule kinds {sorted(kinds)}; expected {RULE_KINDS}")
        return cls(tuple(rules))

    def map(self, name: str) -> Mapped | None:
        """Apply the table to one name; ``None`` means the tensor is dropped."""
        shard_ids: tuple[ShardId, ...] = ()
        expert = None
        interleaved = False
        for kind in RULE_KINDS:
            for rule in self.rules:
                if rule.kind != kind or not rule.matches(name):
                    continue
                if kind == "interleaved":
                    interleaved = True
                    continue
                if rule.replacement is None:
                    return None
                if kind == "expert":
                    expert = rule.expert_id(name)
                name = rule.apply(name)
                if rule.shard_ids:
                    shard_ids = rule.shard_ids
        return Mapped(name, shard_ids, expert, interleaved)

    def __or__(self, other: MappingTable) -> MappingTable:
        """Merge: ``other``'s rules replace ours with the same kind and pattern; new ones follow."""
        theirs = {(r.kind, r.pattern): r for r in other.rules}
        merged = [theirs.pop((r.kind, r.pattern), r) for r in self.rules]
        merged += [r for r in other.rules if (r.kind, r.pattern) in theirs]
        return MappingTable(tuple(merged))

    def rename_only(self) -> MappingTable:
        """The renames alone: no drops, no stacked or expert rules (for quant-config layer lists)."""
        return MappingTable(tuple(r for r in self.rules if r.replacement is not None and r.kind not in _TAGGING))


Stages = MappingTable | Iterable[MappingTable]


def map_name(stages: Stages, name: str) -> Mapped | None:
    """Run ``name`` through tables in sequence; a later stage's shard ids (and expert) replace earlier ones."""
    if isinstance(stages, MappingTable):
        stages = (stages,)
    mapped = Mapped(name)
    for table in stages:
        result = table.map(mapped.name)
        if result is None:
            return None
        mapped = replace(
            result,
            shard_ids=result.shard_ids or mapped.shard_ids,
            expert=result.expert if result.expert is not None else mapped.expert,
            interleaved=result.interleaved or mapped.interleaved,
        )
    return mapped


# Rotary caches some checkpoints carry; never parameters (vLLM REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER).
ROTARY_CACHES = MappingTable.from_dicts(
    substr={
        "rotary_pos_emb.inv_freq": None,
        "rotary_emb.inv_freq": None,
        "rotary_emb.cos_cached": None,
        "rotary_emb.sin_cached": None,
    }
)


# --- memoised mapping, for checkpoints of many layers and experts -----------------------------

_NUMBER = re.compile(r"\.(\d+)(?=\.|$)")  # a dot-separated component that is a number (and its dot)
_WHOLE_NUMBER = re.compile(r"(?:^|\.)\d+(?:\.|$)")  # a digit run a name's number component could match
_LITERAL_ESCAPE = re.compile(r"\\[^A-Za-z0-9]")


def _literal_blind(text: str) -> bool:
    """A literal pattern none of whose occurrences can overlap a number component of a name."""
    return not _WHOLE_NUMBER.search(text)


def _regex_blind(pattern: str) -> bool:
    """A regex (conservatively) made of literal non-digit characters, letter classes, groups and
    anchors only: it can match no digit, so it behaves the same whatever a name's numbers are."""
    rest = _LITERAL_ESCAPE.sub("_", pattern)
    return not ("\\" in rest or "." in rest or "[^" in rest or any(c.isdigit() for c in rest))


def _rule_blind(rule: Rule) -> bool:
    if rule.kind in ("regex", "interleaved"):
        return _regex_blind(rule.pattern)
    if rule.kind == "expert":  # {e} must be a whole number component
        before, after = rule.pattern.split("{e}")
        return before.endswith(".") and after.startswith(".") and _literal_blind(before) and _literal_blind(after)
    return _literal_blind(rule.pattern)


_UNSAFE = object()  # a template whose mapping could not be learned: map each name in full
_MISSING = object()
_Learned = tuple[str, tuple[ShardId, ...], int | None, bool] | None  # a template's mapping: a name format, its fields


def _fields(mapped: Mapped | None) -> tuple[str, tuple[ShardId, ...], int | None, bool] | None:
    return None if mapped is None else (mapped.name, mapped.shard_ids, mapped.expert, mapped.interleaved)


def _apply(learned: _Learned, numbers: list[str]) -> tuple[str, tuple[ShardId, ...], int | None, bool] | None:
    """A learned template's mapping of a name with these number components."""
    if learned is None:
        return None
    fmt, shard_ids, expert, interleaved = learned
    return fmt.format(*numbers), shard_ids, None if expert is None else int(numbers[expert]), interleaved


class NameMapper:
    """``map_name(stages, name)``, memoised per name *template* (the name with its number
    components, ``layers.12`` or ``experts.37``, taken out).

    When no rule of the tables can tell one number from another (no rule pattern can match a
    digit of a number component, :func:`_rule_blind`), every name of a template maps the same
    way with its numbers carried along, and an expert rule's ``{e}`` takes one of them. The
    mapping of a template is learned once, from a probe name with a distinct sentinel for each
    number, and checked against the full mapping of the first real name; a table with any other
    rule is mapped name by name. A checkpoint of 92,000 tensors (DeepSeek-V3) has about 60
    templates."""

    def __init__(self, stages: Stages):
        self.stages = (stages,) if isinstance(stages, MappingTable) else tuple(stages)
        self.blind = all(_rule_blind(r) for table in self.stages for r in table.rules)
        self._memo: JsonDict = {}  # a template -> its _Learned mapping, or _UNSAFE

    def __call__(self, name: str) -> Mapped | None:
        found = self.lookup(name)
        return found if found is None else Mapped(*found)

    def lookup(self, name: str) -> tuple[str, tuple[ShardId, ...], int | None, bool] | None:
        """What :meth:`__call__` returns, as the plain tuple of a :class:`Mapped`'s fields."""
        if not self.blind:
            return _fields(map_name(self.stages, name))
        parts = _NUMBER.split(name)
        learned = self._memo.get("\0".join(parts[0::2]), _MISSING)
        if learned is _MISSING:
            learned = self._memo["\0".join(parts[0::2])] = self._learn(name, parts)
        if learned is _UNSAFE:
            return _fields(map_name(self.stages, name))
        return _apply(learned, parts[1::2])

    def _learn(self, name: str, parts: list[str]) -> _Learned | object:  # object: _UNSAFE
        sentinels = [f"9{i:07d}9" for i in range(len(parts) // 2)]
        probe = "".join(p if i % 2 == 0 else "." + sentinels[i // 2] for i, p in enumerate(parts))
        mapped = map_name(self.stages, probe)
        learned: _Learned = None
        if mapped is not None:
            fmt = mapped.name.replace("{", "{{").replace("}", "}}")
            for i, s in enumerate(sentinels):
                if fmt.count(s) > 1:
                    return _UNSAFE
                fmt = fmt.replace(s, f"{{{i}}}")
            expert = None
            if mapped.expert is not None:
                expert = next((i for i, s in enumerate(sentinels) if int(s) == mapped.expert), None)
                if expert is None:
                    return _UNSAFE
            learned = (fmt, mapped.shard_ids, expert, mapped.interleaved)
        if _apply(learned, parts[1::2]) != _fields(map_name(self.stages, name)):
            return _UNSAFE  # the guard: never memoise what the full mapping disagrees with
        return learned
