"""functional_load's ``load_jax`` into a real JAX stack's own model, inside the stack's environment.

For each case: the stack builds its abstract parameter tree (its own code), ``load_jax(ckpt,
target=tree, mapping=<shipped map>)`` fills it, counting the bytes read; the stack's own loader
fills the same tree; every leaf must equal the own loader's bit for bit (where the own loader
works), and the stack's own forward over our arrays must give transformers' float32 logits
within ``TOLERANCE``. Prints one JSON line per case; exits non-zero when any case fails.

    .venv-tpu-inference/bin/python -m functional_load.testing.jaxstacks.check tpu-inference [--workdir DIR]
    .venv-maxtext/bin/python -m functional_load.testing.jaxstacks.check maxtext [--workdir DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...api_jax import load_jax
from ...io import Reader, ReadOptions
from .common import flatten, setup_cpu_devices
from .smoke import WORKERS, checkpoint

TOLERANCE = 1e-5  # transformers' float32 logits (they reach |6|: about 1e-6 relative)
MAPS = {("tpu-inference", "llama"): "tpu-inference.llama3", ("tpu-inference", "qwen3"): "tpu-inference.qwen3",
        ("maxtext", "llama"): "maxtext.llama3.1", ("maxtext", "qwen3"): "maxtext.qwen3"}


@dataclass(frozen=True)
class Case:
    arch: str
    mesh: dict[str, int]
    head_dim: int = 16
    options: dict[str, Any] = field(default_factory=dict)
    own: bool = True  # the stack's own loader can load it (compared bit for bit)
    reference: bool = True  # transformers' float32 logits apply (not to a bfloat16 model)

    @property
    def name(self) -> str:
        mesh = "x".join(f"{k}{v}" for k, v in self.mesh.items())
        extra = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.arch}/hd{self.head_dim}/{mesh}" + (f"/{extra}" if extra else "")


CASES: dict[str, list[Case]] = {
    "tpu-inference": [
        Case("llama", {"data": 2, "model": 4}),  # KV heads repeated to the model axis, head_dim padded to 128
        Case("llama", {"data": 4, "model": 2}),
        Case("llama", {"data": 2, "model": 4}, options={"dtype": "bfloat16"}, reference=False),  # cast from float32
        Case("qwen3", {"data": 4, "model": 2}, head_dim=128),
        Case("qwen3", {"data": 2, "model": 4}, head_dim=64, own=False),  # its own loader repeats no KV head
    ],
    "maxtext": [
        Case("llama", {"fsdp": 4, "tensor": 2}, options={"scan_layers": True}),
        Case("llama", {"fsdp": 4, "tensor": 2}, options={"scan_layers": False}),
        Case("qwen3", {"fsdp": 4, "tensor": 2}, options={"scan_layers": True}),
        Case("qwen3", {"fsdp": 4, "tensor": 2}, options={"scan_layers": False}),
    ],
}


def shard_bytes(tree: Any) -> int:
    """Bytes of the distinct shards of this process (a box held by several devices once)."""
    total = 0
    for array in flatten(tree).values():
        seen = set()
        for shard in array.addressable_shards:
            key = tuple((s.start, s.stop) for s in shard.index)
            if key not in seen:
                seen.add(key)
                total += shard.data.nbytes
    return total


def differences(ours: Any, theirs: Any) -> list[str]:
    """Leaves whose shape, dtype, sharding or bytes differ."""
    import numpy as np

    a, b = flatten(ours), flatten(theirs)
    problems = [f"only ours: {k}" for k in a.keys() - b.keys()] + [f"only theirs: {k}" for k in b.keys() - a.keys()]
    for name in sorted(a.keys() & b.keys()):
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            problems.append(f"{name}: ours {x.shape} {x.dtype}, theirs {y.shape} {y.dtype}")
        elif not x.sharding.is_equivalent_to(y.sharding, x.ndim):
            problems.append(f"{name}: ours {x.sharding.spec}, theirs {y.sharding}")
        elif not np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)):
            gap = float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
            problems.append(f"{name}: values differ (max |diff| {gap})")
    return problems


def run_case(stack: str, worker: Any, case: Case, workdir: Path) -> dict[str, Any]:
    import numpy as np

    directory = checkpoint(case.arch, case.head_dim, workdir)
    options = {**getattr(worker, "SMOKE_OPTIONS", {}).get(case.arch, {}), **case.options}
    target, _, handle = worker.abstract_target(str(directory), case.mesh, **options)
    start = time.perf_counter()
    with Reader(ReadOptions()) as reader:
        ours = load_jax(directory, target=target, mapping=MAPS[(stack, case.arch)], reader=reader)
        read = reader.bytes_read
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {"case": f"{stack} {case.name}", "bytes_read": read, "shard_bytes": shard_bytes(ours),
                              "seconds": round(seconds, 3), "leaves": len(flatten(ours))}
    if case.own:
        result["own_differences"] = differences(ours, worker.own_load(str(directory), case.mesh, **options))
    tokens = json.loads((directory / "tiny.json").read_text())["tokens"]
    logits = worker.forward(ours, handle, tokens)
    result["max_logit_diff"] = float(np.max(np.abs(logits - np.load(directory / "logits.npy"))))
    close = result["max_logit_diff"] <= TOLERANCE or not case.reference
    result["ok"] = close and not result.get("own_differences") and (case.own or case.reference)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m functional_load.testing.jaxstacks.check")
    parser.add_argument("stack", choices=sorted(CASES))
    parser.add_argument("--workdir", help="where the tiny checkpoints go (default: a temporary directory)")
    parser.add_argument("--only", help="run the cases whose name contains this")
    args = parser.parse_args(argv)
    setup_cpu_devices()
    worker = importlib.import_module(f"functional_load.testing.jaxstacks.{WORKERS[args.stack]}")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        for case in CASES[args.stack]:
            if args.only and args.only not in case.name:
                continue
            try:
                result = run_case(args.stack, worker, case, workdir)
            except Exception as error:  # reported as a failed case
                result = {"case": f"{args.stack} {case.name}", "ok": False, "error": f"{type(error).__name__}: {error}",
                          "traceback": traceback.format_exc()[-4000:]}
            failed += not result["ok"]
            print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
