"""Parity with the real vLLM loader: real vLLM is the test oracle of every rank state.

``python -m functional_load.testing.parity`` builds tiny checkpoints (:mod:`.cases`), takes real
vLLM's answer for every rank of every case from the record (:mod:`.record`; ``--refresh`` has real
vLLM, :mod:`.vllm_worker` inside the environment :mod:`.env` builds, recompute the stale ones),
loads the same ranks with :func:`functional_load.load` and compares them bit for bit
(:mod:`.run`). docs/parity.md explains it.
"""
