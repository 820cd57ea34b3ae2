"""Which rank of how many, and where whole MoE experts go under expert parallelism.

:class:`Parallel` is an explicit, frozen value: nothing here reads the environment. The expert
tables are vLLM's (``determine_expert_map`` / ``compute_local_expert_ids``), as pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardingError

PLACEMENTS = ("linear", "round_robin")


def compute_local_expert_ids(num_experts: int, ep_size: int, ep_rank: int, placement: str = "linear") -> tuple[int, ...]:
    """The expert ids ``ep_rank`` holds (vLLM ``compute_local_expert_ids`` / ``determine_expert_map``).

    ``linear``: contiguous blocks of ``E // ep``, the first ``E % ep`` ranks one more;
    ``round_robin``: ``ep_rank, ep_rank + ep, ...``. With more ranks than experts the ranks past
    the experts hold none (vLLM loads them with zero local experts).
    """
    if placement not in PLACEMENTS:
        raise ShardingError(f"unknown expert placement {placement!r}; use one of {PLACEMENTS}")
    if placement == "round_robin":
        return tuple(range(ep_rank, num_experts, ep_size))
    base, rem = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, rem)
    return tuple(range(start, start + base + (ep_rank < rem)))


def local_expert_slots(
    num_experts: int, ep_size: int, ep_rank: int, placement: str = "linear", redundant: int = 0
) -> tuple[int, ...]:
    """The logical expert loaded into each local slot, in slot order.

    With ``redundant`` extra physical experts, physical expert ``p`` holds logical expert
    ``p % num_experts`` (vLLM's ``phys2log``); the ``num_experts + redundant`` physical experts
    are what expert parallelism spreads.
    """
    physical = num_experts + redundant
    ids = compute_local_expert_ids(physical, ep_size, ep_rank, placement) if ep_size > 1 else tuple(range(physical))
    return tuple(p % num_experts for p in ids)


@dataclass(frozen=True, slots=True)
class Parallel:
    """One rank over every parallel axis vLLM has, and how MoE experts are spread.

    ``tp_size``/``rank``: the tensor-parallel group and this rank in it (attention and dense
    layers are split over it alone); ``pp_size``/``pp_rank``: the pipeline stage;
    ``dp_size``/``dp_rank``: the data-parallel replica. Fused MoE experts are split over the
    flattened ``dp_size x tp_size`` ranks at rank ``dp_rank * tp_size + rank`` (vLLM's
    ``FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp``): with ``expert_parallel`` whole
    experts are spread over that group (``ep_size``, ``ep_rank``), otherwise each expert is split
    over it (``expert_tp``); ``num_redundant_experts`` extra physical experts repeat logical ones.
    """

    tp_size: int = 1
    rank: int = 0
    expert_parallel: bool = False
    expert_placement: str = "linear"
    num_redundant_experts: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    pp_partition: tuple[int, ...] = ()  # decoder layers per stage (vLLM's VLLM_PP_LAYER_PARTITION); (): vLLM's split

    def __post_init__(self) -> None:
        for size, index, what in ((self.tp_size, self.rank, "tp_size/rank"), (self.pp_size, self.pp_rank, "pp_size/pp_rank"),
                                  (self.dp_size, self.dp_rank, "dp_size/dp_rank")):
            _check_axis(size, index, what)
        if not isinstance(self.expert_parallel, bool):
            raise ShardingError(f"expert_parallel must be True or False, got {self.expert_parallel!r}")
        if self.expert_placement not in PLACEMENTS:
            raise ShardingError(f"expert_placement must be one of {PLACEMENTS}, got {self.expert_placement!r}")
        redundant = self.num_redundant_experts
        if isinstance(redundant, bool) or not isinstance(redundant, int) or redundant < 0:
            raise ShardingError(f"num_redundant_experts must be a non-negative integer, got {redundant!r}")
        partition = self.pp_partition
        if not isinstance(partition, tuple) or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in partition):
            raise ShardingError(f"pp_partition must be a tuple of layer counts (non-negative integers), got {partition!r}")
        if redundant and not self.expert_parallel:
            raise ShardingError("num_redundant_experts needs expert_parallel=True (redundant experts are an EP feature)")

    @property
    def flat_rank(self) -> int:
        """vLLM's global rank of this worker: ``(dp_rank * pp_size + pp_rank) * tp_size + rank``."""
        return (self.dp_rank * self.pp_size + self.pp_rank) * self.tp_size + self.rank

    @property
    def moe_size(self) -> int:
        """The ranks fused MoE experts are spread or split over: ``dp_size x tp_size``."""
        return self.dp_size * self.tp_size

    @property
    def moe_rank(self) -> int:
        """This rank's place among them: ``dp_rank * tp_size + rank``."""
        return self.dp_rank * self.tp_size + self.rank

    @property
    def ep_size(self) -> int:
        return self.moe_size if self.expert_parallel else 1

    @property
    def ep_rank(self) -> int:
        return self.moe_rank if self.expert_parallel else 0

    @property
    def sequence_parallel_moe(self) -> bool:
        """vLLM runs the MoE layers sequence-parallel (``ParallelConfig.use_sequence_parallel_moe``
        with its default all2all backend): expert parallelism over ``dp_size x tp_size`` with both
        above 1. Models change other layers then (shared experts replicated: spec expressions see it)."""
        return self.expert_parallel and self.tp_size > 1 and self.dp_size > 1

    @property
    def expert_tp(self) -> Parallel:
        """The tensor-parallel split inside each expert: none under expert parallelism."""
        return Parallel() if self.expert_parallel else Parallel(self.moe_size, self.moe_rank)

    def expert_slots(self, num_experts: int) -> tuple[int, ...]:
        """The logical expert held in each local expert slot of this rank."""
        return local_expert_slots(num_experts, self.ep_size, self.ep_rank, self.expert_placement, self.num_redundant_experts)

    def describe(self) -> str:
        """``rank 1/2 (pipeline stage 1 of 2, data-parallel rank 0 of 4)``: the tensor rank, and the other axes in use."""
        parts = [f"pipeline stage {self.pp_rank} of {self.pp_size}"] if self.pp_size > 1 else []
        parts += [f"data-parallel rank {self.dp_rank} of {self.dp_size}"] if self.dp_size > 1 else []
        return f"rank {self.rank}/{self.tp_size}" + (f" ({', '.join(parts)})" if parts else "")

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "tp_size": self.tp_size,
            "rank": self.rank,
            "expert_parallel": self.expert_parallel,
            "expert_placement": self.expert_placement,
            "num_redundant_experts": self.num_redundant_experts,
        }
        if self.pp_size > 1 or self.dp_size > 1:  # a single-stage, single-replica rank is written as before
            out.update(pp_size=self.pp_size, pp_rank=self.pp_rank, dp_size=self.dp_size, dp_rank=self.dp_rank)
        if self.pp_partition:
            out["pp_partition"] = list(self.pp_partition)
        return out


def _check_axis(size: object, index: object, what: str) -> None:
    name, index_name = what.split("/")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ShardingError(f"{name} must be a positive integer, got {size!r}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
        raise ShardingError(f"{index_name} must be in [0, {size}) for {name}={size}, got {index!r}; ranks count from 0")
