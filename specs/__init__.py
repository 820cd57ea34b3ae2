"""Architecture specs (TOML data), importable as ``functional_load.specs`` for package-data lookup."""
