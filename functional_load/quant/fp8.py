"""FP8 (e4m3) weights with a scale: per tensor, per channel or per block; and INT8, the same shape.

* Parsing: vLLM's ``fp8`` method (AutoFP8 / Quark-exported per-tensor checkpoints with
  ``activation_scheme``; DeepSeek / transformers FineGrainedFP8 ``weight_block_size`` with
  ``weight_scale_inv``), and online quantization (``quantization="fp8"`` / ``"fp8_block"``).
  compressed-tensors, Quark and ModelOpt configs build the same :class:`Fp8Scheme` (their modules).
* Manifest (vLLM ``create_weights``): ``weight`` e4m3 (int8 for INT8); the scale: one per logical
  shard of a fused linear (``Slots``), ``[out, 1]`` per channel, or block scales ``Blocked``
  (vLLM's block-shape rule; for fused experts ``ExpertBlocks``, refined grids for the fp8
  method); a static ``input_scale`` per shard. Scales are read before any weight and must be
  finite and positive.
* ``W = q * scale``; post-load targets ``cuda-fp8`` / ``rocm-fp8`` (vLLM's
  ``process_weights_after_loading``, see :func:`apply_target`); online quantization per rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, NamedTuple

from ..errors import ConfigError
from ..layout.experts import from_linears
from ..layout.parallel import Parallel
from ..layout.param import ParamSpec
from ..layout.quantized import FP8_DTYPES, Experts, Get, Linear, ParamDef
from ..layout.scales import Blocked, ExpertBlocks, Slots
from ..layout.sharding import Replicated, Sharding, Split
from ..paths import JsonDict, JsonObject
from .base import BaseScheme
from .config import QuantConfig, ignore_list, int_field
from .fp8_targets import experts_to_target, linear_to_target, quantize_dense
from .kv import BASE_KV, CACHE_SCALES, OPTIONAL_KV

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

Strategy = Literal["tensor", "channel", "block"]
BlockRule = Literal["strict", "fp8", "none"]  # the block-shape check (layout.scales.Blocked's rule)
STRATEGIES: tuple[Strategy, ...] = ("tensor", "channel", "block")
BLOCK_RULES: tuple[BlockRule, ...] = ("strict", "fp8", "none")


@dataclass(frozen=True, slots=True)
class TensorScale:
    """One scale per logical shard of a fused linear (per tensor)."""

    name: ClassVar[Literal["tensor"]] = "tensor"


@dataclass(frozen=True, slots=True)
class ChannelScale:
    """One scale per output row (``[out, 1]``)."""

    name: ClassVar[Literal["channel"]] = "channel"


@dataclass(frozen=True, slots=True)
class BlockScale:
    """One scale per ``rows x cols`` block of the weight."""

    rows: int
    cols: int
    name: ClassVar[Literal["block"]] = "block"

    def __post_init__(self) -> None:
        if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in (self.rows, self.cols)):
            raise ConfigError(f"block quantization needs a block size of 2 positive integers, got {[self.rows, self.cols]!r}; "
                              f"check config.json")

    @property
    def size(self) -> tuple[int, int]:
        return self.rows, self.cols


ScaleGeometry = TensorScale | ChannelScale | BlockScale


def scale_geometry(strategy: str, block: Sequence[int] | None = None, what: str = "fp8") -> ScaleGeometry:
    """A config's scale strategy (``"tensor"``, ``"channel"``, ``"block"`` with its block size)."""
    if strategy == "tensor":
        return TensorScale()
    if strategy == "channel":
        return ChannelScale()
    if strategy == "block":
        if block is None or len(block) != 2:
            raise ConfigError(f"block quantization needs a block size of 2 positive integers, got {block!r}; check config.json")
        return BlockScale(block[0], block[1])
    raise ConfigError(f"{what} weights with a {strategy!r} scale strategy are not supported; use one of {STRATEGIES}")


@dataclass(frozen=True, slots=True)
class Fp8Scheme(BaseScheme):
    """FP8 weights whose scale has ``geometry`` (per tensor, per channel, per block), named
    ``scale_name``; ``static_input``: a static per-tensor input scale; ``online``: the checkpoint
    holds dense weights, quantized while loading; ``block_rule``: the block-shape check
    (:class:`~functional_load.layout.scales.Blocked`)."""

    geometry: ScaleGeometry = TensorScale()
    static_input: bool = False
    scale_name: str = "weight_scale"
    scale_dtype: str = "float32"
    online: bool = False
    block_rule: BlockRule = "strict"

    def __post_init__(self) -> None:
        if self.block_rule not in BLOCK_RULES:
            raise ConfigError(f"unknown block rule {self.block_rule!r}")

    @property
    def strategy(self) -> Strategy:
        return self.geometry.name

    @property
    def block_size(self) -> tuple[int, int]:
        """The ``(rows, columns)`` of a scale block (block geometry only)."""
        if not isinstance(self.geometry, BlockScale):
            raise ValueError(f"{self.format} weights with a {self.strategy!r} scale have no block size")
        return self.geometry.size

    def to_json(self) -> JsonDict:
        block = list(self.geometry.size) if isinstance(self.geometry, BlockScale) else None
        return {"format": self.format, "strategy": self.strategy, "block": block, "static_input": self.static_input,
                "scale_name": self.scale_name, "scale_dtype": self.scale_dtype, "online": self.online, "block_rule": self.block_rule}

    @property
    def format(self) -> str:
        return "fp8"

    @property
    def weight_dtype(self) -> str:
        return "float8_e4m3fn"

    def _stored(self) -> tuple[str, ...]:
        return () if self.online else FP8_DTYPES if self.format == "fp8" else ("int8",)

    def linear_params(self, linear: Linear, model_dtype: str) -> list[ParamDef]:
        out, inp = linear.out_size, linear.in_size
        params = [ParamDef("weight", (out, inp), linear.weight_split(), self.weight_dtype, stored=self._stored()), self._scale(linear)]
        if self.static_input:
            ids = linear.slot_ids()
            params.append(ParamDef("input_scale", (len(ids),), Slots(ids), "float32", check="positive", role="input_scale"))
        return params

    def _scale(self, linear: Linear) -> ParamDef:
        out, inp = linear.out_size, linear.in_size
        sharding: Sharding
        shape: tuple[int, ...]
        geometry = self.geometry
        if isinstance(geometry, TensorScale):
            ids = linear.slot_ids()
            shape, sharding = (len(ids),), Slots(ids)
        elif isinstance(geometry, ChannelScale):
            shape, sharding = (out, 1), linear.out_split(0)
        else:
            bn, bk = geometry.size
            shape = (-(-out // bn), -(-inp // bk))
            if linear.column:
                sharding = Blocked(_split(linear.out_split(0)), bn, self.block_rule)
            elif linear.row:
                sharding = Blocked(_split(linear.in_split(1, inp, "input columns")), bk, self.block_rule)
            else:
                sharding = Replicated()
        return ParamDef(self.scale_name, shape, sharding, self.scale_dtype, check="positive", role="scale")

    def expert_params(self, experts: Experts, model_dtype: str) -> list[ParamDef]:
        def fix(p: ParamDef, linear: Linear, down: bool) -> ParamDef:
            if p.role == "scale" and isinstance(self.geometry, BlockScale):
                blocks = ExpertBlocks(experts.intermediate, experts.hidden, self.geometry.size, down=down, refine=self.block_rule == "fp8")
                return p._replace(sharding=blocks)
            return p

        return from_linears(self, experts, model_dtype, fix)

    def dequantize(self, get: Get, specs: Mapping[str, ParamSpec], parallel: Parallel, target: str = "checkpoint") -> torch.Tensor:
        import torch

        weight = get("weight").float().numpy()
        scale = get(self.scale_name).float().numpy()
        if target != "checkpoint" and self.strategy in ("tensor", "channel"):
            weight = weight.T  # kernel layouts hold [in, out]; a per-tensor scale is one scalar
            if self.strategy == "tensor":
                return torch.from_numpy(dequantize_cells(weight, [Cells((0, weight.shape[0]), scale.reshape(1, 1), weight.shape)]))
        rows, cols = weight.shape
        if self.strategy == "channel":
            return torch.from_numpy(dequantize_cells(weight, [Cells((0, rows), scale.reshape(-1, 1), (1, cols))]))
        pieces = specs["weight"].local_pieces(parallel)
        if self.strategy == "tensor":  # one scale per fused segment (in order), over that segment's rows
            flat = scale.reshape(-1)
            cells = [Cells((a, b), flat[k].reshape(1, 1), (b - a, cols)) for k, (_, (a, b)) in enumerate(pieces)]
            return torch.from_numpy(dequantize_cells(weight, cells))
        weight_rows = dict(pieces)  # block: each segment's scale blocks over its rows
        blocks = [Cells(weight_rows.get(segment, (0, rows)), scale[b0:b1], self.block_size) for segment, (b0, b1) in
                  specs[self.scale_name].local_pieces(parallel)]
        return torch.from_numpy(dequantize_cells(weight, blocks))

    def dequantize_experts(self, get: Get, stem: str, specs: Mapping[str, ParamSpec], parallel: Parallel) -> torch.Tensor:
        import torch

        weight, scale = get(f"{stem}_weight").float().numpy(), get(f"{stem}_{self.scale_name}").float().numpy()
        experts, out, inp = weight.shape
        halves = 2 if stem == "w13" else 1  # w13's rows: w1's, then w3's, each with its own scales
        if self.strategy == "channel":
            cells = [Cells((0, out), scale, (1, inp))]
        elif self.strategy == "block":
            hidden = specs["w13_weight"].shape[2]
            grid = ExpertBlocks(specs["w13_weight"].shape[1] // 2, hidden, self.block_size, refine=self.block_rule == "fp8").grid(
                parallel.expert_tp
            )
            half, per = out // halves, scale.shape[1] // halves
            cells = [Cells((h * half, (h + 1) * half), scale[:, h * per : (h + 1) * per], grid) for h in range(halves)]
        elif stem == "w13" and scale.ndim == 2:  # a scale per expert and shard: w1's rows, then w3's
            cells = [Cells((h * out // 2, (h + 1) * out // 2), scale[:, h].reshape(experts, 1, 1), (out // 2, inp)) for h in range(2)]
        else:
            cells = [Cells((0, out), scale.reshape(-1, 1, 1), (out, inp))]
        return torch.from_numpy(dequantize_cells(weight, cells))

    def apply_target(
        self, target: str, module: str, tensors: dict[str, torch.Tensor], specs: Mapping[str, ParamSpec], parallel: Parallel
    ) -> None:
        if "routed_experts.w13_weight" in specs:
            experts_to_target(self, target, f"{module}.routed_experts.", tensors)
        else:
            widths = tuple(b - a for _, (a, b) in specs["weight"].local_pieces(parallel))
            linear_to_target(self, target, module, tensors, widths)

    def quantize(self, dense: torch.Tensor, specs: Mapping[str, ParamSpec], parallel: Parallel) -> dict[str, torch.Tensor]:
        return quantize_dense(self, dense, specs, parallel)

    def box_dequantizer(self) -> Fp8Boxes | None:
        return None if self.online else Fp8Boxes(self.scale_name, self.geometry)


@dataclass(frozen=True, slots=True)
class Fp8Boxes:
    """Boxes of a stored FP8 (or INT8) weight and the scale cells that cover them:
    ``W = q * scale`` in float32 (:func:`dequantize_cells`, as every FP8 dequantization)."""

    scale: str
    geometry: ScaleGeometry

    @property
    def scale_names(self) -> tuple[str, ...]:
        return (self.scale,)


    def scale_box(self, name: str, box: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        geometry = self.geometry
        if isinstance(geometry, TensorScale):
            return tuple((0, n) for n in shape)
        (r0, r1), (c0, c1) = box
        if isinstance(geometry, ChannelScale):
            return ((r0, r1), (0, shape[1]))
        bn, bk = geometry.size
        return ((r0 // bn, -(-r1 // bn)), (c0 // bk, -(-c1 // bk)))

    def apply(self, weight: np.ndarray, scales: Mapping[str, np.ndarray], box: tuple[tuple[int, int], ...]) -> npt.NDArray[np.float32]:
        import numpy as np

        scale = np.asarray(scales[self.scale], dtype=np.float32)
        rows, cols = weight.shape
        geometry = self.geometry
        if isinstance(geometry, TensorScale):
            cells = Cells((0, rows), scale.reshape(1, 1), (rows, cols))
        elif isinstance(geometry, ChannelScale):
            cells = Cells((0, rows), scale.reshape(-1, 1), (1, cols))
        else:
            (r0, _), (c0, _) = box
            cells = Cells((0, rows), scale, geometry.size, (r0 % geometry.size[0], c0 % geometry.size[1]))
        return dequantize_cells(weight.astype(np.float32), [cells])


@dataclass(frozen=True, slots=True)
class Int8Scheme(Fp8Scheme):
    """INT8 weights with a per-channel or per-tensor scale (compressed-tensors W8A8 / W8A16)."""

    @property
    def format(self) -> str:
        return "int8"

    @property
    def weight_dtype(self) -> str:
        return "int8"


class Cells(NamedTuple):
    """Weight rows ``[a, b)`` (of the last two dimensions; leading ones, an expert's, go along)
    whose scales are ``scale``, each cell covering ``grid`` values, the rows starting ``offset``
    values into their first cell (a box of a block-scaled weight)."""

    rows: tuple[int, int]
    scale: np.ndarray
    grid: tuple[int, int]
    offset: tuple[int, int] = (0, 0)


def dequantize_cells(weight: np.ndarray, cells: Sequence[Cells]) -> npt.NDArray[np.float32]:
    """``W = q * scale`` in float32, the one FP8 (and INT8) dequantization, over the rows each of
    ``cells`` covers (rows none covers are left uninitialised)."""
    import numpy as np

    out = np.empty(weight.shape, dtype=np.float32)
    cols = weight.shape[-1]
    for (a, b), scale, (gr, gc), (r0, c0) in cells:
        expanded = np.repeat(np.repeat(np.asarray(scale, dtype=np.float32), gr, axis=-2), gc, axis=-1)
        np.multiply(weight[..., a:b, :], expanded[..., r0 : r0 + b - a, c0 : c0 + cols], out=out[..., a:b, :], dtype=np.float32)
    return out


def parse_fp8(qc: JsonObject) -> QuantConfig:
    """vLLM's ``fp8`` method: per-tensor (``activation_scheme`` static or dynamic) or, with
    ``weight_block_size``, DeepSeek's block format (``weight_scale_inv``, dynamic activations)."""
    if qc.get("weight_scale_semantics", "") == "inverse" or str(qc.get("checkpoint_format", "")).startswith("float8"):
        raise ConfigError(
            "config.json: this FP8 checkpoint (GPTQModel format, weight_scale_semantics='inverse') stores the reciprocal "
            "of DeepSeek's weight_scale_inv; loading it as vLLM fp8 would silently scale every weight wrongly. "
            "Re-export it in the DeepSeek / compressed-tensors layout"
        )
    activation = str(qc.get("activation_scheme", "dynamic")).lower()
    if activation not in ("static", "dynamic"):
        raise ConfigError(f"config.json: Unsupported activation scheme {activation!r} (use 'static' or 'dynamic')")
    block = qc.get("weight_block_size")
    if block is not None:
        if len(block) != 2:
            raise ConfigError(
                f"config.json: The quantization block size of weight must have 2 dimensions, but got {len(block)} dimensions"
            )
        if activation != "dynamic":
            raise ConfigError(
                f"config.json: The block-wise quantization only supports dynamic activation scheme for now, but got "
                f"{activation} activation scheme."
            )
        # vLLM keeps block scales float32, e8m0 (scale_fmt "ue8m0") ones included: powers of two, cast exactly.
        default = Fp8Scheme(
            BlockScale(int_field(block[0], "weight_block_size[0]"), int_field(block[1], "weight_block_size[1]")),
            scale_name="weight_scale_inv", block_rule="fp8",
        )
    else:
        default = Fp8Scheme(TensorScale(), static_input=activation == "static")
    return QuantConfig("fp8", default, ignore_list(qc), kv_params=BASE_KV, mapping=(CACHE_SCALES,), optional=OPTIONAL_KV)


ONLINE_METHODS = ("fp8", "fp8_block")


def online_quant_config(method: str, config: JsonObject, stored: bool = False) -> QuantConfig:
    """Quantize an unquantized checkpoint while loading: ``"fp8"`` (per-tensor scale
    ``amax / 448`` per rank-local weight) or ``"fp8_block"`` (128 x 128 blocks). ``stored``: the
    weights were quantized so when saved (a pre-sharded save); they and their scales are read."""
    if method not in ONLINE_METHODS:
        raise ConfigError(f"quantization={method!r} is not supported; use one of {ONLINE_METHODS}")
    if config.get("quantization_config") is not None:
        existing = config["quantization_config"].get("quant_method")
        raise ConfigError(
            f"quantization={method!r} asks to quantize while loading, but the checkpoint is already quantized "
            f"({existing!r}); drop the quantization option to load it as stored"
        )
    if method == "fp8":
        scheme = Fp8Scheme(TensorScale(), online=not stored)
    else:
        scheme = Fp8Scheme(BlockScale(128, 128), scale_name="weight_scale_inv", online=not stored, block_rule="none")
    return QuantConfig(f"online-{method}", scheme, kv_params=BASE_KV, mapping=(CACHE_SCALES,), optional=OPTIONAL_KV)


def _split(sharding: Sharding) -> Split:
    """The split a column's rows (or a row's columns) have: what a block scale counts blocks of."""
    if not isinstance(sharding, Split):
        raise TypeError(f"a block scale needs a split weight, not {sharding!r}")
    return sharding
