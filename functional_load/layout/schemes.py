"""Quantized linears: which parameters a linear module has under a scheme, and how each is sharded.

The scheme (:class:`functional_load.model.quant.QuantScheme`) decides the parameter manifest at
layout time; the planner and reader never special-case a format. Shapes are global (what the checkpoint holds); the sharding says how
each tensor splits with the linear's output segments (column-like) or its input (row).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from ..errors import ConfigError
from ..model.quant import QuantScheme
from .scales import Blocked, Pick, Shared, Slots
from .segments import Segment
from .sharding import Replicated, Sharding, Split


class ParamDef(NamedTuple):
    """One parameter of a module: its name after the module's, its global shape (what the
    checkpoint holds), descriptor and dtype; ``default`` is the value it keeps when the checkpoint
    lacks it (None: the checkpoint must hold it)."""

    suffix: str
    shape: tuple[int, ...]
    sharding: Sharding
    dtype: str
    default: float | None = None


@dataclass(frozen=True, slots=True)
class Linear:
    """The shape of one linear module, as far as a quantization scheme needs it."""

    kind: str  # column | merged | qkv | row | replicated_linear
    in_size: int
    segments: tuple[Segment, ...]  # output segments (one for plain column/row layers)
    disable_tp: bool = False

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
        return Split(dim, pack_segments(self.segments, pack), self.disable_tp)

    def in_split(self, dim: int, count: int, label: str) -> Sharding:
        """Sharding of a tensor whose ``dim`` runs over ``count`` input units (columns, packs, groups)."""
        if not self.row:
            return Replicated()
        return Split(dim, (Segment(0, count, label=label),))

    def slot_ids(self) -> tuple[Any, ...]:
        """One per-tensor scale slot per logical shard of a column-like layer (q/k/v: 3)."""
        return tuple(s.id for s in self.segments) if self.column else (0,)


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


def groups_of(scheme: QuantScheme, linear: Linear) -> int:
    """Quantization groups along the input of ``linear`` (1 for per-channel int formats)."""
    if scheme.group_size == -1 or scheme.group_size >= linear.in_size:
        return 1
    if linear.in_size % scheme.group_size:
        raise ConfigError(f"input size {linear.in_size} is not a multiple of the group size {scheme.group_size}")
    return linear.in_size // scheme.group_size


def quant_params(scheme: QuantScheme, linear: Linear, model_dtype: str) -> list[ParamDef]:
    """``(suffix, global shape, sharding, dtype)`` of every parameter of a linear quantized with
    ``scheme``, bias excluded: the format's manifest, as vLLM's ``create_weights`` makes it.

    * ``fp8``: ``weight`` float8_e4m3fn; a per-tensor scale per logical shard (``Slots``), per
      channel (``[out, 1]``) or per block (``Blocked``), named ``scheme.scale_name``.
    * ``int8``: ``weight`` int8, per-channel or per-tensor ``weight_scale`` (W8A8, W8A16).
    * ``pack``: compressed-tensors pack-quantized int4/int8 (``weight_packed [out, in/pf]``,
      ``weight_scale [out, groups]``, asymmetric ``weight_zero_point [out/pf, groups]``,
      ``weight_shape``).
    * ``gptq``: ``qweight [in/pf, out]``, ``qzeros [groups, out/pf]``, ``scales [groups, out]``,
      ``g_idx [in]`` with act-order.
    * ``awq``: ``qweight [in, out/pf]`` (interleaved), ``qzeros``, ``scales``.
    """
    return [ParamDef(*p) for p in _manifest(scheme, linear, model_dtype)]


def _manifest(scheme: QuantScheme, linear: Linear, model_dtype: str) -> list[tuple[Any, ...]]:
    out, inp = linear.out_size, linear.in_size
    weight_sharding = linear.out_split(0) if linear.column else linear.in_split(1, inp, "input columns")
    if scheme.format in ("fp8", "int8"):
        dtype = "float8_e4m3fn" if scheme.format == "fp8" else "int8"
        params = [("weight", (out, inp), weight_sharding, dtype), _scale(scheme, linear)]
        if scheme.static_input:
            params.append(("input_scale", (len(linear.slot_ids()),), Slots(linear.slot_ids()), "float32"))
        return params
    pf, groups = scheme.pack_factor, groups_of(scheme, linear)
    if scheme.format == "pack":
        params = [
            (
                "weight_packed", (out, inp // pf),
                linear.out_split(0) if linear.column else linear.in_split(1, inp // pf, "packed input columns"), "int32",
            ),
            ("weight_scale", (out, groups), _group_split(linear, 0, 1, groups), model_dtype),
        ]
        if not scheme.symmetric:
            zero_split = linear.out_split(0, pf) if linear.column else linear.in_split(1, groups, "quantization groups")
            params.append(("weight_zero_point", (-(-out // pf), groups), zero_split, "int32"))
        # The checkpoint's [out, in] of each part; vLLM keeps the last part it loads.
        ids = linear.slot_ids()
        params.append(("weight_shape", (2,), Pick(ids, ids[-1]) if len(ids) > 1 else Replicated(), "int64"))
        return params
    if scheme.format == "gptq":
        scale_groups = _group_split(linear, 1, 0, groups, replicate_in=scheme.act_order)
        params = [
            ("qweight", (inp // pf, out), linear.out_split(1) if linear.column else linear.in_split(0, inp // pf, "packed input rows"),
             "int32"),
            ("qzeros", (groups, out // pf), linear.out_split(1, pf) if linear.column else _groups(linear, 0, groups, scheme.act_order),
             "int32"),
            ("scales", (groups, out), scale_groups, model_dtype),
        ]
        if scheme.act_order:
            g_idx = linear.in_split(0, inp, "input rows") if linear.row else Shared(linear.slot_ids())
            params.append(("g_idx", (inp,), g_idx, "int32"))
        return params
    # awq
    return [
        ("qweight", (inp, out // pf), linear.out_split(1, pf) if linear.column else linear.in_split(0, inp, "input rows"), "int32"),
        ("qzeros", (groups, out // pf), linear.out_split(1, pf) if linear.column else _groups(linear, 0, groups, False), "int32"),
        ("scales", (groups, out), _group_split(linear, 1, 0, groups), model_dtype),
    ]


def _scale(scheme: QuantScheme, linear: Linear) -> tuple[Any, ...]:
    out, inp = linear.out_size, linear.in_size
    if scheme.strategy == "tensor":
        ids = linear.slot_ids()
        return (scheme.scale_name, (len(ids),), Slots(ids), "float32")
    if scheme.strategy == "channel":
        return (scheme.scale_name, (out, 1), linear.out_split(0), "float32")
    if scheme.strategy == "block":
        bn, bk = scheme.block  # type: ignore[misc]
        shape = (-(-out // bn), -(-inp // bk))
        if linear.column:
            sharding: Sharding = Blocked(Split(0, linear.segments, linear.disable_tp), bn, scheme.block_rule)
        elif linear.row:
            sharding = Blocked(Split(1, (Segment(0, inp, label="input columns"),)), bk, scheme.block_rule)
        else:
            sharding = Replicated()
        return (scheme.scale_name, shape, sharding, scheme.scale_dtype)
    raise ConfigError(f"{scheme.format} weights with a {scheme.strategy!r} scale strategy are not supported")


def _group_split(linear: Linear, out_dim: int, in_dim: int, groups: int, replicate_in: bool = False) -> Sharding:
    """Per-group scales: split with the outputs (column) or over the groups (row)."""
    if linear.column:
        return linear.out_split(out_dim)
    return _groups(linear, in_dim, groups, replicate_in)


def _groups(linear: Linear, dim: int, groups: int, replicate: bool) -> Sharding:
    """Row-parallel tensors indexed by quantization group. With act-order (``g_idx``) every
    rank keeps all groups, since its input rows may belong to any of them (vLLM does the same)."""
    if replicate or groups == 1:
        return Replicated()
    return linear.in_split(dim, groups, "quantization groups")
