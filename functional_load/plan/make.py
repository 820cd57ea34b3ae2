"""``make_plan(layout, checkpoint)``: route every checkpoint tensor to its parameter slices, validated.

Pure: it reads names, shapes and dtypes only. It validates everything it can before a byte of
tensor data is read and raises one :class:`PlanError` listing every problem. What a tensor
gives a parameter on a rank is the parameter's slice descriptor's business
(:meth:`~functional_load.layout.sharding.Sharding.part`); this module only routes and checks.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import replace

from ..checkpoint import Checkpoint, TensorInfo, paused_gc
from ..dtypes import FLOAT8, torch_name
from ..errors import PlanError, ShardingError
from ..layout.build import Layout, ParamSpec
from ..layout.expert_sharding import ExpertSplit
from ..layout.segments import Box, box_volume, boxes_overlap, full_box, swap_last
from ..layout.sharding import Part, Sharding, Slot
from ..model.mapping import MappingTable, NameMapper, ShardId
from .copy import Copy, merge_expert_runs, slice_copy
from .plan import ParamPlan, Plan, _slices

Routed = tuple[str, tuple[ShardId, ...], int | None, bool]  # a Mapped's fields: parameter, shard ids, expert, interleaved


def make_plan(layout: Layout, checkpoint: Checkpoint) -> Plan:
    """Route every checkpoint tensor to its parameter slices and validate the result.

    Raises one PlanError listing: checkpoint tensors with no destination, shape mismatches,
    dtypes that cannot be cast, tensors filling the same slot twice, parameters (or segments)
    not found in the checkpoint, and a tied alias whose canonical tensor is missing.
    """
    with paused_gc():
        return _make_plan(layout, checkpoint)


def _make_plan(layout: Layout, checkpoint: Checkpoint) -> Plan:
    """The validated plan: each checkpoint tensor routed and placed, then every parameter checked complete."""
    router = _Router(layout, checkpoint.renames)
    placed = _Placement(layout, checkpoint)
    unplaced: list[tuple[str, str]] = []  # checkpoint tensors with no destination (name, mapped name)
    tensors = checkpoint.tensors  # lazily indexed: an info is built only for a tensor the rank may read
    for name in tensors:
        mapped = router.route(name, placed.dropped, unplaced)
        if mapped is None:
            continue
        param, shard_ids, expert, interleaved = mapped
        spec = router.params[param]
        if expert is not None and placed.elsewhere(spec, expert):  # another rank's expert: no info, no part
            placed.drop(name, expert)
            continue
        info = tensors[name]
        for shard_id in shard_ids or (None,):
            placed.add(name, info, spec, shard_id, expert, interleaved)
    problems = placed.problems
    problems[:0] = _unplaced([(name, tensors[name], mapped) for name, mapped in unplaced], layout)
    fills = _completeness(layout, checkpoint, placed.filled, placed.copies, placed.zeros, problems, placed.failed)
    if problems:
        raise PlanError(problems)
    return Plan(
        model_dir=str(checkpoint.directory),
        arch=layout.arch,
        parallel=layout.parallel,
        dtype=layout.dtype,
        params=tuple(
            ParamPlan(
                s,
                tuple(merge_expert_runs(sorted(placed.copies[s.name], key=lambda c: c.dst))),
                tuple(placed.zeros[s.name]),
                fills.get(s.name),
                tuple(placed.checks[s.name]),
            )
            for s in layout.params.values()
        ),
        schemes=layout.schemes,
        tensors=placed.used,
        aliases=layout.aliases,
        dropped=tuple(placed.dropped),
        checksums=checkpoint.checksums,
    )


class _Placement:
    """What the checkpoint's tensors give the rank's parameters, gathered tensor by tensor: copies,
    zeros and checks per parameter, the slots filled, the tensors used and dropped, the problems."""

    def __init__(self, layout: Layout, checkpoint: Checkpoint):
        self.layout, self.parallel, self.local = layout, layout.parallel, checkpoint.rank_local
        self.parts = _Parts(layout, checkpoint)
        self.problems: list[str] = []
        self.dropped: list[tuple[str, str]] = []
        self.copies: dict[str, list[Copy]] = defaultdict(list)
        self.zeros: dict[str, list[Box]] = defaultdict(list)
        self.checks: dict[str, list[Copy]] = defaultdict(list)
        self.filled: dict[tuple[str, Slot], str] = {}  # (parameter, slot) -> checkpoint tensor
        self.shared: set[tuple[str, Box]] = set()  # (parameter, box) already filled by a copy
        self.failed: set[str] = set()  # parameters a tensor could not fill (already a problem)
        self.used: dict[str, TensorInfo] = {}
        self.not_held: dict[int | None, str] = {}  # expert -> why its tensors are dropped
        self.held: dict[int, frozenset[int]] = {}  # number of experts -> the experts this rank holds

    def elsewhere(self, spec: ParamSpec, expert: int) -> bool:
        """Whether ``expert`` of an expert-parallel parameter is another rank's (an expert out of range is a problem later)."""
        sharding = spec.sharding
        if not isinstance(sharding, ExpertSplit) or self.local:
            return False
        count = sharding.num_experts
        if count not in self.held:
            self.held[count] = sharding.held(self.parallel)
        return expert not in self.held[count] and 0 <= expert < count

    def drop(self, name: str, expert: int | None) -> None:
        """Drop checkpoint tensor ``name``: ``expert`` is not held by this rank."""
        if expert not in self.not_held:
            self.not_held[expert] = f"expert {expert} is not held by rank {self.parallel.rank}"
        self.dropped.append((name, self.not_held[expert]))

    def add(self, name: str, info: TensorInfo, spec: ParamSpec, shard_id: ShardId | None, expert: int | None, interleaved: bool) -> None:
        """Place what tensor ``name`` gives parameter ``spec`` (as ``shard_id``), or record why it cannot."""
        local = self.local
        try:
            part = self.parts.get(spec, shard_id, expert, info)
        except ShardingError as exc:
            self.problems.append(f"checkpoint tensor {name!r} in {info.file.name}: {spec.name}: {exc}")
            self.failed.add(spec.name)
            return
        if part is None:
            self.drop(name, expert)
            return
        if interleaved and not local and spec.sharding.unit_rows(shard_id) and len(info.shape) and info.shape[0] > 1:
            part = replace(part, rotary=spec.sharding.unit_rows(shard_id))
        problem = _mismatch(name, info, spec, part, shard_id, self.layout, local)
        if problem:
            self.problems.append(problem)
            self.failed.add(spec.name)  # its parameter is reported once, not again as incomplete
            return
        # a part that is all zeros (a vocabulary shard of padding, gpt-oss w2_bias off the first
        # rank) takes nothing from the tensor but completes the parameter
        keys = [(spec.name, slot) for _, _, slot in part.pairs]
        if not keys and part.zeros:
            keys = [(spec.name, slot) for slot in spec.sharding.slots(self.parallel)]
        clash = next((self.filled[k] for k in keys if k in self.filled), None)
        if clash is not None:
            self.problems.append(f"checkpoint tensors {clash!r} and {name!r} both fill parameter {spec.name}")
            return
        self.filled.update({k: name for k in keys})
        transpose = (spec.transposed and not local) or part.transpose
        transform = None if local else spec.transform  # a rank-local file holds the parameters as they are
        for src, dst, _ in part.pairs:
            copy = slice_copy(name, info.shape, swap_last(src) if transpose else src, dst, transpose=transpose, repeat=part.repeat,
                              rotary=part.rotary, transform=transform)
            if part.check and (spec.name, dst) in self.shared:  # a part stored identically by several tensors
                self.checks[spec.name].append(copy)
            else:
                self.copies[spec.name].append(copy)
                self.shared.add((spec.name, dst))
        self.zeros[spec.name].extend(part.zeros)
        self.used[name] = info


class _Router:
    """The parameter a checkpoint tensor goes to, or None (dropped with the reason, or a problem)."""

    def __init__(self, layout: Layout, renames: tuple[MappingTable, ...] = ()):
        self.layout = layout
        self.params = dict(layout.params)
        self.aliases = dict(layout.aliases)
        self.drop_prefixes = tuple(prefix for prefix, _ in layout.drops)
        self.left_out = [  # text_only: the vision modules
            (re.compile(re.escape(pattern).replace(re.escape("{layer}"), r"\d+") + r"\."), why) for pattern, why in layout.left_out
        ]
        self.layer_modules = [  # pipeline parallelism: the decoder layers of other stages
            re.compile(re.escape(pattern).replace(re.escape("{layer}"), r"(\d+)", 1).replace(re.escape("{layer}"), r"\d+") + r"\.")
            for pattern in layout.layer_modules if "{layer}" in pattern
        ]
        self.mapper = NameMapper(renames + layout.mapping)
        self.optional = [(re.compile(pattern), why) for pattern, why in layout.optional]

    def route(self, name: str, dropped: list[tuple[str, str]], unplaced: list[tuple[str, str]]) -> Routed | None:
        """``(parameter, shard ids, expert, interleaved)``: the fields of a :class:`Mapped`."""
        if self.drop_prefixes and name.startswith(self.drop_prefixes):
            dropped.append((name, next(why for prefix, why in self.layout.drops if name.startswith(prefix))))
            return None
        mapped = self.mapper.lookup(name)
        if mapped is None:
            dropped.append((name, "dropped by a mapping rule (not a parameter, e.g. a rotary cache)"))
            return None
        param = mapped[0]
        if param in self.params and param not in self.aliases:
            return mapped
        if param in self.aliases:
            dropped.append((name, f"tied: {param} is the same tensor as {self.aliases[param]}"))
        elif left_out := self._left_out(param):
            dropped.append((name, left_out))
        elif optional := next((why for regex, why in self.optional if regex.search(param)), None):
            dropped.append((name, f"{param}: {optional}"))
        else:
            unplaced.append((name, param))
        return None

    def _left_out(self, param: str) -> str | None:
        """Why ``param`` belongs to a module the layout leaves out (text_only, another pipeline
        stage's), or None."""
        for regex, why in self.left_out:
            found = regex.match(param)
            if found:
                return f"{found.group(0)[:-1]}: {why}"
        stage = self.layout.stage
        if stage is None:
            return None
        for regex in self.layer_modules:
            found = regex.match(param)
            if found and not stage.start <= int(found.group(1)) < stage.stop:
                return f"{found.group(0)[:-1]}: {stage.why}"
        return None


class _Parts:
    """What a tensor gives a parameter on this rank (a rank-local checkpoint: all of it).

    A descriptor's ``part`` is a pure function of the descriptor, the parameter's shape, the
    shard id, the expert and the tensor's shape (the rank being fixed), and every layer of a
    model repeats the same few: each is computed once."""

    def __init__(self, layout: Layout, checkpoint: Checkpoint):
        self.parallel = layout.parallel
        self.rank_local = checkpoint.rank_local
        self._ids: dict[int, int] = {}  # id(descriptor) -> number of its equal class
        self._classes: dict[Sharding, int] = {}
        # (number of the descriptor's class, parameter shape, shard id, expert, tensor shape) -> its part
        self._memo: dict[tuple[int, tuple[int, ...], ShardId | None, int | None, tuple[int, ...]], Part | None] = {}

    def get(self, spec: ParamSpec, shard_id: ShardId | None, expert: int | None, info: TensorInfo) -> Part | None:
        if self.rank_local:
            box = full_box(spec.local_shape)
            return Part(((box, box, None),), (), spec.local_shape)
        sharding = spec.sharding  # alive as long as the layout: its id is stable here
        number = self._ids.get(id(sharding))
        if number is None:
            try:
                number = self._classes.setdefault(sharding, len(self._classes))
            except TypeError:  # an unhashable descriptor: computed each time
                return sharding.part(spec.shape, shard_id, expert, self.parallel, info.shape)
            self._ids[id(sharding)] = number
        key = (number, spec.shape, shard_id, expert, info.shape)
        if key in self._memo:
            return self._memo[key]
        part = self._memo[key] = sharding.part(spec.shape, shard_id, expert, self.parallel, info.shape)
        return part


def _mismatch(
    name: str, info: TensorInfo, spec: ParamSpec, part: Part, shard_id: ShardId | None, layout: Layout, local: bool
) -> str | None:
    """A shape that is not the expected one, or a dtype that cannot become the parameter's."""
    stored = swap_last(part.expected) if (spec.transposed and not local) or part.transpose else part.expected
    if info.shape != stored:
        what = f" (shard {shard_id!r})" if shard_id is not None else ""
        return (
            f"checkpoint tensor {name!r} in {info.file.name} has shape {list(info.shape)}, expected "
            f"{list(stored)} for parameter {spec.name}{what}; check config.json against the checkpoint"
        )
    source = torch_name(info.dtype)
    if source in FLOAT8 and source != spec.dtype and source not in spec.stored:
        return (
            f"checkpoint tensor {name!r} in {info.file.name} is {source}, a quantized weight, but parameter "
            f"{spec.name} is {spec.dtype}: casting it without its scales would load wrong values. The config's "
            f"quantization_config does not cover this module (or ignores it); fix the config"
        )
    if spec.stored and source not in spec.stored:
        scheme = layout.schemes.get(spec.module)
        method = f" ({scheme.format})" if scheme is not None else ""
        return (
            f"checkpoint tensor {name!r} in {info.file.name} is {source}, but parameter {spec.name} is stored as "
            f"{' or '.join(spec.stored)}: the quantization config quantizes module {spec.module}{method}, and casting the tensor "
            f"would load it without its scales (vLLM does, leaving them uninitialised). If the module is stored unquantized, "
            f"list it in quantization_config's ignore list by its full name ({spec.module!r}): vLLM matches that list "
            f"exactly, so a short name such as 'mlp.gate' does not exclude it"
        )
    is_float = source.startswith(("float", "bfloat"))
    if is_float != spec.dtype.startswith(("float", "bfloat")) and source != spec.dtype and not spec.stored:
        return (
            f"checkpoint tensor {name!r} in {info.file.name} has dtype {info.dtype}, which cannot be cast "
            f"to the parameter dtype {spec.dtype} of {spec.name}"
        )
    return None


def _completeness(
    layout: Layout, checkpoint: Checkpoint, filled: dict[tuple[str, Slot], str],
    copies: dict[str, list[Copy]], zeros: dict[str, list[Box]], problems: list[str], failed: set[str],
) -> dict[str, float]:
    """Every parameter covered exactly once, or defaulted; returns the defaults to fill. A
    parameter one of whose tensors was refused (``failed``) is not reported again as incomplete."""
    missing, fills = [], {}
    parallel = layout.parallel
    for spec in layout.params.values():
        if spec.name in failed:
            continue
        wanted = [None] if checkpoint.rank_local else spec.sharding.slots(parallel)
        absent = [slot for slot in wanted if (spec.name, slot) not in filled]
        if spec.derived or not wanted:  # nothing to fill (an EP rank past the experts holds none)
            continue
        if len(absent) == len(wanted) and spec.default is not None:
            fills[spec.name] = spec.default
        elif len(absent) == len(wanted):
            missing.append(spec.name)
        elif absent:
            present = sorted({filled[(spec.name, s)] for s in wanted if (spec.name, s) in filled})
            problems.append(
                f"{spec.name} is only partly initialized from checkpoint: "
                f"{_abbreviate([spec.sharding.describe(slot, parallel) for slot in absent])} not found "
                f"(found: {_abbreviate(present, 3)})"
            )
        else:
            problem = _coverage_problem(spec, copies[spec.name], zeros[spec.name])
            if problem:
                problems.append(problem)
    for alias, target in layout.aliases.items():
        if target in layout.params and target in missing:
            problems.append(
                f"{alias!r} is tied to {target!r}, but {target!r} was not found in the checkpoint, so the tied "
                f"weight would be uninitialized"
            )
    if missing:
        index = f"its index {checkpoint.index_file.name} and " if checkpoint.index_file else ""
        problems.append(
            f"Following weights were not initialized from checkpoint: {_abbreviate(missing)}; no tensor of the checkpoint "
            f"in {checkpoint.directory} ({index}{len(checkpoint.files)} weight files) maps to them. Fix: download the "
            f"checkpoint again if a file was cut or edited, or give the spec of its real architecture (spec=)"
        )
    return fills


def _coverage_problem(spec: ParamSpec, copies: list[Copy], zeros: list[Box]) -> str | None:
    """A message when the boxes do not tile the rank-local parameter exactly once (every slot
    being filled should guarantee it; this guards the index maths itself)."""
    boxes = sorted([c.dst for c in copies] + zeros)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if b[0][0] >= a[0][1]:
                break  # sorted by the first dimension: nothing later can overlap a
            if boxes_overlap(a, b):
                return f"{spec.name}: two checkpoint slices overlap in the rank-local parameter at {_slices(a)} and {_slices(b)}"
    covered, total = sum(box_volume(b) for b in boxes), box_volume(full_box(spec.local_shape))
    if covered != total:
        return f"{spec.name}: the planned slices cover {covered} of its {total} elements"
    return None


MAX_LISTED = 8  # more tensors with no destination than this are summed up in one problem


def _unplaced(unplaced: list[tuple[str, TensorInfo, str]], layout: Layout) -> list[str]:
    """One problem per checkpoint tensor with no destination, or one for all of them when there
    are many (a wrong architecture or checkpoint format, not a few stray tensors)."""
    if len(unplaced) <= MAX_LISTED:
        return [_unexpected(name, info, mapped, layout) for name, info, mapped in unplaced]
    files = sorted({info.file.name for _, info, _ in unplaced})
    return [
        f"{len(unplaced)} checkpoint tensors (of {_abbreviate(files, 3)}) have no destination in {layout.arch}, e.g. "
        f"{_abbreviate([repr(n) for n, _, _ in unplaced], MAX_LISTED)}; its parameters: {_abbreviate(sorted(layout.params), 6)}"
    ]


def _unexpected(name: str, info: TensorInfo, mapped: str, layout: Layout) -> str:
    """No destination: list the parameters under the longest prefix that exists, like vLLM."""
    parts = mapped.split(".")
    near: list[str] = []
    prefix = ""
    for cut in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:cut])
        near = sorted(p for p in layout.params if p.startswith(prefix + ".") or not prefix)
        if near:
            break
    target = f" (mapped to {mapped!r})" if mapped != name else ""
    return (
        f"checkpoint tensor {name!r} in {info.file.name}{target} has no destination in {layout.arch}; "
        f"parameters under {prefix or '<root>'!r}: {_abbreviate(near)}"
    )


def _abbreviate(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
