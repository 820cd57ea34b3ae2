"""``dequantize``: the dense float32 ``[out_local, in_local]`` weight of a loaded rank-local linear.

For inspection, notebooks and tests. It reads the rank's own tensors and the plan that
:func:`functional_load.load` attaches to the state it returns (``state.plan``), which knows each
module's scheme and where each fused segment's rows (and scale blocks) are.

Conventions (``shared/reference/quant-fixtures.md`` section 5):
FP8 and int8 ``W = q * scale``; compressed-tensors pack-quantized ``W = (q - zp) * scale`` with
signed fields (stored + 2^(b-1)), packed LSB-first along the input (weights) or output (zero
points); GPTQ ``W[o, i] = (q[i, o] - z[g(i), o]) * s[g(i), o]``, v1 storing ``zero - 1`` per
field (the whole word is corrected with ``+0x11111111``, which also undoes the borrow of a zero
of 0); AWQ GEMM packs along the output with the interleave ``[0, 2, 4, 6, 1, 3, 5, 7]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import LoadError
from ..model.quant import QuantScheme

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # element e of a word sits in field AWQ_REVERSE_ORDER[e]
_FP8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def unpack_int32(words: Any, bits: int, dim: int, interleave: tuple[int, ...] | None = None) -> Any:
    """Unpack ``32 // bits`` unsigned fields per int32 along ``dim`` (LSB first): the result has
    ``dim`` longer by the pack factor. ``interleave[e]`` is the field holding element ``e``."""
    import torch

    pf = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(pf, dtype=torch.int64) * bits
    view = [1] * (w.dim() + 1)
    view[dim + 1] = pf
    fields = (w.unsqueeze(dim + 1) >> shifts.view(view)) & ((1 << bits) - 1)
    if interleave is not None:
        fields = fields.index_select(dim + 1, torch.tensor(interleave))
    shape = list(w.shape)
    shape[dim] *= pf
    return fields.reshape(shape)


def dequantize(state: Mapping[str, Any], module_prefix: str) -> Any:
    """The dense float32 weight ``[out_local, in_local]`` of a rank-local linear module, or for an
    MoE layer's experts (``"model.layers.1.mlp.experts"``) the pair ``(w13, w2)``: ``w13
    [E_local, 2 * I_local, H]`` (gate rows then up rows, or interleaved as gpt-oss stores them)
    and ``w2 [E_local, H, I_local]``.

    ``state`` is what :func:`functional_load.load` returned (quantized modules need its
    ``state.plan``); ``module_prefix`` names the module, e.g. ``"model.layers.0.self_attn.qkv_proj"``.
    """
    plan = getattr(state, "plan", None)
    scheme = plan.schemes.get(module_prefix) if plan is not None else None
    if f"{module_prefix}.routed_experts.w13_{'weight' if scheme is None else _weight_name(scheme)}" in state:
        return tuple(_expert_stem(state, plan, module_prefix, scheme, stem) for stem in ("w13", "w2"))
    if scheme is None:
        weight = state.get(f"{module_prefix}.weight")
        if weight is None:
            near = sorted(k for k in state if k.startswith(module_prefix + "."))
            raise LoadError(
                f"dequantize: no linear module {module_prefix!r} in this state (no {module_prefix}.weight); "
                f"its parameters: {near or 'none'}"
            )
        if str(weight.dtype).removeprefix("torch.") not in _FP8 and weight.is_floating_point():
            return weight.float()
        raise LoadError(
            f"dequantize: {module_prefix}.weight is {weight.dtype} but the state carries no plan that says how it "
            f"was quantized; pass the state returned by functional_load.load"
        )
    get = _getter(state, module_prefix)
    if scheme.format in ("fp8", "int8"):
        return _scaled(plan, module_prefix, scheme, get, getattr(state, "target", "checkpoint"))
    if scheme.format == "pack":
        return _pack_quantized(scheme, get)
    if scheme.format == "gptq":
        return _gptq(scheme, get)
    return _awq(scheme, get)


def _getter(state: Mapping[str, Any], module: str):
    def get(suffix: str) -> Any:
        try:
            return state[f"{module}.{suffix}"]
        except KeyError:
            raise LoadError(f"dequantize: {module}.{suffix} is missing from the state") from None

    return get


def _scaled(plan: Any, module: str, scheme: QuantScheme, get: Any, target: str) -> Any:
    import torch

    weight = get("weight").float()
    scale = get(scheme.scale_name).float()
    if target != "checkpoint" and scheme.strategy in ("tensor", "channel"):
        weight = weight.T  # kernel layouts hold [in, out]; a per-tensor scale is one scalar
        if scheme.strategy == "tensor":
            return weight * scale
    if scheme.strategy == "channel":
        return weight * scale.reshape(-1, 1)
    if scheme.strategy == "tensor":  # one scale per fused segment, over that segment's rows
        ids = plan.param(f"{module}.{scheme.scale_name}").spec.sharding.ids
        per_row = torch.empty(weight.shape[0])
        for segment, (start, stop) in plan.param(f"{module}.weight").spec.local_pieces(plan.parallel):
            per_row[start:stop] = scale.reshape(-1)[ids.index(segment) if segment is not None else 0]
        return weight * per_row[:, None]
    # block: expand each segment's scale blocks over its rows, and blocks over columns
    bn, bk = scheme.block  # type: ignore[misc]
    rows, cols = weight.shape
    weight_rows = dict(plan.param(f"{module}.weight").spec.local_pieces(plan.parallel))
    scale_rows = torch.empty(rows, scale.shape[1])
    for segment, (b0, b1) in plan.param(f"{module}.{scheme.scale_name}").spec.local_pieces(plan.parallel):
        r0, r1 = weight_rows.get(segment, (0, rows))
        scale_rows[r0:r1] = scale[b0:b1].repeat_interleave(bn, dim=0)[: r1 - r0]
    return weight * scale_rows.repeat_interleave(bk, dim=1)[:, :cols]


def _groups_of(n: int, scheme: QuantScheme, groups: int) -> Any:
    import torch

    if groups == 1:
        return torch.zeros(n, dtype=torch.int64)
    return torch.arange(n) // scheme.group_size


def _pack_quantized(scheme: QuantScheme, get: Any) -> Any:
    offset = 1 << (scheme.bits - 1)
    scale = get("weight_scale").float()
    q = unpack_int32(get("weight_packed"), scheme.bits, dim=1) - offset
    out = scale.shape[0]
    in_size = q.shape[1] if scale.shape[1] == 1 else scale.shape[1] * scheme.group_size
    q = q[:, :in_size]
    g = _groups_of(in_size, scheme, scale.shape[1])
    zero = 0
    if not scheme.symmetric:
        zero = (unpack_int32(get("weight_zero_point"), scheme.bits, dim=0)[:out] - offset)[:, g]
    return (q - zero).float() * scale[:, g]


def _gptq(scheme: QuantScheme, get: Any) -> Any:
    import torch

    q = unpack_int32(get("qweight"), scheme.bits, dim=0)  # [in, out]
    words = get("qzeros")
    if scheme.zero_offset:  # v1: every field holds zero - 1; add 1 to each, borrows included
        ones = sum(1 << (scheme.bits * j) for j in range(32 // scheme.bits))
        words = (words.to(torch.int64) + ones) & 0xFFFFFFFF
    zeros = unpack_int32(words, scheme.bits, dim=1)  # [groups, out]
    scales = get("scales").float()
    g = get("g_idx").to(torch.int64) if scheme.act_order else _groups_of(q.shape[0], scheme, scales.shape[0])
    return ((q - zeros[g]).float() * scales[g]).T.contiguous()


def _awq(scheme: QuantScheme, get: Any) -> Any:
    q = unpack_int32(get("qweight"), scheme.bits, dim=1, interleave=AWQ_REVERSE_ORDER)  # [in, out]
    zeros = unpack_int32(get("qzeros"), scheme.bits, dim=1, interleave=AWQ_REVERSE_ORDER)
    scales = get("scales").float()
    g = _groups_of(q.shape[0], scheme, scales.shape[0])
    return ((q - zeros[g]).float() * scales[g]).T.contiguous()


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; bit 3 is the sign


def _weight_name(scheme: QuantScheme) -> str:
    return {"pack": "weight_packed", "gptq": "qweight", "awq": "qweight"}.get(scheme.format, "weight")


def _expert_stem(state: Mapping[str, Any], plan: Any, module: str, scheme: QuantScheme | None, stem: str) -> Any:
    """One of an MoE layer's fused expert weights (``w13`` or ``w2``), dense float32 ``[E_local, out, in]``."""
    import torch

    prefix = f"{module}.routed_experts.{stem}_"
    if scheme is None:
        return state[prefix + "weight"].float()
    get = _getter(state, module + ".routed_experts")
    if scheme.format == "mxfp4":
        return _mxfp4(get(f"{stem}_weight"), get(f"{stem}_weight_scale"))
    if scheme.format in ("fp8", "int8"):
        weight, scale = get(f"{stem}_weight").float(), get(f"{stem}_{scheme.scale_name}").float()
        if scheme.strategy == "channel":
            return weight * scale
        if scheme.strategy == "block":
            grid = plan.param(prefix + scheme.scale_name).spec.sharding.inner.grid(plan.parallel.expert_tp)
            return weight * _expand_blocks(scale, weight.shape, grid, halves=stem == "w13")
        if stem == "w13" and scale.dim() == 2:  # a scale per expert and shard: w1's rows, then w3's
            half = weight.shape[1] // 2
            per_row = scale.repeat_interleave(half, dim=1)
            return weight * per_row[:, :, None]
        return weight * scale.reshape(-1, 1, 1)
    dense = {"pack": _pack_quantized, "gptq": _gptq, "awq": _awq}[scheme.format]
    experts = state[prefix + _weight_name(scheme)].shape[0]

    def expert(slot: int) -> Any:
        return dense(scheme, lambda suffix: get(f"{stem}_{suffix}")[slot])

    return torch.stack([expert(s) for s in range(experts)]) if experts else torch.empty(0)


def _expand_blocks(scale: Any, shape: tuple[int, ...], grid: tuple[int, int], halves: bool) -> Any:
    """Block scales ``[E, rows, cols]`` over a weight ``[E, out, in]``: each scale covers a ``grid``
    block; w13's scale rows are w1's blocks, then w3's, each half of the weight."""
    import torch

    rn, rk = grid
    _, out, inp = shape
    parts = scale.chunk(2, dim=1) if halves else (scale,)
    rows = out // len(parts)
    expanded = torch.cat([p.repeat_interleave(rn, dim=1)[:, :rows] for p in parts], dim=1)
    return expanded.repeat_interleave(rk, dim=2)[:, :, :inp]


def _mxfp4(blocks: Any, scales: Any) -> Any:
    """MXFP4 ``[E, out, in/2]`` bytes (two e2m1 codes, the low nibble first) with e8m0 scales
    ``[E, out, in/32]`` (``2 ** (byte - 127)``) as float32 ``[E, out, in]``."""
    import torch

    magnitude = torch.tensor(FP4_E2M1, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], -1).long()
    values = magnitude[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
    factor = torch.exp2(scales.float() - 127.0).repeat_interleave(32, dim=-1)
    return values * factor

