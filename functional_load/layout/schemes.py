"""Quantization schemes: which parameters a linear module has, and how each is sharded.

The scheme decides the parameter manifest at layout time; the planner and reader never
special-case a format. Shapes are global (what the checkpoint holds); the sharding says how
each tensor splits with the linear's output segments (column-like) or its input (row).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError
from ..sharding import Blocked, Pick, Replicated, Segment, Shared, Sharding, Slots, Split

FP8_FORMATS = ("fp8",)
INT_FORMATS = ("int8", "pack", "gptq", "awq")


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


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """How one linear module is quantized.

    * ``fp8``: ``weight`` float8_e4m3fn; ``strategy`` tensor (one scale per logical shard),
      channel (``[out, 1]``) or block (``block = (bn, bk)``, scale named ``scale_name``).
    * ``int8``: ``weight`` int8, per-channel or per-tensor ``weight_scale`` (W8A8, W8A16).
    * ``pack``: compressed-tensors pack-quantized int4/int8 (``weight_packed [out, in/pf]``,
      ``weight_scale [out, groups]``, asymmetric ``weight_zero_point [out/pf, groups]``).
    * ``gptq``: ``qweight [in/pf, out]``, ``qzeros [groups, out/pf]``, ``scales [groups, out]``,
      ``g_idx [in]`` with act-order; ``zero_offset`` 1 for v1 checkpoints (stored zero - 1).
    * ``awq``: ``qweight [in, out/pf]`` (interleaved), ``qzeros``, ``scales``.

    ``online`` FP8 schemes read an unquantized weight and quantize it as it is loaded; their
    scales are derived from the weight, not read.
    """

    format: str
    bits: int = 8
    strategy: str = "tensor"  # tensor | channel | group | block
    group_size: int = -1
    block: tuple[int, int] | None = None
    symmetric: bool = True
    static_input: bool = False
    scale_name: str = "weight_scale"
    scale_dtype: str = "float32"
    zero_offset: int = 0
    act_order: bool = False
    online: bool = False  # the checkpoint holds unquantized weights; quantize them while loading
    block_rule: str = "strict"  # the block-shape check of its scales (see sharding.Blocked.rule)

    def __post_init__(self) -> None:
        if self.format not in FP8_FORMATS + INT_FORMATS:
            raise ConfigError(f"unknown quantization format {self.format!r}")
        if self.strategy == "block" and (self.block is None or len(self.block) != 2):
            raise ConfigError(f"block quantization needs a block size of 2 dimensions, got {self.block!r}")

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    def groups(self, linear: Linear) -> int:
        if self.group_size in (-1, None) or self.group_size >= linear.in_size:
            return 1
        if linear.in_size % self.group_size:
            raise ConfigError(f"input size {linear.in_size} is not a multiple of the group size {self.group_size}")
        return linear.in_size // self.group_size

    def params(self, linear: Linear, model_dtype: str) -> list[tuple[str, tuple[int, ...], Sharding, str]]:
        """``(suffix, global shape, sharding, dtype)`` of every parameter of the layer, bias excluded."""
        out, inp = linear.out_size, linear.in_size
        weight_sharding = linear.out_split(0) if linear.column else linear.in_split(1, inp, "input columns")
        if self.format in ("fp8", "int8"):
            dtype = "float8_e4m3fn" if self.format == "fp8" else "int8"
            params = [("weight", (out, inp), weight_sharding, dtype), self._scale(linear)]
            if self.static_input:
                params.append(("input_scale", (len(linear.slot_ids()),), Slots(linear.slot_ids()), "float32"))
            return params
        pf, groups = self.pack_factor, self.groups(linear)
        if self.format == "pack":
            params = [
                ("weight_packed", (out, inp // pf), linear.out_split(0) if linear.column else linear.in_split(1, inp // pf, "packed input columns"), "int32"),
                ("weight_scale", (out, groups), self._group_split(linear, 0, 1, groups), model_dtype),
            ]
            if not self.symmetric:
                params.append(("weight_zero_point", (-(-out // pf), groups), linear.out_split(0, pf) if linear.column else linear.in_split(1, groups, "quantization groups"), "int32"))
            # The checkpoint's [out, in] of each part; vLLM keeps the last part it loads.
            ids = linear.slot_ids()
            params.append(("weight_shape", (2,), Pick(ids, ids[-1]) if len(ids) > 1 else Replicated(), "int64"))
            return params
        if self.format == "gptq":
            scale_groups = self._group_split(linear, 1, 0, groups, replicate_in=self.act_order)
            params = [
                ("qweight", (inp // pf, out), linear.out_split(1) if linear.column else linear.in_split(0, inp // pf, "packed input rows"), "int32"),
                ("qzeros", (groups, out // pf), linear.out_split(1, pf) if linear.column else _groups(linear, 0, groups, self.act_order), "int32"),
                ("scales", (groups, out), scale_groups, model_dtype),
            ]
            if self.act_order:
                g_idx = linear.in_split(0, inp, "input rows") if linear.row else Shared(linear.slot_ids())
                params.append(("g_idx", (inp,), g_idx, "int32"))
            return params
        # awq
        return [
            ("qweight", (inp, out // pf), linear.out_split(1, pf) if linear.column else linear.in_split(0, inp, "input rows"), "int32"),
            ("qzeros", (groups, out // pf), linear.out_split(1, pf) if linear.column else _groups(linear, 0, groups, False), "int32"),
            ("scales", (groups, out), self._group_split(linear, 1, 0, groups), model_dtype),
        ]

    def _scale(self, linear: Linear) -> tuple[str, tuple[int, ...], Sharding, str]:
        out, inp = linear.out_size, linear.in_size
        if self.strategy == "tensor":
            ids = linear.slot_ids()
            return (self.scale_name, (len(ids),), Slots(ids), "float32")
        if self.strategy == "channel":
            return (self.scale_name, (out, 1), linear.out_split(0), "float32")
        if self.strategy == "block":
            bn, bk = self.block  # type: ignore[misc]
            shape = (-(-out // bn), -(-inp // bk))
            if linear.column:
                sharding: Sharding = Blocked(Split(0, linear.segments, linear.disable_tp), bn, self.block_rule)
            elif linear.row:
                sharding = Blocked(Split(1, (Segment(0, inp, label="input columns"),)), bk, self.block_rule)
            else:
                sharding = Replicated()
            return (self.scale_name, shape, sharding, self.scale_dtype)
        raise ConfigError(f"{self.format} weights with a {self.strategy!r} scale strategy are not supported")

    def _group_split(self, linear: Linear, out_dim: int, in_dim: int, groups: int, replicate_in: bool = False) -> Sharding:
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
