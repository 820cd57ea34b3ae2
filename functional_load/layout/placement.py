"""Where a parameter's values live across the tensor-parallel ranks: an explicit value.

A descriptor's :meth:`~functional_load.layout.sharding.Sharding.placement` says one of three
things, never an ``Optional`` that means two: every rank holds the same values (:class:`Same`);
rank ``r`` holds block ``r`` of one tensor along a dimension (:class:`Along`, rank-major); or the
ranks hold different values that are no split of one tensor (:class:`PerRank`: gpt-oss's
``w2_bias``, on the first rank, zeros elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Same:
    """Every rank holds the same values (norms, routers, per-tensor scales)."""

    def shifted(self, by: int) -> Placement:
        return self


@dataclass(frozen=True, slots=True)
class Along:
    """Rank ``r`` holds block ``r`` along dimension ``dim``, all blocks of one size."""

    dim: int

    def shifted(self, by: int) -> Placement:
        """The same placement inside a tensor with ``by`` more leading dimensions (experts)."""
        return Along(self.dim + by)


@dataclass(frozen=True, slots=True)
class PerRank:
    """The ranks hold different values that do not split one tensor."""

    def shifted(self, by: int) -> Placement:
        return self


Placement = Same | Along | PerRank
