"""Quantized checkpoints: the config parser, the per-scheme parameter manifests, dequantization."""

from .config import QuantConfig, parse_quant_config
from .schemes import Linear, QuantScheme

__all__ = ["Linear", "QuantConfig", "QuantScheme", "parse_quant_config"]
