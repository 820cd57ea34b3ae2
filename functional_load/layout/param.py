"""``ParamSpec``: one destination parameter of one rank, with its slice descriptor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ..model.mapping import ShardId
from .expert_sharding import ExpertSplit
from .parallel import Parallel
from .placement import PerRank, Placement, Same
from .sharding import Sharding

# What a parameter is in its module (a quantization format's scales, zero points...).
Role = Literal["weight", "scale", "input_scale", "global_scale", "input_global_scale", "zero", "g_idx", "shape", "bias", "kv_scale"]
Check = Literal["positive", "finite", "e8m0"]  # how read values are checked
Transform = Literal["neg_exp"]  # what a loader computes from the stored values: -exp(x), Mamba's A from A_log
CHECKS: tuple[Check, ...] = get_args(Check)
TRANSFORMS: tuple[Transform, ...] = get_args(Transform)


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
    check: Check | None = None  # how read values are checked, e.g. scales "positive"
    stored: tuple[str, ...] = ()  # dtypes the checkpoint must store it in (empty: any that casts)
    role: Role = "weight"  # what it is in its module: weight, scale, zero, bias... (layout.quantized.ParamDef)
    transform: Transform | None = None  # computed from the stored values as read

    def placement(self, parallel: Parallel) -> Placement:
        """Where this parameter's values live across the ranks. A parameter computed at load from
        this rank's slice of another (an online quantization scale of a split weight) differs per
        rank even where its descriptor says every rank holds the same shape: ``PerRank``."""
        placement = self.sharding.placement(parallel)
        if self.derived and isinstance(placement, Same) and parallel.tp_size > 1:
            return PerRank()
        return placement

    @property
    def on_moe_ranks(self) -> bool:
        """Whether :meth:`placement` is over the MoE ranks (``Parallel.moe_size``: ``dp_size x
        tp_size``, this rank at ``moe_rank``) rather than the tensor-parallel ranks alone: a fused
        MoE expert parameter, split or spread over every data-parallel replica's ranks."""
        return isinstance(self.sharding, ExpertSplit)

    def local_pieces(self, parallel: Parallel, dim: int = 0) -> list[tuple[ShardId | None, tuple[int, int]]]:
        """``(segment id, local range)`` along ``dim`` on this rank: each fused segment's, when the
        parameter's segments lie along ``dim``; else one ``(None, whole dimension)`` piece."""
        if self.sharding.segment_dim == dim:
            return self.sharding.segment_ranges(self.shape, parallel)
        return [(None, (0, self.local_shape[dim] if self.local_shape else 1))]
