"""Small helpers shared by the tests: bit-exact comparison, KV-head unreplication, segment widths
from a config, and a hook on every way Python opens a file."""

from __future__ import annotations

import builtins
import io
import os
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what}: values differ"


def assert_same_state(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], what: str = "") -> None:
    """The same names, and every tensor the same dtype, shape and bytes."""
    assert set(got) == set(want), f"{what}: names differ: {sorted(set(got) ^ set(want))[:5]}"
    for name, tensor in want.items():
        assert_same_bits(got[name], tensor, f"{what} {name}".strip())


def unreplicate(blocks: list[torch.Tensor], kv_heads: int, tp: int, what: str) -> torch.Tensor:
    """KV blocks of all ranks -> the checkpoint's KV rows. With tp > kv_heads, ranks
    r*replicas ... (r+1)*replicas-1 hold the same head and must agree."""
    if tp <= kv_heads:
        return torch.cat(blocks)
    replicas = tp // kv_heads
    for r in range(tp):
        assert_same_bits(blocks[r], blocks[r - r % replicas], f"{what} rank {r} vs its replica group")
    return torch.cat(blocks[::replicas])


def segment_rows(config: dict, module: str, tp: int) -> tuple[int, ...]:
    """Rank-local output rows of each logical segment of a Llama-family linear, from the config alone."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if module.endswith("qkv_proj"):
        q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
        return (q // tp, kv // tp, kv // tp)
    if module.endswith("gate_up_proj"):
        return (config["intermediate_size"] // tp,) * 2
    return (config["hidden_size"],)  # o_proj / down_proj are row-parallel: every output row


def hook_opens(monkeypatch: pytest.MonkeyPatch, note: Callable[[Any], None], *, skip_dir_fd: bool = False) -> None:
    """Call ``note(path)`` before every ``os.open``, ``builtins.open`` and ``io.open`` (any thread).
    ``skip_dir_fd``: ignore ``os.open`` calls relative to a directory descriptor."""
    real_os_open, real_open, real_io_open = os.open, builtins.open, io.open

    def os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        if not (skip_dir_fd and kwargs.get("dir_fd") is not None):
            note(path)
        return real_os_open(path, *args, **kwargs)

    def b_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        note(file)
        return real_open(file, *args, **kwargs)

    def i_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        note(file)
        return real_io_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", b_open)
    monkeypatch.setattr(io, "open", i_open)
