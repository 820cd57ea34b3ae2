"""Integrations with serving stacks: :mod:`.vllm` (the ``functional_load`` load format)."""
