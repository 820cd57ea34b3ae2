"""compressed-tensors' ``quantization_config``: config groups, each a format of its own module.

``config_groups`` map ``targets`` (``Linear``, module names or ``re:`` regexes) to a weight scheme;
the group's ``format`` (or the config's) says how it is stored: ``float-quantized`` (FP8,
:mod:`.fp8`), ``int-quantized`` / ``naive-quantized`` (INT8), ``pack-quantized`` (:mod:`.pack`),
``nvfp4-pack-quantized`` (:mod:`.nvfp4`), ``mxfp4-pack-quantized`` (:mod:`.mxfp4`),
``mxfp8-quantized`` (:mod:`.mxfp8`). ``kv_cache_scheme`` adds per-tensor KV-cache scales.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..errors import ConfigError
from ..layout.quantized import Scheme
from ..paths import JsonObject
from .config import KVParam, QuantConfig, group_size_field, ignore_list, int_field, names
from .fp8 import Fp8Scheme, Int8Scheme, scale_geometry
from .kv import CACHE_SCALES, COMPRESSED_TENSORS_KV, OPTIONAL_KV
from .mxfp4 import compressed_tensors_mxfp4
from .mxfp8 import compressed_tensors_mxfp8
from .nvfp4 import compressed_tensors_nvfp4
from .pack import PackScheme

# formats whose module reads the group's weights and input_activations
MICROSCALING: dict[str, Callable[[JsonObject, JsonObject], Scheme]] = {
    "nvfp4-pack-quantized": compressed_tensors_nvfp4,
    "mxfp4-pack-quantized": compressed_tensors_mxfp4,
    "mxfp8-quantized": compressed_tensors_mxfp8,
}


def group_scheme(group: JsonObject, fmt: str) -> Scheme:
    weights = group.get("weights") or {}
    acts = group.get("input_activations") or {}
    bits = int_field(weights.get("num_bits", 8), "weights.num_bits")
    kind = weights.get("type", "int")
    strategy = str(weights.get("strategy", "tensor")).lower()
    static_input = not acts.get("dynamic", True) and acts.get("strategy", "tensor") == "tensor"
    if fmt in MICROSCALING:
        return MICROSCALING[fmt](weights, acts)
    if kind == "float":
        if bits != 8:
            raise ConfigError(f"compressed-tensors float weights of {bits} bits in format {fmt!r} are not supported")
        block = [int_field(b, "weights.block_structure") for b in weights["block_structure"]] if strategy == "block" else None
        return Fp8Scheme(scale_geometry(strategy, block, "fp8"), static_input)
    if fmt == "pack-quantized":
        return PackScheme(bits, group_size_field(weights.get("group_size")), bool(weights.get("symmetric", True)),
                          weights.get("actorder") == "group")
    if bits == 8 and fmt in ("int-quantized", "naive-quantized"):
        if strategy not in ("tensor", "channel"):
            raise ConfigError(f"compressed-tensors int8 weights with strategy {strategy!r} are not supported")
        return Int8Scheme(scale_geometry(strategy, None, "int8"), static_input=static_input)
    raise ConfigError(f"compressed-tensors format {fmt!r} with {bits}-bit {kind} weights is not supported")


def parse_compressed_tensors(qc: JsonObject) -> QuantConfig:
    fmt = str(qc.get("format", "")).lower()
    targets: list[tuple[str, Scheme]] = []
    default = None
    for name, group in (qc.get("config_groups") or {}).items():
        scheme = group_scheme(group, str(group.get("format") or fmt).lower())
        for target in names(group.get("targets"), f"config_groups.{name}.targets"):
            if target == "Linear":
                default = scheme
            else:
                targets.append((target, scheme))
    if default is None and not targets:
        raise ConfigError("config.json: compressed-tensors quantization_config has no config_groups targeting Linear layers")
    return QuantConfig(
        "compressed-tensors", default, ignore_list(qc), tuple(targets),
        kv_params=_kv(qc.get("kv_cache_scheme")), mapping=(CACHE_SCALES,), optional=OPTIONAL_KV,
    )


def _kv(scheme: object) -> tuple[KVParam, ...]:
    """compressed-tensors' KV-cache parameters; per-head scales are not supported."""
    if isinstance(scheme, Mapping) and str(scheme.get("strategy", "tensor")).lower() != "tensor":
        raise ConfigError(
            f"config.json: compressed-tensors kv_cache_scheme strategy {scheme.get('strategy')!r} is not supported; "
            "only per-tensor ('tensor') KV-cache scales are"
        )
    return COMPRESSED_TENSORS_KV
