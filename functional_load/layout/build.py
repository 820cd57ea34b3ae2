"""The layout: every destination parameter of one rank, from config + spec + parallel settings.

This is the "shell" of the model: names, global and rank-local shapes, dtypes and slice
descriptors, with no memory allocated. It is a pure function of its inputs.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from .errors import ConfigError, ShardingError
from .mapping import ROTARY_CACHES, MappingTable
from .quant.config import QuantConfig
from .quant.schemes import Linear, QuantScheme
from .sharding import (
    PLACEMENTS,
    Blocked,
    ExpertSplit,
    Slots,
    blocked_pieces,
    Replicated,
    Segment,
    Sharding,
    Split,
    VocabSplit,
    local_expert_slots,
    split_local_rows,
    split_pieces,
    vocab_shard,
)
from .spec import ArchSpec, ModuleSpec, evaluate
from .vllm_target import VLLM_VERSION

# A config asking for more layers than this is corrupt or hostile (real models have a few hundred
# at most); expanding it would take unbounded time and memory before any check could fail.
MAX_LAYERS = 10_000


@dataclass(frozen=True, slots=True)
class Parallel:
    """Which rank of how many. Explicit, never read from the environment.

    With ``expert_parallel`` the MoE experts are spread over the ``tp_size`` ranks
    (``ep_size = tp_size``, ``ep_rank = rank``) and kept whole, while attention stays
    tensor-parallel; ``num_redundant_experts`` extra physical experts repeat logical ones.
    """

    tp_size: int = 1
    rank: int = 0
    expert_parallel: bool = False
    expert_placement: str = "linear"
    num_redundant_experts: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ShardingError(f"tp_size must be a positive integer, got {self.tp_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.tp_size:
            raise ShardingError(f"rank must be in [0, {self.tp_size}) for tp_size={self.tp_size}, got {self.rank!r}")
        if self.expert_placement not in PLACEMENTS:
            raise ShardingError(f"expert_placement must be one of {PLACEMENTS}, got {self.expert_placement!r}")
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ShardingError(f"num_redundant_experts must be a non-negative integer, got {self.num_redundant_experts!r}")
        if self.num_redundant_experts and not self.expert_parallel:
            raise ShardingError("num_redundant_experts needs expert_parallel=True (redundant experts are an EP feature)")

    @property
    def ep_size(self) -> int:
        return self.tp_size if self.expert_parallel else 1

    @property
    def expert_tp(self) -> tuple[int, int]:
        """(tp size, rank) used inside each expert: whole experts under expert parallelism."""
        return (1, 0) if self.expert_parallel else (self.tp_size, self.rank)

    def expert_slots(self, num_experts: int) -> tuple[int, ...]:
        """The logical expert held in each local expert slot of this rank."""
        return local_expert_slots(
            num_experts, self.ep_size, self.rank, self.expert_placement, self.num_redundant_experts
        )


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One destination parameter on one rank.

    ``shape`` is the global shape in the orientation of the destination (``[out, in]`` for
    linear weights), unpadded and unreplicated, i.e. what the checkpoint holds; ``local_shape``
    is what this rank allocates. ``transposed`` marks a 2-D weight that the checkpoint stores as
    ``[in, out]`` (GPT-2 ``Conv1D``) and that is transposed on load.
    """

    name: str
    module: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str  # a torch dtype name, or "checkpoint": keep the checkpoint tensor's dtype
    sharding: Sharding
    transposed: bool = False
    default: float | None = None  # value when the checkpoint lacks it (KV-cache scales: vLLM's created value)
    derived: bool = False  # computed at load from another parameter (scales of online quantization)


@dataclass(frozen=True, slots=True)
class Layout:
    arch: str
    parallel: Parallel
    dtype: str
    params: Mapping[str, ParamSpec]
    mapping: tuple[MappingTable, ...]
    aliases: Mapping[str, str]  # tied alias -> canonical parameter
    schemes: Mapping[str, QuantScheme] = field(default_factory=dict)  # quantized module -> its scheme

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "aliases", MappingProxyType(dict(self.aliases)))
        object.__setattr__(self, "schemes", MappingProxyType(dict(self.schemes)))


class _Scope(Mapping[str, Any]):
    """Name lookup for spec expressions: ``layer``, then dims (evaluated lazily), then config keys."""

    def __init__(self, config: Mapping[str, Any], dims: Mapping[str, str], layer: int | None = None):
        self._config, self._dims, self._layer = config, dims, layer
        self._cache: dict[str, Any] = {}
        self._busy: set[str] = set()

    def with_layer(self, layer: int) -> _Scope:
        scope = _Scope(self._config, self._dims, layer)
        scope._cache = self._cache
        return scope

    def __getitem__(self, name: str) -> Any:
        if name == "layer":
            return self._layer
        if name in self._dims and name not in self._busy:  # inside its own expression a dim means the config key
            if name not in self._cache:
                self._busy.add(name)
                try:
                    self._cache[name] = evaluate(self._dims[name], self)
                finally:
                    self._busy.discard(name)
            return self._cache[name]
        return self._config.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._dims)

    def __len__(self) -> int:
        return len(self._dims)

    def int(self, expr: Any, what: str) -> int:
        value = evaluate(expr, self)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{what} = {expr!r} evaluated to {value!r}; expected a non-negative integer from config.json")
        return value


def _linear(module: ModuleSpec, scope: _Scope) -> Linear:
    f = module.fields
    in_size = scope.int(f["in"], f"{module.pattern}.in")
    kind = module.kind
    if kind == "qkv":
        head_dim = scope.int(f["head_dim"], f"{module.pattern}.head_dim")
        v_head_dim = scope.int(f.get("v_head_dim", f["head_dim"]), f"{module.pattern}.v_head_dim")
        kv_heads = scope.int(f["kv_heads"], f"{module.pattern}.kv_heads")
        segments: tuple[Segment, ...] = (
            Segment("q", scope.int(f["heads"], f"{module.pattern}.heads"), head_dim, label="attention heads"),
            Segment("k", kv_heads, head_dim, replicate=True, label="KV heads"),
            Segment("v", kv_heads, v_head_dim, replicate=True, label="KV heads"),
        )
    elif kind == "merged":
        segments = tuple(
            Segment(i, scope.int(out, f"{module.pattern}.outs[{i}]"), label="output rows")
            for i, out in enumerate(f["outs"])
        )
    else:
        out = scope.int(f["out"], f"{module.pattern}.out")
        unit = scope.int(f.get("unit", 1), f"{module.pattern}.unit")
        segments = (Segment(0, out, unit, label=f.get("label", "output rows")),)
    return Linear(kind, in_size, segments, bool(f.get("disable_tp", False)))


def _linear_params(linear: Linear, scheme: QuantScheme | None, model_dtype: str, has_bias: bool) -> list[ParamDef]:
    """Weight (or the scheme's quantized tensors) and the unquantized bias."""
    if linear.kind == "row":
        weight: Sharding = Split(1, (Segment(0, linear.in_size, label="input columns"),))
        bias: Sharding = Replicated()
    elif linear.kind == "replicated_linear":
        weight = bias = Replicated()
    else:
        weight = bias = Split(0, linear.segments, linear.disable_tp)
    if scheme is None:
        params = [("weight", (linear.out_size, linear.in_size), weight, model_dtype)]
    else:
        params = scheme.params(linear, model_dtype)
    if has_bias:
        params.append(("bias", (linear.out_size,), bias, model_dtype))
    return params


ParamDef = tuple[str, tuple[int, ...], Sharding, str]  # (suffix, global shape, sharding, dtype)


def _module_params(module: ModuleSpec, name: str, scope: _Scope, dtype: str, quant: QuantConfig | None, layout_stages: tuple[MappingTable, ...], schemes: dict[str, QuantScheme]) -> list[ParamDef]:
    f = module.fields
    if module.kind == "vocab":
        size = scope.int(f["size"], f"{module.pattern}.size")
        dim = scope.int(f["dim"], f"{module.pattern}.dim")
        return [("weight", (size, dim), VocabSplit(size, int(f.get("padding", 64))), dtype)]
    if module.kind == "replicated":
        params = []
        for suffix, shape in f["params"].items():
            pinned = dtype
            if isinstance(shape, Mapping):  # {shape = [...], dtype = "float32"}
                shape, pinned = shape["shape"], shape.get("dtype", dtype)
            params.append((suffix, tuple(scope.int(d, f"{module.pattern}.{suffix}") for d in shape), Replicated(), pinned))
        return params
    if module.kind == "kv_cache":  # the quantization method's KV-cache parameters (none when unquantized)
        kv = quant.kv_params if quant else ()
        return [(n, shape, Replicated(), dtype if p_dtype == "model" else p_dtype) for n, shape, p_dtype, _ in kv]
    if module.kind == "experts":
        experts = scope.int(f["experts"], f"{module.pattern}.experts")
        hidden = scope.int(f["in"], f"{module.pattern}.in")
        inter = scope.int(f["intermediate"], f"{module.pattern}.intermediate")
        if experts < 1:
            raise ConfigError(f"{module.pattern}: {f['experts']!r} gave {experts} experts; an MoE layer needs at least one")
        w13 = Split(0, (Segment("w1", inter, label="expert intermediate rows"), Segment("w3", inter, label="expert intermediate rows")))
        w2 = Split(1, (Segment("w2", inter, label="expert intermediate columns"),))
        return [
            ("routed_experts.w13_weight", (experts, 2 * inter, hidden), ExpertSplit(experts, w13), dtype),
            ("routed_experts.w2_weight", (experts, hidden, inter), ExpertSplit(experts, w2), dtype),
        ]
    linear = _linear(module, scope)
    scheme = quant.scheme_for(name, _checkpoint_modules(name, layout_stages)) if quant else None
    if scheme is not None:
        schemes[name] = scheme
    return _linear_params(linear, scheme, dtype, bool(evaluate(f.get("bias", False), scope)))


def _checkpoint_modules(module: str, stages: tuple[MappingTable, ...]) -> list[str]:
    """The checkpoint module names a vLLM module is loaded from, by undoing stacked rules
    (``...qkv_proj`` <- ``q_proj``, ``k_proj``, ``v_proj``); the name itself if none apply."""
    parts = [
        module.replace(rule.replacement, rule.pattern, 1)
        for table in stages
        for rule in table.rules
        if rule.kind == "stacked" and rule.replacement and (module + ".").find(rule.replacement + ".") >= 0
    ]
    return parts or [module]


def local_shape(shape: tuple[int, ...], sharding: Sharding, parallel: Parallel) -> tuple[int, ...]:
    """The rank-local shape of a parameter; raises ShardingError when it does not divide."""
    if isinstance(sharding, Split):
        split_pieces(sharding, parallel.tp_size, parallel.rank)  # validates every segment
        rows = split_local_rows(sharding, parallel.tp_size)
        return shape[: sharding.dim] + (rows,) + shape[sharding.dim + 1 :]
    if isinstance(sharding, VocabSplit):
        shard = vocab_shard(sharding.vocab, parallel.tp_size, parallel.rank, padding=sharding.padding)
        return (shard.per_partition,) + shape[1:]
    if isinstance(sharding, Slots):
        return (len(sharding.ids),)
    if isinstance(sharding, Blocked):
        sharding.check(parallel.tp_size)
        for other in range(parallel.tp_size):  # every rank accepts the split, or none does
            blocked_pieces(sharding, parallel.tp_size, other, fused=False)
        pieces = blocked_pieces(sharding, parallel.tp_size, parallel.rank, fused=False)
        rows = sum(p.dst[1] - p.dst[0] for p in pieces)
        dim = sharding.split.dim
        return shape[:dim] + (rows,) + shape[dim + 1 :]
    if isinstance(sharding, ExpertSplit):
        slots = parallel.expert_slots(sharding.num_experts)
        tp, rank = parallel.expert_tp
        return (len(slots),) + local_shape(shape[1:], sharding.inner, Parallel(tp, rank))
    return shape


def _instances(spec: ArchSpec, scope: _Scope, num_layers: int) -> Iterator[tuple[ModuleSpec, str, _Scope]]:
    """Module instances in model order: each run of consecutive ``{layer}`` modules in the spec
    is expanded layer-major (all of layer 0, then layer 1...); ``when`` filters instances."""
    runs: list[list[ModuleSpec]] = []
    for module in spec.modules:
        per_layer = "{layer}" in module.pattern
        if runs and per_layer and "{layer}" in runs[-1][0].pattern:
            runs[-1].append(module)
        else:
            runs.append([module])
    for run in runs:
        layers = range(num_layers) if "{layer}" in run[0].pattern else [None]
        for layer in layers:
            layer_scope = scope.with_layer(layer) if layer is not None else scope
            for module in run:
                if "when" in module.fields and not evaluate(module.fields["when"], layer_scope):
                    continue
                yield module, module.pattern.replace("{layer}", str(layer)), layer_scope


def model_tp_sizes(
    config: Mapping[str, Any], spec: ArchSpec, parallel: Parallel, dtype: str, quant: QuantConfig | None, up_to: int = 64
) -> list[int]:
    """Every tp size that divides every module of the model (for error messages)."""
    sizes = []
    for tp in range(1, up_to + 1):
        try:
            build_layout(config, spec, replace(parallel, tp_size=tp, rank=0, num_redundant_experts=0, expert_parallel=parallel.expert_parallel), dtype, quant, report=False)
        except (ShardingError, ConfigError):
            continue
        sizes.append(tp)
    return sizes


def _served_placement(spec: ArchSpec, scope: _Scope, parallel: Parallel, warn: bool) -> Parallel:
    """The expert placement vLLM serves: round-robin only with expert parallelism over several
    ranks, for models with more than one expert group and no redundant experts; otherwise
    linear (with a warning when round-robin was asked for and cannot be served)."""
    experts = [m for m in spec.modules if m.kind == "experts"]
    if parallel.expert_placement != "round_robin" or not experts:
        return parallel
    linear = replace(parallel, expert_placement="linear")
    if parallel.ep_size == 1:
        return linear
    groups = scope.int(experts[0].fields.get("groups", 1), f"{experts[0].pattern}.groups")
    if groups > 1 and parallel.num_redundant_experts == 0:
        return parallel
    if warn:
        why = f"{spec.name} has {groups} expert group(s)" if groups <= 1 else f"{parallel.num_redundant_experts} redundant experts"
        warnings.warn(
            f"expert_placement='round_robin' falls back to 'linear', as vLLM {VLLM_VERSION} serves it: round-robin "
            f"placement needs more than one expert group and no redundant experts ({why}); the plan records 'linear'",
            stacklevel=4,
        )
    return linear


def build_layout(
    config: Mapping[str, Any], spec: ArchSpec, parallel: Parallel, dtype: str, quant: QuantConfig | None = None,
    *, report: bool = True,
) -> Layout:
    """Every parameter of ``parallel.rank``; ``quant`` decides each linear's quantized tensors.
    Divisibility problems of all modules are collected and raised together as one ShardingError."""
    scope = _Scope(config, spec.dims)
    stages = tuple(stage.table for stage in spec.stages if evaluate(stage.when, scope))
    schemes: dict[str, QuantScheme] = {}
    num_layers = scope.int(spec.layers, f"{spec.name}.layers")
    if num_layers > MAX_LAYERS:
        raise ConfigError(
            f"{spec.name}.layers = {spec.layers!r} evaluated to {num_layers}, more than the {MAX_LAYERS} layers any "
            f"real model has; config.json is corrupt"
        )
    parallel = _served_placement(spec, scope, parallel, warn=report)
    params: dict[str, ParamSpec] = {}
    kv_defaults = {n: value for n, _, _, value in (quant.kv_params if quant else ())}
    problems: list[str] = []
    failed: set[str] = set()
    for module, name, module_scope in _instances(spec, scope, num_layers):
        if module.pattern in failed:
            continue
        transposed = bool(module.fields.get("transposed", False))
        try:
            for suffix, shape, sharding, param_dtype in _module_params(module, name, module_scope, dtype, quant, stages, schemes):
                full = f"{name}.{suffix}"
                params[full] = ParamSpec(
                    name=full,
                    module=name,
                    shape=shape,
                    local_shape=local_shape(shape, sharding, parallel),
                    dtype=param_dtype,
                    sharding=sharding,
                    transposed=transposed and suffix == "weight" and len(shape) == 2,
                    default=kv_defaults.get(suffix) if module.kind == "kv_cache" else None,
                    derived=name in schemes and schemes[name].online and suffix != "weight",
                )
        except ShardingError as exc:
            failed.add(module.pattern)
            where = f"{name} (and every layer like it)" if "{layer}" in module.pattern else name
            hint = "; or load with expert_parallel=True, which keeps experts whole" if module.kind == "experts" and not parallel.expert_parallel else ""
            problems.append(f"{where}: {exc}{hint}")
    if problems and not report:
        raise ShardingError(problems[0])
    if problems:
        head = f"{spec.name} does not shard over tp_size={parallel.tp_size}:"
        tail = f"tp sizes (up to 64) that work for the whole model: {model_tp_sizes(config, spec, parallel, dtype, quant)}"
        raise ShardingError("\n".join([head, *(f"  - {p}" for p in problems), tail]))
    aliases = {}
    if spec.tie is not None and evaluate(spec.tie.when, scope):
        params.pop(spec.tie.alias, None)
        aliases[spec.tie.alias] = spec.tie.target
    quant_stages = quant.mapping if quant else ()
    return Layout(spec.name, parallel, dtype, params, (ROTARY_CACHES, *quant_stages, *stages), aliases, schemes)
