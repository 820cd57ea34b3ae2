"""The parity cases (every architecture, tp size and option set) and the parity command line.

The runner, the record and the vLLM environment are :mod:`functional_load.testing.parity` (check-spec uses them).
"""
