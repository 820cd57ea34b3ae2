"""Shared fixtures: tiny real checkpoints written by transformers, built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from functional_load.testing.checkpoints import write_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_checkpoint(arch, **options)``: the directory of a cached transformers checkpoint."""
    cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}

    def make(arch: str, **options: Any) -> Path:
        key = (arch, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = write_checkpoint(arch, tmp_path_factory.mktemp(arch), **options)
        return cache[key]

    return make
