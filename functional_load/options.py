"""``LoadOptions``: how a checkpoint is read, one frozen value shared by every entry point.

``layout``, ``plan``, ``load``, ``load_jax``, ``save_sharded``, ``verify_ranks`` and the CLI take
the same ``options=LoadOptions(...)``; each field may also be given by name as a keyword
(``fl.load(model, tp_size=2, rank=1, dtype="float32")``), which replaces it in ``options``.
An unknown keyword is a :class:`~functional_load.ConfigError` that lists the fields.
What an entry point produces (the rank, a torch output layout or device, a JAX mesh or target)
is its own argument, not an option.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dtypes import DtypeChoice
from .errors import ConfigError
from .io.options import ReadOptions
from .layout.parallel import PLACEMENTS, Parallel
from .model.spec import ArchSpec, find_spec

SpecChoice = ArchSpec | str | os.PathLike[str] | None


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """How any entry point reads a checkpoint.

    * ``dtype``: destination dtype (``None``: vLLM's ``"auto"``, the config's; float32 models in
      bfloat16); ``quantization``: ``"fp8"`` / ``"fp8_block"`` quantize an unquantized
      checkpoint while loading;
    * ``load_format``: ``"auto"`` | ``"hf"`` | ``"safetensors"`` | ``"mistral"`` | ``"pt"`` |
      ``"dummy"`` (config only, vLLM's dummy values); ``allow_pickle``: permit ``.bin``/``.pt``;
      ``revision``: of a Hugging Face Hub repo id;
    * ``spec``: the architecture spec (an :class:`ArchSpec`, a ``.toml`` path, or a spec name;
      ``None``: picked from ``config.json``, searched in ``$FUNCTIONAL_LOAD_SPEC_PATH`` then the
      built-in specs); ``text_only``: leave a multimodal model's vision tower out;
    * ``expert_parallel``, ``expert_placement`` (``"linear"`` | ``"round_robin"``),
      ``num_redundant_experts``: how MoE experts are spread over the ranks;
    * ``pp_size``/``pp_rank``: the pipeline stage (its decoder layers as vLLM's
      ``get_pp_indices`` splits them, or ``pp_layer_partition``: layers per stage, ``"4,4,3"``
      or a tuple; ``None``: vLLM's ``VLLM_PP_LAYER_PARTITION`` environment variable when set);
      ``dp_size``/``dp_rank``: the data-parallel replica (fused MoE experts are split or spread
      over the ``dp_size x tp_size`` ranks, everything else is as the tensor-parallel rank's);
    * ``read``: :class:`ReadOptions` (strategy, threads, prefetch, hashes); ``progress``: a
      progress bar (``None``: only for long loads);
    * ``cache_dir``: a local folder for the rank cache of loads from object storage (``s3://``): a
      rank's fetched tensors are kept there as a one-rank pre-sharded save, checked against the
      objects' identities (size, ETag), and a later load of the same rank at the same layout
      reads them from local disk (:mod:`functional_load.output.rank_cache`; ``None``: no cache).
    """

    dtype: DtypeChoice = None
    quantization: str | None = None
    load_format: str = "auto"
    allow_pickle: bool = False
    revision: str | None = None
    spec: SpecChoice = None
    text_only: bool = False
    expert_parallel: bool = False
    expert_placement: str = "linear"
    num_redundant_experts: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    pp_layer_partition: tuple[int, ...] | str | None = None
    read: ReadOptions = ReadOptions()
    progress: bool | None = None
    cache_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        for name in ("allow_pickle", "text_only", "expert_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"option {name} must be True or False, got {getattr(self, name)!r}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ConfigError(f"option progress must be None, True or False, got {self.progress!r}")
        if not isinstance(self.load_format, str):
            raise ConfigError(f"option load_format must be a string, got {self.load_format!r}")
        for name in ("quantization", "revision"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"option {name} must be a string or None, got {getattr(self, name)!r}")
        if not isinstance(self.read, ReadOptions):
            raise ConfigError(f"option read must be a functional_load.ReadOptions, got {type(self.read).__name__}")
        if self.expert_placement not in PLACEMENTS:
            raise ConfigError(f"option expert_placement must be one of {PLACEMENTS}, got {self.expert_placement!r}")
        redundant = self.num_redundant_experts
        if isinstance(redundant, bool) or not isinstance(redundant, int) or redundant < 0:
            raise ConfigError(f"option num_redundant_experts must be a non-negative integer, got {redundant!r}")
        if self.cache_dir is not None and (not isinstance(self.cache_dir, (str, os.PathLike)) or "://" in os.fspath(self.cache_dir)):
            raise ConfigError(f"option cache_dir must be a local folder (a str or os.PathLike, no URI), got {self.cache_dir!r}")
        if self.spec is not None and not isinstance(self.spec, (ArchSpec, str, os.PathLike)):
            raise ConfigError(f"option spec must be an ArchSpec, a spec file path or a spec name, got {type(self.spec).__name__}")

    @property
    def dummy(self) -> bool:
        """``load_format="dummy"``: vLLM's dummy values from the config alone."""
        return self.load_format.lower() == "dummy"

    def replace(self, **changes: Any) -> LoadOptions:
        """These options with ``changes`` (field names of :class:`LoadOptions`) applied."""
        fields = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            hints = [f"{name}: did you mean {_closest(name, fields)}?" for name in unknown if _closest(name, fields)]
            raise ConfigError(
                f"unknown option(s) {unknown}" + "".join(f"; {h}" for h in hints)
                + f"; the options (LoadOptions fields) are {fields}, beside the arguments tp_size and rank"
            )
        return dataclasses.replace(self, **changes) if changes else self

    def parallel(self, tp_size: int, rank: int) -> Parallel:
        """Tensor rank ``rank`` of ``tp_size``, with these options' pipeline stage, data-parallel
        replica and expert parallelism."""
        return Parallel(tp_size, rank, self.expert_parallel, self.expert_placement, self.num_redundant_experts,
                        self.pp_size, self.pp_rank, self.dp_size, self.dp_rank, self.layer_partition())

    def layer_partition(self) -> tuple[int, ...]:
        """Decoder layers per pipeline stage when given: the option, else ``VLLM_PP_LAYER_PARTITION``
        (read as vLLM reads it: comma-separated integers); ``()``: vLLM's own split."""
        given = self.pp_layer_partition if self.pp_layer_partition is not None else os.environ.get("VLLM_PP_LAYER_PARTITION")
        if given is None:
            return ()
        if isinstance(given, str):
            try:
                return tuple(int(layer) for layer in given.split(","))
            except ValueError:
                raise ConfigError(f"Invalid partition string: {given} (pp_layer_partition / VLLM_PP_LAYER_PARTITION: layers per "
                                  f"stage, comma-separated)") from None
        return tuple(given)

    def arch_spec(self) -> ArchSpec | None:
        """The spec asked for: as given, read from a ``.toml`` path, or found by name (``None``:
        the config decides)."""
        if self.spec is None or isinstance(self.spec, ArchSpec):
            return self.spec
        return find_spec(Path(self.spec) if not isinstance(self.spec, str) else self.spec)


# what other loaders call the entry points' own arguments
_ARGUMENT_NAMES = {"tp": "tp_size", "tensor_parallel_size": "tp_size", "world_size": "tp_size", "tp_rank": "rank",
                   "pipeline_parallel_size": "pp_size", "data_parallel_size": "dp_size", "data_parallel_rank": "dp_rank"}


def _closest(name: str, fields: list[str]) -> str:
    """The argument or option a mistyped keyword most likely meant ("" when none is close)."""
    if name in _ARGUMENT_NAMES:
        return _ARGUMENT_NAMES[name]
    close = difflib.get_close_matches(name, [*fields, "tp_size", "rank"], n=1)
    return close[0] if close else ""


def resolve_options(options: LoadOptions, overrides: Mapping[str, object]) -> LoadOptions:
    """``options`` with the keyword overrides of an entry point applied (checked)."""
    if not isinstance(options, LoadOptions):
        raise ConfigError(f"options must be a functional_load.LoadOptions, got {type(options).__name__}")
    return options.replace(**overrides)
