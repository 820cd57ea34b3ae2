"""The vLLM load format's logic that needs no vLLM: its options, matching a plan against a live
model's parameters, and filling them in place (see :mod:`.vllm`)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError, PlanError
from ..io.execute import LoadStats, execute
from ..io.options import ReadOptions
from ..options import LoadOptions
from ..plan.plan import Plan

if TYPE_CHECKING:
    import torch
    from torch import nn

LOAD_FORMAT = "functional_load"
_READ_KEYS = tuple(f.name for f in dataclasses.fields(ReadOptions))


# What vLLM decides itself, so the extra config may not say it: the field and where vLLM sets it
_VLLM_DECIDES = {
    "dtype": "vLLM's --dtype", "quantization": "vLLM's --quantization", "expert_parallel": "vLLM's --enable-expert-parallel",
    "num_redundant_experts": "vLLM's EPLB config", "text_only": "vLLM, which builds the whole model",
}


@dataclass(frozen=True)
class ExtraConfig:
    """What ``model_loader_extra_config`` says to the ``functional_load`` load format: the
    library's one :class:`~functional_load.LoadOptions` (``read``, whose fields may also be given
    at the top level, ``{"threads": 8, "verify_hashes": true}``; ``load_format``; ``progress``;
    ``spec``; ``allow_pickle``; ``expert_placement``, which must equal vLLM's own
    ``expert_placement_strategy``: the experts a rank holds are vLLM's decision), and
    ``weights``, where the weights are when not in vLLM's model directory: an ``s3://`` URI (vLLM
    0.32 refuses an object-storage model for any load format but its own streamers, so the model
    is a local directory with the config files and the weights are named here); and
    ``report_dir``, where each worker writes ``rank<r>.json`` (bytes read and planned, time; ``r`` is
    vLLM's global rank, ``(dp_rank * pp_size + pp_rank) * tp_size + tp_rank``)."""

    options: LoadOptions = LoadOptions()
    expert_placement: str | None = None  # as given (None: vLLM's)
    report_dir: str | None = None
    weights: str | None = None  # the checkpoint's directory or URI when not vLLM's model directory

    @classmethod
    def parse(cls, extra: object) -> ExtraConfig:
        """Parse vLLM's ``model_loader_extra_config`` (a dict; unknown keys are refused)."""
        if extra is None:
            return cls()
        if not isinstance(extra, Mapping):
            raise ConfigError(f"model_loader_extra_config for load_format={LOAD_FORMAT!r} must be a dict, got {type(extra).__name__}")
        decided = sorted(set(extra) & set(_VLLM_DECIDES))
        if decided:
            raise ConfigError(f"model_loader_extra_config: {decided} for load_format={LOAD_FORMAT!r} are set by "
                              + ", ".join(_VLLM_DECIDES[k] for k in decided))
        own = {f.name for f in dataclasses.fields(LoadOptions)} - {"read"} - set(_VLLM_DECIDES)
        unknown = sorted(set(extra) - own - set(_READ_KEYS) - {"read", "report_dir", "weights"})
        if unknown:
            raise ConfigError(
                f"model_loader_extra_config: unknown key(s) {unknown} for load_format={LOAD_FORMAT!r}; "
                f"use {sorted(own | {'read', 'report_dir', 'weights'})} or ReadOptions fields {list(_READ_KEYS)}"
            )
        read = extra.get("read") or {}
        if not isinstance(read, Mapping):
            raise ConfigError(f"model_loader_extra_config['read'] must be a dict of ReadOptions fields, got {read!r}")
        read = {**read, **{k: extra[k] for k in _READ_KEYS if k in extra}}
        bad = sorted(set(read) - set(_READ_KEYS))
        if bad:
            raise ConfigError(f"model_loader_extra_config['read']: unknown ReadOptions field(s) {bad}; use {list(_READ_KEYS)}")
        options = LoadOptions().replace(read=ReadOptions(**read), **{k: extra[k] for k in own - {"expert_placement"} if k in extra})
        weights = extra.get("weights")
        if weights is not None and not isinstance(weights, str):
            raise ConfigError(f"model_loader_extra_config['weights'] must be a directory or a URI (s3://bucket/prefix), got {weights!r}")
        return cls(options, extra.get("expert_placement"), extra.get("report_dir"), weights)


@dataclass(frozen=True)
class MoePlacement:
    """How vLLM placed one fused-MoE layer's experts on this rank: the strategy, the number of
    (physical) experts, and the global expert of each local slot."""

    placement: str
    num_experts: int
    local: tuple[int, ...]


def check_supported(online_quantization: str | None) -> None:
    """Refuse what this load format does not plan, before any byte is read (every parallel
    layout vLLM builds is planned: tensor, pipeline, data and expert parallel)."""
    if online_quantization:
        raise ConfigError(
            f"quantization={online_quantization!r} of an unquantized checkpoint happens inside vLLM's own loader; "
            f"load it with vLLM's default load format, or load a checkpoint that is already quantized"
        )


def match_model(
    plan: Plan, params: Mapping[str, torch.Tensor], experts: Mapping[str, MoePlacement] = {}
) -> dict[str, torch.Tensor]:
    """The live model parameters the plan fills, by name; raises a :class:`PlanError` listing
    every parameter the plan leaves unfilled, every planned tensor the model lacks, every shape or
    dtype that differs, and every MoE layer whose expert placement differs from the plan's. A
    name only vLLM has is fine when it is the very same tensor as a planned one (an alias).

    ``params`` is ``model.named_parameters(remove_duplicate=False)``; ``experts`` maps each
    fused-MoE layer's prefix to the placement vLLM gave it."""
    planned = {p.spec.name: p.spec for p in plan.params}
    canonical = {**{n: n for n in planned}, **dict(plan.aliases)}
    problems: list[str] = []
    for name, target in sorted(canonical.items()):
        spec = planned[target]
        param = params.get(name)
        if param is None:
            problems.append(f"{name}: planned {spec.dtype} {list(spec.local_shape)}, but vLLM's model has no such parameter")
            continue
        shape, dtype = tuple(param.shape), str(param.dtype).removeprefix("torch.")
        if shape != tuple(spec.local_shape) or dtype != spec.dtype:
            problems.append(f"{name}: vLLM's model has {dtype} {list(shape)}, the plan gives {spec.dtype} {list(spec.local_shape)}")
    filled = {_key(params[n]) for n in canonical if n in params}
    for name in sorted(set(params) - set(canonical)):
        param = params[name]
        if _key(param) in filled:  # another name of a planned tensor (FusedMoE keeps its router as experts.gate)
            continue
        problems.append(f"{name}: vLLM's model has {str(param.dtype).removeprefix('torch.')} {list(param.shape)}, the plan fills nothing")
    parallel = plan.parallel
    for prefix, moe in sorted(experts.items()):
        if moe.placement != parallel.expert_placement:
            problems.append(f"{prefix}: vLLM placed experts {moe.placement!r}, the plan {parallel.expert_placement!r}")
        elif not parallel.num_redundant_experts:
            mine = parallel.expert_slots(moe.num_experts)
            if tuple(moe.local) != mine:
                problems.append(f"{prefix}: vLLM put experts {list(moe.local)} on this rank, the plan {list(mine)}")
    if problems:
        raise PlanError([*problems, f"the model was built by vLLM from {plan.model_dir}; the plan is functional_load's for the same rank"])
    return {name: params[name] for name in planned}


def _key(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...], str, str]:
    """Where a tensor's elements are: two names with the same key are one tensor."""
    return (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype), str(tensor.device))


def live_tensors(model: nn.Module, plan: Plan) -> dict[str, torch.Tensor]:
    """What the plan fills in vLLM's model, by name: its parameters (``remove_duplicate=False``:
    aliases too), and the buffers the plan names (a persistent buffer vLLM's loader fills from the
    checkpoint: Gemma 4's ``layer_scalar``, xIELU's ``beta`` and ``eps``)."""
    params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    planned = {p.spec.name for p in plan.params}
    params.update({n: b for n, b in model.named_buffers(remove_duplicate=False) if n in planned and n not in params})
    return params


def fill_model(
    plan: Plan, params: Mapping[str, torch.Tensor], options: LoadOptions, experts: Mapping[str, MoePlacement] = {}
) -> LoadStats:
    """Read the plan's bytes into the live parameters ``params`` (checked by :func:`match_model`):
    CPU parameters are filled in place, others from a CPU copy, one parameter at a time."""
    import torch

    targets = match_model(plan, params, experts)
    into = {n: p.data for n, p in targets.items() if p.device.type == "cpu" and p.data.is_contiguous()}
    state, stats = execute(plan, options.read, progress=options.progress, into=into)
    with torch.no_grad():
        for name, param in targets.items():
            if name not in into:
                param.data.copy_(state[name])
        for alias, target in plan.aliases.items():  # a tied name that vLLM keeps as its own tensor
            if params[alias].data_ptr() != params[target].data_ptr():
                params[alias].data.copy_(params[target].data)
    return stats


def write_report(report_dir: str | None, plan: Plan, stats: LoadStats, seconds: float) -> None:
    """``rank<r>.json`` in ``report_dir``: what this worker planned and read (``tensor_bytes``:
    the whole sizes of the checkpoint tensors it reads slices of)."""
    if not report_dir:
        return
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    par = plan.parallel
    report = {
        "rank": par.rank, "tp_size": par.tp_size, "expert_parallel": par.expert_parallel, "pp_rank": par.pp_rank,
        "pp_size": par.pp_size, "dp_rank": par.dp_rank, "dp_size": par.dp_size,
        "bytes_to_read": plan.bytes_to_read, "bytes_read": stats.bytes_read, "bytes_out": stats.bytes_out,
        "tensor_bytes": sum(info.nbytes for info in plan.tensors.values()), "seconds": seconds, "pid": os.getpid(),
    }
    (out / f"rank{par.flat_rank}.json").write_text(json.dumps(report, indent=1))
