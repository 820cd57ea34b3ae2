"""``plan_target``: every leaf of a JAX target tree matched to its rule and sources, validated.

Pure: names, shapes and dtypes only, no tensor byte. Every problem (a leaf with no rule or two,
a missing source, shapes that disagree after the rearrangement, a sharding that does not divide,
a dtype that cannot be cast, a checkpoint tensor no leaf takes) is collected into one
:class:`PlanError`. A :class:`LeafPlan` then says, for any box of its leaf (a device's shard),
its box plan: the copies of checkpoint boxes that fill it (:meth:`LeafPlan.box_plan`).
"""

from __future__ import annotations

import difflib
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..checkpoint import Checkpoint, TensorInfo
from ..dtypes import torch_name
from ..errors import ConfigError, PlanError
from ..layout.axes import Arrangement, Axis, Range, read_axes
from ..layout.quantized import BoxDequantizer, Quantization
from ..model.expressions import Expr, Scope, evaluate
from ..model.mapping import ROTARY_CACHES
from ..model.pattern import Groups, solve_sizes
from ..model.targetmap import Rule, Take, TargetMap, placeholders
from ..paths import JsonObject
from ..quant import parse_quant_config
from ..storage import StoredPath
from .copy import BoxPlan, Copy, Dequantize

if TYPE_CHECKING:
    from jax.sharding import Sharding

_FLOAT = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True, slots=True)
class Leaf:
    """One leaf of the target tree: its key path, shape, dtype (a numpy/torch name) and sharding."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    sharding: Sharding


@dataclass(frozen=True, slots=True)
class LeafPlan:
    """How one leaf is filled: its rule's arrangement over the source tensors, by stacked index."""

    leaf: Leaf
    rule: str  # the map key that matched
    arrangement: Arrangement
    sources: Mapping[tuple[int, ...], TensorInfo]
    scale: float | None = None
    dequantizer: BoxDequantizer | None = None  # dequantize=True: the sources' format, box by box
    scales: Mapping[tuple[tuple[int, ...], str], TensorInfo] = field(default_factory=dict)  # (stacked index, suffix) -> scale

    def box_plan(self, index: tuple[Range, ...]) -> BoxPlan:
        """The copies (one per source tensor and piece, :meth:`Arrangement.boxes`) and zero boxes
        that fill box ``index`` of the leaf (a device's shard), relative to its start."""
        arrangement, k = self.arrangement, self.arrangement.stacked
        view = tuple(tuple(arrangement.axes[a].size for a in g) for g in arrangement.source)  # source dims as axes
        view = view if any(len(g) > 1 for g in view) else ()
        order = [i for group in arrangement.target for i in group]
        full = order + [i for i in range(len(arrangement.axes)) if i not in order]
        perm = tuple(i - k for i in full if i >= k)  # a piece holds one element of each stacked axis
        copies, zeros = [], []
        for place, reads in arrangement.boxes(index):
            axes = read_axes(reads)
            if axes is None:
                zeros.append(place)
                continue
            which = tuple(a.src[0] for a in axes[:k])
            steps = tuple(None if a.step.identity(a.src[1] - a.src[0]) else a.step for a in axes[k:])
            fmt = self.dequantizer
            how = None if fmt is None else Dequantize(fmt, tuple((n, self.scales[(which, n)].name) for n in fmt.scale_names))
            identity = perm == tuple(range(len(perm)))
            copies.append(Copy(self.sources[which].name, tuple(a.src for a in axes[k:]), place, view, steps if any(steps) else (),
                               () if identity else perm, None, self.scale, how))
        return BoxPlan(tuple(copies), tuple(zeros))


@dataclass(frozen=True, slots=True)
class TargetPlan:
    """A validated plan for a whole target tree (every process's share)."""

    model_dir: str
    leaves: tuple[LeafPlan, ...]
    tensors: Mapping[str, TensorInfo]
    dropped: tuple[tuple[str, str], ...] = ()
    checksums: Mapping[StoredPath, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))


def _key_regex(key: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[A-Za-z_][A-Za-z0-9_]*\})", key)
    body = "".join(f"(?P<{p[1:-1]}>\\d+)" if p.startswith("{") else re.escape(p) for p in parts)
    return re.compile(body + r"\Z")


class _Sources:
    """Checkpoint tensor names by the literal text before their first number (fast enumeration)."""

    def __init__(self, tensors: Mapping[str, TensorInfo]) -> None:
        self.tensors = tensors

    def enumerate(self, template: str, names: Sequence[str]) -> dict[tuple[int, ...], str]:
        """``{(values of names): tensor}`` for every checkpoint tensor the template matches."""
        prefix = template.split("{", 1)[0]
        regex = _key_regex(template)
        found = {}
        for tensor in self.tensors:
            if tensor.startswith(prefix):
                match = regex.match(tensor)
                if match:
                    found[tuple(int(match.group(n)) for n in names)] = tensor
        return found


def plan_target(
    leaves: Sequence[Leaf], target_map: TargetMap, checkpoint: Checkpoint, config: JsonObject,
) -> TargetPlan:
    """Match every leaf to exactly one rule, resolve and check its sources; raise one PlanError."""
    problems: list[str] = []
    scope = Scope(config, target_map.dims)
    try:
        quant = parse_quant_config(config)
    except ConfigError as exc:
        quant, quant_problem = None, str(exc)
    else:
        quant_problem = ""
    compiled = [(key, _key_regex(key), rule) for key, rule in target_map.rules.items()]
    sources = _Sources(checkpoint.tensors)
    plans: list[LeafPlan] = []
    used: dict[str, TensorInfo] = {}
    claimed: set[str] = set()  # the sources of leaves that failed
    for leaf in leaves:
        matches = [(key, m.groupdict(), rule) for key, regex, rule in compiled if (m := regex.match(leaf.key))]
        if not matches:
            problems.append(f"target leaf {leaf.key!r} has no rule in {target_map.name}; {_near(leaf.key, list(target_map.rules))}")
            continue
        if len(matches) > 1:
            problems.append(f"target leaf {leaf.key!r} is matched by {len(matches)} rules of {target_map.name}: {[m[0] for m in matches]}")
            continue
        key, bound, rule = matches[0]
        try:
            plan = _leaf_plan(leaf, key, {k: int(v) for k, v in bound.items()}, rule, sources, scope, checkpoint)
            if rule.dequantize:
                plan = _dequantized(plan, quant, quant_problem, checkpoint)
        except ConfigError as exc:
            problems.append(f"target leaf {leaf.key!r} ({target_map.name} rule {key!r}): {exc}")
            claimed.update(_claimed(rule, bound, sources))  # not reported again as unused
            continue
        plans.append(plan)
        used.update({info.name: info for info in (*plan.sources.values(), *plan.scales.values())})
    problems += _unmatched_rules(compiled, leaves, sources, set(used), target_map.name)
    dropped = _unused(checkpoint, {**{n: checkpoint.tensors[n] for n in claimed}, **used}, target_map, problems)
    if problems:
        raise PlanError(problems)
    return TargetPlan(str(checkpoint.directory), tuple(plans), used, tuple(dropped), checkpoint.checksums)


def _unmatched_rules(
    compiled: Sequence[tuple[str, re.Pattern[str], Rule]], leaves: Sequence[Leaf], sources: _Sources, used: set[str], name: str
) -> list[str]:
    """Rules that match no leaf and whose sources no other rule takes (a mistyped key): one
    serving another form of the tree (MaxText's scanned and unscanned layers) takes the same sources."""
    problems = []
    for key, regex, rule in compiled:
        if any(regex.match(leaf.key) for leaf in leaves) or _claimed(rule, {}, sources) & used:
            continue
        close = difflib.get_close_matches(key, [leaf.key for leaf in leaves], n=3, cutoff=0.4)
        problems.append(f"rule {key!r} of {name} matches no target leaf" + (f"; closest leaves: {close}" if close else ""))
    return problems


def _claimed(rule: Rule, bound: Mapping[str, str], sources: _Sources) -> set[str]:
    """The checkpoint tensors a rule would take for a leaf (any value of its free placeholders)."""
    out: set[str] = set()
    for template in rule.source:
        bound_template = _bind(template, {k: int(v) for k, v in bound.items()})
        out.update(sources.enumerate(bound_template, placeholders(bound_template)).values())
    return out


def _leaf_plan(
    leaf: Leaf, key: str, bound: dict[str, int], rule: Rule, sources: _Sources, scope: Scope, checkpoint: Checkpoint
) -> LeafPlan:
    pattern = rule.pattern
    templates = [_bind(s, bound) for s in rule.source]
    free = sorted({p for t in templates for p in placeholders(t)})
    stacked = [g[0] for g in itertools.takewhile(lambda g: len(g) == 1 and (g[0] in free or g[0] == rule.fuse), pattern.left)]
    loose = sorted(set(free) - set(stacked))
    if loose:
        raise ConfigError(
            f"source placeholder {{{loose[0]}}} of {rule.where} is neither bound by the leaf key {key!r} nor a stacking axis "
            f"leading the pattern's left side"
        )
    names = [a for a in stacked if a != rule.fuse]
    by_index: dict[tuple[int, ...], TensorInfo] = {}
    counts: dict[str, int] = {}
    for position, template in enumerate(templates):
        found: dict[tuple[int, ...], str] = (
            sources.enumerate(template, names) if names else ({(): template} if template in checkpoint.tensors else {})
        )
        if not found:
            raise ConfigError(f"no checkpoint tensor {template!r}{_near_tensor(template, checkpoint)}")
        for axis_index, axis in enumerate(names):
            values = sorted({k[axis_index] for k in found})
            if values != list(range(len(values))):
                raise ConfigError(f"the checkpoint's {template!r} have {axis} = {values}, not 0..{len(values) - 1}")
            counts[axis] = len(values)
        for combo in itertools.product(*(range(counts[a]) for a in names)):
            if combo not in found:
                missing = template.format(**dict(zip(names, combo)))
                raise ConfigError(f"checkpoint tensor {missing!r} is missing (its {names} siblings exist)")
            full = {**dict(zip(names, combo)), **({rule.fuse: position} if rule.fuse else {})}
            by_index[tuple(full[a] for a in stacked)] = checkpoint.tensors[found[combo]]
    if rule.fuse:
        counts[rule.fuse] = len(templates)
    infos = list(by_index.values())
    shapes = {info.shape for info in infos}
    if len(shapes) > 1:
        raise ConfigError(f"its sources have different shapes {sorted(shapes)}; stacked or fused sources need one shape")
    shape = shapes.pop()
    given = {a: _int(v, scope, f"{rule.where} {a}") for a, v in rule.sizes.items()}
    sizes = {**counts, **given}
    sizes.update(_from_target(rule, pattern.left[len(stacked):], sizes, leaf))
    sizes.update(solve_sizes(pattern.left[len(stacked):], shape, sizes, f"{rule.where} on {infos[0].name} {list(shape)}"))
    axes = _axes(rule, pattern.left_axes, sizes, leaf, scope)
    index = {a.name: i for i, a in enumerate(axes)}
    arrangement = Arrangement(
        tuple(axes),
        tuple(tuple(index[a] for a in g) for g in pattern.left[len(stacked):]),
        tuple(tuple(index[a] for a in g) for g in pattern.right),
        len(stacked),
    )
    if arrangement.shape != leaf.shape:
        raise ConfigError(f"{rule.where} gives shape {list(arrangement.shape)}, the target has {list(leaf.shape)}")
    if not rule.dequantize:  # a dequantized source becomes float32 values, checked with its scheme
        _check_dtype(infos[0], leaf, rule)
    _check_sharding(leaf)
    scale = None if rule.scale is None else float(_number(rule.scale, scope, f"{rule.where} scale"))
    return LeafPlan(leaf, key, arrangement, MappingProxyType(by_index), scale)


def _from_target(rule: Rule, left: Groups, sizes: Mapping[str, int], leaf: Leaf) -> dict[str, int]:
    """Sizes the target's shape gives for axes of a source group that has more than one unknown
    axis (``(n h) d -> d n h`` into ``[64, 8, 8]``: n = h = 8): an axis alone in a target
    dimension that no take, repeat or pad resizes."""
    resized = set(rule.take) | set(rule.repeat) | set(rule.pad)
    alone = {g[0]: leaf.shape[i] for i, g in enumerate(rule.pattern.right) if len(g) == 1 and g[0] not in resized}
    out: dict[str, int] = {}
    for group in left:
        unknown = [a for a in group if a not in sizes]
        if len(unknown) > 1:
            out.update({a: alone[a] for a in unknown if a in alone})
    return out


def _dequantized(plan: LeafPlan, quant: Quantization | None, quant_problem: str, checkpoint: Checkpoint) -> LeafPlan:
    """A leaf whose sources are dequantized: each source is ``<module>.weight`` of a module the
    checkpoint's quantization config quantizes in a format that dequantizes box by box."""
    if quant is None:
        raise ConfigError(quant_problem or "dequantize=True, but the checkpoint has no quantization_config")
    if plan.leaf.dtype not in _FLOAT:
        raise ConfigError(f"dequantize=True gives floating values; the leaf is {plan.leaf.dtype}")
    scales: dict[tuple[tuple[int, ...], str], TensorInfo] = {}
    dequantizer = None
    for which, info in plan.sources.items():
        module = info.name.removesuffix(".weight")
        scheme = quant.scheme_for(module, [module]) if info.name.endswith(".weight") else None
        if scheme is None:
            raise ConfigError(
                f"dequantize=True: checkpoint tensor {info.name!r} is no weight of a module the quantization config quantizes"
            )
        dequantizer = scheme.box_dequantizer()
        if dequantizer is None:
            raise ConfigError(
                f"dequantize=True: {scheme.format} weights ({info.name!r}) do not dequantize box by box yet (FP8 and INT8 do); "
                f"keep them quantized: make the leaf their stored dtype and load their scales as leaves of their own"
            )
        for suffix in dequantizer.scale_names:
            name = f"{module}.{suffix}"
            if name not in checkpoint.tensors:
                raise ConfigError(f"dequantize=True: {info.name!r} has no scale {name!r} in the checkpoint")
            scales[(which, suffix)] = checkpoint.tensors[name]
    return replace(plan, dequantizer=dequantizer, scales=MappingProxyType(scales))


def _axes(rule: Rule, left: tuple[str, ...], sizes: dict[str, int], leaf: Leaf, scope: Scope) -> list[Axis]:
    """The rule's axes with take/rotary/repeat/pad, the target-sized ones solved from the leaf's shape."""
    where = rule.where
    takes = {a: _take(v, scope, f"{where} take {a}") for a, v in rule.take.items()}
    auto = set(rule.repeat if isinstance(rule.repeat, tuple) else ()) | set(rule.pad if isinstance(rule.pad, tuple) else ())
    repeat = {a: _int(v, scope, f"{where} repeat {a}") for a, v in rule.repeat.items()} if isinstance(rule.repeat, Mapping) else {}
    pad = {a: _int(v, scope, f"{where} pad {a}") for a, v in rule.pad.items()} if isinstance(rule.pad, Mapping) else {}
    base = {a: Axis(a, sizes[a], takes.get(a), rule.rotary.get(a), repeat.get(a, 1), pad.get(a)) for a in left}
    known = {a: axis.out for a, axis in base.items() if a not in auto}
    out = solve_sizes(rule.pattern.right, leaf.shape, known, f"{where} for the target shape {list(leaf.shape)}")
    if isinstance(rule.repeat, tuple):
        for a in rule.repeat:
            if out[a] % base[a].taken or (isinstance(rule.pad, tuple) and a in rule.pad):
                raise ConfigError(f"{where}: axis {a!r} of {base[a].taken} cannot repeat to the target's {out[a]}")
            base[a] = Axis(a, sizes[a], takes.get(a), rule.rotary.get(a), out[a] // base[a].taken, pad.get(a))
    if isinstance(rule.pad, tuple):
        for a in rule.pad:
            base[a] = Axis(a, sizes[a], takes.get(a), rule.rotary.get(a), base[a].repeat, out[a])
    return [base[a] for a in left]


def _bind(template: str, bound: Mapping[str, int]) -> str:
    for name, value in bound.items():
        template = template.replace("{" + name + "}", str(value))
    return template


def _number(value: Expr, scope: Scope, what: str) -> int | float:
    result = evaluate(value, scope)
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        raise ConfigError(f"{what} = {value!r} evaluated to {result!r}, not a number")
    return result


def _int(value: Expr, scope: Scope, what: str) -> int:
    result = _number(value, scope, what)
    if not isinstance(result, int):
        raise ConfigError(f"{what} = {value!r} evaluated to {result!r}, not an integer")
    return result


def _take(value: Take, scope: Scope, what: str) -> int | Range:
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return (_int(value[0], scope, what), _int(value[1], scope, what))
    return _int(value, scope, what)


def _check_dtype(info: TensorInfo, leaf: Leaf, rule: Rule) -> None:
    source = torch_name(info.dtype)
    if source.startswith("float8") and source != leaf.dtype:
        raise ConfigError(
            f"checkpoint tensor {info.name!r} in {info.file.name} is {source}, a quantized weight, but the leaf is {leaf.dtype}: "
            f"make the leaf {source} and load its scales as leaves of their own, or dequantize it (dequantize=True)"
        )
    if (source in _FLOAT) != (leaf.dtype in _FLOAT) and not (source.startswith("float8") and source == leaf.dtype):
        raise ConfigError(f"checkpoint tensor {info.name!r} ({source}) cannot be cast to the leaf's {leaf.dtype}")
    if leaf.dtype not in _FLOAT and source != leaf.dtype:
        raise ConfigError(f"checkpoint tensor {info.name!r} is {source}; an integer leaf must have the same dtype, not {leaf.dtype}")
    if rule.scale is not None and leaf.dtype not in _FLOAT:
        raise ConfigError(f"scale= needs a floating leaf, not {leaf.dtype}")


def _check_sharding(leaf: Leaf) -> None:
    try:
        leaf.sharding.shard_shape(leaf.shape)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"its sharding {leaf.sharding} does not divide its shape {list(leaf.shape)}: {exc}") from None


def _unused(checkpoint: Checkpoint, used: Mapping[str, TensorInfo], target_map: TargetMap, problems: list[str]) -> list[tuple[str, str]]:
    """Checkpoint tensors no leaf takes: dropped when the map's drops (the spec's among them: a
    tied head) say so or they are a rotary cache, a problem otherwise."""
    caches = [rule.pattern for rule in ROTARY_CACHES.rules]
    drops = [(re.compile(d.pattern), d.reason) for d in target_map.drops]
    dropped, unused = [], []
    for name in checkpoint.tensors:
        if name in used:
            continue
        reason = next((why for regex, why in drops if regex.search(name)), None)
        if reason is None and any(c in name for c in caches):
            reason = "a rotary cache (computed, not a parameter)"
        if reason is None:
            unused.append(name)
        else:
            dropped.append((name, reason))
    if unused:
        shown = ", ".join(repr(n) for n in unused[:8]) + (f", ... ({len(unused) - 8} more)" if len(unused) > 8 else "")
        problems.append(
            f"{len(unused)} checkpoint tensor(s) fill no leaf of the target: {shown}; add rules for them to {target_map.name}, "
            f"or [[drop]] entries with the reason if the target really has no such parameter"
        )
    return dropped


def _near(key: str, keys: list[str]) -> str:
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.4)
    return f"closest rules: {close}" if close else f"its rules: {keys[:6]}"


def _near_tensor(name: str, checkpoint: Checkpoint) -> str:
    flat = re.sub(r"\{[^}]*\}", "0", name)
    close = difflib.get_close_matches(flat, list(checkpoint.tensors), n=3, cutoff=0.6)
    return f" in {checkpoint.directory}; closest: {close}" if close else f" in {checkpoint.directory}"
