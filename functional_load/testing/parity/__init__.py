"""Parity with the real vLLM loader: real vLLM is the test oracle of every rank state.

``python -m functional_load.testing.parity`` builds the vLLM environment on first use
(:mod:`.env`), builds tiny checkpoints (:mod:`.cases`), has real vLLM load every rank of every
case (:mod:`.vllm_worker`, inside the vLLM environment), loads the same ranks with
:func:`functional_load.load` and compares them bit for bit (:mod:`.run`). docs/parity.md explains it.
"""
