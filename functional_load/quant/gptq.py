"""GPTQ integer weights (v1 and v2 checkpoints; auto-round's GPTQ packing).

Manifest (vLLM ``GPTQLinearMethod``): ``qweight [in / pf, out]`` int32 (fields along the input),
``qzeros [groups, out / pf]``, ``scales [groups, out]`` in the model dtype, ``g_idx [in]`` with
act-order (shared by the parts of a fused layer: read and compared); row-parallel act-order
layers keep every group on every rank. ``W[o, i] = (q[i, o] - z[g(i), o]) * s[g(i), o]``; v1
checkpoints store every zero field minus one (the whole word is corrected with ``+0x11111111``,
which also undoes the borrow a zero of 0 causes). vLLM's GPTQ MoE method always has expert biases,
zero unless the checkpoint holds them; GPTQ checkpoints may carry a bias for every linear, which
vLLM skips where its model has none (an optional tensor here, dropped with the reason).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..layout.experts import biases, from_linears, w13_split
from ..layout.parallel import Parallel
from ..layout.param import ParamSpec
from ..layout.quantized import Experts, Get, Linear, ParamDef, groups_of
from ..layout.scales import Shared
from ..model.mapping import MappingTable
from ..paths import JsonObject
from .base import BaseScheme
from .codes import unpack_int32
from .config import QuantConfig, group_size_field, ignore_list, int_field, names
from .kv import CACHE_SCALES, OPTIONAL_KV
from .pack import group_index, group_split, per_group

if TYPE_CHECKING:
    import torch

# Without act-order g_idx is the trivial i // group_size; vLLM drops it.
DROP_G_IDX = MappingTable.from_dicts(suffix={".g_idx": None})
OPTIONAL_BIAS = ((r"\.bias$", "an unexpected bias (GPTQ checkpoints carry one for every linear; vLLM skips those its model has none for)"),)


@dataclass(frozen=True, slots=True)
class GptqScheme(BaseScheme):
    bits: int = 4
    group_size: int = -1
    symmetric: bool = True
    zero_offset: int = 0  # 1 for v1 checkpoints (stored zero - 1)
    act_order: bool = False

    @property
    def format(self) -> str:
        return "gptq"

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    def linear_params(self, linear: Linear, model_dtype: str) -> list[ParamDef]:
        out, inp, pf = linear.out_size, linear.in_size, self.pack_factor
        groups = groups_of(self.group_size, linear)
        qweight = linear.out_split(1) if linear.column else linear.in_split(0, inp // pf, "packed input rows")
        qzeros = linear.out_split(1, pf) if linear.column else group_split(linear, 0, groups, self.act_order)
        params = [
            ParamDef("qweight", (inp // pf, out), qweight, "int32"),
            ParamDef("qzeros", (groups, out // pf), qzeros, "int32", role="zero"),
            ParamDef("scales", (groups, out), per_group(linear, 1, 0, groups, replicate_in=self.act_order), model_dtype,
                     check="finite", role="scale"),
        ]
        if self.act_order:
            g_idx = linear.in_split(0, inp, "input rows") if linear.row else Shared(linear.slot_ids())
            params.append(ParamDef("g_idx", (inp,), g_idx, "int32", role="g_idx"))
        return params

    def expert_params(self, experts: Experts, model_dtype: str) -> list[ParamDef]:
        w13 = w13_split(experts.intermediate, False)
        return from_linears(self, experts, model_dtype) + biases(experts, model_dtype, "all", w13, default=0.0)

    def dequantize(self, get: Get, specs: Mapping[str, ParamSpec], parallel: Parallel, target: str = "checkpoint") -> torch.Tensor:
        import torch

        q = unpack_int32(get("qweight"), self.bits, dim=0)  # [in, out]
        words = get("qzeros")
        if self.zero_offset:  # v1: every field holds zero - 1; add 1 to each, borrows included
            ones = sum(1 << (self.bits * j) for j in range(32 // self.bits))
            words = (words.to(torch.int64) + ones) & 0xFFFFFFFF
        zeros = unpack_int32(words, self.bits, dim=1)  # [groups, out]
        scales = get("scales").float()
        g = get("g_idx").to(torch.int64) if self.act_order else group_index(q.shape[0], self.group_size, scales.shape[0])
        return ((q - zeros[g]).float() * scales[g]).T.contiguous()


def bits_and_group(qc: JsonObject) -> tuple[int, int]:
    bits = int_field(qc.get("bits", 4), "bits")
    if bits not in (2, 4, 8):
        raise ConfigError(f"config.json: {bits}-bit GPTQ/AWQ weights are not supported (2, 4 or 8)")
    return bits, group_size_field(qc.get("group_size", -1))


def parse_gptq(qc: JsonObject, v2: bool | None = None) -> QuantConfig:
    """``gptq`` / ``gptq_v2`` (``checkpoint_format``), and auto-round's GPTQ packing (v1 zeros)."""
    method = str(qc.get("quant_method", "gptq")).lower()
    if v2 is None:
        v2 = method == "gptq_v2" or str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
    bits, group = bits_and_group(qc)
    act_order = bool(qc.get("desc_act", False))
    scheme = GptqScheme(bits, group, bool(qc.get("sym", True)), 0 if v2 else 1, act_order)
    mapping = (CACHE_SCALES,) if act_order else (CACHE_SCALES, DROP_G_IDX)
    listed = qc.get("modules_in_block_to_quantize")
    quantized = None
    if listed:  # a list of names, or of lists of them
        quantized = tuple(n for item in listed for n in (item if isinstance(item, list) else [item]))
        names(quantized, "modules_in_block_to_quantize")
    return QuantConfig("gptq", scheme, ignore_list(qc), mapping=mapping, optional=OPTIONAL_KV + OPTIONAL_BIAS,
                       quantized=quantized, detect=True, skip=dynamic_skips(qc.get("dynamic")))


def dynamic_skips(dynamic: object) -> tuple[str, ...]:
    """The modules GPTQ's ``dynamic`` rules build unquantized: each ``"-:<regex>"`` key, matched
    (``re.match``) on vLLM's module name as vLLM matches it (gptq_utils.get_dynamic_override).
    Positive rules that override a module's bits or group size are refused: they are not
    supported yet, and a rule vLLM applies first would decide before a later "-:" one."""
    if not dynamic:
        return ()
    if not isinstance(dynamic, Mapping):
        raise ConfigError(f"config.json quantization_config dynamic must be an object of regex -> overrides, found {dynamic!r:.80}")
    skips: list[str] = []
    positive = ""
    for pattern, overrides in dynamic.items():
        if not isinstance(pattern, str):
            raise ConfigError(f"config.json quantization_config dynamic: key {pattern!r} is not a regex string")
        regex = pattern.removeprefix("-:") if pattern.startswith("-:") else pattern.removeprefix("+:")
        try:
            re.compile(regex)
        except re.error as exc:
            raise ConfigError(f"config.json quantization_config dynamic: {pattern!r} is not a valid regex ({exc})") from None
        if pattern.startswith("-:"):
            if positive:
                raise ConfigError(
                    f"config.json quantization_config dynamic: {pattern!r} follows the positive rule {positive!r}, which "
                    f"vLLM applies first to a module both match; mixed rule orders are not supported yet"
                )
            skips.append(regex)
        elif overrides:
            raise ConfigError(
                f"config.json quantization_config dynamic: {pattern!r} overrides {sorted(overrides)} for the modules it "
                f"matches; per-module GPTQ overrides are not supported yet (only \"-:\" rules, which leave modules unquantized)"
            )
        else:
            positive = positive or pattern
    return tuple(skips)
