"""MoE experts: the fused parameters of one expert layer, as vLLM's fused-MoE methods create them.

Each expert's gate (``w1``) and up (``w3``) projections fill ``routed_experts.w13_*`` (w1 rows
first, or gate/up interleaved as gpt-oss stores them), its down projection ``w2_*``; every
parameter is ``[E, ...]`` under an :class:`ExpertSplit`. Unquantized experts are built here;
quantized ones take their scheme's expert manifest (:meth:`.quantized.Scheme.expert_params`),
most of which derive it from the scheme's dense manifest for a merged ``w13`` and a row ``w2``
with vLLM's MoE differences (:func:`from_linears`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..errors import ConfigError
from ..model.expressions import Scope, evaluate
from ..model.spec import ModuleSpec
from .expert_sharding import ExpertSplit, FirstRank
from .quantized import Experts, Linear, ParamDef, Scheme
from .scales import Pick, Shared, Slots
from .segments import Segment
from .sharding import Replicated, Sharding, Split

BIASES = ("none", "all", "first_rank")


def expert_params(module: ModuleSpec, scope: Scope, dtype: str, scheme: Scheme | None) -> list[ParamDef]:
    """Every ``routed_experts.*`` parameter of one MoE layer (global shapes, ``[E, ...]``).

    Spec fields: ``experts``, ``in`` (hidden), ``intermediate``; ``bias`` (``"none"``,
    ``"all"``, or ``"first_rank"``: w2's bias on the first rank only, gpt-oss); ``interleaved``
    (gate and up rows alternate); ``input_major`` (fused checkpoint tensors are ``[E, in, out]``);
    ``pad`` (with tp > 1, each rank allocates at least this many intermediate rows, zero past its own);
    ``flat`` (a tensor holding every expert is ``[E * rows, cols]``: DBRX); ``gated`` (an
    expression, default true; false: non-gated experts, whose ``w13`` is ``w1`` alone,
    ``[E, I, H]``, as vLLM's ``is_act_and_mul=False`` experts: Nemotron-H's relu2).
    """
    f, where = module.fields, module.pattern
    experts = scope.int(f["experts"], f"{where}.experts")
    if experts < 1:
        raise ConfigError(f"{where}: {f['experts']!r} gave {experts} experts; an MoE layer needs at least one")
    bias = str(f.get("bias", "none"))
    if bias not in BIASES:
        raise ConfigError(f"{where}: bias = {bias!r}; expected one of {BIASES}")
    hidden, inter = scope.int(f["in"], f"{where}.in"), scope.int(f["intermediate"], f"{where}.intermediate")
    shape = Experts(hidden, inter, bool(f.get("interleaved")), bias)
    params = plain(shape, dtype) if scheme is None else scheme.expert_params(shape, dtype)
    if bias != "none" and not any(p.role == "bias" for p in params):
        params += biases(shape, dtype, bias, w13_split(shape.intermediate, shape.interleaved))
    # input_major: true (both w13 and w2) or the one of them ("w13", "w2") stored input-major
    major = f.get("input_major", False)
    majors = {"w13_weight", "w2_weight"} if major is True else {f"{major}_weight"} if isinstance(major, str) else set()
    input_major = bool(majors) and scheme is None
    flat = bool(f.get("flat", False))
    if flat and scheme is not None:
        raise ConfigError(f"{where}: experts stored flat (flat = true) are described for plain experts only")
    if not evaluate(f.get("gated", True), scope):  # non-gated experts (relu2: up and down only): w13 holds w1 alone
        if scheme is not None or shape.interleaved or bias != "none":
            raise ConfigError(f"{where}: non-gated experts (gated = {f['gated']!r}) are described for plain experts only")
        one = Split(0, (Segment("w1", inter, label="expert intermediate rows"),))
        params = [p._replace(shape=(inter, hidden), sharding=one) if p.suffix == "w13_weight" else p for p in params]
    pad = scope.int(f.get("pad", 0), f"{where}.pad")
    if pad:  # with tp > 1 (not expert-parallel), each rank's intermediate rows padded with zeros to >= pad
        if scheme is not None or shape.interleaved or bias != "none":
            raise ConfigError(f"{where}: padded expert intermediate rows (pad = {f['pad']!r}) are described for plain experts only")
        params = [p._replace(sharding=_padded(p.sharding, pad)) for p in params]
    return [
        p._replace(
            suffix=f"routed_experts.{p.suffix}", shape=(experts, *p.shape),
            sharding=ExpertSplit(experts, p.sharding, input_major and p.suffix in majors, flat),
        )
        for p in params
    ]


def _padded(split: Sharding, pad: int) -> Sharding:
    """A plain expert's split with each rank's rows padded to at least ``pad``."""
    if not isinstance(split, Split):
        raise ConfigError(f"padded expert rows (pad = {pad}) need a split parameter, not {split!r}")
    return replace(split, segments=tuple(replace(s, pad=pad) for s in split.segments))


def w13_split(inter: int, interleaved: bool, unit: int = 1, uneven: bool = False) -> Split:
    """w13's rows: w1's then w3's, each split over the ranks; or, interleaved, pairs of gate and up
    rows split as one (a rank's rows are a contiguous range of the fused tensor)."""
    label = "expert intermediate rows"
    if interleaved:
        return Split(0, (Segment("w13", inter // unit, 2 * unit, label=label, uneven=uneven),))
    return Split(0, (Segment("w1", inter, label=label), Segment("w3", inter, label=label)))


def w2_split(inter: int, dim: int, unit: int = 1, uneven: bool = False) -> Split:
    return Split(dim, (Segment("w2", inter // unit, unit, label="expert intermediate columns", uneven=uneven),))


def biases(shape: Experts, dtype: str, kind: str, w13: Sharding, default: float | None = None) -> list[ParamDef]:
    """The experts' biases: w13's split like its rows, w2's on every rank (``"all"``) or the
    first (``"first_rank"``: vLLM adds it once, after the row-parallel reduction)."""
    w2: Sharding = Replicated() if kind == "all" else FirstRank()
    return [
        ParamDef("w13_bias", (2 * shape.intermediate,), w13, dtype, default, role="bias"),
        ParamDef("w2_bias", (shape.hidden,), w2, dtype, default, role="bias"),
    ]


def plain(shape: Experts, dtype: str) -> list[ParamDef]:
    return [
        ParamDef("w13_weight", (2 * shape.intermediate, shape.hidden), w13_split(shape.intermediate, shape.interleaved), dtype),
        ParamDef("w2_weight", (shape.hidden, shape.intermediate), w2_split(shape.intermediate, 1), dtype),
    ]


Fix = Callable[[ParamDef, Linear, bool], ParamDef]  # (dense parameter, its linear, is w2) -> its MoE form


def from_linears(scheme: Scheme, shape: Experts, dtype: str, fix: Fix | None = None) -> list[ParamDef]:
    """A scheme's expert manifest derived from its dense manifest of w13 (merged) and w2 (row),
    with vLLM's fused-MoE forms, by role: per-tensor scales ``[2]`` for w13 and one for w2, input
    scales one per expert that w1 and w3 share (read and compared), ``weight_shape`` the last part
    vLLM loads, in the model dtype; ``fix`` applies a format's own further changes."""
    if shape.interleaved:
        raise ConfigError(f"interleaved gate/up experts quantized as {scheme.format} are not supported")
    out = []
    for stem, linear in (("w13", shape.w13()), ("w2", shape.w2())):
        for p in scheme.linear_params(linear, dtype):
            if p.role == "input_scale":  # one per expert: w1's and w3's must agree
                p = p._replace(shape=(), sharding=Shared(linear.slot_ids()))
            elif p.role in ("scale", "global_scale", "input_global_scale") and isinstance(p.sharding, Slots) and linear.row:
                p = p._replace(shape=(), sharding=Replicated())  # per tensor: one per expert, [E, 2] for w13
            elif p.role == "shape":  # vLLM keeps the last part it loads, in the model dtype
                ids = linear.slot_ids()
                p = p._replace(sharding=Pick(ids, ids[-1]), dtype=dtype)
            if fix is not None:
                p = fix(p, linear, linear.row)
            out.append(p._replace(suffix=f"{stem}_{p.suffix}"))
    return out
