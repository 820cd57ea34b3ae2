"""Target maps (TOML data) of JAX stacks, importable as ``functional_load.targets`` for package-data lookup."""
