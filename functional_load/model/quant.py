"""``quantization_config`` from ``config.json`` -> which scheme each linear module uses.

Supported ``quant_method`` values: ``fp8`` (vLLM / AutoFP8 / Quark fp8 per-tensor, and the
DeepSeek / transformers FineGrainedFP8 block format), ``compressed-tensors`` (float-, int-,
naive- and pack-quantized), ``gptq`` (v1 and v2), ``awq`` (GEMM) and ``auto-round`` (its GPTQ
and AWQ packings). Ignore lists (``ignore``, ``ignored_layers``, ``modules_to_not_convert``)
name checkpoint modules; a fused vLLM module is skipped only if all of its parts are.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .mapping import MappingTable

FORMATS = ("fp8", "int8", "pack", "gptq", "awq", "mxfp4")
STRATEGIES = ("tensor", "channel", "group", "block")


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
    * ``mxfp4``: OCP MX FP4 MoE experts (gpt-oss): 4-bit values packed two per byte in blocks of
      32 with one e8m0 (power of two) scale each.

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
    block_rule: str = "strict"  # the block-shape check of its scales (see layout.scales.Blocked.rule)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"unknown quantization format {self.format!r}; known: {FORMATS}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"unknown quantization strategy {self.strategy!r}; known: {STRATEGIES}")
        if self.bits not in (2, 4, 8):
            raise ConfigError(f"{self.bits}-bit weights are not supported (2, 4 or 8)")
        if self.strategy == "block":
            block = self.block
            if block is None or len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
                raise ConfigError(f"block quantization needs a block size of 2 positive integers, got {block!r}; check config.json")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or not (self.group_size == -1 or self.group_size > 0):
            raise ConfigError(f"quantization group_size must be a positive integer or -1, got {self.group_size!r}; check config.json")
        if self.block_rule not in ("strict", "fp8", "none"):
            raise ConfigError(f"unknown block rule {self.block_rule!r}")

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits


# vLLM's KV-cache scale names (``QuantizationConfig.get_cache_scale_mapper`` + Fp8/Quark output scales).
CACHE_SCALES = MappingTable.from_dicts(
    regex={
        r"\.kv_scale$": ".attn.k_scale",
        r"\.self_attn\.[kv]_proj\.([kv])_scale$": r".self_attn.attn.\1_scale",
        r"\.self_attn\.qk(?:qk)?v_proj\.([kv])_scale$": r".self_attn.attn.\1_scale",
        r"\.self_attn\.q\.scale$": ".self_attn.attn.q_scale",
        r"\.self_attn\.([kv])_cache\.scale$": r".self_attn.attn.\1_scale",
        r"(?<!\.attn)\.([qkv])_scale$": r".attn.\1_scale",
        r"(?<!\.attn)\.([qkv])_zero_point$": r".attn.\1_zero_point",
    },
    suffix={
        ".k_proj.output_scale": ".attn.k_scale",
        ".v_proj.output_scale": ".attn.v_scale",
    },
)

# The attention layer's KV-cache parameters, as each vLLM KV-cache method creates them:
# (name, shape, dtype or "model" for the model dtype, the value vLLM creates it with). A
# checkpoint tensor overwrites the value; an absent one keeps it (vLLM's
# ``process_weights_after_loading`` later reads -1.0 as "not in the checkpoint").
KVParam = tuple[str, tuple[int, ...], str, float]
BASE_KV: tuple[KVParam, ...] = tuple((f"{n}_scale", (), "model", -1.0) for n in ("q", "k", "v", "prob"))
COMPRESSED_TENSORS_KV: tuple[KVParam, ...] = (
    *((f"{n}_scale", (1,), "float32", 1.0) for n in ("k", "v", "q")),
    *((f"{n}_zero_point", (1,), "model", 0.0) for n in ("k", "v", "q")),
)

# Checkpoint tensors that never become parameters (with why).
_DROP_G_IDX = MappingTable.from_dicts(suffix={".g_idx": None})


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """The parsed quantization config: a default scheme, per-target overrides, ignored modules."""

    method: str
    default: QuantScheme | None
    ignore: tuple[str, ...] = ()
    targets: tuple[tuple[str, QuantScheme], ...] = ()  # (regex or name, scheme), compressed-tensors
    kv_params: tuple[KVParam, ...] = ()  # the attention layer's KV-cache parameters (BASE_KV, ...)
    mapping: tuple[MappingTable, ...] = field(default=())
    kinds: tuple[str, ...] = ("linear", "experts")  # what the method quantizes (MXFP4: experts only)

    def quantizes(self, kind: str) -> bool:
        """Whether the method quantizes modules of ``kind`` (``"linear"`` or ``"experts"``)."""
        return kind in self.kinds

    def scheme_for(self, module: str, sources: Sequence[str]) -> QuantScheme | None:
        """The scheme of vLLM module ``module`` whose checkpoint parts are ``sources``."""
        skipped = [_matches(self.ignore, s) for s in sources]
        if any(skipped) and not all(skipped):
            raise ConfigError(
                f"{module}: some but not all of its checkpoint parts {list(sources)} are in the quantization "
                f"ignore list; all parts of a fused layer must have the same precision"
            )
        if skipped and all(skipped):
            return None
        for pattern, scheme in self.targets:
            if any(_matches((pattern,), s) for s in sources):
                return scheme
        return self.default


def _matches(patterns: Sequence[str], name: str) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.startswith(p + "."):  # a module, or a parent of it
            return True
    return False


def parse_quant_config(config: Mapping[str, Any]) -> QuantConfig | None:
    """``None`` for an unquantized model; a ConfigError for a format this loader cannot read or
    a malformed field (never a bare TypeError or ValueError)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ConfigError(f"config.json quantization_config must be an object, found {type(qc).__name__}")
    try:
        return _parse(qc)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(
            f"config.json quantization_config is malformed ({type(exc).__name__}: {exc!s:.200}); check it against what "
            f"the quantization tool writes"
        ) from None


def _parse(qc: Mapping[str, Any]) -> QuantConfig:
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method in ("gptq", "gptq_v2"):
        return _gptq(qc, v2=method == "gptq_v2" or str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2")
    if method == "awq":
        return _awq(qc)
    if method == "quark":
        return _quark(qc)
    if method == "mxfp4":
        # vLLM's Mxfp4Config quantizes fused MoE experts only; every linear stays unquantized.
        scheme = QuantScheme("mxfp4", bits=4, strategy="group", group_size=32)
        return QuantConfig("mxfp4", scheme, _ignore(qc), kinds=("experts",))
    if method == "auto-round":
        packing = str(qc.get("packing_format", "auto_round:auto_gptq")).lower()
        if "awq" in packing:
            return _awq(qc)
        return _gptq(qc, v2=False)
    raise ConfigError(
        f"config.json quantization_config.quant_method = {method!r} is not supported; supported: fp8, "
        f"compressed-tensors, gptq, awq, auto-round, quark (FP8), mxfp4 (MoE experts)"
    )


def _int(value: Any, what: str) -> int:
    """An integer field of quantization_config (not a bool, a float or a string)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json quantization_config {what} must be an integer, found {value!r:.60}")
    return value


def _names(value: Any, what: str) -> tuple[str, ...]:
    """A list of module names or ``re:`` regexes (an ignore list, compressed-tensors targets),
    checked here so that matching them against module names cannot fail later."""
    if not value:
        return ()
    if isinstance(value, (str, Mapping)) or not isinstance(value, Sequence):
        raise ConfigError(
            f"config.json quantization_config {what} must be a list of module names or 're:' regexes, found "
            f"{type(value).__name__} {value!r:.60}; write it as a list, e.g. [\"lm_head\"]"
        )
    for name in value:
        if not isinstance(name, str):
            raise ConfigError(
                f"config.json quantization_config {what} must hold module names or 're:' regexes (strings), found "
                f"{type(name).__name__} {name!r:.60}; remove it or quote the module name"
            )
        if name.startswith("re:"):
            try:
                re.compile(name[3:])
            except re.error as exc:
                raise ConfigError(
                    f"config.json quantization_config {what} has an invalid regex {name!r:.60} ({exc}); fix the pattern after 're:'"
                ) from None
    return tuple(value)


def _ignore(qc: Mapping[str, Any]) -> tuple[str, ...]:
    names: list[str] = []
    for key in ("ignore", "ignored_layers", "modules_to_not_convert", "exclude"):
        names += _names(qc.get(key), key)
    return tuple(names)


def _fp8(qc: Mapping[str, Any]) -> QuantConfig:
    if qc.get("weight_scale_semantics", "") == "inverse" or str(qc.get("checkpoint_format", "")).startswith("float8"):
        raise ConfigError(
            "config.json: this FP8 checkpoint (GPTQModel format, weight_scale_semantics='inverse') stores the reciprocal "
            "of DeepSeek's weight_scale_inv; loading it as vLLM fp8 would silently scale every weight wrongly. "
            "Re-export it in the DeepSeek / compressed-tensors layout"
        )
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("static", "dynamic"):
        raise ConfigError(f"config.json: Unsupported activation scheme {scheme!r} (use 'static' or 'dynamic')")
    block = qc.get("weight_block_size")
    if block is not None:
        if len(block) != 2:
            raise ConfigError(
                f"config.json: The quantization block size of weight must have 2 dimensions, but got {len(block)} dimensions"
            )
        if scheme != "dynamic":
            raise ConfigError(
                f"config.json: The block-wise quantization only supports dynamic activation scheme for now, but got "
                f"{scheme} activation scheme."
            )
        # vLLM keeps block scales float32, e8m0 (scale_fmt "ue8m0") ones included: powers of two, cast exactly.
        default = QuantScheme(
            "fp8", strategy="block", block=(_int(block[0], "weight_block_size[0]"), _int(block[1], "weight_block_size[1]")),
            scale_name="weight_scale_inv", block_rule="fp8",
        )
    else:
        default = QuantScheme("fp8", strategy="tensor", static_input=scheme == "static")
    return QuantConfig("fp8", default, _ignore(qc), kv_params=BASE_KV, mapping=(CACHE_SCALES,))


def _ct_scheme(group: Mapping[str, Any], fmt: str) -> QuantScheme:
    weights = group.get("weights") or {}
    acts = group.get("input_activations") or {}
    bits = _int(weights.get("num_bits", 8), "weights.num_bits")
    kind = weights.get("type", "int")
    strategy = str(weights.get("strategy", "tensor")).lower()
    static_input = not acts.get("dynamic", True) and acts.get("strategy", "tensor") == "tensor"
    if kind == "float":
        if bits != 8:
            raise ConfigError(f"compressed-tensors float weights of {bits} bits are not supported (FP8 only)")
        block = tuple(_int(b, "weights.block_structure") for b in weights["block_structure"]) if strategy == "block" else None
        return QuantScheme("fp8", strategy=strategy, block=block, static_input=static_input)  # type: ignore[arg-type]
    if fmt == "pack-quantized":
        raw_group = weights.get("group_size")
        group_size = -1 if raw_group is None else _int(raw_group, "weights.group_size")
        return QuantScheme(
            "pack", bits=bits, strategy=strategy, group_size=group_size, symmetric=bool(weights.get("symmetric", True)),
            act_order=weights.get("actorder") == "group",
        )
    if bits == 8 and fmt in ("int-quantized", "naive-quantized"):
        if strategy not in ("tensor", "channel"):
            raise ConfigError(f"compressed-tensors int8 weights with strategy {strategy!r} are not supported")
        return QuantScheme("int8", strategy=strategy, static_input=static_input)
    raise ConfigError(f"compressed-tensors format {fmt!r} with {bits}-bit {kind} weights is not supported")


def _compressed_tensors(qc: Mapping[str, Any]) -> QuantConfig:
    fmt = str(qc.get("format", "")).lower()
    targets: list[tuple[str, QuantScheme]] = []
    default = None
    for name, group in (qc.get("config_groups") or {}).items():
        scheme = _ct_scheme(group, str(group.get("format") or fmt).lower())
        for target in _names(group.get("targets"), f"config_groups.{name}.targets"):
            if target == "Linear":
                default = scheme
            else:
                targets.append((target, scheme))
    if default is None and not targets:
        raise ConfigError("config.json: compressed-tensors quantization_config has no config_groups targeting Linear layers")
    return QuantConfig(
        "compressed-tensors", default, _ignore(qc), tuple(targets),
        kv_params=_ct_kv(qc.get("kv_cache_scheme")), mapping=(CACHE_SCALES,),
    )


def _ct_kv(scheme: Any) -> tuple[KVParam, ...]:
    """compressed-tensors' KV-cache parameters; per-head scales are not supported."""
    if isinstance(scheme, Mapping) and str(scheme.get("strategy", "tensor")).lower() != "tensor":
        raise ConfigError(
            f"config.json: compressed-tensors kv_cache_scheme strategy {scheme.get('strategy')!r} is not supported; "
            "only per-tensor ('tensor') KV-cache scales are"
        )
    return COMPRESSED_TENSORS_KV


def _int4(qc: Mapping[str, Any]) -> tuple[int, int]:
    bits = _int(qc.get("bits", 4), "bits")
    if bits not in (2, 4, 8):
        raise ConfigError(f"config.json: {bits}-bit GPTQ/AWQ weights are not supported (2, 4 or 8)")
    return bits, _int(qc.get("group_size", -1), "group_size")


def _gptq(qc: Mapping[str, Any], v2: bool) -> QuantConfig:
    bits, group = _int4(qc)
    act_order = bool(qc.get("desc_act", False))
    scheme = QuantScheme(
        "gptq", bits=bits, strategy="group", group_size=group, symmetric=bool(qc.get("sym", True)),
        zero_offset=0 if v2 else 1, act_order=act_order,
    )
    # Without act-order g_idx is the trivial i // group_size; vLLM drops it.
    mapping = (CACHE_SCALES,) if act_order else (CACHE_SCALES, _DROP_G_IDX)
    return QuantConfig("gptq", scheme, _ignore(qc), mapping=mapping)


def _awq(qc: Mapping[str, Any]) -> QuantConfig:
    bits, group = _int4(qc)
    version = str(qc.get("version", qc.get("format", "gemm"))).lower()
    if version != "gemm":
        raise ConfigError(f"config.json: AWQ version {version!r} is not supported (GEMM only)")
    scheme = QuantScheme("awq", bits=bits, strategy="group", group_size=group, symmetric=not qc.get("zero_point", True))
    return QuantConfig("awq", scheme, _ignore(qc), mapping=(CACHE_SCALES,))


def _quark(qc: Mapping[str, Any]) -> QuantConfig:
    """AMD Quark's own config: FP8 (e4m3) weights per tensor or per channel, optional static inputs."""
    glob = qc.get("global_quant_config") or {}
    weight, inputs = glob.get("weight") or {}, glob.get("input_tensors") or {}
    # Per-layer entries may only add output (KV-cache) quantization to the global scheme.
    layers = {**(qc.get("layer_quant_config") or {}), **(qc.get("layer_type_quant_config") or {})}
    differing = sorted(k for k, v in layers.items() if v.get("weight") != weight or (v.get("input_tensors") or {}) != inputs)
    if weight.get("dtype") != "fp8_e4m3" or differing:
        raise ConfigError(
            f"config.json: Quark quantization with weight dtype {weight.get('dtype')!r} and per-layer schemes "
            f"{differing} is not supported; only one global FP8 (fp8_e4m3) scheme is"
        )
    strategy = {"per_tensor": "tensor", "per_channel": "channel"}.get(str(weight.get("qscheme")))
    if strategy is None:
        raise ConfigError(f"config.json: Quark FP8 qscheme {weight.get('qscheme')!r} is not supported (per_tensor, per_channel)")
    static = not inputs.get("is_dynamic", True) and inputs.get("qscheme") == "per_tensor"
    scheme = QuantScheme("fp8", strategy=strategy, static_input=static)
    return QuantConfig("quark", scheme, _ignore(qc), kv_params=BASE_KV, mapping=(CACHE_SCALES,))


ONLINE_METHODS = ("fp8", "fp8_block")


def online_quant_config(method: str, config: Mapping[str, Any], stored: bool = False) -> QuantConfig:
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
        scheme = QuantScheme("fp8", strategy="tensor", online=not stored)
    else:
        scheme = QuantScheme("fp8", strategy="block", block=(128, 128), scale_name="weight_scale_inv", online=not stored, block_rule="none")
    return QuantConfig(f"online-{method}", scheme, kv_params=BASE_KV, mapping=(CACHE_SCALES,))
