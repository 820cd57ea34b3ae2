"""Smoke run of one JAX stack, inside its environment: tiny float32 checkpoints written by
transformers, the stack's own loader, the stack's forward, and the max |logits - transformers'|
for 8 fixed token ids; also that the own loader's tree matches the abstract target leaf for leaf
(key path, shape, dtype, sharding).

    .venv-tpu-inference/bin/python -m harness.jaxstacks.smoke tpu-inference
    .venv-maxtext/bin/python -m harness.jaxstacks.smoke maxtext

The checkpoints and their transformers logits come from :mod:`.tiny`, run in the repository's
``.venv`` (``FUNCTIONAL_LOAD_TORCH_PYTHON`` to override), so every stack reads the same files.
Exits non-zero when a case fails or a diff exceeds ``--tolerance``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from .cases import WORKERS, Case
from .common import flatten, setup_cpu_devices
from .tiny import reference_path

ROOT = Path(__file__).resolve().parents[2]


CASES: dict[str, list[Case]] = {
    "tpu-inference": [
        Case("llama", {"data": 2, "model": 4}),
        Case("llama", {"data": 4, "model": 2}),
        Case("qwen3", {"data": 4, "model": 2}, head_dim=128),
        Case("qwen3", {"data": 4, "model": 2}, head_dim=64),
    ],
    "maxtext": [
        Case("llama", {"fsdp": 4, "tensor": 2}, options={"scan_layers": True}),
        Case("llama", {"fsdp": 4, "tensor": 2}, options={"scan_layers": False}),
        Case("qwen3", {"fsdp": 4, "tensor": 2}, options={"scan_layers": True}),
        Case("qwen3", {"fsdp": 4, "tensor": 2}, options={"scan_layers": False}),
    ],
}


def torch_python() -> str:
    """The interpreter that writes the tiny checkpoints: ``$FUNCTIONAL_LOAD_TORCH_PYTHON``, the
    repository's ``.venv``, else this one when it has torch and transformers, else ``.venv-ci``."""
    if os.environ.get("FUNCTIONAL_LOAD_TORCH_PYTHON"):
        return os.environ["FUNCTIONAL_LOAD_TORCH_PYTHON"]
    main = ROOT / ".venv" / "bin" / "python"
    if main.exists():
        return str(main)
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        return sys.executable
    if (ROOT / ".venv-ci" / "bin" / "python").exists():
        return str(ROOT / ".venv-ci" / "bin" / "python")
    raise RuntimeError("no Python with torch and transformers to write the tiny checkpoints (set FUNCTIONAL_LOAD_TORCH_PYTHON)")


def checkpoint(arch: str, head_dim: int, workdir: Path) -> Path:
    directory = workdir / f"{arch}-hd{head_dim}"
    if not reference_path(directory).exists():
        args = [torch_python(), "-m", "harness.jaxstacks.tiny", arch, str(directory), "--head-dim", str(head_dim)]
        done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if done.returncode:
            raise RuntimeError(f"`{' '.join(args)}` failed:\n{done.stderr[-3000:]}")
    return directory


def same_layout(target: Any, loaded: Any) -> list[str]:
    """Differences between the abstract target and the own loader's tree (empty when none)."""
    want, got = flatten(target), flatten(loaded)
    problems = [f"missing {k}" for k in want.keys() - got.keys()] + [f"extra {k}" for k in got.keys() - want.keys()]
    for name in sorted(want.keys() & got.keys()):
        a, b = want[name], got[name]
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            problems.append(f"{name}: target {a.shape} {a.dtype}, loaded {b.shape} {b.dtype}")
        elif not a.sharding.is_equivalent_to(b.sharding, len(a.shape)):
            problems.append(f"{name}: target {a.sharding.spec}, loaded {b.sharding}")
    return problems


def run_case(worker: Any, case: Case, workdir: Path) -> float:
    import numpy as np

    directory = checkpoint(case.arch, case.head_dim, workdir)
    options = {**getattr(worker, "SMOKE_OPTIONS", {}).get(case.arch, {}), **case.options}
    target, _, handle = worker.abstract_target(str(directory), case.mesh, **options)
    loaded = worker.own_load(str(directory), case.mesh, **options)
    problems = same_layout(target, loaded)
    if problems:
        raise AssertionError("own load differs from the abstract target:\n  " + "\n  ".join(problems[:20]))
    tiny = np.load(reference_path(directory))
    tokens = json.loads((directory / "tiny.json").read_text())["tokens"]
    logits = worker.forward(loaded, handle, tokens)
    if logits.shape != tiny.shape:
        raise AssertionError(f"logits {logits.shape}, transformers {tiny.shape}")
    return float(np.max(np.abs(logits - tiny)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.jaxstacks.smoke")
    parser.add_argument("stack", choices=sorted(CASES))
    parser.add_argument("--workdir", help="where the tiny checkpoints go (default: a temporary directory)")
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args(argv)
    setup_cpu_devices()
    worker = importlib.import_module(f"harness.jaxstacks.{WORKERS[args.stack]}")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        for case in CASES[args.stack]:
            if args.only and args.only not in case.name:
                continue
            start = time.perf_counter()
            try:
                diff = run_case(worker, case, workdir)
            except Exception as error:  # reported, and counted as a failure
                failed += 1
                print(f"FAIL {args.stack} {case.name}: {type(error).__name__}: {error}", flush=True)
                traceback.print_exc()
                continue
            ok = diff <= args.tolerance
            failed += not ok
            print(
                f"{'ok  ' if ok else 'FAIL'} {args.stack} {case.name}: max |logits - transformers| = {diff:.3g} "
                f"({time.perf_counter() - start:.1f} s)",
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
