"""Time and memory of ``fl.plan`` on full-size sparse checkpoints (headers only, no tensor data).

Each measurement is a fresh ``python`` process that imports functional_load, reads ``VmRSS``
from ``/proc/self/status``, runs one ``fl.plan(...)`` under a wall-clock timer, then reads
``VmHWM``: *extra MB* is the peak above the post-import baseline. Rows report the median (and
min) of ``--runs`` processes. The checkpoints are written by ``sparse_checkpoint.py`` under
``--root`` when missing (headers only: a few MB of disk); their headers are in the page cache
after the first run, so the times are of warm header reads.

    python benchmarks/bench_plan.py [--runs 3] [--scaling] [--root /tmp/fl-bench/sparse]

``--scaling`` adds rows at 1/4 and 1/2 of each model's layers (planning time against the
number of checkpoint tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparse_checkpoint import MODELS, write_sparse

CHILD = r"""
import json, sys, time
import functional_load as fl

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)

directory, tp, rank, ep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
base = status("VmRSS")
start = time.perf_counter()
plan = fl.plan(directory, tp_size=tp, rank=rank, expert_parallel=ep)
seconds = time.perf_counter() - start
peak = status("VmHWM")
copies = sum(len(p.copies) for p in plan.params)
print(json.dumps({"s": seconds, "extra": peak - base, "base": base, "params": len(plan.params),
                  "tensors": len(plan.tensors), "dropped": len(plan.dropped), "copies": copies}))
"""

# (model, layers fraction, tp, rank, expert_parallel)
FULL = [
    ("deepseek-v3", 1.0, 8, 0, True),
    ("deepseek-v3", 1.0, 8, 7, True),
    ("deepseek-v3", 1.0, 8, 0, False),
    ("llama-405b", 1.0, 8, 0, False),
    ("llama-405b", 1.0, 16, 0, False),
    ("llama-405b", 1.0, 16, 15, False),
    ("kimi-k2", 1.0, 8, 0, True),
    ("kimi-k2", 1.0, 16, 0, True),
    ("kimi-k2", 1.0, 8, 0, False),
    ("qwen3-235b", 1.0, 8, 0, True),
    ("qwen3-235b", 1.0, 8, 0, False),
]
SCALING = [
    ("deepseek-v3", 0.25, 8, 0, True),
    ("deepseek-v3", 0.5, 8, 0, True),
    ("llama-405b", 0.25, 16, 0, False),
    ("llama-405b", 0.5, 16, 0, False),
]


def checkpoint(root: Path, model: str, layers: int) -> Path:
    out = root / f"{model}-{layers}l"
    if not (out / "model.safetensors.index.json").exists():
        write_sparse(model, out, layers)
    return out


def measure(directory: Path, tp: int, rank: int, ep: bool) -> dict[str, float]:
    cmd = [sys.executable, "-c", CHILD, str(directory), str(tp), str(rank), "1" if ep else "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[3:])} failed:\n{done.stderr}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--root", default="/tmp/fl-bench/sparse")
    ap.add_argument("--scaling", action="store_true", help="also 1/4 and 1/2 of the layers")
    ap.add_argument("--only", help="comma-separated models to run (default: all)")
    args = ap.parse_args(argv)
    rows = SCALING + FULL if args.scaling else FULL
    if args.only:
        rows = [r for r in rows if r[0] in args.only.split(",")]
    root = Path(args.root)
    print(f"{args.runs} fresh process(es) per row, median (min); cpu count {os.cpu_count()}\n")
    print("| model | layers | ckpt tensors | tp | rank | EP | plan s, median (min) | extra MB, median (max) | plan tensors | copies |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for model, fraction, tp, rank, ep in rows:
        full_layers = MODELS[model][0]["num_hidden_layers"]
        layers = max(1, round(full_layers * fraction))
        directory = checkpoint(root, model, layers)
        n = len(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"])
        runs = [measure(directory, tp, rank, ep) for _ in range(args.runs)]
        s = [r["s"] for r in runs]
        mb = [r["extra"] / 1e6 for r in runs]
        last = runs[-1]
        print(
            f"| {model} | {layers} | {n:,} | {tp} | {rank} | {'yes' if ep else 'no'} | "
            f"{statistics.median(s):.3f} ({min(s):.3f}) | {statistics.median(mb):.0f} ({max(mb):.0f}) | "
            f"{int(last['tensors']):,} | {int(last['copies']):,} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
