"""Pipeline stages as vLLM builds them: the decoder layers a stage holds, and which of the
modules outside them (embeddings, final norm, head) it holds.

The layers are vLLM's ``get_pp_indices``: even partitions, the remainder going to the
partitions before the last (``[-2], [-3], ...``: the last holds the final norm and the head), or
the partition given (vLLM's ``VLLM_PP_LAYER_PARTITION``, read by the entry points, never here).
Where the other modules live is each model's own code: a spec's ``[pipeline]`` table says it
(``first``: the first stage only, ``last``: the last stage only, ``tied_last``: the tied
embedding also on the last stage), judged by real vLLM (docs/parity.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardingError
from ..model.spec_parts import PipelineSpec
from .parallel import Parallel


def pp_partition(num_layers: int, pp_size: int, partition: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Layers per stage: ``partition`` when given (checked as vLLM checks it), else vLLM's split."""
    if partition:
        if len(partition) != pp_size:
            raise ShardingError(
                f"len(partitions)={len(partition)} does not match pp_size={pp_size}. (the pipeline layer partition "
                f"{','.join(map(str, partition))}: one layer count per stage)"
            )
        if sum(partition) != num_layers:
            raise ShardingError(
                f"sum(partitions)={sum(partition)} does not match num_hidden_layers={num_layers}. (the pipeline layer "
                f"partition {','.join(map(str, partition))} must count every decoder layer once)"
            )
        return partition
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    return tuple(parts)


def stage_layers(num_layers: int, parallel: Parallel) -> tuple[int, int]:
    """``[start, end)``: the decoder layers of ``parallel``'s pipeline stage."""
    parts = pp_partition(num_layers, parallel.pp_size, parallel.pp_partition)
    start = sum(parts[: parallel.pp_rank])
    return start, start + parts[parallel.pp_rank]


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """What one pipeline stage of a model holds: its decoder layers ``[start, stop)`` and the
    modules outside them its spec's ``[pipeline]`` table puts there."""

    rank: int
    size: int
    start: int
    stop: int
    table: PipelineSpec
    tied: bool  # the model ties its embedding and head

    @classmethod
    def of(cls, table: PipelineSpec, num_layers: int, parallel: Parallel, tied: bool, name: str) -> PipelineStage | None:
        """The stage of ``parallel`` (None without pipeline parallelism); ShardingError where vLLM refuses."""
        if parallel.pp_size == 1:
            return None
        if table.refuse:
            raise ShardingError(f"{name}: {table.refuse} (pipeline_parallel_size={parallel.pp_size})")
        start, stop = stage_layers(num_layers, parallel)
        return cls(parallel.pp_rank, parallel.pp_size, start, stop, table, tied)

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def holds(self, pattern: str, layer: int | None) -> bool:
        """Whether the stage holds module ``pattern`` (of decoder ``layer``: None outside them)."""
        if layer is not None:
            return self.start <= layer < self.stop
        if pattern in self.table.first:
            return self.first or (self.last and self.tied and self.table.tied_last)
        return self.last if pattern in self.table.last else True

    @property
    def why(self) -> str:
        held = f"decoder layers {self.start}..{self.stop - 1}" if self.stop > self.start else "no decoder layer"
        return f"pipeline stage {self.rank} of {self.size} holds {held} and not this module (vLLM builds a PPMissingLayer)"
