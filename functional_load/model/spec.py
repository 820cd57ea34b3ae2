"""Architecture specs: the per-architecture facts, read from ``specs/<arch>.toml``.

A spec names the config keys that give each dimension (as small expressions), the modules of
the model with their parallel kind, the tied-embedding rule, and the name-mapping stages. Adding
an architecture means adding a TOML file; no Python changes.

Sizes are expressions over config keys (:mod:`.expressions`).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType

from ..errors import ConfigError
from ..paths import JsonDict, JsonObject
from .mapping import RULE_KINDS, MappingTable, Rule, shard_id_tuple
from .spec_fields import carried, check_module
from .spec_parts import DropSpec, PipelineSpec, RefuseSpec, TieSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODULE_KINDS = ("vocab", "column", "merged", "qkv", "row", "replicated_linear", "replicated", "heads", "params", "experts", "kv_cache")

@dataclass(frozen=True, slots=True)
class ModuleSpec:
    """One module pattern of an architecture (``{layer}`` expands over the decoder layers).

    Besides its kind's fields, every module may have ``when`` (an expression of ``layer``),
    ``layers`` (an expression: how many times ``{layer}`` expands, e.g. a vision tower's
    ``"vision_config.depth"``; default the spec's ``layers``), ``prefix`` (replaces the spec's
    prefix for this module: ``""`` for a vision tower beside ``language_model.``) and ``vision``
    (true: part of the vision tower or projector, left out with ``text_only=True``)."""

    pattern: str
    kind: str
    fields: JsonObject  # kind-specific expressions: in, out, outs, heads, size, params...

    def __post_init__(self) -> None:
        if self.kind not in MODULE_KINDS:
            raise ConfigError(f"module {self.pattern!r}: unknown kind {self.kind!r}; expected one of {MODULE_KINDS}")
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))


@dataclass(frozen=True, slots=True)
class Stage:
    """One mapping table, applied only when ``when`` (an expression over the config) holds.

    With ``layers`` (an expression: a layer count), the table is per layer, as vLLM's mappers
    built layer by layer (Gemma 4's KV-shared and k-equals-v layers): every ``{layer}`` of its
    rules is instantiated for each layer ``n`` below the count for which ``when`` holds with
    ``layer = n``."""

    table: MappingTable
    when: str | bool = True
    layers: str | int | None = None


@dataclass(frozen=True, slots=True)
class ArchSpec:
    name: str
    architectures: tuple[str, ...]
    layers: str
    dims: Mapping[str, str]
    modules: tuple[ModuleSpec, ...]
    stages: tuple[Stage, ...]
    tie: TieSpec | None = None
    source: str = ""
    drops: tuple[DropSpec, ...] = ()
    prefix: str = ""  # before every module and tied name: a multimodal model's language model ("language_model.")
    refusals: tuple[RefuseSpec, ...] = ()
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", MappingProxyType(dict(self.dims)))


def _stage(stage: JsonObject, where: str) -> Stage:
    rules = []
    for kind, entries in stage.items():
        if kind in ("when", "replace", "layers"):
            continue
        if kind not in RULE_KINDS:
            raise ConfigError(f"{where}: unknown mapping rule kind {kind!r}; expected one of {RULE_KINDS}")
        for pattern, value in entries.items():
            if kind == "expert" and isinstance(value, str):
                rules.append(Rule(kind, pattern, value))
            elif kind == "interleaved":
                rules.append(Rule(kind, pattern, None))
            elif kind in ("stacked", "expert"):
                new, ids = value
                rules.append(Rule(kind, pattern, new, shard_id_tuple(ids)))
            else:
                rules.append(Rule(kind, pattern, None if value is False else value))
    return Stage(MappingTable(tuple(rules)), stage.get("when", True), stage.get("layers"))


def parse_spec(data: JsonObject, source: str = "<spec>") -> ArchSpec:
    """Build an :class:`ArchSpec` from parsed TOML, checking every field."""
    known = {"name", "architectures", "layers", "dims", "modules", "stages", "tie", "extends", "drop", "prefix", "refuse", "pipeline"}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"{source}: unknown top-level keys {sorted(unknown)}; expected {sorted(known)}")
    try:
        modules = tuple(
            ModuleSpec(pattern, fields["kind"], {k: v for k, v in fields.items() if k != "kind"})
            for pattern, fields in data["modules"].items()
        )
        if problems := [p for m in modules for p in check_module(m.pattern, m.kind, m.fields)]:
            raise ConfigError(f"{source}: {len(problems)} problems in its modules:\n  " + "\n  ".join(problems))
        tie = TieSpec(**data["tie"]) if "tie" in data else None
        table = data.get("pipeline", {})
        pipeline = PipelineSpec(**table)
        named = [str(p) for key in ("first", "last") for p in table.get(key, ())]
        if absent := sorted(set(named) - {m.pattern for m in modules}):
            raise ConfigError(f"{source}: [pipeline] names modules the spec does not have: {absent}; its modules: "
                              f"{[m.pattern for m in modules if '{layer}' not in m.pattern]}")
        return ArchSpec(
            name=data["name"],
            architectures=tuple(data.get("architectures", ())),
            layers=data["layers"],
            dims=data.get("dims", {}),
            modules=modules,
            stages=tuple(_stage(stage, f"{source} stage {i}") for i, stage in enumerate(data.get("stages", []))),
            tie=tie,
            source=source,
            drops=tuple(DropSpec(**d) for d in data.get("drop", [])),
            prefix=str(data.get("prefix", "")),
            refusals=tuple(RefuseSpec(**r) for r in data.get("refuse", [])),
            pipeline=pipeline,
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{source}: malformed architecture spec: {exc!r}") from None


def _read_toml(text: str, source: str) -> JsonDict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None


SPEC_PATH_ENV = "FUNCTIONAL_LOAD_SPEC_PATH"  # directories of out-of-tree specs, searched before the built-in ones


_TOP_NAME = re.compile(r"""^name\s*=\s*["']([^"'\n]+)["']\s*(?:#.*)?$""", re.M)


class _RawSpecs(Mapping[str, tuple[JsonDict, str]]):
    """Spec files by name (the top-level ``name = "..."`` before the first table, else the stem),
    in lookup order, each parsed when first asked for: a load parses its spec and ``extends``
    chain, not all 87 files (about 60 ms a process here)."""

    def __init__(self, files: list[tuple[str, str, str]]):  # (stem, text, source)
        self._files: dict[str, tuple[str, str]] = {}
        self._parsed: dict[str, tuple[JsonDict, str]] = {}
        for stem, text, source in files:
            head = re.split(r"^\s*\[", text, maxsplit=1, flags=re.M)[0]
            found = _TOP_NAME.search(head)
            self._files.setdefault(found.group(1) if found else stem, (text, source))

    def __getitem__(self, name: str) -> tuple[JsonDict, str]:
        if name not in self._parsed:
            text, source = self._files[name]
            data = _read_toml(text, source)
            if data.get("name", name) != name:
                raise ConfigError(f"{source}: its name {data.get('name')!r} is not the one read off its text ({name!r})")
            self._parsed[name] = (data, source)
        return self._parsed[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def mentioning(self, word: str) -> list[str]:
        """The names of the files whose text holds ``word`` as a quoted string, in lookup order."""
        quoted = (f'"{word}"', f"'{word}'")
        return [name for name, (text, _) in self._files.items() if any(q in text for q in quoted)]


def _builtin_files() -> list[tuple[str, str, str]]:
    return [
        (entry.name[:-5], entry.read_text(), f"specs/{entry.name}")
        for entry in sorted(resources.files("functional_load.specs").iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".toml")
    ]


def spec_dirs() -> list[Path]:
    """The directories of ``$FUNCTIONAL_LOAD_SPEC_PATH`` (``os.pathsep``-separated), read at call time."""
    return [Path(d) for d in os.environ.get(SPEC_PATH_ENV, "").split(os.pathsep) if d]


def _all_raw() -> _RawSpecs:
    """Every spec by name, in the order a config's architecture is looked up: those on the search
    path first (the first directory first; they replace a built-in of the same name, and serve an
    architecture a built-in serves too), then the built-in ones."""
    files: list[tuple[str, str, str]] = []
    for directory in spec_dirs():
        if not directory.is_dir():
            raise ConfigError(f"{SPEC_PATH_ENV} names {directory}, which is not a directory of spec .toml files")
        files += [(path.stem, path.read_text(), str(path)) for path in sorted(directory.glob("*.toml"))]
    return _RawSpecs(files + _builtin_files())


def _resolve(
    data: JsonDict, source: str, raw: Mapping[str, tuple[JsonDict, str]], seen: tuple[str, ...] = ()
) -> JsonDict:
    """Apply ``extends``: start from the base spec; ``dims``, each module's fields and each mapping
    stage's rules (stage by stage, in order) are updated key by key (a module given another kind
    keeps the base's fields that kind takes; ``kind = "none"`` removes a module; a stage with
    ``replace = true`` replaces the base's stage); everything else is replaced."""
    base_name = data.get("extends")
    if base_name is None:
        return data
    if base_name not in raw or base_name in seen:
        raise ConfigError(f"{source}: extends unknown or circular spec {base_name!r}; known: {sorted(raw)}")
    base = _resolve(*raw[base_name], raw, seen + (base_name,))
    merged = {k: v for k, v in base.items() if k not in ("architectures", "extends")}
    for key, value in data.items():
        if key == "dims":
            merged["dims"] = {**base.get("dims", {}), **value}
        elif key == "modules":
            modules = [(name, dict(fields)) for name, fields in base.get("modules", {}).items()]
            for name, fields in value.items():
                names = [n for n, _ in modules]
                if name in names:
                    i = names.index(name)
                    modules[i] = (name, {**carried(modules[i][1], fields.get("kind")), **fields})
                else:  # a new per-layer module joins the end of the layer block with its layer count
                    layered = [
                        i for i, (n, f) in enumerate(modules) if "{layer}" in n and f.get("layers") == fields.get("layers")
                    ]
                    at = layered[-1] + 1 if "{layer}" in name and layered else len(modules)
                    modules.insert(at, (name, dict(fields)))
            merged["modules"] = {n: f for n, f in modules if f.get("kind") != "none"}
        elif key == "stages":
            stages = [dict(stage) for stage in base.get("stages", [])]
            for i, stage in enumerate(value):
                if i < len(stages) and stage.get("replace"):  # the base's stage i does not apply
                    stages[i] = {k: v for k, v in stage.items() if k != "replace"}
                elif i < len(stages):
                    for kind, rules in stage.items():
                        stages[i][kind] = {**stages[i].get(kind, {}), **rules} if isinstance(rules, dict) else rules
                else:
                    stages.append(dict(stage))
            merged["stages"] = stages
        elif key != "extends":
            merged[key] = value
    return merged


def load_spec(path: str | Path) -> ArchSpec:
    """Read one spec file; ``extends`` may name a built-in spec or one on the search path."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"spec file {path} does not exist")
    data = _read_toml(path.read_text(), str(path))
    return parse_spec(_resolve(data, str(path), _all_raw()), str(path))


def builtin_specs() -> dict[str, ArchSpec]:
    """The specs shipped in ``specs/``, by name."""
    raw = _RawSpecs(_builtin_files())
    return {name: parse_spec(_resolve(data, source, raw), source) for name, (data, source) in raw.items()}


_PARSED: dict[tuple[tuple[str, int, int], ...], dict[str, ArchSpec]] = {}  # spec files' stamps -> their specs


def _stamps() -> tuple[tuple[str, int, int], ...] | None:
    """(path, size, mtime) of every spec file a load can pick; None where one cannot be stat'ed."""
    try:
        paths = [str(e) for e in resources.files("functional_load.specs").iterdir() if e.name.endswith(".toml")]
        paths += [str(p) for d in spec_dirs() if d.is_dir() for p in d.glob("*.toml")]
        return tuple((path, (st := os.stat(path)).st_size, st.st_mtime_ns) for path in sorted(paths))
    except OSError:
        return None


def available_specs() -> dict[str, ArchSpec]:
    """Every spec a load can pick: ``$FUNCTIONAL_LOAD_SPEC_PATH``'s, then the built-in ones
    (parsed once while no spec file changes)."""
    stamps = _stamps()
    if stamps is not None and stamps in _PARSED:
        return dict(_PARSED[stamps])
    raw = _all_raw()
    specs = {name: parse_spec(_resolve(data, source, raw), source) for name, (data, source) in raw.items()}
    if stamps is not None:
        _PARSED.clear()
        _PARSED[stamps] = specs
    return dict(specs)


def find_spec(name_or_path: str | Path) -> ArchSpec:
    """A spec by file path (``.toml``) or by name (search path, then built-in)."""
    if isinstance(name_or_path, Path) or str(name_or_path).endswith(".toml"):
        return load_spec(name_or_path)
    specs = available_specs()
    if name_or_path not in specs:
        raise ConfigError(
            f"no architecture spec named {name_or_path!r}; known: {sorted(specs)} (a spec file path must end in .toml)"
        )
    return specs[name_or_path]


def spec_for_config(config: JsonObject, specs: Mapping[str, ArchSpec] | None = None) -> ArchSpec:
    """The spec whose ``architectures`` lists the config's first architecture (or its model_type)."""
    wanted = config.get("architectures") or []
    model_type = config.get("model_type")
    if not isinstance(wanted, list) or not all(isinstance(a, str) for a in wanted) or not isinstance(model_type, (str, type(None))):
        raise ConfigError(
            f"config.json: 'architectures' must be a list of class names and 'model_type' a string, found "
            f"{wanted!r:.100} and {model_type!r:.100}"
        )
    if specs is None and (found := _first_serving(wanted)) is not None:
        return found
    specs = available_specs() if specs is None else specs
    for arch in wanted:
        for spec in specs.values():
            if arch in spec.architectures:
                return spec
    if isinstance(model_type, str) and model_type in specs:
        return specs[model_type]
    supported = sorted(a for s in specs.values() for a in s.architectures)
    raise ConfigError(
        f"no architecture spec for architectures={wanted} (model_type={model_type!r}){_closest(model_type, wanted, specs)}; "
        f"supported: {supported}. Write a spec for it (docs/adding-an-architecture.md), often `extends` of the closest "
        f"family, then pass spec= (or --spec FILE), or put it in a directory on {SPEC_PATH_ENV}; "
        f"`functional-load check-spec SPEC` proves it against transformers and vLLM"
    )


def _first_serving(architectures: list[str]) -> ArchSpec | None:
    """What :func:`spec_for_config` finds by architecture, parsing only the files that mention it;
    None when none does or every spec is parsed already."""
    stamps = _stamps()
    if stamps is None or stamps in _PARSED:
        return None
    raw = _all_raw()
    for arch in architectures:
        for name in raw.mentioning(arch):
            data, source = raw[name]
            if arch in data.get("architectures", ()):
                return parse_spec(_resolve(data, source, raw), source)
    return None


def _closest(model_type: object, architectures: list[str], specs: Mapping[str, ArchSpec]) -> str:
    """``; the closest supported family is ...`` by name similarity, or nothing."""
    names = {name: name for name in specs} | {a.lower(): s.name for s in specs.values() for a in s.architectures}
    keys = [k.lower().removesuffix("forcausallm") for k in ([model_type] if isinstance(model_type, str) else []) + architectures]
    best = [difflib.get_close_matches(k, list(names), n=1, cutoff=0.5) for k in keys]
    found = [names[b[0]] for b in best if b]
    return f"; the closest supported family is {found[0]!r}" if found else ""
