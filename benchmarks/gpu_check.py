"""The checks and figures that need a CUDA machine, in one run (for a lent GPU).

1. The GPU tests and the FP8 kernel tests on JAX's GPU backend: a load onto CUDA equals the CPU
   load bit for bit, the post-load transforms as jitted JAX kernels on the GPU equal their
   references bit for bit (correctly rounded division, fp16 rounding kept).
2. Load times of a Llama-2-7B-shaped bf16 checkpoint (``make_checkpoint.py``, page cache hot),
   ``ROUNDS`` interleaved rounds, medians and minimums: ``fl.load`` tp 1 and one tp-4 rank onto
   the CPU and onto CUDA, ``load_jax`` onto the GPU, and ``safetensors.torch.load_file(device=
   "cuda")`` as the reference; each CUDA state checked bit for bit against the CPU one.

    python benchmarks/gpu_check.py [--layers 4] [--rounds 5] [--out DIR]

Prints one JSON object (and writes it to ``--out``/gpu_check.json when given).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# the GPU tests, and the kernel tests that run on JAX's default backend (the GPU there)
KERNEL_TESTS = "divide or quantize or requant or fnuz or e8m0 or cuda_equals or jax_gpu"


def _tests() -> dict[str, Any]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "tests/test_transforms.py", "-p", "no:cacheprovider", "-k", KERNEL_TESTS],
        cwd=ROOT, capture_output=True, text=True,
    )
    print(done.stdout[-4000:], done.stderr[-2000:], flush=True)
    return {"rc": done.returncode, "tail": done.stdout.strip().splitlines()[-1:], "seconds": round(time.perf_counter() - start, 1)}


def _timed(fn: Callable[[], Any]) -> float:
    import torch

    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    del out
    return time.perf_counter() - start


def _same(cpu: Any, gpu: Any, device: str) -> bool:
    import torch

    return cpu.keys() == gpu.keys() and all(
        gpu[k].device.type == device and torch.equal(gpu[k].cpu().view(torch.uint8), cpu[k].view(torch.uint8)) for k in cpu
    )


def _bench(ckpt: Path, rounds: int, device: str) -> dict[str, Any]:
    import jax
    import torch
    from safetensors.torch import load_file

    import functional_load as fl

    files = sorted(ckpt.glob("*.safetensors"))
    mesh = jax.sharding.Mesh(jax.devices("gpu" if device == "cuda" else "cpu")[:1], ("tp",))
    methods: dict[str, Callable[[], Any]] = {
        "fl tp1 cpu": lambda: fl.load(ckpt, progress=False),
        "fl tp1 cuda": lambda: fl.load(ckpt, device=device, progress=False),
        "fl tp4 rank0 cpu": lambda: fl.load(ckpt, tp_size=4, rank=0, progress=False),
        "fl tp4 rank0 cuda": lambda: fl.load(ckpt, tp_size=4, rank=0, device=device, progress=False),
        "fl load_jax gpu": lambda: jax.block_until_ready(fl.load_jax(ckpt, mesh)),
        "safetensors load_file cuda": lambda: {k: v for f in files for k, v in load_file(f, device=device).items()},
    }
    checks = {
        "tp1 cuda == cpu": _same(fl.load(ckpt, progress=False), fl.load(ckpt, device=device, progress=False), device),
        "tp4 rank0 cuda == cpu": _same(
            fl.load(ckpt, tp_size=4, rank=0, progress=False), fl.load(ckpt, tp_size=4, rank=0, device=device, progress=False), device
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for fn in methods.values():  # warm-up: page cache, CUDA context, jit
        _timed(fn)
    for _ in range(rounds):
        for name, fn in methods.items():
            times[name].append(_timed(fn))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in files)
    return {
        "checkpoint_bytes": size,
        "checks": checks,
        "seconds": {k: {"median": round(statistics.median(v), 4), "min": round(min(v), 4)} for k, v in times.items()},
        "GB/s (median, whole checkpoint)": {k: round(size / statistics.median(v) / 1e9, 2) for k, v in times.items()},
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "jax": jax.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script on a machine without a GPU")
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"tests": _tests()}
    ckpt = Path(f"/tmp/fl-bench/llama7b-{args.layers}l")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_checkpoint.py"), str(ckpt), "--layers", str(args.layers)], check=True)
    result["bench"] = _bench(ckpt, args.rounds, args.device)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(text)
    return 0 if result["tests"]["rc"] == 0 and all(result["bench"]["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
