"""The public entry points, each a thin composition of the pipeline's stages.

``layout`` (config -> what a rank holds), ``plan`` (+ checkpoint headers -> a validated plan),
``load`` (+ reading -> rank-local torch tensors), ``load_jax`` (-> global ``jax.Array``s) and
``save_sharded`` (every rank of a layout, written once).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .checkpoint import Checkpoint
from .checkpoint.discover import discover
from .checkpoint.hub import resolve_model
from .checkpoint.index import index_checkpoint
from .checkpoint.sharded import read_manifest, sharded_checkpoint
from .dtypes import TORCH_TO_SAFETENSORS
from .errors import ConfigError, LoadError, PlanError
from .io import Reader, ReadOptions, execute, reader_for
from .layout.build import Layout, build_layout
from .layout.parallel import Parallel
from .model.config import checkpoint_format, declared_dtype, model_directory, model_dtype, read_config
from .model.quant import online_quant_config, parse_quant_config
from .model.spec import ArchSpec, spec_for_config
from .output.jax import global_arrays, local_tp_ranks
from .output.save import write_sharded
from .output.state import LoadedState, check_device, to_device
from .plan import Plan, make_plan
from .plan.dummy import dummy_plan
from .transform.online import is_online_weight, quantize_online
from .transform.targets import apply_target, check_target

Model = str | Path | os.PathLike[str]
DUMMY = "dummy"  # load_format of vLLM's DummyModelLoader: config only, vLLM's dummy values


def resolve_model_dir(
    model: Model, revision: str | None = None, load_format: str = "auto", allow_pickle: bool = False, weights: bool = True
) -> Path:
    """The local model directory ``model`` names: a directory (or its ``config.json``) as it is, or
    the snapshot of a Hugging Face Hub repo id (``org/name``) or cache folder (``models--org--name``)
    at ``revision``, with the files a load with ``load_format`` reads downloaded unless
    ``HF_HUB_OFFLINE`` is set (``weights=False``: the config and index only; see
    :mod:`functional_load.checkpoint.hub`)."""
    return model_directory(resolve_model(model, revision=revision, load_format=load_format, allow_pickle=allow_pickle, weights=weights))


def _layout(
    config: Mapping[str, Any], parallel: Parallel, dtype: str, quantization: str | None, spec: ArchSpec | None, stored: bool = False,
    load_format: str = "hf", text_only: bool = False,
) -> Layout:
    """The layout of one rank: the spec from the config (unless given), and the checkpoint's
    quantization config or the online one asked for (``stored``: already quantized, in a save);
    ``load_format`` is the checkpoint's resolved format."""
    arch = spec or spec_for_config(config)
    quant = online_quant_config(quantization, config, stored) if quantization else parse_quant_config(config)
    return build_layout(config, arch, parallel, dtype, quant, load_format=load_format, text_only=text_only)


def layout(
    model: Model | Mapping[str, Any],
    *,
    tp_size: int = 1,
    rank: int = 0,
    dtype: Any = None,
    expert_parallel: bool = False,
    expert_placement: str = "linear",
    num_redundant_experts: int = 0,
    quantization: str | None = None,
    spec: ArchSpec | None = None,
    revision: str | None = None,
    text_only: bool = False,
) -> Layout:
    """Every parameter of one rank (names, shapes, dtypes, slice descriptors) from a config
    alone: ``model`` is a model directory, its ``config.json``, or a parsed config (e.g. a real
    model's, with no weights at hand), or a Hugging Face Hub repo id at ``revision`` (only its
    config is fetched). Only the config (and, when it names no dtype, the weight files' headers)
    is read."""
    parallel = Parallel(tp_size, rank, expert_parallel, expert_placement, num_redundant_experts)
    weights: tuple[str, ...] = ()
    fmt = "hf"
    if isinstance(model, Mapping):
        config, where = dict(model), "config"
    else:
        directory = resolve_model_dir(model, revision, weights=False)
        fmt = checkpoint_format(directory)
        config = read_config(directory, fmt)
        if declared_dtype(config) is None:  # the dtype rule falls back to the weights: a Hub repo's are fetched
            with contextlib.suppress(LoadError):
                directory = resolve_model_dir(model, revision)
        weights, where = weight_dtypes(directory, config), str(directory / "config.json")
    return _layout(config, parallel, model_dtype(dtype, config, weights, where), quantization, spec, load_format=fmt, text_only=text_only)


def weight_dtypes(directory: Path, config: Mapping[str, Any]) -> tuple[str, ...]:
    """The weights' dtypes, from the headers, when the config names no dtype (the dtype rule
    falls back to them, as ``plan`` does)."""
    if declared_dtype(config) is not None:
        return ()
    try:
        manifest = read_manifest(directory)
        if manifest is not None:
            return (TORCH_TO_SAFETENSORS[manifest["dtype"]],)
        return tuple(info.dtype for info in index_checkpoint(discover(directory)).tensors.values())
    except LoadError:  # no weights at hand: the config decides alone
        return ()


def _checkpoint(directory: Path, manifest: Mapping[str, Any] | None, rank: int, load_format: str, allow_pickle: bool) -> Checkpoint:
    if manifest is not None:  # a pre-sharded save: its virtual original checkpoint
        return sharded_checkpoint(directory, manifest, rank)
    return index_checkpoint(discover(directory, load_format), allow_pickle=allow_pickle)


def _is_dummy(load_format: Any) -> bool:
    return isinstance(load_format, str) and load_format.lower() == DUMMY


def _dummy_plan(
    model: Model | Mapping[str, Any], parallel: Parallel, dtype: Any, quantization: str | None, spec: ArchSpec | None,
    text_only: bool = False,
) -> Plan:
    """A dummy load's plan, from the config alone (a model directory's, or a parsed one)."""
    if isinstance(model, Mapping):
        config, where, model_dir = dict(model), "config", ""
    else:
        directory = model_directory(model)
        config, where, model_dir = read_config(directory), str(directory / "config.json"), str(directory)
    return dummy_plan(_layout(config, parallel, model_dtype(dtype, config, (), where), quantization, spec, text_only=text_only), model_dir)


def plan(
    model: Model | Mapping[str, Any],
    *,
    tp_size: int = 1,
    rank: int = 0,
    dtype: Any = None,
    expert_parallel: bool = False,
    expert_placement: str = "linear",
    num_redundant_experts: int = 0,
    quantization: str | None = None,
    load_format: str = "auto",
    allow_pickle: bool = False,
    spec: ArchSpec | None = None,
    revision: str | None = None,
    text_only: bool = False,
) -> Plan:
    """The validated load plan of one rank, from ``config.json`` and the weight-file headers only
    (no tensor data is read).

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
    parallel = Parallel(tp_size, rank, expert_parallel, expert_placement, num_redundant_experts)
    if _is_dummy(load_format):
        model = model if isinstance(model, Mapping) else resolve_model_dir(model, revision, load_format)
        return _dummy_plan(model, parallel, dtype, quantization, spec, text_only)
    if isinstance(model, Mapping):
        raise ConfigError("a parsed config has no weights: pass the model directory, or load_format='dummy' for dummy weights")
    directory = resolve_model_dir(model, revision, load_format, allow_pickle)
    manifest = read_manifest(directory)
    fmt = "hf" if manifest is not None else checkpoint_format(directory, load_format)
    config = read_config(directory, fmt)
    stored = False
    if manifest is not None:
        dtype = dtype if dtype is not None else manifest["dtype"]
        stored = bool(manifest.get("online_quantization"))
        quantization = quantization or manifest.get("online_quantization")
        if stored and (parallel.tp_size, expert_parallel) != (manifest["parallel"]["tp_size"], manifest["parallel"]["expert_parallel"]):
            raise ConfigError(
                f"{directory}: this save holds weights quantized while loading; it reloads only as saved "
                f"({manifest['parallel']}), its original weights are not in it. Save from the original checkpoint to reshard"
            )
    checkpoint = _checkpoint(directory, manifest, parallel.rank, load_format, allow_pickle)
    dtype_name = model_dtype(dtype, config, (info.dtype for info in checkpoint.tensors.values()), str(directory / "config.json"))
    try:
        return make_plan(_layout(config, parallel, dtype_name, quantization, spec, stored, fmt, text_only), checkpoint)
    except PlanError as exc:
        if fmt != "mistral" or load_format != "auto":
            raise
        raise PlanError([
            *exc.problems,
            "this directory was read in Mistral's own format (load_format='auto' picks it when consolidated*.safetensors "
            "exist); if those files do not hold Mistral's names, load the HF files with load_format='hf'",
        ]) from None


def load(
    model: Model | Mapping[str, Any],
    *,
    tp_size: int = 1,
    rank: int = 0,
    dtype: Any = None,
    device: Any = "cpu",
    expert_parallel: bool = False,
    expert_placement: str = "linear",
    num_redundant_experts: int = 0,
    quantization: str | None = None,
    target: str = "checkpoint",
    load_format: str = "auto",
    allow_pickle: bool = False,
    read: ReadOptions = ReadOptions(),
    progress: bool | None = None,
    spec: ArchSpec | None = None,
    revision: str | None = None,
    text_only: bool = False,
) -> LoadedState:
    """The rank-local parameters of ``rank`` out of ``tp_size``, with vLLM's names and layouts.

    ``dtype=None`` follows vLLM's ``"auto"`` (the config's dtype; float32 models in bfloat16);
    otherwise tensors are cast. Only the bytes this rank keeps are read, as ``read``
    (:class:`ReadOptions`) says. MoE, ``quantization``, ``load_format``, ``allow_pickle`` and
    ``revision`` (of a Hub repo id) are those of :func:`plan`. ``target`` picks the output
    layout: ``"checkpoint"`` (default, what vLLM holds after ``load_weights``), ``"cuda-fp8"`` or
    ``"rocm-fp8"`` (after its FP8 ``process_weights_after_loading``). ``device`` ``"cpu"`` or a CUDA device. ``progress``: a
    progress bar (``None``: only for long loads). Returns a read-only :class:`LoadedState`.
    ``load_format="dummy"``: vLLM's dummy values from the config alone (``model`` may be a
    parsed config), drawn on the CPU whatever ``device`` is.
    """
    check_target(target)
    if str(device) != "cpu":
        check_device(device)
    start = time.perf_counter()
    the_plan = plan(
        model, tp_size=tp_size, rank=rank, dtype=dtype, expert_parallel=expert_parallel, expert_placement=expert_placement,
        num_redundant_experts=num_redundant_experts, quantization=quantization, load_format=load_format,
        allow_pickle=allow_pickle, spec=spec, revision=revision, text_only=text_only,
    )
    plan_seconds = time.perf_counter() - start
    tensors, stats = execute(
        the_plan, read, progress=progress,
        consume=lambda param, dense: quantize_online(the_plan, param, dense),
        consumed=lambda param: is_online_weight(the_plan, param),
    )
    transform_start = time.perf_counter()
    tensors = apply_target(the_plan, tensors, target)
    transform_seconds = stats.transform_seconds + (time.perf_counter() - transform_start if target != "checkpoint" else 0.0)
    stats = type(stats)(stats.read_seconds, transform_seconds, stats.bytes_read, stats.bytes_out, stats.prefetched, plan_seconds)
    state = LoadedState(tensors, the_plan, target, stats)
    return to_device(state, device) if str(device) != "cpu" else state


def load_jax(
    model: Model | Mapping[str, Any],
    mesh: Any,
    *,
    tp_axis: str = "tp",
    dtype: Any = None,
    expert_parallel: bool = False,
    expert_placement: str = "linear",
    num_redundant_experts: int = 0,
    load_format: str = "auto",
    allow_pickle: bool = False,
    read: ReadOptions = ReadOptions(),
    reader: Reader | None = None,
    revision: str | None = None,
) -> dict[str, Any]:
    """Every parameter as a global ``jax.Array`` sharded over ``mesh``: ``tp_size`` is the size
    of ``tp_axis`` and other mesh axes replicate. The shard of the device at tensor-parallel
    coordinate ``r`` is rank ``r``'s tensor from :func:`load`; each process plans and reads only
    the ranks its own devices hold. Options as for :func:`plan`; ``reader`` (optional, from
    ``functional_load.io.reader_for``) is used for every read, e.g. to count this process's bytes."""
    if tp_axis not in mesh.axis_names:
        raise ConfigError(f"mesh axes {mesh.axis_names} have no tensor-parallel axis {tp_axis!r}; pass tp_axis=")
    tp_size = mesh.shape[tp_axis]
    if not isinstance(model, Mapping):  # a Hub repo id is resolved (and downloaded) once, for every rank
        model = resolve_model_dir(model, revision, load_format, allow_pickle)
    plans: dict[int, Plan] = {}

    def plan_of(rank: int) -> Plan:
        if rank not in plans:
            plans[rank] = plan(
                model, tp_size=tp_size, rank=rank, dtype=dtype, expert_parallel=expert_parallel,
                expert_placement=expert_placement, num_redundant_experts=num_redundant_experts,
                load_format=load_format, allow_pickle=allow_pickle,
            )
        return plans[rank]

    if reader is not None:
        return global_arrays(plan_of, mesh, tp_axis, reader)
    with reader_for(plan_of(local_tp_ranks(mesh, tp_axis)[0]), read) as own:
        return global_arrays(plan_of, mesh, tp_axis, own)


def save_sharded(source: Model | Iterable[LoadedState], out_dir: Model, tp_size: int | None = None, **options: Any) -> Path:
    """Save every rank of a layout to ``out_dir`` once, atomically, with a manifest of sizes,
    SHA-256 and the boxes each rank holds; ``load(out_dir, ...)`` reads it back at that tp size
    (each rank its own file) or reshards it to another.

    ``source`` is a checkpoint directory (then ``tp_size`` is required, and each rank is loaded
    in turn with ``options`` as for :func:`load`, ``revision`` included for a Hub repo id) or
    the :class:`LoadedState` of every rank.
    """
    if isinstance(source, (str, os.PathLike)):
        if tp_size is None:
            raise ConfigError("save_sharded(model_dir, out_dir, tp_size): tp_size is required for a checkpoint directory")
        options.setdefault("progress", False)
        directory = resolve_model_dir(
            source, options.pop("revision", None), options.get("load_format", "auto"), options.get("allow_pickle", False)
        )
        states: Iterable[LoadedState] = (load(directory, tp_size=tp_size, rank=r, **options) for r in range(tp_size))
        return write_sharded(states, out_dir, directory)
    return write_sharded(source, out_dir)
