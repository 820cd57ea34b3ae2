"""Slice descriptors of fused MoE experts: whole experts on a leading dimension (:class:`ExpertSplit`),
a bias on the first rank only (:class:`FirstRank`), and grouped storage (:class:`Grouped`, MXFP4)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, ShardingError
from ..model.mapping import ShardId
from .parallel import Parallel
from .placement import Along, PerRank, Placement, Same
from .segments import Box, Range, full_box
from .sharding import ExpertSlot, Part, Sharding, Slot, _lead, _no_expert, _no_shard_id


@dataclass(frozen=True, slots=True)
class ExpertSplit(Sharding):
    """A fused MoE parameter ``[E_local, ...]``: whole experts on dim 0, each expert's tensor
    described by ``inner`` (over the dimensions after the expert's).

    Without expert parallelism every rank holds every expert, each sharded by ``inner`` over the
    tensor-parallel ranks; with it, experts are spread over the ranks
    (:meth:`Parallel.expert_slots`) and kept whole. ``input_major``: a checkpoint tensor holding
    every expert at once stores each expert's matrix transposed (Llama 4, gpt-oss
    ``gate_up_proj [E, H, 2I]``); per-expert tensors are ``[out, in]`` as usual. ``flat``: such a
    tensor stacks the experts along its first stored dimension, ``[E * rows, cols]`` (DBRX's
    ``ffn.experts.mlp.w1 [E * I, d]``; with ``input_major``, ``w2 [E * I, d]``).
    """

    num_experts: int
    inner: Sharding
    input_major: bool = False
    flat: bool = False

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ConfigError(f"an MoE layer needs at least one expert, got {self.num_experts}")

    def local_shape(self, shape: tuple[int, ...], parallel: Parallel) -> tuple[int, ...]:
        held = len(parallel.expert_slots(self.num_experts))
        return (held,) + self.inner.local_shape(shape[1:], parallel.expert_tp)

    def slots(self, parallel: Parallel) -> list[Slot]:
        held, inner = parallel.expert_slots(self.num_experts), self.inner.slots(parallel.expert_tp)
        return [ExpertSlot(s, seg) for s in range(len(held)) for seg in inner]

    def describe(self, slot: Slot, parallel: Parallel) -> str:
        if not isinstance(slot, ExpertSlot):
            raise TypeError(f"an expert parameter's slots are ExpertSlots, not {slot!r}")
        expert = parallel.expert_slots(self.num_experts)[slot.slot]
        return f"expert {expert}" + (f" ({slot.segment})" if slot.segment is not None else "")

    def held(self, parallel: Parallel) -> frozenset[int]:
        """The experts some local slot of this rank holds (:meth:`part` of any other is None)."""
        return frozenset(parallel.expert_slots(self.num_experts))

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part | None:
        held = parallel.expert_slots(self.num_experts)
        inner_found = found[1:] if expert is None else found
        inner = self.inner.part(shape[1:], shard_id, None, parallel.expert_tp, inner_found)
        if inner is None:
            return None
        if expert is not None:  # one expert's tensor; None when no local slot holds it
            if not 0 <= expert < self.num_experts:
                raise ShardingError(f"expert {expert} is out of range; the config has {self.num_experts} experts")
            slots = [s for s, e in enumerate(held) if e == expert]
            pairs = tuple((src, ((s, s + 1),) + dst, ExpertSlot(s, seg)) for s in slots for src, dst, seg in inner.pairs)
            zeros = tuple(((s, s + 1),) + z for s in slots for z in inner.zeros)
            return Part(pairs, zeros, inner.expected, inner.check, repeat=inner.repeat) if slots else None
        pairs = tuple(
            (((e, e + 1),) + src, ((s, s + 1),) + dst, ExpertSlot(s, seg)) for s, e in enumerate(held) for src, dst, seg in inner.pairs
        )
        zeros = tuple(((s, s + 1),) + z for s in range(len(held)) for z in inner.zeros)
        if self.flat:  # expert e's rows start at e * rows of the stored first dimension
            k = 1 if self.input_major else 0  # that dimension, in destination orientation
            n = inner.expected[k]
            fold = lambda box, e: box[:k] + ((box[k][0] + e * n, box[k][1] + e * n),) + box[k + 1 :]
            pairs = tuple(
                (fold(src, e), ((s, s + 1),) + dst, ExpertSlot(s, seg)) for s, e in enumerate(held) for src, dst, seg in inner.pairs
            )
            expected = inner.expected[:k] + (self.num_experts * n,) + inner.expected[k + 1 :]
            return Part(pairs, zeros, expected, inner.check, transpose=self.input_major, repeat=inner.repeat)
        expected = (self.num_experts,) + inner.expected
        return Part(pairs, zeros, expected, inner.check, transpose=self.input_major, repeat=_lead(inner.repeat))

    def placement(self, parallel: Parallel) -> Placement:
        if parallel.expert_parallel:
            return Along(0)
        return self.inner.placement(parallel.expert_tp).shifted(1)

    @property
    def segment_dim(self) -> int | None:
        dim = self.inner.segment_dim
        return None if dim is None else dim + 1

    def to_json(self) -> dict[str, object]:
        out = {"kind": "experts", "num_experts": self.num_experts, "inner": self.inner.to_json(), "input_major": self.input_major}
        return {**out, "flat": True} if self.flat else out


@dataclass(frozen=True, slots=True)
class FirstRank(Sharding):
    """A tensor the first tensor-parallel rank holds and every other rank holds as zeros (vLLM's
    gpt-oss ``w2_bias``, added once after the row-parallel reduction)."""

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part:
        _no_expert(expert)
        _no_shard_id("first-rank", shard_id)
        if parallel.rank == 0:
            return Part(((full_box(shape), full_box(shape), None),), (), shape)
        return Part((), (full_box(shape),), shape)

    def placement(self, parallel: Parallel) -> Placement:
        return PerRank() if parallel.tp_size > 1 else Same()

    def to_json(self) -> dict[str, object]:
        return {"kind": "first_rank"}


@dataclass(frozen=True, slots=True)
class Grouped(Sharding):
    """A tensor the checkpoint stores with its last dimension as ``[n / size, size]`` (MXFP4's
    ``_blocks``: 16 bytes per 32-value block); ``inner`` describes the parameter, whose slices of
    that dimension must be whole groups."""

    inner: Sharding
    size: int

    def local_shape(self, shape: tuple[int, ...], parallel: Parallel) -> tuple[int, ...]:
        return self.inner.local_shape(shape, parallel)

    def slots(self, parallel: Parallel) -> list[Slot]:
        return self.inner.slots(parallel)

    def part(
        self, shape: tuple[int, ...], shard_id: ShardId | None, expert: int | None, parallel: Parallel, found: tuple[int, ...]
    ) -> Part | None:
        part = self.inner.part(shape, shard_id, expert, parallel, found)
        if part is None:
            return None
        size = self.size

        def stored(box: Box) -> Box:
            (a, b) = box[-1]
            if a % size or b % size:
                raise ShardingError(f"a slice {a}:{b} of the last dimension is not made of whole groups of {size}")
            return box[:-1] + ((a // size, b // size), (0, size))

        pairs = tuple((stored(src), dst, slot) for src, dst, slot in part.pairs)
        expected = part.expected[:-1] + (part.expected[-1] // size, size)
        return Part(pairs, part.zeros, expected, part.check, part.transpose)

    def segment_ranges(self, shape: tuple[int, ...], parallel: Parallel) -> list[tuple[ShardId | None, Range]]:
        return self.inner.segment_ranges(shape, parallel)

    def placement(self, parallel: Parallel) -> Placement:
        return self.inner.placement(parallel)

    @property
    def segment_dim(self) -> int | None:
        return self.inner.segment_dim

    def to_json(self) -> dict[str, object]:
        return {"kind": "grouped", "size": self.size, "inner": self.inner.to_json()}
