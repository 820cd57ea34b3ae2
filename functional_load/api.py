"""The public entry points, each a thin composition of the pipeline's stages.

``layout`` (config -> what a rank holds), ``plan`` (+ checkpoint headers -> a validated plan),
``load`` (+ reading -> rank-local torch tensors), ``load_jax`` (-> global ``jax.Array``s) and
``save_sharded`` (every rank of a layout, written once).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .checkpoint import Checkpoint
from .checkpoint.discover import discover
from .checkpoint.index import index_checkpoint
from .checkpoint.sharded import read_manifest, sharded_checkpoint
from .dtypes import TORCH_TO_SAFETENSORS
from .errors import ConfigError, LoadError
from .io import Reader, ReadOptions, execute, reader_for
from .layout.build import Layout, build_layout
from .layout.parallel import Parallel
from .model.config import declared_dtype, model_directory, model_dtype, read_config
from .model.quant import online_quant_config, parse_quant_config
from .model.spec import ArchSpec, spec_for_config
from .output.jax import global_arrays, local_tp_ranks
from .output.save import write_sharded
from .output.state import LoadedState, check_device, to_device
from .plan import Plan, make_plan
from .transform.online import is_online_weight, quantize_online
from .transform.targets import apply_target, check_target

Model = str | Path | os.PathLike[str]


def _layout(
    config: Mapping[str, Any], parallel: Parallel, dtype: str, quantization: str | None, spec: ArchSpec | None, stored: bool = False
) -> Layout:
    """The layout of one rank: the spec from the config (unless given), and the checkpoint's
    quantization config or the online one asked for (``stored``: already quantized, in a save)."""
    arch = spec or spec_for_config(config)
    quant = online_quant_config(quantization, config, stored) if quantization else parse_quant_config(config)
    return build_layout(config, arch, parallel, dtype, quant)


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
) -> Layout:
    """Every parameter of one rank (names, shapes, dtypes, slice descriptors) from a config
    alone: ``model`` is a model directory, its ``config.json``, or a parsed config (e.g. a real
    model's, with no weights at hand). Only the config (and, when it names no dtype, the weight
    files' headers) is read."""
    parallel = Parallel(tp_size, rank, expert_parallel, expert_placement, num_redundant_experts)
    weights: tuple[str, ...] = ()
    if isinstance(model, Mapping):
        config = dict(model)
    else:
        config = read_config(model)
        weights = weight_dtypes(model_directory(model), config)
    where = "config" if isinstance(model, Mapping) else str(model_directory(model) / "config.json")
    return _layout(config, parallel, model_dtype(dtype, config, weights, where), quantization, spec)


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


def plan(
    model: Model,
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
    ``spec`` overrides the architecture spec picked from ``config.json``. Raises a
    :class:`~functional_load.LoadError` subclass listing every problem found.
    """
    parallel = Parallel(tp_size, rank, expert_parallel, expert_placement, num_redundant_experts)
    directory = model_directory(model)
    config = read_config(directory)
    manifest = read_manifest(directory)
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
    return make_plan(_layout(config, parallel, dtype_name, quantization, spec, stored), checkpoint)


def load(
    model: Model,
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
) -> LoadedState:
    """The rank-local parameters of ``rank`` out of ``tp_size``, with vLLM's names and layouts.

    ``dtype=None`` follows vLLM's ``"auto"`` (the config's dtype; float32 models in bfloat16);
    otherwise tensors are cast. Only the bytes this rank keeps are read, as ``read``
    (:class:`ReadOptions`) says. MoE, ``quantization``, ``load_format`` and ``allow_pickle`` are
    those of :func:`plan`. ``target`` picks the output layout: ``"checkpoint"`` (default, what
    vLLM holds after ``load_weights``), ``"cuda-fp8"`` or ``"rocm-fp8"`` (after its FP8
    ``process_weights_after_loading``). ``device`` ``"cpu"`` or a CUDA device. ``progress``: a
    progress bar (``None``: only for long loads). Returns a read-only :class:`LoadedState`.
    """
    check_target(target)
    if str(device) != "cpu":
        check_device(device)
    start = time.perf_counter()
    the_plan = plan(
        model, tp_size=tp_size, rank=rank, dtype=dtype, expert_parallel=expert_parallel, expert_placement=expert_placement,
        num_redundant_experts=num_redundant_experts, quantization=quantization, load_format=load_format,
        allow_pickle=allow_pickle, spec=spec,
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
    model: Model,
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
) -> dict[str, Any]:
    """Every parameter as a global ``jax.Array`` sharded over ``mesh``: ``tp_size`` is the size
    of ``tp_axis`` and other mesh axes replicate. The shard of the device at tensor-parallel
    coordinate ``r`` is rank ``r``'s tensor from :func:`load`; each process plans and reads only
    the ranks its own devices hold. Options as for :func:`plan`; ``reader`` (optional, from
    ``functional_load.io.reader_for``) is used for every read, e.g. to count this process's bytes."""
    if tp_axis not in mesh.axis_names:
        raise ConfigError(f"mesh axes {mesh.axis_names} have no tensor-parallel axis {tp_axis!r}; pass tp_axis=")
    tp_size = mesh.shape[tp_axis]
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
    in turn with ``options`` as for :func:`load`) or the :class:`LoadedState` of every rank.
    """
    if isinstance(source, (str, os.PathLike)):
        if tp_size is None:
            raise ConfigError("save_sharded(model_dir, out_dir, tp_size): tp_size is required for a checkpoint directory")
        options.setdefault("progress", False)
        states: Iterable[LoadedState] = (load(source, tp_size=tp_size, rank=r, **options) for r in range(tp_size))
        return write_sharded(states, out_dir, model_directory(source))
    return write_sharded(source, out_dir)
