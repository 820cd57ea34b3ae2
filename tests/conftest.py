"""Shared fixtures: tiny real checkpoints written by transformers, built once per session, and a
real S3 server (SeaweedFS), started once per session by the first test that asks for it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from functional_load.testing.checkpoints import write_checkpoint
from functional_load.testing.seaweed import SeaweedServer, start_seaweed


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


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A SeaweedFS server on 127.0.0.1 (ports chosen free), signed requests only; stopped at the end."""
    server = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    try:
        yield server
    finally:
        server.stop()
