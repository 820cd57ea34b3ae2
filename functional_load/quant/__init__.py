"""Quantization formats, one module each, behind the interface of :mod:`functional_load.layout.quantized`.

A format module holds all its knowledge: how its ``quantization_config`` reads, the parameters
of a quantized linear and of fused experts (with the checks and stored dtypes as data on them),
dequantization and its post-load transforms. Methods whose configs hold several formats
(compressed-tensors, Quark, ModelOpt) have a parser module that builds the formats' schemes.
:func:`parse_quant_config` picks the parser by ``quant_method``; the layout, the planner and the
reader see only the schemes' interface and the data on each parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..errors import ConfigError
from ..paths import JsonObject
from .awq import parse_awq
from .compressed_tensors import parse_compressed_tensors
from .config import QuantConfig
from .fp8 import online_quant_config, parse_fp8
from .gptq import parse_gptq
from .modelopt import parse_modelopt
from .mxfp4 import parse_gpt_oss_mxfp4
from .quark import parse_quark

__all__ = ["QuantConfig", "online_quant_config", "parse_quant_config"]


def _auto_round(qc: JsonObject) -> QuantConfig:
    packing = str(qc.get("packing_format", "auto_round:auto_gptq")).lower()
    return parse_awq(qc) if "awq" in packing else parse_gptq(qc, v2=False)


PARSERS: dict[str, Callable[[JsonObject], QuantConfig]] = {
    "fp8": parse_fp8,
    "compressed-tensors": parse_compressed_tensors,
    "gptq": parse_gptq,
    "gptq_v2": parse_gptq,
    "awq": parse_awq,
    "auto-round": _auto_round,
    "quark": parse_quark,
    "mxfp4": parse_gpt_oss_mxfp4,
    "modelopt": parse_modelopt,
}


def parse_quant_config(config: JsonObject) -> QuantConfig | None:
    """``None`` for an unquantized model; a ConfigError for a format this loader cannot read or
    a malformed field (never a bare TypeError or ValueError)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ConfigError(f"config.json quantization_config must be an object, found {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    parser = PARSERS.get(method)
    if parser is None:
        raise ConfigError(
            f"config.json quantization_config.quant_method = {method!r} is not supported; supported: {sorted(PARSERS)}"
        )
    try:
        return parser(qc)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(
            f"config.json quantization_config is malformed ({type(exc).__name__}: {exc!s:.200}); check it against what "
            f"the quantization tool writes"
        ) from None
