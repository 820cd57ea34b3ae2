"""Rearrangement patterns in einops' spelling: ``"layer (n h) d -> d layer n h"``.

Each side lists dimensions; a dimension is one axis name or a parenthesised group of axes
merged row-major. Every axis appears once per side; an axis only on the left must be taken at
one index (``take``); axes only on the right do not exist (repeating and padding act on axes the
source has). :func:`parse_pattern` checks the spelling; sizes are solved later, from the
source and target shapes (:func:`solve_sizes`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError

Groups = tuple[tuple[str, ...], ...]
_TOKEN = re.compile(r"\(|\)|[A-Za-z_][A-Za-z0-9_]*|\S")


def _side(text: str, where: str) -> Groups:
    groups: list[tuple[str, ...]] = []
    current: list[str] | None = None
    for token in _TOKEN.findall(text):
        if token == "(":
            if current is not None:
                raise ConfigError(f"{where}: nested parentheses are not allowed")
            current = []
        elif token == ")":
            if not current:
                raise ConfigError(f"{where}: ')' without a group before it")
            groups.append(tuple(current))
            current = None
        elif token[0].isalpha() or token[0] == "_":
            if current is None:
                groups.append((token,))
            else:
                current.append(token)
        else:
            raise ConfigError(f"{where}: unexpected {token!r} (axes are names; groups are in parentheses)")
    if current is not None:
        raise ConfigError(f"{where}: '(' is not closed")
    return tuple(groups)


@dataclass(frozen=True, slots=True)
class Pattern:
    """A parsed pattern: the dimensions of each side, as groups of axis names."""

    left: Groups
    right: Groups
    text: str

    @property
    def left_axes(self) -> tuple[str, ...]:
        return tuple(a for g in self.left for a in g)

    @property
    def right_axes(self) -> tuple[str, ...]:
        return tuple(a for g in self.right for a in g)


def parse_pattern(text: str, where: str = "pattern") -> Pattern:
    """``"left -> right"``: checked for spelling and for axes used once per side, none created."""
    if not isinstance(text, str) or text.count("->") != 1:
        raise ConfigError(f"{where}: {text!r} must be one 'left -> right' rearrangement, e.g. '(n h) d -> d n h'")
    left_text, right_text = text.split("->")
    where = f"{where} {text!r}"
    left, right = _side(left_text, where), _side(right_text, where)
    for side, groups in (("left", left), ("right", right)):
        names = [a for g in groups for a in g]
        twice = sorted({a for a in names if names.count(a) > 1})
        if twice:
            raise ConfigError(f"{where}: axis {twice[0]!r} appears twice on the {side} side")
        if not groups:
            raise ConfigError(f"{where}: the {side} side is empty")
    new = [a for g in right for a in g if a not in {x for gl in left for x in gl}]
    if new:
        raise ConfigError(f"{where}: axis {new[0]!r} is on the right side only; every target axis comes from the source")
    return Pattern(left, right, text)


def solve_sizes(
    groups: Groups, dims: tuple[int, ...], known: Mapping[str, int], where: str
) -> dict[str, int]:
    """Axis sizes that make each group's product its dimension: at most one unknown axis per
    group, inferred; every known one checked against the dimension."""
    if len(groups) != len(dims):
        raise ConfigError(f"{where}: the pattern has {len(groups)} dimensions here, the tensor {len(dims)} ({list(dims)})")
    sizes: dict[str, int] = {}
    for number, (group, dim) in enumerate(zip(groups, dims)):
        unknown = [a for a in group if a not in known and a not in sizes]
        product = math.prod(known.get(a, sizes.get(a, 1)) for a in group if a not in unknown)
        if len(unknown) > 1:
            raise ConfigError(f"{where}: ({' '.join(group)}) has {len(unknown)} axes of unknown size ({unknown}); give all but one")
        if unknown:
            if product == 0 or dim % product:
                raise ConfigError(f"{where}: dimension {number} ({dim}) does not divide into ({' '.join(group)}) with the sizes given")
            sizes[unknown[0]] = dim // product
        elif product != dim:
            given = " * ".join(f"{a}={known.get(a, sizes.get(a))}" for a in group)
            raise ConfigError(f"{where}: dimension {number} is {dim}, but ({' '.join(group)}) gives {product} ({given})")
    return sizes
