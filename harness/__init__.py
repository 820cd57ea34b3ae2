"""The oracle harness: the parity cases and CLI, the JAX stacks, the recorded answers' tools.

Not part of the functional_load package (it is not in the wheel); run from the repository root.
"""
