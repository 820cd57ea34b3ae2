"""AMD Quark's own ``quantization_config`` (``quant_method: "quark"``): one global scheme.

FP8 (e4m3) weights per tensor or per channel, optional static per-tensor inputs, KV-cache
``output_scale``\\ s; per-layer entries may only add output (KV-cache) quantization to the global
scheme. MXFP4 (``fp4`` weights with per-group e8m0 scales) is read by :mod:`.mxfp4`.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ConfigError
from ..layout.quantized import Scheme
from ..paths import JsonObject
from .config import QuantConfig, ignore_list
from .fp8 import Fp8Scheme, scale_geometry
from .kv import BASE_KV, CACHE_SCALES, OPTIONAL_KV
from .mxfp4 import quark_mxfp4

# weight dtype -> the format module that reads the global scheme's weight and input_tensors
_EXTRA: dict[str, Callable[[JsonObject, JsonObject], Scheme]] = {"fp4": quark_mxfp4}


def parse_quark(qc: JsonObject) -> QuantConfig:
    glob = qc.get("global_quant_config") or {}
    weight, inputs = glob.get("weight") or {}, glob.get("input_tensors") or {}
    layers = {**(qc.get("layer_quant_config") or {}), **(qc.get("layer_type_quant_config") or {})}
    differing = sorted(k for k, v in layers.items() if v.get("weight") != weight or (v.get("input_tensors") or {}) != inputs)
    dtype = str(weight.get("dtype"))
    if differing or (dtype != "fp8_e4m3" and dtype not in _EXTRA):
        raise ConfigError(
            f"config.json: Quark quantization with weight dtype {weight.get('dtype')!r} and per-layer schemes "
            f"{differing} is not supported; only one global scheme of {['fp8_e4m3', *_EXTRA]} is"
        )
    if dtype in _EXTRA:
        return QuantConfig("quark", _EXTRA[dtype](weight, inputs), ignore_list(qc), kv_params=BASE_KV, mapping=(CACHE_SCALES,),
                           optional=OPTIONAL_KV)
    strategy = {"per_tensor": "tensor", "per_channel": "channel"}.get(str(weight.get("qscheme")))
    if strategy is None:
        raise ConfigError(f"config.json: Quark FP8 qscheme {weight.get('qscheme')!r} is not supported (per_tensor, per_channel)")
    static = not inputs.get("is_dynamic", True) and inputs.get("qscheme") == "per_tensor"
    scheme = Fp8Scheme(scale_geometry(strategy), static_input=static)
    return QuantConfig("quark", scheme, ignore_list(qc), kv_params=BASE_KV, mapping=(CACHE_SCALES,), optional=OPTIONAL_KV)
