"""functional_load as a vLLM load format: ``LLM(model=M, load_format="functional_load")``.

``pip install functional_load`` registers
:func:`functional_load.integrations.vllm_loader.register` under vLLM's ``vllm.general_plugins``
entry point; vLLM calls it in every process (the API server, the engine and each worker) and it
adds :class:`~functional_load.integrations.vllm_loader.FunctionalLoadLoader` to vLLM's
model-loader registry. Each worker then plans its own rank from vLLM's parallel state, checks the
plan against the live model's parameters (every parameter filled, every planned tensor used, the
same shapes, dtypes and expert placement), reads only its own bytes straight into the model's
parameters, and leaves ``process_weights_after_loading`` to vLLM.

The options and the matching live in :mod:`.vllm_model` (no vLLM import: tested without it);
:mod:`.vllm_loader` holds the vLLM class and the entry point; it imports vLLM, so only vLLM's
processes import it.
"""

from __future__ import annotations

from .vllm_model import LOAD_FORMAT as LOAD_FORMAT
from .vllm_model import ExtraConfig as ExtraConfig
from .vllm_model import MoePlacement as MoePlacement
from .vllm_model import check_supported as check_supported
from .vllm_model import fill_model as fill_model
from .vllm_model import live_tensors as live_tensors
from .vllm_model import match_model as match_model
