"""Parity with the real vLLM loader: real vLLM is the test oracle of every rank state.

The runner (:mod:`.run`), the oracle, live or recorded (:mod:`.record`), vLLM's environment
(:mod:`.env`) and the worker that runs inside it (:mod:`.vllm_worker`), for ``check-spec`` and for
the repository's parity harness (``python -m harness.parity``: the cases of every architecture,
against the record in ``tests/oracle/vllm/``). docs/parity.md explains it.
"""
