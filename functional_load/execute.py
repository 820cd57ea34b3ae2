"""Run a plan: allocate each rank-local parameter once and fill it in place from the checkpoint.

This is the only stage that reads tensor data. Copies whose destination is a contiguous slot
of the same dtype are read straight into the parameter's memory; a cast or a transpose goes
through one box-sized temporary.
"""

from __future__ import annotations

from typing import Any

from .checkpoint.read import PreadReader
from .dtypes import to_torch, torch_name
from .errors import CheckpointError
from .plan import ParamPlan, Plan
from .sharding import Box
from .online import quantize_online

# Parameters that hold quantization scales: every element must be finite and positive.
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale", ".scales", ".k_scale", ".v_scale")


class LoadedState(dict):  # type: ignore[type-arg]
    """The ``{name: tensor}`` a load returns, carrying the ``plan`` that made it and the output
    ``target`` layout (for :func:`functional_load.dequantize` and inspection); otherwise a dict."""

    plan: Plan
    target: str

    def __init__(self, tensors: dict[str, Any], plan: Plan, target: str = "checkpoint"):
        super().__init__(tensors)
        self.plan = plan
        self.target = target


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _bytes(tensor: Any) -> memoryview:
    """The memory of a contiguous CPU tensor as a writable byte buffer."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _materialise(plan: Plan, param: ParamPlan, reader: PreadReader, bar: Any, dtype: str | None = None) -> Any:
    """Allocate one parameter (in ``dtype``, default its own) and fill it: defaults, zero
    padding, then each planned copy."""
    import torch

    tensor = torch.empty(param.spec.local_shape, dtype=to_torch(dtype or param.spec.dtype))
    if param.fill is not None:
        tensor.fill_(param.fill)
    for box in param.zeros:
        tensor[_index(box)].zero_()
    for copy in param.copies:
        info = plan.tensors[copy.tensor]
        dst = tensor[_index(copy.dst)]
        source_dtype = to_torch(torch_name(info.dtype))
        if not copy.transpose and source_dtype == tensor.dtype and dst.is_contiguous():
            reader.read_into(info, copy.src, _bytes(dst))
        else:
            tmp = torch.empty(tuple(b - a for a, b in copy.src), dtype=source_dtype)
            reader.read_into(info, copy.src, _bytes(tmp))
            dst.copy_((tmp.T if copy.transpose else tmp).reshape(dst.shape))
        if bar is not None:
            bar.update(plan.copy_bytes(copy))
    for check in param.checks:
        info = plan.tensors[check.tensor]
        tmp = torch.empty(tuple(b - a for a, b in check.src), dtype=to_torch(torch_name(info.dtype)))
        reader.read_into(info, check.src, _bytes(tmp))
        if not torch.equal(tmp.to(tensor.dtype).reshape(-1), tensor[_index(check.dst)].reshape(-1)):
            raise CheckpointError(
                f"{param.spec.name}: checkpoint tensors {param.copies[0].tensor!r} and {check.tensor!r} (in "
                f"{info.file.name}) must be identical for the fused parameter, but differ"
            )
    return tensor


def _check_scale(plan: Plan, param: ParamPlan, tensor: Any) -> None:
    """A NaN, infinite, zero or negative scale would silently corrupt every dequantized weight.
    Integer group scales (GPTQ, AWQ, pack-quantized) only need to be finite: some producers
    (auto-round's symmetric GPTQ) store negative ones on purpose."""
    import torch

    values = tensor.float()
    scheme = plan.schemes.get(param.spec.module)
    signed = scheme is not None and scheme.format in ("pack", "gptq", "awq")
    bad = ~torch.isfinite(values) if signed else ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        sources = sorted({c.tensor for c in param.copies}) or ["(default)"]
        first = values[bad].flatten()[0].item()
        raise CheckpointError(
            f"{param.spec.name}: {int(bad.sum())} of {values.numel()} scale values are not finite"
            f"{'' if signed else ' and positive'} "
            f"(e.g. {first}); from checkpoint tensor(s) {sources} in "
            f"{sorted({plan.tensors[t].file.name for t in sources if t in plan.tensors})}. The checkpoint is corrupt "
            f"or was exported wrongly; re-export it"
        )


def load_param(plan: Plan, param: ParamPlan, reader: PreadReader, bar: Any = None) -> Any:
    """One parameter of the plan's rank as a CPU torch tensor; scales are checked."""
    if param.spec.derived:
        raise ValueError(f"{param.spec.name} is computed with its weight by online quantization, not loaded alone")
    tensor = _materialise(plan, param, reader, bar)
    if param.spec.name.endswith(SCALE_SUFFIXES):
        _check_scale(plan, param, tensor)
    return tensor


def execute(plan: Plan, *, reader: PreadReader | None = None, progress: bool | None = None) -> LoadedState:
    """Materialise ``plan`` as rank-local CPU torch tensors, in the plan's parameter order.

    Tied aliases map to the very same tensor object as their canonical parameter.
    ``progress=None`` shows a bar when the plan reads more than a few files.
    """
    own_reader = reader is None
    reader = reader or PreadReader()
    files = {info.file for info in plan.tensors.values()}
    show = progress if progress is not None else len(files) > 4
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=plan.bytes_to_read, unit="B", unit_scale=True, desc=f"rank {plan.parallel.rank} load")
    loaded: dict[str, Any] = {}
    try:
        # Scales first: they are small, and a bad one should stop the load before the weights.
        for param in sorted(plan.params, key=lambda p: not p.spec.name.endswith(SCALE_SUFFIXES)):
            scheme = plan.schemes.get(param.spec.module)
            if param.spec.derived:
                continue  # made with its weight below
            if scheme is not None and scheme.online and param.spec.name.endswith(".weight"):
                # Online quantization: one rank-local weight in the model dtype at a time.
                dense = _materialise(plan, param, reader, bar, dtype=plan.dtype)
                loaded.update(quantize_online(plan, param.spec.module, scheme, dense))
                del dense
                continue
            loaded[param.spec.name] = load_param(plan, param, reader, bar)
    finally:
        if bar is not None:
            bar.close()
        if own_reader:
            reader.close()
    out = {p.spec.name: loaded[p.spec.name] for p in plan.params}
    for alias, target in plan.aliases.items():
        out[alias] = out[target]
    return LoadedState(out, plan)
