"""What the layout asks of a quantization format: the interface every format module implements.

The layout knows linear shapes (:class:`Linear`) and MoE expert shapes (:class:`Experts`) and
builds parameters from the :class:`ParamDef`\\ s a format's scheme gives it; it never looks at
which format that is. Each format lives in one module of :mod:`functional_load.quant`
(parsing, manifests, checks, dequantization, post-load transforms), behind :class:`Scheme`.
What the planner and the reader need of a quantized parameter is data on it: ``check`` (how
its values are checked as they are read), ``stored`` (the dtypes the checkpoint must hold it
in) and ``role`` (what it is: weight, scale, zero point...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeAlias

from ..dtypes import FLOAT8
from ..errors import ConfigError
from ..model.mapping import MappingTable, ShardId
from .parallel import Parallel
from .param import Check, ParamSpec, Role, Transform
from .segments import Segment
from .sharding import Replicated, Sharding, Split

if TYPE_CHECKING:
    import numpy as np
    import torch

# How a parameter's values are checked as they are read (scales: before any weight):
# "positive": finite and > 0 (FP8/int8 and KV-cache scales); "finite": finite, any sign
# (integer group scales, some producers store negative ones); "e8m0": not 0xFF (the e8m0 NaN).
FP8_DTYPES = FLOAT8


class ParamDef(NamedTuple):
    """One parameter of a module: its name after the module's, its global shape (what the
    checkpoint holds), descriptor and dtype; ``default`` is the value it keeps when the checkpoint
    lacks it (None: the checkpoint must hold it); ``check`` one of :data:`~.param.CHECKS`; ``stored``: the
    dtypes the checkpoint must store it in (empty: any that casts); ``role``: what it is."""

    suffix: str
    shape: tuple[int, ...]
    sharding: Sharding
    dtype: str
    default: float | None = None
    check: Check | None = None
    stored: tuple[str, ...] = ()
    role: Role = "weight"
    transform: Transform | None = None  # what vLLM's loader computes from the stored values


@dataclass(frozen=True, slots=True)
class Linear:
    """The shape of one linear module, as far as a quantization scheme needs it."""

    kind: str  # column | merged | qkv | row | replicated_linear
    in_size: int
    segments: tuple[Segment, ...]  # output segments (one for plain column/row layers)
    disable_tp: bool = False
    stored: str = "concat"  # how a checkpoint tensor holding every segment orders them ("grouped": per KV group)

    @property
    def out_size(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def column(self) -> bool:
        """Split along the output: each rank holds a slice of every output segment."""
        return self.kind in ("column", "merged", "qkv")

    @property
    def row(self) -> bool:
        return self.kind == "row"

    def out_split(self, dim: int, pack: int = 1) -> Sharding:
        """Sharding of a tensor whose ``dim`` runs over output rows (``pack`` rows per element)."""
        if not self.column:
            return Replicated()
        return Split(dim, pack_segments(self.segments, pack), self.disable_tp, self.stored)

    def in_split(self, dim: int, count: int, label: str) -> Sharding:
        """Sharding of a tensor whose ``dim`` runs over ``count`` input units (columns, packs, groups)."""
        if not self.row:
            return Replicated()
        return Split(dim, (Segment(0, count, label=label),), self.disable_tp)

    def weight_split(self, dim_in: int = 1, inputs: int | None = None, label: str = "input columns") -> Sharding:
        """A weight ``[out, in]`` (or ``[out, in / pack]``: ``inputs`` units) as the layer splits it."""
        if self.column:
            return self.out_split(0)
        return self.in_split(dim_in, self.in_size if inputs is None else inputs, label)

    def slot_ids(self) -> tuple[ShardId, ...]:
        """One per-tensor scale slot per logical shard of a column-like layer (q/k/v: 3)."""
        return tuple(s.id for s in self.segments) if self.column else (0,)


@dataclass(frozen=True, slots=True)
class Experts:
    """One MoE layer's experts, as a scheme's expert manifest needs them: ``hidden`` and the
    expert ``intermediate`` size; w13 is ``[2 * intermediate, hidden]`` (gate rows then up rows,
    or pairs of them ``interleaved``), w2 ``[hidden, intermediate]``; ``bias``: ``"none"``,
    ``"all"`` or ``"first_rank"`` (w2's bias on the first rank only)."""

    hidden: int
    intermediate: int
    interleaved: bool = False
    bias: str = "none"

    def w13(self) -> Linear:
        label = "expert intermediate rows"
        return Linear("merged", self.hidden, (Segment("w1", self.intermediate, label=label), Segment("w3", self.intermediate, label=label)))

    def w2(self) -> Linear:
        return Linear("row", self.intermediate, (Segment(0, self.hidden, label="hidden rows"),))


def pack_segments(segments: tuple[Segment, ...], pack: int) -> tuple[Segment, ...]:
    """Segments measured in packed elements of ``pack`` rows (int4: 8 rows per int32)."""
    if pack == 1:
        return segments
    packed = []
    for s in segments:
        if s.unit % pack == 0:
            packed.append(replace(s, unit=s.unit // pack))
        elif not s.replicate and s.rows % pack == 0:
            packed.append(Segment(s.id, s.rows // pack, 1, label=f"packed {s.label}"))
        else:
            raise ConfigError(
                f"segment {s.id!r} has {s.rows} rows ({s.count} x {s.unit}), not a multiple of the packing factor {pack}"
            )
    return tuple(packed)


def groups_of(group_size: int, linear: Linear) -> int:
    """Quantization groups along the input of ``linear`` (1 for ``group_size`` -1 or the whole input)."""
    if group_size == -1 or group_size >= linear.in_size:
        return 1
    if linear.in_size % group_size:
        raise ConfigError(f"input size {linear.in_size} is not a multiple of the group size {group_size}")
    return linear.in_size // group_size


Get: TypeAlias = "Callable[[str], torch.Tensor]"  # a parameter of the module by suffix -> its rank-local tensor


class BoxDequantizer(Protocol):
    """Dequantizes any box of one checkpoint linear's weight (``[out, in]``) from the stored box
    and its scales' boxes (a JAX target's ``dequantize=True`` rule)."""

    @property
    def scale_names(self) -> tuple[str, ...]:
        """The suffixes of the checkpoint tensors beside ``weight`` that it reads."""
        ...

    def scale_box(self, name: str, box: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """The box of scale tensor ``name`` (of ``shape``) that weight box ``box`` needs."""
        ...

    def apply(self, weight: np.ndarray, scales: Mapping[str, np.ndarray], box: tuple[tuple[int, int], ...]) -> np.ndarray:
        """The float32 values of weight box ``box`` from its stored block and scale blocks (numpy)."""
        ...


class Scheme(Protocol):
    """How one linear (or one MoE layer's experts) is quantized: a format module's scheme."""

    @property
    def format(self) -> str: ...

    @property
    def online(self) -> bool: ...

    def linear_params(self, linear: Linear, model_dtype: str) -> list[ParamDef]:
        """Every parameter of a linear quantized so (bias excluded), global shapes."""
        ...

    def expert_params(self, experts: Experts, model_dtype: str) -> list[ParamDef]:
        """Every ``w13_*`` / ``w2_*`` parameter of one expert (global shapes, no expert dimension)."""
        ...

    def dequantize(self, get: Get, specs: Mapping[str, ParamSpec], parallel: Parallel, target: str = "checkpoint") -> torch.Tensor:
        """A rank-local linear's dense float32 ``[out, in]`` weight; ``specs`` its ParamSpecs by
        suffix; ``target`` the output layout the tensors are in (``load(target=...)``)."""
        ...

    def apply_target(
        self, target: str, module: str, tensors: dict[str, torch.Tensor], specs: Mapping[str, ParamSpec], parallel: Parallel
    ) -> None:
        """Turn the module's tensors (by full name, in place) into a kernel family's layout (``target``)."""
        ...

    def quantize(self, dense: torch.Tensor, specs: Mapping[str, ParamSpec], parallel: Parallel) -> dict[str, torch.Tensor]:
        """An online scheme's tensors (by suffix) from a dense rank-local weight."""
        ...

    def box_dequantizer(self) -> BoxDequantizer | None:
        """How to dequantize boxes of one stored linear's weight, or None when the format cannot."""
        ...

    def dequantize_experts(self, get: Get, stem: str, specs: Mapping[str, ParamSpec], parallel: Parallel) -> torch.Tensor:
        """An MoE layer's rank-local ``w13`` or ``w2`` (``stem``) as dense float32 ``[E_local, out, in]``."""
        ...

    def to_json(self) -> dict[str, object]: ...


class Quantization(Protocol):
    """A parsed ``quantization_config``: the scheme of each module, and what the method adds."""

    @property
    def method(self) -> str: ...

    @property
    def kv_params(self) -> Sequence[tuple[str, tuple[int, ...], str, float, Check | None]]:
        """(name, shape, dtype or "model", created value, check) of each KV-cache parameter."""
        ...

    @property
    def mapping(self) -> tuple[MappingTable, ...]: ...

    @property
    def optional(self) -> tuple[tuple[str, str], ...]:
        """(regex, why): checkpoint tensors dropped when no parameter takes them."""
        ...

    def quantizes(self, kind: str) -> bool: ...

    def scheme_for(self, module: str, sources: Sequence[str]) -> Scheme | None: ...
