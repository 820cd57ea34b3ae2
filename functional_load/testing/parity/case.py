"""One parity case: a tiny checkpoint, the tensor-parallel sizes and the loader options of its runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..archs import ARCHS
from ..checkpoints import write_checkpoint
from ..mistral_format import add_mistral_copy
from ..multimodal import rename_checkpoint

FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "quant"


@dataclass(frozen=True)
class Options:
    """Loader options of one parity run, given to vLLM and to functional_load alike."""

    expert_parallel: bool = False
    expert_placement: str | None = None  # None: each loader's default (linear)
    dtype: str | None = None  # None: the config's ("auto")
    load_format: str = "auto"
    # ours only: the language model of a multimodal model, compared with vLLM's whole model less
    # the vision parameters (vLLM has no such option; its run is the one without text_only)
    text_only: bool = False

    @property
    def label(self) -> str:
        parts = ["ep"] if self.expert_parallel else []
        if self.expert_placement:
            parts.append(self.expert_placement)
        if self.dtype:
            parts.append(self.dtype)
        if self.load_format != "auto":
            parts.append(self.load_format)
        if self.text_only:
            parts.append("text_only")
        return ",".join(parts) or "-"

    @property
    def vllm_label(self) -> str:
        """The label of vLLM's run: ``text_only`` is ours alone."""
        return Options(self.expert_parallel, self.expert_placement, self.dtype, self.load_format).label

    def vllm(self) -> dict[str, Any]:
        return {
            "expert_parallel": self.expert_parallel,
            "expert_placement": self.expert_placement,
            "dtype": self.dtype or "auto",
            "load_format": self.load_format,
        }

    def ours(self) -> dict[str, Any]:
        out: dict[str, Any] = {"expert_parallel": self.expert_parallel, "dtype": self.dtype, "load_format": self.load_format}
        if self.expert_placement:
            out["expert_placement"] = self.expert_placement
        if self.text_only:
            out["text_only"] = True
        return out


@dataclass(frozen=True)
class Grid:
    """The parallel layout of a run: ``tp`` tensor ranks, ``pp`` pipeline stages (``partition``:
    layers per stage, vLLM's ``VLLM_PP_LAYER_PARTITION``; "": vLLM's split), ``dp`` data-parallel
    replicas. Flat rank ``(dp_rank * pp + pp_rank) * tp + tp_rank``, as the worker counts."""

    tp: int
    pp: int = 1
    dp: int = 1
    partition: str = ""

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def label(self) -> str:
        """The pipeline and data-parallel part of the run's name ("" for a tensor-parallel run)."""
        parts = ([f"dp{self.dp}"] if self.dp > 1 else []) + ([f"pp{self.pp}"] if self.pp > 1 else [])
        return ".".join(parts + ([f"part{self.partition.replace(',', '-')}"] if self.partition else []))

    def job(self) -> dict[str, Any]:
        """The worker's fields (a tensor-parallel run's job is as it always was)."""
        out: dict[str, Any] = {"tp": self.tp}
        out.update({k: v for k, v in (("pp", self.pp), ("dp", self.dp)) if v > 1})
        return {**out, **({"pp_partition": self.partition} if self.partition else {})}

    def ours(self, flat: int) -> dict[str, Any]:
        """functional_load's arguments for flat rank ``flat``."""
        d, p, t = flat // (self.tp * self.pp), flat // self.tp % self.pp, flat % self.tp
        out: dict[str, Any] = {"tp_size": self.tp, "rank": t}
        if self.pp > 1:
            out.update(pp_size=self.pp, pp_rank=p, pp_layer_partition=self.partition or ())
        if self.dp > 1:
            out.update(dp_size=self.dp, dp_rank=d)
        return out


DENSE = (Options(),)
MOE = (Options(), Options(True), Options(True, "round_robin"))


@dataclass(frozen=True)
class Case:
    """One checkpoint and the runs made on it.

    ``arch`` and ``build`` make a tiny checkpoint with
    :func:`functional_load.testing.checkpoints.write_checkpoint`; ``fixture`` names a directory of
    ``tests/fixtures/quant`` instead.
    """

    name: str
    arch: str | None = None
    build: Mapping[str, Any] = field(default_factory=dict)
    fixture: str | None = None
    tps: tuple[int, ...] = (1, 2, 4, 8)
    grids: tuple[Grid, ...] = ()  # pipeline and data-parallel runs, besides the tensor-parallel ``tps``
    options: tuple[Options, ...] = DENSE
    vllm_cannot: str = ""  # why vLLM cannot load this while functional_load can (listed in the report)
    we_refuse: str = ""  # why functional_load refuses a state vLLM loads (listed in the report)
    note: str = ""
    mistral_copy: bool = False  # also write Mistral's own format (params.json, consolidated.safetensors)
    multimodal: bool = False  # vLLM builds a vision tower: its worker gets torchvision (env.ensure_torchvision)
    names: str = ""  # rewrite the built checkpoint to another release's names (testing.multimodal.LAYOUTS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "build", MappingProxyType(dict(self.build)))
        if (self.arch is None) == (self.fixture is None):
            raise ValueError(f"case {self.name}: give exactly one of arch or fixture")

    @property
    def layouts(self) -> tuple[Grid, ...]:
        """Every parallel layout the case runs: each of ``tps``, then ``grids``."""
        return tuple(Grid(tp) for tp in self.tps) + self.grids

    def write(self, root: Path) -> Path:
        """The case's checkpoint directory (built under ``root`` on first use)."""
        if self.fixture is not None:
            return FIXTURES / self.fixture
        out = root / self.name
        if not (out / "config.json").exists():
            assert self.arch is not None
            write_checkpoint(self.arch, out, **dict(self.build))
            if self.names:
                rename_checkpoint(out, self.arch, self.names)
            if self.mistral_copy:
                add_mistral_copy(out)
        return out


def check_case(key: str, tps: tuple[int, ...], kv_heads: int = 2) -> Case:
    """vLLM's side of ``functional-load check-spec``: the tiny checkpoint of ``ARCHS[key]`` at ``tps``."""
    arch = ARCHS[key]
    build = {"kv_heads": kv_heads} if arch.kv_heads_key else {}
    return Case(f"check-{key}", key, build, tps=tps, options=MOE if arch.moe else DENSE, multimodal=arch.text_config_key is not None)
