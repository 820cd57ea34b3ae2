"""``ParamSpec``: one destination parameter of one rank, with its slice descriptor."""

from __future__ import annotations

from dataclasses import dataclass

from ..model.mapping import ShardId
from .parallel import Parallel
from .placement import PerRank, Placement, Same
from .sharding import Sharding


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One destination parameter on one rank.

    ``shape`` is the global shape in the orientation of the destination (``[out, in]`` for
    linear weights), unpadded and unreplicated, i.e. what the checkpoint holds; ``local_shape``
    is what this rank allocates. ``transposed`` marks a 2-D weight that the checkpoint stores as
    ``[in, out]`` (GPT-2 ``Conv1D``) and that is transposed on load.
    """

    name: str
    module: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str  # a torch dtype name
    sharding: Sharding
    transposed: bool = False
    default: float | None = None  # value when the checkpoint lacks it (KV-cache scales: vLLM's created value)
    derived: bool = False  # computed at load from another parameter (scales of online quantization)
    check: str | None = None  # how read values are checked (layout.quantized.CHECKS), e.g. scales "positive"
    stored: tuple[str, ...] = ()  # dtypes the checkpoint must store it in (empty: any that casts)
    role: str = "weight"  # what it is in its module: weight, scale, zero, bias... (layout.quantized.ParamDef)
    transform: str | None = None  # computed from the stored values as read ("neg_exp": -exp(x), Mamba's A from A_log)

    def placement(self, parallel: Parallel) -> Placement:
        """Where this parameter's values live across the ranks. A parameter computed at load from
        this rank's slice of another (an online quantization scale of a split weight) differs per
        rank even where its descriptor says every rank holds the same shape: ``PerRank``."""
        placement = self.sharding.placement(parallel)
        if self.derived and isinstance(placement, Same) and parallel.tp_size > 1:
            return PerRank()
        return placement

    def local_pieces(self, parallel: Parallel, dim: int = 0) -> list[tuple[ShardId | None, tuple[int, int]]]:
        """``(segment id, local range)`` along ``dim`` on this rank: each fused segment's, when the
        parameter's segments lie along ``dim``; else one ``(None, whole dimension)`` piece."""
        if self.sharding.split_dim == dim:
            return self.sharding.segment_ranges(self.shape, parallel)
        return [(None, (0, self.local_shape[dim] if self.local_shape else 1))]
