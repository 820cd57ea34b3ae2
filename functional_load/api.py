"""The public entry points: ``plan`` and ``load``. Each is a thin composition of pure stages."""

from __future__ import annotations

import os
from typing import Any

from .checkpoint.discover import discover
from .checkpoint.index import index_checkpoint
from .config import model_dtype, read_config
from .execute import LoadedState, execute
from .layout import Parallel, build_layout
from .plan import Plan, make_plan
from .quant.config import parse_quant_config
from .spec import ArchSpec, spec_for_config


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
) -> Plan:
    """The validated load plan of one rank, from ``config.json`` and the weight-file headers only.

    ``expert_parallel=True`` spreads whole MoE experts over the ``tp_size`` ranks
    (``expert_placement`` "linear" or "round_robin"; ``num_redundant_experts`` extra physical
    experts repeat logical ones); the plan then reads no byte of another rank's experts.
    ``spec`` overrides the architecture spec picked from ``config.json``.
    Raises a :class:`~functional_load.LoadError` subclass listing every problem found.
    """
    parallel = Parallel(tp_size, rank, expert_parallel, expert_placement, num_redundant_experts)
    config = read_config(model_dir)
    checkpoint = index_checkpoint(discover(model_dir, load_format))
    arch = spec or spec_for_config(config)
    dtype_name = model_dtype(config, checkpoint, dtype)
    layout = build_layout(config, arch, parallel, dtype_name, parse_quant_config(config, dtype_name))
    return make_plan(layout, checkpoint)


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
    progress: bool | None = None,
) -> dict[str, Any]:
    """The rank-local parameters of ``rank`` out of ``tp_size``, with vLLM names and layouts.

    ``dtype=None`` keeps the config's dtype; otherwise tensors are cast. Only the bytes this rank
    keeps are read. Tied aliases (``lm_head.weight``) are the same tensor as their target.
    MoE options are those of :func:`plan`.
    """
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
    )
    state = execute(the_plan, progress=progress)
    if str(device) != "cpu":
        moved: dict[int, Any] = {}
        state = LoadedState({name: moved.setdefault(id(t), t.to(device)) for name, t in state.items()}, the_plan)
    return state
