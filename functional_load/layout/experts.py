"""MoE experts: the fused parameters of one expert layer, as vLLM's fused-MoE methods create them.

Each expert's gate (``w1``) and up (``w3``) projections fill ``routed_experts.w13_*`` (w1 rows
first, or gate/up interleaved as gpt-oss stores them), its down projection ``w2_*``; every
parameter is ``[E, ...]`` under an :class:`ExpertSplit`. Quantized experts get their scheme's dense
manifest (:func:`.schemes.quant_params`) for a merged ``w13`` and a row ``w2``, with vLLM's MoE
differences: per-tensor scales ``w13 [E, 2]`` and ``w2 [E]``, input scales ``[E]`` that w1 and
w3 share, ``weight_shape [E, 2]`` in the model dtype, FP8 block scales under the MoE block rule
(:class:`.scales.ExpertBlocks`), and GPTQ's expert biases, zero unless the checkpoint has them.
MXFP4 (gpt-oss) has its own manifest.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..model.expressions import Scope
from ..model.quant import QuantScheme
from ..model.spec import ModuleSpec
from .scales import ExpertBlocks, Pick, Shared
from .schemes import Linear, ParamDef, quant_params
from .segments import Segment
from .sharding import ExpertSplit, FirstRank, Grouped, Replicated, Sharding, Split

MXFP4_BLOCK = 32  # values per MXFP4 block: one e8m0 scale, 16 bytes of packed 4-bit values
BIASES = ("none", "all", "first_rank")


def expert_params(module: ModuleSpec, scope: Scope, dtype: str, scheme: QuantScheme | None) -> list[ParamDef]:
    """Every ``routed_experts.*`` parameter of one MoE layer (global shapes, ``[E, ...]``).

    Spec fields: ``experts``, ``in`` (hidden), ``intermediate``; ``bias`` (``"none"``,
    ``"all"``, or ``"first_rank"``: w2's bias on the first rank only, gpt-oss); ``interleaved``
    (gate and up rows alternate); ``input_major`` (fused checkpoint tensors are ``[E, in, out]``).
    """
    f, where = module.fields, module.pattern
    experts = scope.int(f["experts"], f"{where}.experts")
    hidden = scope.int(f["in"], f"{where}.in")
    inter = scope.int(f["intermediate"], f"{where}.intermediate")
    if experts < 1:
        raise ConfigError(f"{where}: {f['experts']!r} gave {experts} experts; an MoE layer needs at least one")
    bias = str(f.get("bias", "none"))
    if bias not in BIASES:
        raise ConfigError(f"{where}: bias = {bias!r}; expected one of {BIASES}")
    interleaved = bool(f.get("interleaved", False))
    if scheme is None:
        params = _plain(hidden, inter, dtype, interleaved)
    elif scheme.format == "mxfp4":
        params = _mxfp4(hidden, inter)
    else:
        if interleaved:
            raise ConfigError(f"{where}: interleaved gate/up experts quantized as {scheme.format} are not supported")
        params = _quantized(scheme, hidden, inter, dtype)
    if bias != "none" and not any(p.suffix == "w13_bias" for p in params):
        mxfp4 = scheme is not None and scheme.format == "mxfp4"
        w13 = _w13_split(inter, interleaved, MXFP4_BLOCK, uneven=True) if mxfp4 else _w13_split(inter, interleaved)
        w2: Sharding = Replicated() if bias == "all" else FirstRank()
        params += [ParamDef("w13_bias", (2 * inter,), w13, dtype), ParamDef("w2_bias", (hidden,), w2, dtype)]
    input_major = bool(f.get("input_major", False)) and scheme is None
    return [
        ParamDef(
            f"routed_experts.{p.suffix}", (experts, *p.shape),
            ExpertSplit(experts, p.sharding, input_major and p.suffix in ("w13_weight", "w2_weight")), p.dtype, p.default,
        )
        for p in params
    ]


def _w13_split(inter: int, interleaved: bool, unit: int = 1, uneven: bool = False) -> Split:
    """w13's rows: w1's then w3's, each split over the ranks; or, interleaved, pairs of gate and up
    rows split as one (a rank's rows are a contiguous range of the fused tensor)."""
    label = "expert intermediate rows"
    if interleaved:
        return Split(0, (Segment("w13", inter // unit, 2 * unit, label=label, uneven=uneven),))
    return Split(0, (Segment("w1", inter, label=label), Segment("w3", inter, label=label)))


def _w2_split(inter: int, dim: int, unit: int = 1, uneven: bool = False) -> Split:
    return Split(dim, (Segment("w2", inter // unit, unit, label="expert intermediate columns", uneven=uneven),))


def _plain(hidden: int, inter: int, dtype: str, interleaved: bool) -> list[ParamDef]:
    return [
        ParamDef("w13_weight", (2 * inter, hidden), _w13_split(inter, interleaved), dtype),
        ParamDef("w2_weight", (hidden, inter), _w2_split(inter, 1), dtype),
    ]


def _quantized(scheme: QuantScheme, hidden: int, inter: int, dtype: str) -> list[ParamDef]:
    """The dense manifest of ``scheme`` for w13 (merged) and w2 (row), with vLLM's MoE forms."""
    label = "expert intermediate rows"
    w13 = Linear("merged", hidden, (Segment("w1", inter, label=label), Segment("w3", inter, label=label)))
    w2 = Linear("row", inter, (Segment(0, hidden, label="hidden rows"),))
    params = []
    for stem, linear in (("w13", w13), ("w2", w2)):
        for p in quant_params(scheme, linear, dtype):
            shape, sharding, param_dtype = p.shape, p.sharding, p.dtype
            if p.suffix == "input_scale":  # one per expert: w1's and w3's must agree
                shape, sharding = (), Shared(linear.slot_ids())
            elif p.suffix == scheme.scale_name and scheme.strategy == "tensor" and linear.row:
                shape, sharding = (), Replicated()
            elif p.suffix == scheme.scale_name and scheme.strategy == "block":
                assert scheme.block is not None
                sharding = ExpertBlocks(inter, hidden, scheme.block, down=linear.row, refine=scheme.block_rule == "fp8")
            elif p.suffix == "weight_shape":  # vLLM keeps the last part it loads, in the model dtype
                ids = linear.slot_ids()
                sharding, param_dtype = Pick(ids, ids[-1]), dtype
            params.append(ParamDef(f"{stem}_{p.suffix}", shape, sharding, param_dtype, p.default))
    if scheme.format == "gptq":  # vLLM's GPTQ MoE method always has expert biases, zero by default
        params += [
            ParamDef("w13_bias", (2 * inter,), _w13_split(inter, False), dtype, 0.0),
            ParamDef("w2_bias", (hidden,), Replicated(), dtype, 0.0),
        ]
    return params


def _mxfp4(hidden: int, inter: int) -> list[ParamDef]:
    """gpt-oss MXFP4: ``_blocks [E, 2I, H/32, 16]`` (gate/up interleaved) become ``w13_weight
    [E, 2I, H/2]`` uint8, ``_scales`` e8m0 ``[E, 2I, H/32]``; the down projection likewise along
    its input. The intermediate splits in whole 32-value blocks, ``ceil(blocks / tp)`` per rank
    (the last ranks shorter, zero-padded: vLLM's CPU/emulation layout)."""
    if hidden % MXFP4_BLOCK or inter % MXFP4_BLOCK:
        raise ConfigError(f"MXFP4 experts need hidden ({hidden}) and intermediate ({inter}) sizes in whole blocks of {MXFP4_BLOCK}")
    half = MXFP4_BLOCK // 2
    w13: Sharding = _w13_split(inter, True, MXFP4_BLOCK, uneven=True)
    return [
        ParamDef("w13_weight", (2 * inter, hidden // 2), Grouped(w13, half), "uint8"),
        ParamDef("w13_weight_scale", (2 * inter, hidden // MXFP4_BLOCK), w13, "uint8"),
        ParamDef("w2_weight", (hidden, inter // 2), Grouped(_w2_split(inter // 2, 1, half, uneven=True), half), "uint8"),
        ParamDef("w2_weight_scale", (hidden, inter // MXFP4_BLOCK), _w2_split(inter // MXFP4_BLOCK, 1, uneven=True), "uint8"),
    ]
