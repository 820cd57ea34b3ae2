"""``QuantConfig``: a parsed ``quantization_config``, and the field readers every method's parser uses.

A config holds a default scheme, per-target overrides (compressed-tensors' ``config_groups``),
the ignore list, the attention layer's KV-cache parameters, name-mapping stages and the optional
tensors the method may leave in a checkpoint. Ignore lists (``ignore``, ``ignored_layers``,
``modules_to_not_convert``, ``exclude``) name checkpoint modules; a fused vLLM module is skipped
only if all of its parts are. Malformed fields are ConfigErrors, never bare TypeErrors.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ..layout.param import Check
from ..layout.quantized import Scheme
from ..model.mapping import MappingTable
from ..paths import JsonObject

KVParam = tuple[str, tuple[int, ...], str, float, Check | None]  # name, shape, dtype ("model": the model's), created value, check


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """The parsed quantization config (implements :class:`functional_load.layout.quantized.Quantization`)."""

    method: str
    default: Scheme | None
    ignore: tuple[str, ...] = ()
    targets: tuple[tuple[str, Scheme], ...] = ()  # (regex or name, scheme), compressed-tensors
    kv_params: tuple[KVParam, ...] = ()  # the attention layer's KV-cache parameters
    mapping: tuple[MappingTable, ...] = ()
    kinds: tuple[Literal["linear", "experts"], ...] = ("linear", "experts")  # what the method quantizes (gpt-oss MXFP4: experts only)
    optional: tuple[tuple[str, str], ...] = ()  # (regex of a mapped name, why): dropped when no parameter takes it
    # GPTQ: the checkpoint modules that are quantized (a module is when one of these is part of its
    # name, as vLLM matches them); None: every module the ignore list leaves. ``detect``: learn them
    # from the checkpoint's non-float tensors when the config names none (vLLM reads them from the
    # safetensors metadata), so a router stored in bf16 stays unquantized.
    quantized: tuple[str, ...] | None = None
    detect: bool = False
    # regexes (``re.match``) of vLLM module names vLLM builds unquantized whatever else the config
    # says (GPTQ's ``dynamic`` "-:" rules, matched on vLLM's module prefix as vLLM matches them)
    skip: tuple[str, ...] = ()

    def quantizes(self, kind: str) -> bool:
        """Whether the method quantizes modules of ``kind`` (``"linear"`` or ``"experts"``)."""
        return kind in self.kinds

    def for_checkpoint(self, dtypes: Callable[[], Mapping[str, str]]) -> QuantConfig:
        """This config with the quantized modules learned from the checkpoint's tensor dtypes
        (``dtypes()``: ``{name: safetensors code}``, asked for only where the method learns them so)."""
        if not self.detect or self.quantized is not None:
            return self
        floats = ("F16", "BF16", "F32")
        found = tuple(sorted({name.rsplit(".", 1)[0] for name, code in dtypes().items() if code not in floats}))
        return dataclasses.replace(self, quantized=found or None)

    def scheme_for(self, module: str, sources: Sequence[str]) -> Scheme | None:
        """The scheme of vLLM module ``module`` whose checkpoint parts are ``sources``."""
        if any(re.match(pattern, module) for pattern in self.skip):
            return None
        if self.quantized is not None:
            held = [any(layer in s for layer in self.quantized) for s in sources]
            if any(held) and not all(held):
                raise ConfigError(f"{module}: some but not all of its checkpoint parts {list(sources)} are quantized")
            if not any(held):
                return None
        skipped = [matches(self.ignore, s) for s in sources]
        if any(skipped) and not all(skipped):
            raise ConfigError(
                f"{module}: some but not all of its checkpoint parts {list(sources)} are in the quantization "
                f"ignore list; all parts of a fused layer must have the same precision"
            )
        if skipped and all(skipped):
            return None
        for pattern, scheme in self.targets:
            if any(matches((pattern,), s) for s in sources):
                return scheme
        return self.default


def matches(patterns: Sequence[str], name: str) -> bool:
    """Whether ``name`` is one of ``patterns`` (a module, or a parent of it) or matches a ``re:`` one."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.startswith(p + "."):
            return True
    return False


def int_field(value: object, what: str) -> int:
    """An integer field of quantization_config (not a bool, a float or a string)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json quantization_config {what} must be an integer, found {value!r:.60}")
    return value


def names(value: object, what: str) -> tuple[str, ...]:
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


def ignore_list(qc: JsonObject) -> tuple[str, ...]:
    out: list[str] = []
    for key in ("ignore", "ignored_layers", "modules_to_not_convert", "exclude", "exclude_modules"):
        out += names(qc.get(key), key)
    return tuple(out)


def group_size_field(value: object, what: str = "group_size") -> int:
    """A quantization group size: a positive integer, or -1 for one group (0 is an error, not per-channel)."""
    group = -1 if value is None else int_field(value, what)
    if not (group == -1 or group > 0):
        raise ConfigError(f"quantization group_size must be a positive integer or -1, got {value!r}; check config.json")
    return group
