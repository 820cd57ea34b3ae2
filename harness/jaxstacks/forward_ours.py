"""The stack's own forward over functional_load's arrays, for every case (inside the stack's environment).

The record keeps the stack's forward over its own loader's arrays and the digests of those arrays;
the test suite proves ours bit-identical to them, so the forward over ours follows. This runs it
anyway, as a direct check of a change to the JAX path: for each case, ``load_jax`` fills the
stack's own abstract tree, the stack's own forward runs over it, and the logits must be
transformers' float32 ones within the tolerance (and, where the own loader works, bit-identical
to the own forward's). One JSON line per case; exit 1 when any fails.

    .venv-maxtext/bin/python -m harness.jaxstacks.forward_ours maxtext --workdir DIR
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import numpy as np

from functional_load.api_jax import load_jax

from .cases import CASES, MAPS, TOLERANCE, WORKERS, case_id
from .common import setup_cpu_devices
from .tiny import reference_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.jaxstacks.forward_ours")
    parser.add_argument("stack", choices=sorted(CASES))
    parser.add_argument("--workdir", required=True, help="the tiny checkpoints (<arch>-hd<head_dim>), written by the repository's .venv")
    args = parser.parse_args(argv)
    setup_cpu_devices()
    worker = importlib.import_module(f"harness.jaxstacks.{WORKERS[args.stack]}")
    failed = 0
    for case in CASES[args.stack]:
        directory = Path(args.workdir) / case.checkpoint
        target, _, handle = worker.abstract_target(str(directory), case.mesh, **case.options)
        ours = load_jax(directory, target=target, mapping=MAPS[(args.stack, case.arch)])
        tokens = json.loads((directory / "tiny.json").read_text())["tokens"]
        logits = np.asarray(worker.forward(ours, handle, tokens), dtype=np.float32)
        diff = float(np.max(np.abs(logits - np.load(reference_path(directory)))))
        row = {"case": case_id(args.stack, case), "max_logit_diff": diff}
        if case.own:
            own = np.asarray(worker.forward(worker.own_load(str(directory), case.mesh, **case.options), handle, tokens), dtype=np.float32)
            row["same_as_own_forward"] = own.tobytes() == logits.tobytes()
        row["ok"] = (diff <= TOLERANCE or not case.reference) and row.get("same_as_own_forward", True)
        failed += not row["ok"]
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
