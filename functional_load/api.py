"""The public entry points, each a thin composition of the pipeline's stages.

``layout`` (config -> what a rank holds), ``plan`` (+ checkpoint headers -> a validated plan),
``load`` (+ reading -> rank-local torch tensors) and ``save_sharded`` (every rank of a layout,
written once); ``load_jax`` is in :mod:`.api_jax`. Each takes one :class:`LoadOptions`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .checkpoint import Checkpoint, paused_gc
from .checkpoint.discover import checkpoint_format, discover
from .checkpoint.hub import resolve_model
from .checkpoint.index import index_checkpoint
from .checkpoint.sharded import read_manifest, saved_rank, sharded_checkpoint
from .dtypes import TORCH_TO_SAFETENSORS
from .errors import ConfigError, LoadError, PlanError
from .io import LoadStats, execute
from .io.group import fail_group, group_reader
from .layout.build import Layout, build_layout
from .layout.parallel import Parallel
from .model.config import declared_dtype, model_directory, model_dtype, read_config
from .model.spec import spec_for_config
from .options import LoadOptions, resolve_options
from .output.rank_cache import open_rank_cache
from .output.save_remote import write_to
from .output.state import LoadedState, check_device, to_device
from .paths import JsonObject
from .plan import Plan, make_plan
from .plan.dummy import dummy_plan
from .quant import online_quant_config, parse_quant_config
from .storage import StoredPath, as_path, is_local
from .transform.online import is_online_weight, quantize_online
from .transform.targets import apply_target, check_target

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

Model = str | Path | os.PathLike[str]


def resolve_model_dir(
    model: Model, revision: str | None = None, load_format: str = "auto", allow_pickle: bool = False, weights: bool = True
) -> StoredPath:
    """The model directory ``model`` names: a directory (or its ``config.json``) as it is, a
    directory of a registered storage (``scheme://bucket/prefix``, :mod:`functional_load.storage`),
    or the snapshot of a Hugging Face Hub repo id (``org/name``) or cache folder
    (``models--org--name``) at ``revision``, with the files a load with ``load_format`` reads
    downloaded unless ``HF_HUB_OFFLINE`` is set (``weights=False``: the config and index only; see
    :mod:`functional_load.checkpoint.hub`)."""
    if not is_local(stored := as_path(model)):
        return model_directory(stored)
    return model_directory(resolve_model(model, revision=revision, load_format=load_format, allow_pickle=allow_pickle, weights=weights))


def _layout(
    config: JsonObject, parallel: Parallel, dtype: str, options: LoadOptions, stored: bool = False,
    quantization: str | None = None, checkpoint: Checkpoint | None = None,
) -> Layout:
    """The layout of one rank: the spec from the options or the config, and the checkpoint's
    quantization config (what it learns from the ``checkpoint``'s dtypes too) or the online one
    asked for (``stored``: already quantized, in a save)."""
    arch = options.arch_spec() or spec_for_config(config)
    method = quantization or options.quantization
    quant = online_quant_config(method, config, stored) if method else parse_quant_config(config)
    if quant is not None and checkpoint is not None:
        quant = quant.for_checkpoint(checkpoint.dtypes)
    return build_layout(config, arch, parallel, dtype, quant, text_only=options.text_only)


def layout(
    model: Model | JsonObject, *, tp_size: int = 1, rank: int = 0, options: LoadOptions = LoadOptions(), **overrides: object
) -> Layout:
    """Every parameter of one rank (names, shapes, dtypes, slice descriptors) from a config
    alone: ``model`` is a model directory, its ``config.json``, or a parsed config (e.g. a real
    model's, with no weights at hand), or a Hugging Face Hub repo id at ``options.revision``
    (only its config is fetched). Only the config (and, when it names no dtype, the weight
    files' headers) is read. ``options`` (:class:`LoadOptions`, or its fields as keywords) as for
    every entry point."""
    opts = resolve_options(options, overrides)
    parallel = opts.parallel(tp_size, rank)
    weights: tuple[str, ...] = ()
    fmt = "hf"
    if isinstance(model, Mapping):
        config, where = dict(model), "config"
    else:
        directory = resolve_model_dir(model, opts.revision, weights=False)
        fmt = checkpoint_format(directory)
        config = read_config(directory, fmt)
        if declared_dtype(config) is None:  # the dtype rule falls back to the weights: a Hub repo's are fetched
            with contextlib.suppress(LoadError):
                directory = resolve_model_dir(model, opts.revision)
        weights, where = weight_dtypes(directory, config), str(directory / "config.json")
    return _layout(config, parallel, model_dtype(opts.dtype, config, weights, where), opts)


def weight_dtypes(directory: StoredPath, config: JsonObject) -> tuple[str, ...]:
    """The weights' dtypes, from the headers, when the config names no dtype (the dtype rule
    falls back to them, as ``plan`` does)."""
    if declared_dtype(config) is not None:
        return ()
    try:
        manifest = read_manifest(directory)
        if manifest is not None:
            return (TORCH_TO_SAFETENSORS[manifest["dtype"]],)
        return tuple(index_checkpoint(discover(directory)).dtypes().values())
    except LoadError:  # no weights at hand: the config decides alone
        return ()


def _weight_codes(checkpoint: Checkpoint) -> Iterator[str]:
    """The checkpoint's dtype codes, gathered only if iterated (the config names no dtype)."""
    yield from checkpoint.dtypes().values()


def _checkpoint(directory: StoredPath, manifest: JsonObject | None, rank: int, load_format: str, allow_pickle: bool) -> Checkpoint:
    if manifest is not None:  # a pre-sharded save: its virtual original checkpoint
        return sharded_checkpoint(directory, manifest, rank)
    return index_checkpoint(discover(directory, load_format), allow_pickle=allow_pickle)


def _dummy_plan(model: Model | JsonObject, parallel: Parallel, opts: LoadOptions) -> Plan:
    """A dummy load's plan, from the config alone (a model directory's, or a parsed one)."""
    if isinstance(model, Mapping):
        config, where, model_dir = dict(model), "config", ""
    else:
        directory = model_directory(model)
        config, where, model_dir = read_config(directory, checkpoint_format(directory)), str(directory / "config.json"), str(directory)
    return dummy_plan(_layout(config, parallel, model_dtype(opts.dtype, config, (), where), opts), model_dir)


def plan(
    model: Model | JsonObject, *, tp_size: int = 1, rank: int = 0, options: LoadOptions = LoadOptions(), **overrides: object
) -> Plan:
    """The validated load plan of one rank, from ``config.json`` and the weight-file headers only
    (no tensor data is read). ``options`` is a :class:`LoadOptions` (its fields may be given as
    keywords instead, as for every entry point).

    ``expert_parallel=True`` spreads whole MoE experts over the ``tp_size`` ranks
    (``expert_placement`` "linear" or "round_robin", as vLLM serves it; ``num_redundant_experts``
    extra physical experts repeat logical ones); the plan then reads no byte of another rank's
    experts. ``quantization="fp8"`` or ``"fp8_block"`` quantizes an unquantized checkpoint while
    loading. ``allow_pickle=True`` permits ``.bin``/``.pt`` checkpoints
    (``torch.load(weights_only=True)`` only; safetensors always win when both are present). A
    directory written by :func:`save_sharded` plans like any checkpoint, at any tp size.
    ``spec`` overrides the architecture spec picked from ``config.json``. ``text_only=True`` leaves
    out a multimodal model's vision tower and projector (the spec's ``vision = true`` modules):
    their tensors are in ``Plan.dropped`` with the reason. ``model`` may also be a
    Hugging Face Hub repo id (``"Qwen/Qwen3-8B"``) at ``revision`` (branch, tag or commit; default
    ``main``): the local cache first, only the cache when ``HF_HUB_OFFLINE`` is set, else only
    the files this load reads are downloaded. Raises a :class:`~functional_load.LoadError`
    subclass listing every problem found.

    ``load_format="dummy"`` (vLLM's ``DummyModelLoader``) opens no weight file: ``model`` may be
    a directory with only ``config.json``, or a parsed config; every parameter gets vLLM's dummy
    values (see :mod:`functional_load.io.dummy`) and the plan reads 0 bytes.
    """
    with paused_gc():  # one pause for indexing, layout and plan: the young objects are scanned once, not per stage
        return _plan(model, tp_size, rank, resolve_options(options, overrides))


def _plan(model: Model | JsonObject, tp_size: int, rank: int, opts: LoadOptions) -> Plan:
    parallel = opts.parallel(tp_size, rank)
    if opts.dummy:
        model = model if isinstance(model, Mapping) else resolve_model_dir(model, opts.revision, opts.load_format)
        return _dummy_plan(model, parallel, opts)
    if isinstance(model, Mapping):
        raise ConfigError("a parsed config has no weights: pass the model directory, or load_format='dummy' for dummy weights")
    directory = resolve_model_dir(model, opts.revision, opts.load_format, opts.allow_pickle)
    manifest = read_manifest(directory)
    fmt = "hf" if manifest is not None else checkpoint_format(directory, opts.load_format)
    config = read_config(directory, fmt)
    stored, dtype, quantization = False, opts.dtype, None
    if manifest is not None:
        dtype = dtype if dtype is not None else manifest["dtype"]
        stored = bool(manifest.get("online_quantization"))
        quantization = opts.quantization or manifest.get("online_quantization")
        saved = manifest["parallel"]
        sizes = (saved["tp_size"], saved.get("pp_size", 1), saved.get("dp_size", 1), saved["expert_parallel"])
        if stored and (parallel.tp_size, parallel.pp_size, parallel.dp_size, parallel.expert_parallel) != sizes:
            raise ConfigError(
                f"{directory}: this save holds weights quantized while loading; it reloads only as saved "
                f"({manifest['parallel']}), its original weights are not in it. Save from the original checkpoint to reshard"
            )
    if manifest is not None:  # a pre-sharded save: its virtual original checkpoint, as this rank prefers its boxes
        checkpoint = sharded_checkpoint(directory, manifest, parallel)
    else:
        checkpoint = _checkpoint(directory, None, parallel.rank, opts.load_format, opts.allow_pickle)
    dtype_name = model_dtype(dtype, config, _weight_codes(checkpoint), str(directory / "config.json"))
    layout = _layout(config, parallel, dtype_name, opts, stored, quantization, checkpoint)
    if manifest is not None and not stored:  # at the saved layout, the rank's own file is read as it is
        kept = {name: p.local_shape for name, p in layout.params.items() if name not in layout.aliases}
        checkpoint = saved_rank(directory, manifest, layout.parallel, kept) or checkpoint
    try:
        return make_plan(layout, checkpoint)
    except PlanError as exc:
        if fmt != "mistral" or opts.load_format != "auto":
            raise
        raise PlanError([
            *exc.problems,
            "this directory was read in Mistral's own format (load_format='auto' picks it when consolidated*.safetensors "
            "exist); if those files do not hold Mistral's names, load the HF files with load_format='hf'",
        ]) from None


def load(
    model: Model | JsonObject,
    *,
    tp_size: int = 1,
    rank: int = 0,
    device: str | int | torch.device = "cpu",
    target: str = "checkpoint",
    group: ProcessGroup | None = None,
    options: LoadOptions = LoadOptions(),
    **overrides: object,
) -> LoadedState:
    """The rank-local parameters of ``rank`` out of ``tp_size``, with vLLM's names and layouts.

    ``options`` (:class:`LoadOptions`, or its fields as keywords) as for :func:`plan`:
    ``dtype=None`` follows vLLM's ``"auto"`` (the config's dtype; float32 models in bfloat16);
    otherwise tensors are cast. Only the bytes this rank keeps are read, as ``read``
    (:class:`ReadOptions`) says; ``progress``: a progress bar (``None``: only for long loads).
    ``target`` picks the output layout: ``"checkpoint"`` (default, what vLLM holds after
    ``load_weights``), ``"cuda-fp8"`` or ``"rocm-fp8"`` (after its FP8
    ``process_weights_after_loading``). ``device`` ``"cpu"`` or a CUDA device. Returns a
    read-only :class:`LoadedState`. ``load_format="dummy"``: vLLM's dummy values from the config
    alone (``model`` may be a parsed config), drawn on the CPU whatever ``device`` is.

    ``group``: a ``torch.distributed`` process group whose processes load together (e.g. one
    node's tensor ranks, each calling ``load`` with its own rank and this group at the same
    point): they fetch the union of their byte ranges from object storage once between them and
    hand each other their slices over the group (see :mod:`functional_load.io.group`); the stats'
    ``bytes_read`` and ``requests`` are then what this process fetched for the group.
    """
    opts = resolve_options(options, overrides)
    check_target(target)
    if str(device) != "cpu":
        check_device(device)
    start = time.perf_counter()
    cache = open_rank_cache(model, tp_size, rank, opts if group is None else opts.replace(cache_dir=None))
    try:
        the_plan = cache.plan(plan)
    except Exception as exc:
        if group is not None:  # the others wait for this process's ranges: tell them it failed
            fail_group(group, exc)
        raise
    plan_seconds = time.perf_counter() - start
    tensors, stats = _execute(the_plan, opts, group)
    cache.keep(the_plan, tensors)  # a load from object storage with cache_dir: the rank's tensors kept
    transform_start = time.perf_counter()
    tensors = apply_target(the_plan, tensors, target)
    transform_seconds = stats.transform_seconds + (time.perf_counter() - transform_start if target != "checkpoint" else 0.0)
    stats = dataclasses.replace(stats, transform_seconds=transform_seconds, plan_seconds=plan_seconds)
    state = LoadedState(tensors, the_plan, target, stats)
    return to_device(state, device) if str(device) != "cpu" else state


def _execute(the_plan: Plan, opts: LoadOptions, group: ProcessGroup | None) -> tuple[dict[str, torch.Tensor], LoadStats]:
    """Run ``the_plan``; with a ``group``, from the bytes its processes fetched once between them
    (the seconds of fetching and exchanging them count as read time)."""
    reader, group_seconds = None, 0.0
    if group is not None:
        reader, joined = group_reader(the_plan, group, opts.read)
        group_seconds = joined.seconds
    try:
        tensors, stats = execute(
            the_plan, opts.read, reader=reader, progress=opts.progress,
            consume=lambda param, dense: quantize_online(the_plan, param, dense),
            consumed=lambda param: is_online_weight(the_plan, param),
        )
    finally:
        if reader is not None:
            reader.close()
    return tensors, dataclasses.replace(stats, read_seconds=stats.read_seconds + group_seconds)


def save_sharded(
    source: Model | Iterable[LoadedState], out_dir: Model, tp_size: int | None = None, *, options: LoadOptions = LoadOptions(),
    **overrides: object,
) -> StoredPath:
    """Save every rank of a layout to ``out_dir`` once, atomically, with a manifest of sizes,
    SHA-256, each rank's coordinates and the boxes each rank holds; ``load(out_dir, ...)`` reads
    it back at that layout (each rank its stored tensors, as they are) or reshards it to another
    (any tp, pp or dp size, with or without expert parallelism), as if loading the original.

    ``source`` is a checkpoint directory (then ``tp_size`` is required, and every rank of
    ``pp_size x dp_size x tp_size`` is loaded in turn with ``options``, as for :func:`load`; the
    options pick the layout, not a rank: ``pp_rank``/``dp_rank`` are refused) or the
    :class:`LoadedState` of every rank, in any order.

    Files: ``model-rank-{g}-of-{world}-{id}.safetensors`` for each global rank
    ``g = (dp_rank * pp_size + pp_rank) * tp_size + rank`` (vLLM's), ``config.json`` and
    ``functional_load.sharded.json``. Nothing is stored twice across replicas or stages: a tensor
    that another data-parallel replica or pipeline stage holds identically (the same tensor rank,
    name and original boxes: every replica's attention and dense layers, an outer module repeated
    on a later stage) is written only by the first such rank in global order, and the manifest
    points the others' entries at that file; a replica's own file holds its experts (a dense
    model's: no tensor). Within one stage of one replica each tensor rank's file is complete, as
    in a tp save (replicated norms and KV heads are in every tensor rank's file). A rank reloaded
    at the saved layout reads its own file and the files its entries point at; from a directory,
    each replica is loaded in full, its shared tensors read and not written. A single-stage,
    single-replica save is manifest version 1, as before; a larger one is version 2, which older
    loaders refuse rather than misread. A save quantized while loading reloads at its layout only.
    ``out_dir`` may be an object-storage prefix (``s3://bucket/prefix``): each rank file is
    uploaded (multipart past a part's size), the manifest last (see
    :mod:`functional_load.output.save_remote`).
    """
    opts = resolve_options(options, overrides)
    if isinstance(source, (str, os.PathLike)):
        if tp_size is None:
            raise ConfigError("save_sharded(model_dir, out_dir, tp_size): tp_size is required for a checkpoint directory")
        if opts.pp_rank or opts.dp_rank or {"pp_rank", "dp_rank"} & set(overrides):
            raise ConfigError(
                f"save_sharded saves every rank of the layout (pp_size={opts.pp_size} x dp_size={opts.dp_size} x "
                f"tp_size={tp_size}); pp_rank/dp_rank pick one rank: leave them out"
            )
        if "progress" not in overrides and options.progress is None:
            opts = opts.replace(progress=False)
        directory = resolve_model_dir(source, opts.revision, opts.load_format, opts.allow_pickle)
        local = opts.replace(revision=None)
        states: Iterable[LoadedState] = (
            load(directory, tp_size=tp_size, rank=r, options=local.replace(pp_rank=p, dp_rank=d))
            for d in range(opts.dp_size) for p in range(opts.pp_size) for r in range(tp_size)
        )
        return write_to(states, out_dir, directory)
    if overrides or options != LoadOptions():
        raise ConfigError("save_sharded(states, out_dir): the states are loaded already; options apply to a checkpoint directory")
    return write_to(source, out_dir)
