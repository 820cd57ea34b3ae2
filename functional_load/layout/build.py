"""The layout: every destination parameter of one rank, from config + spec + parallel settings.

This is the "shell" of the model: names, global and rank-local shapes, dtypes and slice
descriptors, with no memory allocated. It is a pure function of its inputs.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from ..errors import ConfigError, ShardingError
from ..model.expressions import Scope, Value, evaluate
from ..model.mapping import ROTARY_CACHES, MappingTable
from ..model.spec import ArchSpec, ModuleSpec, Stage
from ..paths import JsonObject
from ..vllm_target import VLLM_VERSION
from .modules import module_params
from .parallel import Parallel
from .param import ParamSpec
from .pipeline import PipelineStage
from .quantized import ParamDef, Quantization, Scheme

# A config asking for more layers than this is corrupt or hostile (real models have a few hundred
# at most); expanding it would take unbounded time and memory before any check could fail.
MAX_LAYERS = 10_000


@dataclass(frozen=True, slots=True)
class Layout:
    arch: str
    parallel: Parallel
    dtype: str
    params: Mapping[str, ParamSpec]
    mapping: tuple[MappingTable, ...]
    aliases: Mapping[str, str]  # tied alias -> canonical parameter
    schemes: Mapping[str, Scheme] = field(default_factory=dict)  # quantized module -> its scheme
    drops: tuple[tuple[str, str], ...] = ()  # (name prefix, why): checkpoint tensors that are no parameter
    # (module pattern, why): modules left out (``vision = true`` ones with text_only; ``{layer}`` stands
    # for any layer); checkpoint tensors mapped into them are dropped
    left_out: tuple[tuple[str, str], ...] = ()
    # (regex, why): checkpoint tensors dropped when no parameter takes them (the quantization method's
    # optional tensors: KV-cache scales it has no parameter for, GPTQ's zero biases)
    optional: tuple[tuple[str, str], ...] = ()
    # pipeline parallelism: the rank's stage, and the decoder-layer module patterns whose other
    # layers (those outside the stage) are dropped with the stage's reason
    stage: PipelineStage | None = None
    layer_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "aliases", MappingProxyType(dict(self.aliases)))
        object.__setattr__(self, "schemes", MappingProxyType(dict(self.schemes)))


TEXT_ONLY_REASON = "part of the vision tower or projector, which text_only=True leaves out"


def _layer_count(spec: ArchSpec, module: ModuleSpec, scope: Scope, num_layers: int) -> int:
    """How many times the module's ``{layer}`` expands: its own ``layers`` or the spec's."""
    if "layers" not in module.fields:
        return num_layers
    count = scope.int(module.fields["layers"], f"{module.pattern}.layers")
    if count > MAX_LAYERS:
        raise ConfigError(f"{module.pattern}.layers = {module.fields['layers']!r} evaluated to {count}; config.json is corrupt")
    return count


def _instances(
    spec: ArchSpec, scope: Scope, num_layers: int, modules: tuple[ModuleSpec, ...] | None = None
) -> Iterator[tuple[ModuleSpec, str, Scope, int | None]]:
    """Module instances in model order, with the decoder layer of each (None outside them): each
    run of consecutive ``{layer}`` modules with the same ``layers`` is expanded layer-major (all
    of layer 0, then layer 1...); ``when`` filters instances; a module's ``prefix`` replaces the spec's."""
    runs: list[list[ModuleSpec]] = []
    for module in spec.modules if modules is None else modules:
        per_layer = _per_layer(module)
        last = runs[-1][0] if runs else None
        if last is not None and per_layer and _per_layer(last) and last.fields.get("layers") == module.fields.get("layers"):
            runs[-1].append(module)
        else:
            runs.append([module])
    for run in runs:
        layers = range(_layer_count(spec, run[0], scope, num_layers)) if _per_layer(run[0]) else [None]
        for layer in layers:
            layer_scope = scope.with_layer(layer) if layer is not None else scope
            for module in run:
                if "when" in module.fields and not evaluate(module.fields["when"], layer_scope):
                    continue
                prefix = str(module.fields.get("prefix", spec.prefix))
                yield module, prefix + _instance_name(module, layer, layer_scope), layer_scope, layer if _decoder_layer(module) else None


def _decoder_layer(module: ModuleSpec) -> bool:
    """Whether the module is part of each decoder layer (a ``{layer}`` module with the spec's count)."""
    return _per_layer(module) and "layers" not in module.fields


def _off_stage(spec: ArchSpec, modules: tuple[ModuleSpec, ...], stage: PipelineStage | None) -> tuple[tuple[str, str], ...]:
    """The modules outside the decoder layers that ``stage`` does not hold, as left-out patterns."""
    if stage is None:
        return ()
    off = [m for m in modules if not _decoder_layer(m) and not stage.holds(m.pattern, None)]
    return tuple((str(m.fields.get("prefix", spec.prefix)) + m.pattern, stage.why) for m in off)


def _per_layer(module: ModuleSpec) -> bool:
    """Whether the module expands per layer: its pattern holds ``{layer}``, or names computed from it."""
    return "{layer}" in module.pattern or "names" in module.fields


def _instance_name(module: ModuleSpec, layer: int | None, scope: Scope) -> str:
    """The module's pattern with ``{layer}`` and each placeholder of its ``names`` filled in:
    ``names = { first = "hybrid_layer_ids[layer % num_mem_blocks]" }`` puts that number for
    ``{first}`` (a module vLLM names after another layer: Zamba2's shared blocks, held by the first
    hybrid layer that uses them)."""
    name = module.pattern.replace("{layer}", str(layer))
    for key, expr in dict(module.fields.get("names", {})).items():
        name = name.replace("{" + key + "}", str(scope.int(expr, f"{module.pattern}.names.{key}")))
    return name


def model_tp_sizes(
    config: JsonObject, spec: ArchSpec, parallel: Parallel, dtype: str, quant: Quantization | None, up_to: int = 64,
    text_only: bool = False,
) -> list[int]:
    """Every tp size that divides every module of the model (for error messages)."""
    sizes = []
    for tp in range(1, up_to + 1):
        try:
            one = replace(parallel, tp_size=tp, rank=0, num_redundant_experts=0)
            build_layout(config, spec, one, dtype, quant, report=False, text_only=text_only)
        except (ShardingError, ConfigError):
            continue
        sizes.append(tp)
    return sizes


def _served_placement(spec: ArchSpec, scope: Scope, parallel: Parallel, warn: bool) -> Parallel:
    """The expert placement vLLM serves: round-robin only with expert parallelism over several
    ranks, for models with more than one expert group and no redundant experts, without data
    parallelism (vLLM's ``determine_expert_placement_strategy``); otherwise linear (with a
    warning when round-robin was asked for and cannot be served)."""
    experts = [m for m in spec.modules if m.kind == "experts"]
    if parallel.expert_placement != "round_robin" or not experts:
        return parallel
    linear = replace(parallel, expert_placement="linear")
    if parallel.ep_size == 1:
        return linear
    groups = scope.int(experts[0].fields.get("groups", 1), f"{experts[0].pattern}.groups")
    if groups > 1 and parallel.num_redundant_experts == 0 and parallel.dp_size == 1:
        return parallel
    if warn:
        why = f"{spec.name} has {groups} expert group(s)" if groups <= 1 else f"{parallel.num_redundant_experts} redundant experts"
        if groups > 1 and parallel.num_redundant_experts == 0:  # data parallel: vLLM's all2all kernels
            why = f"dp_size={parallel.dp_size}: the default all2all backend (allgather_reducescatter) has no round-robin routing tables"
        warnings.warn(
            f"expert_placement='round_robin' falls back to 'linear', as vLLM {VLLM_VERSION} serves it: round-robin "
            f"placement needs more than one expert group and no redundant experts ({why}); the plan records 'linear'",
            stacklevel=4,
        )
    return linear


def build_layout(
    config: JsonObject, spec: ArchSpec, parallel: Parallel, dtype: str, quant: Quantization | None = None,
    *, report: bool = True, text_only: bool = False,
) -> Layout:
    """Every parameter of ``parallel.rank``; ``quant`` (a parsed quantization config, see
    :mod:`functional_load.quant`) decides each linear's quantized tensors; ``text_only`` leaves
    out the ``vision = true`` modules (their tensors are dropped, with the reason). Divisibility
    problems of all modules are collected and raised together as one ShardingError."""
    scope = Scope(config, spec.dims, extra={"sequence_parallel_moe": parallel.sequence_parallel_moe})
    stages = tuple(_stage_table(stage, scope) for stage in spec.stages if stage.layers is not None or evaluate(stage.when, scope))
    schemes: dict[str, Scheme] = {}
    num_layers = _num_layers(spec, scope)
    tied = spec.tie is not None and bool(evaluate(spec.tie.when, scope))
    stage = PipelineStage.of(spec.pipeline, num_layers, parallel, tied, spec.name)
    parallel = _served_placement(spec, scope, parallel, warn=report)
    _refusals(spec, scope, parallel)
    params: dict[str, ParamSpec] = {}
    problems: list[str] = []
    failed: set[str] = set()
    # text_only: the vision modules, as name patterns (the tower's depth need not be in the config)
    vision = [m for m in spec.modules if text_only and m.fields.get("vision")]
    left_out = tuple((str(m.fields.get("prefix", spec.prefix)) + m.pattern, TEXT_ONLY_REASON) for m in vision)
    kept = tuple(m for m in spec.modules if m not in vision)
    left_out += _off_stage(spec, kept, stage)
    for module, name, module_scope, layer in _instances(spec, scope, num_layers, kept):
        if module.pattern in failed or (stage is not None and not stage.holds(module.pattern, layer)):
            continue
        transposed = bool(module.fields.get("transposed", False))
        try:
            for d in module_params(module, name, module_scope, dtype, quant, stages, schemes):
                full = f"{name}.{d.suffix}"
                params[full] = _param_spec(full, name, d, transposed, name in schemes and schemes[name].online, parallel)
        except ShardingError as exc:
            failed.add(module.pattern)
            problems.append(_shard_problem(module, name, parallel, exc))
    if problems and not report:
        raise ShardingError(problems[0])
    if problems:
        head = f"{spec.name} does not shard over tp_size={parallel.tp_size}:"
        sizes = model_tp_sizes(config, spec, parallel, dtype, quant, text_only=text_only)
        tail = f"tp sizes (up to 64) that work for the whole model: {sizes}"
        raise ShardingError("\n".join([head, *(f"  - {p}" for p in problems), tail]))
    aliases = {}
    if spec.tie is not None and tied:
        alias, target = spec.prefix + spec.tie.alias, spec.prefix + spec.tie.target
        params.pop(alias, None)
        if stage is None or (stage.holds(spec.tie.alias.rsplit(".", 1)[0], None) and target in params):
            aliases[alias] = target
    quant_stages = quant.mapping if quant else ()
    mapping = (ROTARY_CACHES, *quant_stages, *stages)
    optional = tuple(quant.optional) if quant else ()
    layer_modules = tuple(str(m.fields.get("prefix", spec.prefix)) + m.pattern for m in kept if _decoder_layer(m)) if stage else ()
    return Layout(spec.name, parallel, dtype, params, mapping, aliases, schemes, _drops(spec, scope), left_out, optional,
                  stage, layer_modules)


def _num_layers(spec: ArchSpec, scope: Scope) -> int:
    """The spec's number of layers for this config; a count no real model has means a corrupt config."""
    num_layers = scope.int(spec.layers, f"{spec.name}.layers")
    if num_layers > MAX_LAYERS:
        raise ConfigError(
            f"{spec.name}.layers = {spec.layers!r} evaluated to {num_layers}, more than the {MAX_LAYERS} layers any "
            f"real model has; config.json is corrupt"
        )
    return num_layers


def _param_spec(full: str, module: str, d: ParamDef, transposed: bool, online: bool, parallel: Parallel) -> ParamSpec:
    """Parameter ``full`` of module instance ``module`` on this rank, from its definition ``d``."""
    return ParamSpec(
        name=full,
        module=module,
        shape=d.shape,
        local_shape=d.sharding.local_shape(d.shape, parallel),
        dtype=d.dtype,
        sharding=d.sharding,
        transposed=transposed and d.suffix == "weight" and len(d.shape) == 2,
        default=d.default,
        derived=online and d.role != "weight",
        check=d.check,
        stored=d.stored,
        role=d.role,
        transform=d.transform,
    )


def _shard_problem(module: ModuleSpec, name: str, parallel: Parallel, exc: ShardingError) -> str:
    """The problem line of a module instance that does not shard (every layer like it is skipped)."""
    where = f"{name} (and every layer like it)" if "{layer}" in module.pattern else name
    experts_split = module.kind == "experts" and not parallel.expert_parallel
    hint = "; or load with expert_parallel=True, which keeps experts whole" if experts_split else ""
    return f"{where}: {exc}{hint}"


def _stage_table(stage: Stage, scope: Scope) -> MappingTable:
    """A stage's table; a per-layer stage's rules instantiated for each layer its ``when`` holds for."""
    if stage.layers is None:
        return stage.table
    count = scope.int(stage.layers, "stage layers")
    if count > MAX_LAYERS:
        raise ConfigError(f"a mapping stage's layers = {stage.layers!r} evaluated to {count}; config.json is corrupt")
    return MappingTable(tuple(
        replace(rule, pattern=rule.pattern.replace("{layer}", str(n)),
                replacement=None if rule.replacement is None else rule.replacement.replace("{layer}", str(n)))
        for n in range(count) if evaluate(stage.when, scope.with_layer(n))
        for rule in stage.table.rules
    ))


class _Fields(dict[str, Value]):
    """``str.format_map`` names from a scope."""

    def __init__(self, scope: Scope) -> None:
        super().__init__()
        self.scope = scope

    def __missing__(self, key: str) -> Value:
        return self.scope[key]


def _refusals(spec: ArchSpec, scope: Scope, parallel: Parallel) -> None:
    """The configurations vLLM refuses for this architecture, refused in its words."""
    values = scope.with_values(tp_size=parallel.tp_size, expert_parallel=parallel.expert_parallel)
    for refusal in spec.refusals:
        if evaluate(refusal.when, values):
            raise ShardingError(f"{spec.name}: {refusal.message.format_map(_Fields(values))} (vLLM {VLLM_VERSION} refuses it too)")


def _drops(spec: ArchSpec, scope: Scope) -> tuple[tuple[str, str], ...]:
    """The spec's drop rules for this config, as (name prefix, reason) pairs."""
    out = []
    for drop in spec.drops:
        first, stop = scope.int(drop.first, f"{spec.name} drop.first"), scope.int(drop.stop, f"{spec.name} drop.stop")
        if stop - first > MAX_LAYERS:
            raise ConfigError(f"{spec.name}: drop rule {drop.prefix!r} spans {stop - first} layers; config.json is corrupt")
        if "{layer}" not in drop.prefix:
            if evaluate(drop.when, scope):
                out.append((drop.prefix, drop.reason))
            continue
        kept = (n for n in range(first, stop) if evaluate(drop.when, scope.with_layer(n)))
        out += [(drop.prefix.replace("{layer}", str(n)), drop.reason) for n in kept]
    return tuple(out)
