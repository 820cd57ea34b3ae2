"""The public entry points: ``plan`` and ``load``. Each is a thin composition of pure stages."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from collections.abc import Mapping
from typing import Any

from .checkpoint.discover import discover
from .checkpoint.pickles import PickleReader
from .checkpoint.read import ReadOptions
from .dtypes import canonical_dtype
from .sharded_state import plan_sharded, read_manifest
from .checkpoint.index import index_checkpoint
from .config import model_dtype, read_config
from .errors import ConfigError
from .execute import execute
from .materialize import to_device
from .targets import TARGETS, apply_target
from .layout import Layout, Parallel, build_layout
from .plan import Plan, make_plan
from .quant.config import online_quant_config, parse_quant_config
from .spec import ArchSpec, spec_for_config


def layout(
    model: str | os.PathLike | Mapping[str, Any],
    *,
    tp_size: int = 1,
    rank: int = 0,
    dtype: Any = None,
    spec: ArchSpec | None = None,
    expert_parallel: bool = False,
    expert_placement: str = "linear",
    num_redundant_experts: int = 0,
    quantization: str | None = None,
) -> Layout:
    """Every parameter of one rank (names, shapes, dtypes, slice descriptors) from a config alone:
    ``model`` is a checkpoint directory or a parsed ``config.json`` (e.g. a real model's, with no
    weights at hand). Nothing but the config is read."""
    config = dict(model) if isinstance(model, Mapping) else read_config(model)
    parallel = Parallel(tp_size, rank, expert_parallel, expert_placement, num_redundant_experts)
    try:
        dtype_name = canonical_dtype(dtype) or canonical_dtype(config.get("dtype") or config.get("torch_dtype")) or "bfloat16"
    except ValueError as exc:
        raise ConfigError(f"config.json or dtype argument: {exc}") from None
    return _layout(config, spec, parallel, dtype_name, quantization)


def _layout(config: Mapping[str, Any], spec: ArchSpec | None, parallel: Parallel, dtype: str, quantization: str | None) -> Layout:
    """The layout of one rank: the spec from the config (unless given), and the checkpoint's
    quantization config or the online one asked for."""
    arch = spec or spec_for_config(config)
    quant = online_quant_config(quantization, config) if quantization else parse_quant_config(config, dtype)
    return build_layout(config, arch, parallel, dtype, quant)


def plan(
    model_dir: str | os.PathLike,
    *,
    tp_size: int = 1,
    rank: int = 0,
    dtype: Any = None,
    load_format: str = "auto",
    spec: ArchSpec | None = None,
    expert_parallel: bool = False,
    expert_placement: str = "linear",
    num_redundant_experts: int = 0,
    quantization: str | None = None,
    allow_pickle: bool = False,
    verify_hashes: bool = False,
) -> Plan:
    """The validated load plan of one rank, from ``config.json`` and the weight-file headers only.

    ``expert_parallel=True`` spreads whole MoE experts over the ``tp_size`` ranks
    (``expert_placement`` "linear" or "round_robin"; ``num_redundant_experts`` extra physical
    experts repeat logical ones); the plan then reads no byte of another rank's experts.
    ``quantization="fp8"`` or ``"fp8_block"`` quantizes an unquantized checkpoint while loading.
    ``allow_pickle=True`` permits ``.bin``/``.pt`` checkpoints (``torch.load(weights_only=True)``
    only; safetensors always win when both are present). A directory written by
    :func:`~functional_load.save_sharded` loads from its rank files (at the saved tp size) or is
    resharded (at another); sizes are always checked, SHA-256 too with ``verify_hashes=True``.
    ``spec`` overrides the architecture spec picked from ``config.json``.
    Raises a :class:`~functional_load.LoadError` subclass listing every problem found.
    """
    parallel = Parallel(tp_size, rank, expert_parallel, expert_placement, num_redundant_experts)
    config = read_config(model_dir)
    manifest = read_manifest(model_dir)
    if manifest is not None:  # a pre-sharded save (save_sharded)
        quantization = quantization or manifest.get("online_quantization")
        dtype_name = canonical_dtype(dtype) or manifest["dtype"]
        return plan_sharded(model_dir, manifest, _layout(config, spec, parallel, dtype_name, quantization), verify_hashes)
    checkpoint = index_checkpoint(discover(model_dir, load_format), allow_pickle=allow_pickle)
    the_plan = make_plan(_layout(config, spec, parallel, model_dtype(config, checkpoint, dtype), quantization), checkpoint)
    if any(info.offset < 0 for info in checkpoint.tensors.values()):  # pickles are read through torch
        return replace(the_plan, source=PickleReader)
    return the_plan


def load(
    model_dir: str | os.PathLike,
    *,
    tp_size: int = 1,
    rank: int = 0,
    dtype: Any = None,
    device: Any = "cpu",
    load_format: str = "auto",
    spec: ArchSpec | None = None,
    expert_parallel: bool = False,
    expert_placement: str = "linear",
    num_redundant_experts: int = 0,
    quantization: str | None = None,
    allow_pickle: bool = False,
    verify_hashes: bool = False,
    target: str = "checkpoint",
    progress: bool | None = None,
    strategy: str = "auto",
    threads: int = 4,
    prefetch: bool | None = None,
    prefetch_threads: int = 8,
    prefetch_block_size: int = 16 << 20,
    direct: bool = False,
    max_over_read: float = 1.0,
) -> dict[str, Any]:
    """The rank-local parameters of ``rank`` out of ``tp_size``, with vLLM names and layouts.

    ``dtype=None`` keeps the config's dtype; otherwise tensors are cast. Only the bytes this rank
    keeps are read. Tied aliases (``lm_head.weight``) are the same tensor as their target.
    MoE and ``quantization`` options are those of :func:`plan`. ``target`` picks the output
    layout: ``"checkpoint"`` (default), ``"cuda-fp8"`` or ``"rocm-fp8"`` (see :mod:`.targets`).

    Reading (see :class:`~functional_load.checkpoint.read.ReadOptions` and docs/performance.md):
    ``strategy`` "auto" | "pread" | "mmap" | "eager"; ``threads`` parallel readers; ``prefetch``
    (``None``: automatic on network filesystems) with ``prefetch_threads`` and
    ``prefetch_block_size``; ``direct`` (O_DIRECT); ``max_over_read`` (read a row-parallel slice
    as one span when that reads at most this many times the needed bytes). Contradictory options
    raise a ConfigError before anything is read.
    """
    if target not in TARGETS:
        raise ConfigError(f"target={target!r} is not a known output layout; use one of {TARGETS}")
    options = ReadOptions(strategy, threads, prefetch, prefetch_threads, prefetch_block_size, direct, max_over_read)
    start = time.perf_counter()
    the_plan = plan(
        model_dir,
        tp_size=tp_size,
        rank=rank,
        dtype=dtype,
        load_format=load_format,
        spec=spec,
        expert_parallel=expert_parallel,
        expert_placement=expert_placement,
        num_redundant_experts=num_redundant_experts,
        quantization=quantization,
        allow_pickle=allow_pickle,
        verify_hashes=verify_hashes,
    )
    plan_seconds = time.perf_counter() - start
    state = execute(the_plan, options=options, progress=progress)
    state.stats = replace(state.stats, plan_seconds=plan_seconds)
    transform_start = time.perf_counter()
    state = apply_target(state, target)
    if target != "checkpoint":
        state.stats = replace(state.stats, transform_seconds=state.stats.transform_seconds + time.perf_counter() - transform_start)
    if str(device) != "cpu":
        state = to_device(state, device)
    return state
