"""The vLLM release whose parameter names and rank layouts functional_load produces.

This is the one place the target is written down. The parity harness
(``python -m harness.parity``) installs exactly this release and checks every
rank state against it; the specs' names (for example MoE experts under
``<moe>.experts.routed_experts.``, new in vLLM 0.32) follow it.
"""

VLLM_VERSION = "0.32.0"
