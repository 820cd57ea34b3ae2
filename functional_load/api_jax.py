"""``load_jax``: a checkpoint into ``jax.Array``s, in vLLM's layout or in a JAX stack's own.

``load_jax(model, mesh)`` gives vLLM's layout (:mod:`.output.jax`): one global array per vLLM
parameter, tensor parallelism along ``tp_axis`` (one mesh axis or several), data-parallel replicas
along ``dp_axis``, and with ``pp_axis`` one such dict per pipeline stage. ``load_jax(model,
target=tree, mapping=map)`` fills a stack's own abstract parameter tree (leaves
``jax.ShapeDtypeStruct`` with a sharding over any mesh) through a target map
(:mod:`.model.targetmap`): the whole target is planned and validated before a byte is read, then
each process reads only the source boxes its devices' shards need (:mod:`.plan.target`,
:mod:`.output.arrays`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .api import Model, _checkpoint, plan, resolve_model_dir
from .checkpoint.discover import checkpoint_format
from .checkpoint.sharded import read_manifest
from .dtypes import numpy_name, to_numpy
from .errors import ConfigError, PlanError
from .io import Reader, reader_for
from .io.copies import fill, fresh_array
from .io.execute import show_progress
from .layout.axes import Range
from .layout.build import build_layout
from .layout.parallel import Parallel
from .model.config import model_dtype, read_config
from .model.spec import spec_for_config
from .model.targetmap import Drop, Rule, TargetMap, as_target_map
from .options import LoadOptions, resolve_options
from .output.arrays import Progress, block_bytes, build_arrays, device_boxes, file_order
from .output.jax import MeshRanks, Rank, coordinate, tp_axes_of, vllm_arrays
from .paths import JsonObject
from .plan import Plan
from .plan.target import Leaf, LeafPlan, TargetPlan, plan_target
from .quant import parse_quant_config

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh
    from jax.tree_util import PyTreeDef


def load_jax(
    model: Model | JsonObject,
    mesh: Mesh | None = None,
    *,
    target: object = None,
    mapping: TargetMap | Mapping[str, Rule] | str | Path | None = None,
    tp_axis: str | Sequence[str] = "tp",
    pp_axis: str | None = None,
    dp_axis: str | Sequence[str] | None = None,
    reader: Reader | None = None,
    options: LoadOptions = LoadOptions(),
    **overrides: Any,
) -> Any:
    """A checkpoint as ``jax.Array``s: vLLM's layout over ``mesh``, or the stack's own ``target``.

    * ``load_jax(model, mesh, tp_axis="tp")``: ``{vLLM name: global array}``; the tensor-parallel
      size is the size of ``tp_axis`` (a tuple of axes: their product, a device's rank its
      row-major coordinate over them); other axes replicate. Each shard is the rank tensor
      :func:`~functional_load.load` gives that rank.

      ``dp_axis`` (axis or tuple): the data-parallel replicas. Every parameter is replicated over
      it except fused MoE experts, which vLLM splits or spreads over the ``dp_size x tp_size``
      ranks ``dp_rank * tp_size + tp_rank``: their global array runs over ``(*dp_axis,
      *tp_axis)``, each device holding what ``load(..., dp_size=, dp_rank=, tp_size=, rank=)``
      gives its worker. ``pp_axis`` (one axis): stage ``s`` is the devices at index ``s`` of it,
      and the result is ``{s: {vLLM name: global array}}``, stage ``s``'s parameters
      (``plan(..., pp_size=, pp_rank=s)``'s) over its sub-mesh (``mesh`` without ``pp_axis``),
      for the stages this process has devices in only: a process reads no byte of another
      stage's layers. The ``pp_size``/``pp_rank`` (``dp_size``/``dp_rank``) options are refused
      with ``pp_axis`` (``dp_axis``); without it they pick one stage (replica) for the whole mesh.
    * ``load_jax(model, target=tree, mapping=map)``: ``tree`` is any pytree (dicts, lists, a
      Flax NNX ``State`` from ``nnx.eval_shape``) of ``jax.ShapeDtypeStruct`` leaves with a
      sharding (over an abstract mesh, as ``nnx.eval_shape`` under ``jax.set_mesh`` gives: then
      ``mesh`` is the concrete mesh); ``map`` a :class:`~functional_load.TargetMap`, a dict of
      leaf key path -> :class:`~functional_load.Rule`, a ``.toml`` path or a shipped map's name.
      Returns the same structure with global arrays of the leaves' shapes, dtypes and
      shardings (ready for ``nnx.update``). Pipeline stages are a mesh axis over a stacked
      leaf's layer dimension (``P("stage", None, "tp")`` on ``[layers, ...]``): each process
      reads only its devices' layers.

    ``options`` (:class:`LoadOptions`, or its fields as keywords) as for every entry point; with
    a ``target``, the leaves decide dtypes and placement, so ``dtype``, ``quantization``, the
    expert options and the pipeline and data-parallel ones do not apply. ``reader`` (from
    ``functional_load.io.reader_for``, optional) is used for every read, e.g. to count this
    process's bytes.
    """
    opts = resolve_options(options, overrides)
    if target is None:
        if mesh is None:
            raise ConfigError("load_jax needs a mesh (vLLM's layout) or a target tree and its mapping")
        if mapping is not None:
            raise ConfigError("mapping= applies to a target tree: pass target= too, or leave mapping out for vLLM's layout")
        return _vllm_layout(model, mesh, _axes(mesh, tp_axis, pp_axis, dp_axis, opts), reader, opts)
    if mapping is None:
        raise ConfigError("load_jax(target=...) needs mapping=: a TargetMap, a dict of leaf -> Rule, a .toml file or a shipped map name")
    given = [(name, why) for name, axis, why in (("pp_axis", pp_axis, STAGES_ARE_AXES), ("dp_axis", dp_axis, REPLICAS_ARE_AXES))
             if axis is not None]
    if given:
        raise ConfigError(f"{[n for n, _ in given]} do not apply to load_jax(target=...): {'; '.join(why for _, why in given)}")
    return _target(model, target, as_target_map(mapping), mesh, reader, opts)


STAGES_ARE_AXES = ("a target tree's pipeline stages are a mesh axis over its stacked layer dimension: shard that dimension over "
                   "your stage axis (e.g. P('stage', None, 'tp') for a [layers, ...] leaf); each process then reads only its "
                   "stages' layers")
REPLICAS_ARE_AXES = "a target tree's data-parallel replicas are its leaves' shardings: replicate or shard them over your data axis"


def _axes(
    mesh: Mesh, tp_axis: str | Sequence[str], pp_axis: str | None, dp_axis: str | Sequence[str] | None, opts: LoadOptions
) -> tuple[tuple[str, ...], str | None, tuple[str, ...]]:
    """The tensor-parallel, pipeline and data-parallel axes of vLLM's layout, checked against the
    mesh, each other and the options."""
    tp = tp_axes_of(mesh, tp_axis)
    dp = () if dp_axis is None else tp_axes_of(mesh, dp_axis, "data-parallel", "dp_axis")
    if pp_axis is not None and (not isinstance(pp_axis, str) or pp_axis not in mesh.axis_names):
        raise ConfigError(f"mesh axes {tuple(mesh.axis_names)} have no pipeline axis {pp_axis!r}; pass pp_axis= one of them (one axis)")
    named = [*tp, *dp, *([pp_axis] if pp_axis is not None else [])]
    twice = sorted({a for a in named if named.count(a) > 1})
    if twice:
        raise ConfigError(f"mesh axis {twice} is given to more than one of tp_axis={tp_axis!r}, dp_axis={dp_axis!r}, pp_axis={pp_axis!r}; "
                          f"each parallel axis is its own mesh axis")
    for option, axis, fields in (("pp_axis", pp_axis, ("pp_size", "pp_rank")), ("dp_axis", dp_axis, ("dp_size", "dp_rank"))):
        given = [f for f in fields if getattr(opts, f) != getattr(LoadOptions(), f)]
        if axis is not None and given:
            raise ConfigError(f"option(s) {given} with {option}={axis!r}: that mesh axis gives the size and each device's index; "
                              f"leave {'/'.join(fields)} out (without {option}, they pick one of them for the whole mesh)")
    return tp, pp_axis, dp


def _vllm_layout(
    model: Model | JsonObject, mesh: Mesh, axes: tuple[tuple[str, ...], str | None, tuple[str, ...]], reader: Reader | None,
    opts: LoadOptions,
) -> dict[str, jax.Array] | dict[int, dict[str, jax.Array]]:
    """vLLM's layout over ``mesh``; with a pipeline axis, one stage per index of it that this process has devices at."""
    from jax.sharding import Mesh

    tp, pp_axis, dp = axes
    if not isinstance(model, Mapping):  # a Hub repo id is resolved (and downloaded) once, for every rank
        model = resolve_model_dir(model, opts.revision, opts.load_format, opts.allow_pickle)
    local = opts.replace(revision=None)
    if dp:
        local = local.replace(dp_size=math.prod(mesh.shape[a] for a in dp))
    if pp_axis is None:
        return _stage(model, MeshRanks(mesh, tp, dp, opts.dp_rank), reader, local, "load_jax")
    i = mesh.axis_names.index(pp_axis)
    keep = [j for j in range(len(mesh.axis_names)) if j != i]
    names, types = tuple(mesh.axis_names[j] for j in keep), tuple(mesh.axis_types[j] for j in keep)
    stages = sorted({coordinate(mesh, (pp_axis,), d) for d in mesh.local_devices})
    out = {}
    for s in stages:
        sub = Mesh(mesh.devices.take(s, axis=i), names, axis_types=types)
        stage_opts = local.replace(pp_size=mesh.shape[pp_axis], pp_rank=s)
        out[s] = _stage(model, MeshRanks(sub, tp, dp, opts.dp_rank), reader, stage_opts, f"load_jax stage {s}")
    return out


def _stage(model: Model | JsonObject, ranks: MeshRanks, reader: Reader | None, opts: LoadOptions, what: str) -> dict[str, jax.Array]:
    """One stage's parameters over ``ranks.mesh``, planned and read for this process's workers only."""
    plans: dict[Rank, Plan] = {}
    lock = threading.Lock()

    def plan_of(rank: Rank) -> Plan:
        with lock:
            if rank not in plans:
                plans[rank] = plan(model, tp_size=ranks.tp_size, rank=rank[1], options=opts.replace(dp_rank=rank[0]))
            return plans[rank]

    local = ranks.local()
    if not local:
        raise ConfigError(f"this process has none of the mesh's devices {ranks.mesh.devices.tolist()}; give it a mesh that holds some")
    first = plan_of(local[0])
    bar = _bar(opts, first.bytes_to_read * len(local), what)
    try:
        if reader is not None:
            return vllm_arrays(plan_of, ranks, reader, threads=opts.read.threads, bar=bar)
        with reader_for(first, opts.read) as own:
            return vllm_arrays(plan_of, ranks, own, threads=opts.read.threads, bar=bar)
    finally:
        if bar is not None:
            bar.close()


def _bar(opts: LoadOptions, total: int, what: str) -> Progress | None:
    if not show_progress(opts.progress, total):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=what)


def key_path(path: Sequence[object]) -> str:
    """A leaf's ``jax.tree_util`` key path joined with ``"."``: a dict key as it is, an attribute
    by name, a sequence position as its number; the trailing ``value`` of a Flax NNX variable is
    left out (its leaf is named by the variable's path)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    import jax

    if len(parts) > 1 and parts[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
        parts.pop()
    return ".".join(parts)


def target_leaves(tree: object, mesh: Mesh | None = None) -> tuple[list[Leaf], PyTreeDef]:
    """The leaves of a target tree and its structure. Every leaf must be a ``ShapeDtypeStruct``
    (anything with shape, dtype and sharding) with a sharding; one over an abstract mesh (as
    ``nnx.eval_shape`` under ``jax.set_mesh`` gives) is placed on ``mesh``, which must then be given."""
    import jax
    from jax.sharding import AbstractMesh, NamedSharding

    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves, problems = [], []
    for path, leaf in flat:
        key = key_path(path)
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
            if mesh is None:
                problems.append(f"target leaf {key!r} is sharded over an abstract mesh; pass mesh= (a jax Mesh with axes "
                                f"{tuple(sharding.mesh.axis_names)})")
                continue
            if tuple(mesh.axis_names) != tuple(sharding.mesh.axis_names) or dict(mesh.shape) != dict(sharding.mesh.shape):
                problems.append(f"target leaf {key!r}: its abstract mesh {dict(sharding.mesh.shape)} is not mesh= {dict(mesh.shape)}")
                continue
            sharding = NamedSharding(mesh, sharding.spec)
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            problems.append(f"target leaf {key!r} is a {type(leaf).__name__}, not a jax.ShapeDtypeStruct (shape, dtype, sharding)")
        elif sharding is None or not hasattr(sharding, "addressable_devices_indices_map"):
            problems.append(f"target leaf {key!r} has no sharding; give it a jax.sharding.NamedSharding over the mesh")
        else:
            try:
                leaves.append(Leaf(key, tuple(int(n) for n in leaf.shape), numpy_name(leaf.dtype), sharding))
            except ValueError as exc:
                problems.append(f"target leaf {key!r}: {exc}")
    if problems:
        raise PlanError(problems)
    return leaves, treedef


def _not_for_targets(opts: LoadOptions) -> None:
    default = LoadOptions()
    wrong = [f for f in ("dtype", "quantization", "expert_parallel", "expert_placement", "num_redundant_experts")
             if getattr(opts, f) != getattr(default, f)]
    if wrong:
        raise ConfigError(
            f"option(s) {wrong} do not apply to load_jax(target=...): the target's leaves give dtypes and shardings, the map the layout"
        )
    for fields, why in ((("pp_size", "pp_rank", "pp_layer_partition"), STAGES_ARE_AXES), (("dp_size", "dp_rank"), REPLICAS_ARE_AXES)):
        given = [f for f in fields if getattr(opts, f) != getattr(default, f)]
        if given:
            raise ConfigError(f"option(s) {given} do not apply to load_jax(target=...): {why}")
    if opts.dummy:
        raise ConfigError("load_format='dummy' is not supported with a target tree; use load_jax(model, mesh) for vLLM's dummy layout")


def spec_drops(config: JsonObject, opts: LoadOptions) -> tuple[Drop, ...]:
    """Checkpoint tensors the architecture spec says are no parameter (multi-token-prediction
    layers..., a tied ``lm_head``), and with ``text_only`` the vision tower: a target need not take them."""
    import re

    try:
        spec = opts.arch_spec() or spec_for_config(config)
        layout = build_layout(config, spec, Parallel(), model_dtype(None, config), parse_quant_config(config),
                              report=False, text_only=opts.text_only)
    except ConfigError:
        return ()  # no spec for this architecture: only the map's drops apply
    drops = [Drop("^" + re.escape(prefix), why) for prefix, why in layout.drops]
    drops += [Drop("^" + re.escape(pattern).replace(re.escape("{layer}"), r"\d+") + r"\.", why) for pattern, why in layout.left_out]
    drops += [Drop("^" + re.escape(alias) + "$", f"tied to {target} (the spec's [tie])") for alias, target in layout.aliases.items()]
    return tuple(drops)


def plan_jax_target(
    model: Model, tree: object, target_map: TargetMap, opts: LoadOptions, mesh: Mesh | None = None
) -> tuple[TargetPlan, PyTreeDef]:
    """The validated plan of a target tree (no tensor byte read) and the tree's structure."""
    _not_for_targets(opts)
    leaves, treedef = target_leaves(tree, mesh)
    directory = resolve_model_dir(model, opts.revision, opts.load_format, opts.allow_pickle)
    manifest = read_manifest(directory)
    fmt = "hf" if manifest is not None else checkpoint_format(directory, opts.load_format)
    config = read_config(directory, fmt)
    checkpoint = _checkpoint(directory, manifest, 0, opts.load_format, opts.allow_pickle)
    full = TargetMap(target_map.rules, target_map.dims, target_map.drops + spec_drops(config, opts), target_map.name, target_map.source)
    return plan_target(leaves, full, checkpoint, config), treedef


def _target(model: Any, tree: object, target_map: TargetMap, mesh: Mesh | None, reader: Reader | None, opts: LoadOptions) -> Any:
    import jax
    import numpy as np

    the_plan, treedef = plan_jax_target(model, tree, target_map, opts, mesh)
    leaves = [p.leaf for p in the_plan.leaves]

    def block(i: int, box: tuple[Range, ...]) -> np.ndarray:
        out = fresh_array(tuple(b - a for a, b in box), to_numpy(leaves[i].dtype))
        fill(the_plan.tensors, out, the_plan.leaves[i].box_plan(box), active)
        return out

    first = [_first_byte(p) for p in the_plan.leaves]
    active = reader or Reader(opts.read, dict(the_plan.checksums))
    total = sum(block_bytes(box, to_numpy(leaf.dtype)) for leaf in leaves for box in device_boxes(leaf))
    bar = _bar(opts, total, "load_jax")
    try:
        arrays = build_arrays(leaves, block, threads=opts.read.threads, order=file_order(first), bar=bar)
    finally:
        if bar is not None:
            bar.close()
        if reader is None:
            active.close()
    return jax.tree_util.tree_unflatten(treedef, arrays)


def _first_byte(leaf_plan: LeafPlan) -> tuple[str, int]:
    info = min(leaf_plan.sources.values(), key=lambda i: (str(i.file), getattr(i.location, "offset", 0)))
    return str(info.file), getattr(info.location, "offset", 0)
