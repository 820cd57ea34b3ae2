"""The small tables of an architecture spec: the tie, drops, refusals and pipeline stages."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True, slots=True)
class TieSpec:
    """``alias`` is the same tensor as ``target`` when ``when`` holds (tied word embeddings)."""

    alias: str
    target: str
    when: str


@dataclass(frozen=True, slots=True)
class DropSpec:
    """Checkpoint tensors that are not this model's parameters, with why: every name starting
    with ``prefix``, for each ``{layer}`` in ``[first, stop)`` (expressions over the config) when
    the prefix has one: e.g. DeepSeek-V3's multi-token-prediction layers past ``num_hidden_layers``,
    or a multimodal checkpoint's ``vision_model.``. ``when`` (an expression, with ``layer`` bound
    for a prefix holding ``{layer}``) keeps only the layers it holds for: the indexer weights
    DeepSeek-V3.2 ships for the layers whose indexer vLLM does not build."""

    prefix: str
    reason: str
    first: str | int = 0
    stop: str | int = 1
    when: str | bool = True

    def __post_init__(self) -> None:
        if self.prefix.count("{layer}") > 1:
            raise ConfigError(f"drop prefix {self.prefix!r} may contain {{layer}} once at most")


@dataclass(frozen=True, slots=True)
class RefuseSpec:
    """A configuration vLLM refuses, refused here with its words: when ``when`` holds (an
    expression over the config, the dims, ``tp_size`` and ``expert_parallel``), the layout is a
    ShardingError with ``message`` (``{name}`` fields filled from the same names)."""

    when: str
    message: str


@dataclass(frozen=True, slots=True)
class PipelineSpec:
    """Where vLLM's pipeline stages put the modules outside the decoder layers, as the model's
    vLLM code builds them (``PPMissingLayer`` elsewhere): ``first`` (module patterns) on the first
    stage only, ``last`` on the last stage only, every other module on every stage; with tied
    embeddings the tie's target module is on the last stage too (it is the head there) when
    ``tied_last``. The defaults are Llama's (most models copy it). ``refuse``: vLLM's words when
    the model does not implement ``SupportsPP``."""

    first: tuple[str, ...] = ("model.embed_tokens",)
    last: tuple[str, ...] = ("model.norm", "lm_head")
    tied_last: bool = True
    refuse: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "first", tuple(self.first))
        object.__setattr__(self, "last", tuple(self.last))
        if not isinstance(self.tied_last, bool) or not isinstance(self.refuse, str):
            raise ConfigError(f"[pipeline]: tied_last must be true or false and refuse a string, got {self.tied_last!r}, {self.refuse!r}")
