"""Recorded oracle answers: keys, digests and the files that hold them.

An oracle (real vLLM, a JAX stack's own loader and forward) answers a question that depends only
on its inputs: the checkpoint's bytes, the options, the oracle's release and the oracle-side
code that asks. Those inputs hash to a *key*; the answer is stored under it, as plain JSON in
``tests/oracle/`` (digests, never tensors). The default test run replays the stored answers
against functional_load's side, computed in full; an answer whose key no longer matches is
*stale* and fails the run with the command that recomputes it with the real oracle. Nothing here
ever writes an answer from functional_load's output: the writers take what an oracle run produced.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..output.save import file_sha256

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "tests" / "oracle"
FORMAT = 1  # bump when what an answer holds changes: every key goes stale


class StaleRecordError(AssertionError):
    """Recorded answers are missing or stale; the message names them and the refresh command."""


def stale_error(kind: str, ids: Sequence[str], command: str) -> StaleRecordError:
    shown = "\n  ".join(ids[:15]) + (f"\n  ... and {len(ids) - 15} more" if len(ids) > 15 else "")
    return StaleRecordError(
        f"{len(ids)} recorded {kind} answers are missing or stale (their inputs changed):\n  {shown}\n"
        f"recompute them with the real oracle: {command}"
    )


def digest_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def file_digest(path: Path) -> str:
    return file_sha256(Path(path))


_TREES: dict[tuple[str, int, int, int], str] = {}


def tree_digest(directory: Path) -> str:
    """Every file under ``directory``: its relative path and content (memoised per path and mtime)."""
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    stats = [p.stat() for p in files]
    stamp = (str(directory.resolve()), max((s.st_mtime_ns for s in stats), default=0), sum(s.st_size for s in stats), len(files))
    if stamp not in _TREES:
        _TREES[stamp] = key_of({str(p.relative_to(directory)): file_digest(p) for p in files})
    return _TREES[stamp]


def code_digest(paths: Iterable[Path]) -> str:
    return key_of({Path(p).name: file_digest(Path(p)) for p in paths})


def key_of(value: Any) -> str:
    """The SHA-256 of a value's canonical JSON."""
    return digest_bytes(json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode())


def tensor_digest(tensor: Any) -> list[Any]:
    """``[dtype, shape, sha256 of the bytes]`` of a torch tensor (dtype as torch prints it)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return [str(tensor.dtype), list(tensor.shape), digest_bytes(flat.numpy().tobytes())]


def array_digest(array: Any) -> list[Any]:
    """``[dtype, shape, sha256 of the bytes]`` of a numpy (or addressable jax) array."""
    import numpy as np

    host = np.ascontiguousarray(np.asarray(array))
    return [str(host.dtype), list(host.shape), digest_bytes(host.view(np.uint8).tobytes())]


# ---- files --------------------------------------------------------------------------------------------


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def write(path: Path, value: Mapping[str, Any]) -> None:
    """Write JSON a reviewer can read: objects one key a line, lists of scalars (and tensor
    digests) on one line; atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(_dump(value, 0) + "\n")
    os.replace(tmp, path)


def _dump(value: Any, depth: int) -> str:
    if isinstance(value, Mapping) and value and depth < 7:
        pad = " " * (depth + 1)
        items = [f"{pad}{json.dumps(str(k))}: {_dump(v, depth + 1)}" for k, v in sorted(value.items())]
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    return json.dumps(value, sort_keys=True, separators=(",", ":") if isinstance(value, list) else (", ", ": "))


def sample(names: Sequence[str], fraction: float, seed: str) -> list[str]:
    """At least ``fraction`` of ``names`` (and at least one), chosen by hashing each with ``seed``
    (a commit hash): the same commit checks the same sample, the next commit another."""
    if not names:
        return []
    count = max(1, math.ceil(len(names) * fraction))
    return sorted(sorted(names, key=lambda n: digest_bytes(f"{seed}:{n}".encode()))[:count])
