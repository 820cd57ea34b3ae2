"""What every format's scheme shares: defaults for the parts of the interface a format may leave.

A scheme is a frozen value (its format's fields) with behaviour, like the slice descriptors: its
manifests (:meth:`linear_params`, :meth:`expert_params`), dequantization, post-load transforms
(:meth:`apply_target`) and online quantization. :class:`functional_load.layout.quantized.Scheme`
is the interface the layout sees; this base gives the defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..errors import ConfigError, LoadError
from ..layout.experts import from_linears
from ..layout.parallel import Parallel
from ..layout.param import ParamSpec
from ..layout.quantized import BoxDequantizer, Experts, Get, Linear, ParamDef
from ..paths import JsonDict

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True, slots=True)
class BaseScheme:
    """Defaults: experts from the dense manifests (:func:`~functional_load.layout.experts.from_linears`),
    experts dequantized one by one, no post-load transform, no online quantization."""

    @property
    def format(self) -> str:
        raise NotImplementedError

    @property
    def online(self) -> bool:
        return False

    def linear_params(self, linear: Linear, model_dtype: str) -> list[ParamDef]:
        raise NotImplementedError

    def expert_params(self, experts: Experts, model_dtype: str) -> list[ParamDef]:
        return from_linears(self, experts, model_dtype)

    def dequantize(self, get: Get, specs: Mapping[str, ParamSpec], parallel: Parallel, target: str = "checkpoint") -> torch.Tensor:
        raise NotImplementedError

    def dequantize_experts(self, get: Get, stem: str, specs: Mapping[str, ParamSpec], parallel: Parallel) -> torch.Tensor:
        """Each local expert dequantized as a linear of its own (``get(suffix)[slot]``)."""
        import torch

        weight = next(name for name, spec in specs.items() if spec.role == "weight" and name.startswith(f"{stem}_"))
        count = get(weight).shape[0]

        def expert(slot: int) -> torch.Tensor:
            return self.dequantize(lambda suffix: get(f"{stem}_{suffix}")[slot], {}, parallel, "checkpoint")

        return torch.stack([expert(s) for s in range(count)]) if count else torch.empty(0)

    def apply_target(
        self, target: str, module: str, tensors: dict[str, torch.Tensor], specs: Mapping[str, ParamSpec], parallel: Parallel
    ) -> None:
        """Turn the module's tensors (by full name, in place in ``tensors``) into ``target``'s layout."""

    def quantize(self, dense: torch.Tensor, specs: Mapping[str, ParamSpec], parallel: Parallel) -> dict[str, torch.Tensor]:
        raise ConfigError(f"{self.format} weights cannot be quantized while loading")

    def box_dequantizer(self) -> BoxDequantizer | None:
        return None

    def to_json(self) -> JsonDict:
        return {"format": self.format, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}


def missing(module: str, suffix: str) -> LoadError:
    return LoadError(f"dequantize: {module}.{suffix} is missing from the state")
