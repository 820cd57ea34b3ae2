"""One module of a spec, instantiated: the parameters it has on every rank, with their descriptors.

Linear modules (``column``, ``merged``, ``qkv``, ``row``, ``replicated_linear``) get their weight
and bias, or their quantization scheme's manifest; the other kinds (``vocab``, ``replicated``,
``experts``, ``kv_cache``) their own parameters.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import ConfigError
from ..model.expressions import Scope, evaluate
from ..model.mapping import MappingTable
from ..model.spec import ModuleSpec
from .experts import expert_params
from .param import TRANSFORMS
from .quantized import Linear, ParamDef, Quantization, Scheme
from .segments import Segment
from .sharding import Replicated, Sharding, Split, VocabSplit


def _linear(module: ModuleSpec, scope: Scope) -> Linear:
    f = module.fields
    in_size = scope.int(f["in"], f"{module.pattern}.in")
    kind = module.kind
    if kind == "qkv":
        head_dim = scope.int(f["head_dim"], f"{module.pattern}.head_dim")
        v_head_dim = scope.int(f.get("v_head_dim", f["head_dim"]), f"{module.pattern}.v_head_dim")
        kv_heads = scope.int(f["kv_heads"], f"{module.pattern}.kv_heads")
        replicate = bool(evaluate(f.get("replicate_kv", True), scope))  # vLLM replicates KV heads over extra ranks
        segments: tuple[Segment, ...] = (
            Segment("q", scope.int(f["heads"], f"{module.pattern}.heads"), head_dim, label="attention heads"),
            Segment("k", kv_heads, head_dim, replicate=replicate, label="KV heads"),
            Segment("v", kv_heads, v_head_dim, replicate=replicate, label="KV heads"),
        )
    elif kind == "merged":
        segments = sections(f, "outs", scope, module.pattern)
    else:
        # ``out`` units of ``unit`` rows (a unit: a head, whose rows stay on one rank)
        out = scope.int(f["out"], f"{module.pattern}.out")
        unit = scope.int(f.get("unit", 1), f"{module.pattern}.unit")
        replicate = bool(evaluate(f.get("replicate", False), scope))  # a column of KV heads (vLLM replicates them too)
        segments = (Segment(0, out, unit, replicate, label=f.get("label", "output rows")),)
    # disable_tp (an expression): every rank holds the whole layer (vLLM's disable_tp, or a
    # ReplicatedLinear of some configurations only: GPTBigCode's multi-head attention)
    disable_tp = bool(evaluate(f.get("disable_tp", False), scope))
    return Linear(kind, in_size, segments, disable_tp, str(f.get("stored", "concat")))


def _list(value: object, where: str) -> list[str | int | float | bool]:
    """A spec field that must be a list (a TOML array) of expressions."""
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
        raise ConfigError(f"{where} = {value!r}: expected a list of expressions (numbers, booleans or strings)")
    return value


def _units(rows: int, unit: int, where: str) -> int:
    if unit < 1 or rows % unit:
        raise ConfigError(f"{where}: {rows} rows are not a whole number of units of {unit}; check config.json")
    return rows // unit


def sections(fields: Mapping[str, object], key: str, scope: Scope, where: str) -> tuple[Segment, ...]:
    """Segments from a list of row counts (``outs`` of a merged linear, ``sections`` of a
    parameter), with per-section ``units`` (rows per unit: a head; default 1) and ``replicate``
    (a section of fewer units than ranks is repeated on them, as vLLM's KV heads and Mamba-2's
    single B/C group are)."""
    outs = _list(fields[key], f"{where}.{key}")
    units = _list(fields.get("units", [1] * len(outs)), f"{where}.units")
    replicate = _list(fields.get("replicate", [False] * len(outs)), f"{where}.replicate")
    if not len(outs) == len(units) == len(replicate):
        raise ConfigError(f"{where}: {key}, units and replicate must have one entry per section")
    out = []
    for i, (rows_expr, unit_expr, rep) in enumerate(zip(outs, units, replicate)):
        rows, unit = scope.int(rows_expr, f"{where}.{key}[{i}]"), scope.int(unit_expr, f"{where}.units[{i}]")
        out.append(Segment(i, _units(rows, unit, where), unit, bool(evaluate(rep, scope)), label="output rows" if unit == 1 else "units"))
    return tuple(out)


def _linear_params(linear: Linear, scheme: Scheme | None, model_dtype: str, has_bias: bool) -> list[ParamDef]:
    """Weight (or the scheme's quantized tensors) and the unquantized bias."""
    if linear.kind == "row":
        weight: Sharding = Split(1, (Segment(0, linear.in_size, label="input columns"),), linear.disable_tp)
        bias: Sharding = Replicated()
    elif linear.kind == "replicated_linear":
        weight = bias = Replicated()
    else:
        weight = bias = Split(0, linear.segments, linear.disable_tp, linear.stored)
    params: list[ParamDef]
    if scheme is None:
        params = [ParamDef("weight", (linear.out_size, linear.in_size), weight, model_dtype)]
    else:
        params = scheme.linear_params(linear, model_dtype)
    if has_bias:
        params.append(ParamDef("bias", (linear.out_size,), bias, model_dtype, role="bias"))
    return params


def module_params(
    module: ModuleSpec, name: str, scope: Scope, dtype: str, quant: Quantization | None,
    layout_stages: tuple[MappingTable, ...], schemes: dict[str, Scheme],
) -> list[ParamDef]:
    f = module.fields
    if module.kind == "vocab":
        size = scope.int(f["size"], f"{module.pattern}.size")
        dim = scope.int(f["dim"], f"{module.pattern}.dim")
        vocab = VocabSplit(size, int(f.get("padding", 64)))
        bias = [ParamDef("bias", (size,), vocab, dtype, role="bias")] if evaluate(f.get("bias", False), scope) else []
        return [ParamDef("weight", (size, dim), vocab, dtype), *bias]
    if module.kind == "replicated":
        params: list[ParamDef] = []
        for suffix, shape in f["params"].items():
            pinned, squeeze = dtype, False
            if isinstance(shape, Mapping):  # {shape = [...], dtype = "float32", when = "...", squeeze = true}
                if not evaluate(shape.get("when", True), scope):
                    continue
                shape, pinned, squeeze = shape["shape"], shape.get("dtype", dtype), bool(shape.get("squeeze", False))
            dims = tuple(scope.int(d, f"{module.pattern}.{suffix}") for d in shape)
            params.append(ParamDef(suffix, dims, Replicated(squeeze), pinned))
        return params
    if module.kind == "heads":  # one value per attention head, split with the heads (gpt-oss sinks)
        heads = scope.int(f["heads"], f"{module.pattern}.heads")
        split = Split(0, (Segment(0, heads, label="attention heads"),))
        return [ParamDef(suffix, (heads,), split, dtype) for suffix in f["params"]]
    if module.kind == "params":  # parameters of their own, each split along one dimension or replicated
        return [
            _param(suffix, fields, scope, f"{module.pattern}.{suffix}", dtype)
            for suffix, fields in f["params"].items()
            if evaluate(fields.get("when", True), scope)  # a parameter of some configs only (Mamba's conv1d bias)
        ]
    if module.kind == "kv_cache":  # the quantization method's KV-cache parameters (none when unquantized)
        kv = quant.kv_params if quant else ()
        return [
            ParamDef(n, shape, Replicated(), dtype if p_dtype == "model" else p_dtype, value, check, role="kv_scale")
            for n, shape, p_dtype, value, check in kv
        ]
    if module.kind == "experts":
        scheme = _experts_scheme(module, name, quant, layout_stages)
        if scheme is not None:
            schemes[name] = scheme
        return expert_params(module, scope, dtype, scheme)
    linear = _linear(module, scope)
    quantized = quant is not None and quant.quantizes("linear") and bool(evaluate(f.get("quantized", True), scope))
    scheme = quant.scheme_for(name, _checkpoint_modules(name, layout_stages)) if quant and quantized else None
    if scheme is not None:
        schemes[name] = scheme
    return _linear_params(linear, scheme, dtype, bool(evaluate(f.get("bias", False), scope)))



def _param(suffix: str, fields: Mapping[str, object], scope: Scope, where: str, dtype: str) -> ParamDef:
    """One parameter of a ``params`` module: ``shape``; ``split`` (the dimension split over the
    ranks, with ``sections``/``units``/``replicate`` along it; absent: replicated); ``dtype``;
    ``transform`` (a value vLLM's loader computes from the stored one); ``when`` (the parameter
    exists only when it holds); ``squeeze`` (the checkpoint may store it with extra size-1
    dimensions, as vLLM's loader accepts: Kimi-Linear's A_log)."""
    shape = tuple(scope.int(d, f"{where}.shape") for d in _list(fields["shape"], f"{where}.shape"))
    squeeze = bool(fields.get("squeeze", False))
    sharding: Sharding = Replicated(squeeze)
    if "split" in fields:
        dim = scope.int(fields["split"], f"{where}.split")
        if not 0 <= dim < len(shape):
            raise ConfigError(f"{where}: split dimension {dim} is not a dimension of its shape {list(shape)}")
        spec = dict(fields)
        spec.setdefault("sections", [shape[dim]])
        segments = sections(spec, "sections", scope, where)
        if sum(s.rows for s in segments) != shape[dim]:
            raise ConfigError(f"{where}: sections {[s.rows for s in segments]} do not add up to dimension {dim} of {list(shape)}")
        sharding = Split(dim, segments, squeeze=squeeze)
    transform = fields.get("transform")
    if transform is not None and transform not in TRANSFORMS:
        raise ConfigError(f"{where}: transform {transform!r} is unknown; known: {TRANSFORMS}")
    known = None if transform is None else TRANSFORMS[TRANSFORMS.index(transform)]
    return ParamDef(suffix, shape, sharding, str(fields.get("dtype", dtype)), transform=known)


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


def _experts_scheme(module: ModuleSpec, name: str, quant: Quantization | None, stages: tuple[MappingTable, ...]) -> Scheme | None:
    """The scheme of an MoE layer's experts: that of its checkpoint expert modules (expert 0's
    gate, up and down projections, which must agree), as vLLM picks one method per layer."""
    if quant is None or not quant.quantizes("experts"):
        return None
    sources = [
        name + rule.pattern.split("{e}")[0].rsplit(".experts", 1)[-1] + "0" + rule.pattern.split("{e}")[1].rstrip(".")
        for table in stages
        for rule in table.rules
        if rule.kind == "expert"
    ] or [name]
    schemes = {s: quant.scheme_for(name, [s]) for s in sources}  # vLLM matches its FusedMoE prefix, the layer's
    if any(s is not None and s.online for s in schemes.values()):
        raise ConfigError(
            f"{name}: quantizing MoE experts while loading ({quant.method}) is not supported yet; vLLM would "
            "quantize them too, so loading them unquantized would not match it. Load without quantization="
        )
    if len(set(schemes.values())) > 1:
        raise ConfigError(
            f"{name}: its expert projections have different quantization schemes ({schemes}); vLLM quantizes an MoE "
            "layer's experts with one method"
        )
    return next(iter(schemes.values()))

