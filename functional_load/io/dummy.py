"""vLLM's dummy values (``load_format="dummy"``): its ``initialize_single_dummy_weight``, exactly.

vLLM 0.32 (``DummyModelLoader``) visits every parameter of every layer and, for a floating one,
seeds a new generator on the parameter's device with the same seed (1234) and fills the
rank-local parameter with ``uniform_(-1e-3, 1e-3)``; formats under 16 bits (FP8) are drawn in
float16 and cast. A parameter's values therefore depend only on its rank-local shape and dtype,
never on which other ranks run. Integer parameters (packed int4, zero points, ``g_idx``...) vLLM
leaves as created (``torch.empty``, undefined bytes) except on ROCm, where it zeroes them for
reproducibility; here they are zero, as on ROCm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..plan.plan import Dummy

if TYPE_CHECKING:
    import torch


def initialize_dummy(tensor: torch.Tensor, dummy: Dummy) -> None:
    """Fill ``tensor`` (a torch tensor, in place) with vLLM's dummy values for a parameter of its
    shape and dtype. The generator is on the tensor's device, as vLLM's is on the parameter's:
    CPU tensors (every load here) get vLLM's CPU values bit for bit."""
    import torch

    if not torch.is_floating_point(tensor):
        tensor.zero_()  # vLLM on ROCm; elsewhere vLLM leaves torch.empty's bytes
        return
    generator = torch.Generator(device=tensor.device)
    generator.manual_seed(dummy.seed)
    if torch.finfo(tensor.dtype).bits < 16:  # uniform_ has no FP8 kernel: draw in float16, cast
        tmp = torch.empty_like(tensor, dtype=torch.float16)
        tmp.uniform_(dummy.low, dummy.high, generator=generator)
        tensor.copy_(tmp)
    else:
        tensor.uniform_(dummy.low, dummy.high, generator=generator)
