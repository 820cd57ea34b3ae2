"""1. What the model is: ``config.json`` and the dtype rule, architecture specs (TOML) with their
expression language and name-mapping tables, and the quantization config."""
