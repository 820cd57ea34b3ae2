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
from typing import Any, Literal, cast

ShardId = int | str  # which part of a fused parameter a tensor fills: "q", "k", "v", 0, 1...

RuleKind = Literal["interleaved", "rename", "regex", "substr", "expert", "stacked", "prefix", "suffix"]
RULE_KINDS: tuple[RuleKind, ...] = ("interleaved", "rename", "regex", "substr", "expert", "stacked", "prefix", "suffix")
_TAGGING = ("expert", "stacked")  # kinds that carry shard ids and cannot drop


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
        before, after = self.pattern.split("{e}")
        return re.compile(re.escape(before) + r"(\d+)" + re.escape(after))

    def expert_id(self, name: str) -> int:
        """The expert number an expert rule matched in ``name``."""
        match = self._expert_regex().search(name)
        assert match is not None
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
        assert new is not None
        if self.kind == "rename":
            return new
        if self.kind == "regex":
            return re.sub(self.pattern, new, name)
        if self.kind == "suffix":
            return new.join(name.rsplit(self.pattern, 1))
        if self.kind == "expert":
            return self._expert_regex().sub(new.replace("\\", "\\\\"), name, count=1)
        return name.replace(self.pattern, new, 1)


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
                    shard_ids = tuple(ids) if isinstance(ids, (list, tuple)) else (ids,)
                    rules.append(Rule(kind, pattern, new, shard_ids))
                else:
                    rules.append(Rule(kind, pattern, value))  # type: ignore[arg-type]
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
