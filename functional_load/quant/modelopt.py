"""NVIDIA ModelOpt's ``quantization_config`` (``quant_method: "modelopt"``), as vLLM 0.32 reads it.

``quant_algo`` picks the format: ``FP8`` (per-tensor e4m3 weights with static per-tensor input
scales: :class:`~.fp8.Fp8Scheme`), ``NVFP4`` / ``W4A16_NVFP4`` (:mod:`.nvfp4`, ModelOpt's names),
``MXFP8`` (:mod:`.mxfp8`). vLLM 0.32 refuses every other algorithm ("ModelOpt currently only
supports: ..."), ModelOpt's ``mxfp4`` export included, and so does this parser. Excluded modules
(``ignore`` / ``exclude_modules``) are wildcards (``*``); KV-cache scales are vLLM's base ones.
"""

from __future__ import annotations

import fnmatch

from ..errors import ConfigError
from ..layout.quantized import Scheme
from ..paths import JsonObject
from .config import QuantConfig, ignore_list
from .fp8 import Fp8Scheme, TensorScale
from .kv import BASE_KV, CACHE_SCALES, OPTIONAL_KV
from .mxfp8 import Mxfp8Scheme
from .nvfp4 import GROUP, Nvfp4Scheme

VLLM_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION")


def parse_modelopt(qc: JsonObject) -> QuantConfig:
    algo = str(qc.get("quant_algo", ""))
    scheme = _scheme(algo.upper(), qc)
    if scheme is None:
        raise ConfigError(
            f"config.json: ModelOpt quant_algo {algo!r} is not supported: vLLM 0.32 supports only {list(VLLM_ALGOS)} "
            f"(this loader: FP8, NVFP4, W4A16_NVFP4, MXFP8); re-export the model with one of them"
        )
    ignore = tuple("re:" + fnmatch.translate(p) if any(c in p for c in "*?[") else p for p in ignore_list(qc))
    return QuantConfig("modelopt", scheme, ignore, kv_params=BASE_KV, mapping=(CACHE_SCALES,), optional=OPTIONAL_KV)


def _scheme(algo: str, qc: JsonObject) -> Scheme | None:
    if algo == "FP8":
        return Fp8Scheme(TensorScale(), static_input=True)
    if algo in ("NVFP4", "W4A16_NVFP4"):
        group = qc.get("group_size") or ((qc.get("config_groups") or {}).get("group_0") or {}).get("weights", {}).get("group_size")
        if group not in (None, GROUP):
            raise ConfigError(f"config.json: ModelOpt NVFP4 group_size {group!r}; NVFP4 groups are {GROUP}")
        return Nvfp4Scheme(modelopt=True, activations=algo == "NVFP4")
    if algo == "MXFP8":
        return Mxfp8Scheme()
    return None
