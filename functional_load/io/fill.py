"""A rank's parameters: the arena they live in, what is filled before any copy, and the checks.

Every parameter of a rank lives in one 64-byte-aligned arena (so DLPack hands them to JAX
without copies). Defaults, vocabulary padding and dummy values are filled first; the copies are
:mod:`.copies`'; scales are checked as they are read, and parts of a fused layer that must be
identical are compared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..dtypes import to_torch, torch_itemsize, torch_name
from ..errors import CheckpointError
from ..layout.param import ParamSpec
from ..layout.segments import box_volume, full_box
from ..plan.plan import ParamPlan, Plan
from .copies import as_bytes, copy_into, fresh_memory, index
from .dummy import initialize_dummy
from .reader import Reader

if TYPE_CHECKING:
    import torch

ALIGN = 64


def allocate(specs: list[ParamSpec]) -> dict[str, torch.Tensor]:
    """One arena for all ``specs``: each tensor starts on a 64-byte boundary. The arena is
    private anonymous memory advised against transparent huge pages. Measured here with
    ``fl.load`` of a 2.1 GB checkpoint (fresh processes, medians of 3, quiet machine): hot tp 1
    1.17 s so, 1.55 s in ``mmap``'s default shared mapping (shared memory) and 1.89 s with huge
    pages (faulting 2 MiB pages from several reading threads); cold tp 1 2.94 s vs 2.98 s and
    3.65 s. Its pages are faulted in by the reads themselves, on several threads at once
    (measured faster here than pre-faulting it first with ``MADV_POPULATE_WRITE``, which runs
    serially)."""
    import torch

    offsets, total = {}, 0
    for spec in specs:
        offsets[spec.name] = total
        nbytes = box_volume(full_box(spec.local_shape)) * torch_itemsize(spec.dtype)
        total += -(-max(nbytes, 1) // ALIGN) * ALIGN
    if total == 0:
        return {}
    memory = torch.frombuffer(fresh_memory(total), dtype=torch.uint8)
    out = {}
    for spec in specs:
        start = offsets[spec.name]
        nbytes = box_volume(full_box(spec.local_shape)) * torch_itemsize(spec.dtype)
        out[spec.name] = memory[start : start + nbytes].view(to_torch(spec.dtype)).view(spec.local_shape)
    return out


def prepare(param: ParamPlan, tensor: torch.Tensor) -> None:
    """Defaults, zero boxes (vocabulary padding) and dummy values, before any copy."""
    if param.dummy is not None:
        initialize_dummy(tensor, param.dummy)
    if param.fill is not None:
        tensor.fill_(param.fill)
    for box in param.zeros:
        tensor[index(box)].zero_()


def verify_shared(plan: Plan, param: ParamPlan, tensor: torch.Tensor, reader: Reader) -> None:
    """Parts of a fused layer that must be identical (act-order ``g_idx``) are compared."""
    import torch

    for check in param.checks:
        info = plan.tensors[check.tensor]
        tmp = torch.empty(tuple(b - a for a, b in check.src), dtype=to_torch(torch_name(info.dtype)))
        reader.read_into(info, check.src, as_bytes(tmp))
        if not torch.equal(tmp.to(tensor.dtype).reshape(-1), tensor[index(check.dst)].reshape(-1)):
            first = next((c.tensor for c in param.copies if c.dst == check.dst), "?")
            raise CheckpointError(
                f"{param.spec.name}: checkpoint tensors {first!r} and {check.tensor!r} (in {info.file.name}) must be "
                f"identical for the fused parameter (vLLM keeps one value for both), but differ; re-export the checkpoint"
            )


def check_scale(plan: Plan, param: ParamPlan, tensor: torch.Tensor) -> None:
    """A NaN, infinite, zero or negative scale would silently corrupt every dequantized weight: a
    parameter's ``check`` (data its format put on it) says what its values must be: ``"positive"``
    (finite and > 0), ``"finite"`` (integer group scales: some producers store negative ones on
    purpose) or ``"e8m0"`` (exponent bytes, 0xFF is NaN)."""
    import torch

    check = param.spec.check
    values = tensor.view(torch.uint8).float() if tensor.dtype == torch.float8_e8m0fnu and check == "e8m0" else tensor.float()
    if check == "e8m0":
        bad = values == 255
    elif check == "finite":
        bad = ~torch.isfinite(values)
    else:
        bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        sources = sorted({c.tensor for c in param.copies}) or ["(default)"]
        first = values[bad].flatten()[0].item()
        what = {"e8m0": "valid e8m0 exponents (not 0xFF)", "finite": "finite"}.get(str(check), "finite and positive")
        raise CheckpointError(
            f"{param.spec.name}: {int(bad.sum())} of {values.numel()} scale values are not {what} "
            f"(e.g. {first}); from checkpoint tensor(s) {sources} in "
            f"{sorted({plan.tensors[t].file.name for t in sources if t in plan.tensors})}. The checkpoint is corrupt "
            f"or was exported wrongly; re-export it"
        )


def load_param(plan: Plan, param: ParamPlan, reader: Reader, dtype: str | None = None) -> torch.Tensor:
    """One parameter of the plan's rank as a fresh CPU torch tensor (``dtype``: override the
    parameter's own, for online quantization); scales are checked."""
    import torch

    if param.spec.derived:
        raise ValueError(f"{param.spec.name} is computed with its weight by online quantization, not loaded alone")
    tensor = torch.empty(param.spec.local_shape, dtype=to_torch(dtype or param.spec.dtype))
    prepare(param, tensor)
    for copy in param.copies:
        copy_into(plan.tensors, tensor, copy, reader)
    verify_shared(plan, param, tensor, reader)
    if is_scale(param):
        check_scale(plan, param, tensor)
    return tensor


def is_scale(param: ParamPlan) -> bool:
    """A checked parameter (a scale) read from the checkpoint (a default, like vLLM's -1.0 "absent"
    KV scale, is not data)."""
    return param.spec.check is not None and bool(param.copies)
