"""The plan of a dummy load (``load_format="dummy"``): every parameter of the layout, no copies.

No checkpoint is involved: the plan reads 0 bytes, and each parameter carries the
:class:`~.plan.Dummy` marker that :func:`functional_load.io.execute` turns into vLLM's dummy values.
"""

from __future__ import annotations

from ..layout.build import Layout
from .plan import Dummy, ParamPlan, Plan

VLLM_DUMMY = Dummy()  # vLLM 0.32's initialize_single_dummy_weight defaults: low -1e-3, high 1e-3, seed 1234


def dummy_plan(layout: Layout, model_dir: str = "", dummy: Dummy = VLLM_DUMMY) -> Plan:
    """Every parameter of ``layout`` with vLLM's dummy values; tied aliases stay the same tensor.
    Online-quantization scales (``derived``) are computed from their dummy weight, as vLLM does."""
    return Plan(
        model_dir=model_dir,
        arch=layout.arch,
        parallel=layout.parallel,
        dtype=layout.dtype,
        params=tuple(ParamPlan(spec, (), dummy=dummy) for spec in layout.params.values()),
        tensors={},
        aliases=layout.aliases,
        schemes=layout.schemes,
    )
