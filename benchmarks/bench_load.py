"""Load benchmark: functional_load against a vLLM-style loader, ``safetensors.torch.load_file``
and the machine's limits, cold (page cache dropped) and hot (page cache re-warmed), tp 1/2/4.

Every measured run is a fresh Python process (``--worker``, at the bottom of this file) that
imports everything first, then times only the load and reports one JSON line: seconds, output
bytes, ``/proc/self/io`` read_bytes delta, peak RSS (VmHWM, which includes mapped file pages),
baseline RSS, its own CPU seconds and the CPU seconds other processes used meanwhile.

    python benchmarks/bench_load.py [DIR] [--quick] [--runs N] [--tp 1,2,4] [--out docs/performance.md]
    functional-load bench [DIR] ...            (the same)

``DIR`` defaults to /tmp/fl-bench/llama7b-4l (/tmp/fl-bench/llama7b-1l with ``--quick``) and is
generated with benchmarks/make_checkpoint.py when it does not exist.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MB = 1e6
BLOCK = 16 << 20
RESULT_TAG = "@@BENCH-RESULT "

# --------------------------------------------------------------------------------------------
# Methods


class Method:
    def __init__(self, key: str, label: str, kind: str, scenarios: tuple[str, ...] = ("cold", "hot"), *,
                 options: dict | None = None, tps: tuple[int, ...] | None = None, min_tp: int = 1,
                 default: bool = True, family: str = "functional_load"):
        self.key, self.label, self.kind, self.scenarios = key, label, kind, scenarios
        self.options = options or {}
        self.tps, self.min_tp = tps, min_tp
        self.default = default  # in the default method set
        self.family = family

    def applies(self, scenario: str, tp: int) -> bool:
        return scenario in self.scenarios and tp >= self.min_tp and (self.tps is None or tp in self.tps)


METHODS = [
    Method("auto", "functional_load, defaults (auto)", "fl"),
    Method("pread-t1", "fl pread exact, 1 thread", "fl", options={"strategy": "pread", "threads": 1}),
    Method("pread-t2", "fl pread exact, 2 threads", "fl", options={"strategy": "pread", "threads": 2}),
    # auto already runs 4 threads (with cold row-parallel spans), so exact preads on 4 threads are optional.
    Method("pread-t4", "fl pread exact, 4 threads", "fl", options={"strategy": "pread", "threads": 4}, default=False),
    Method(
        "span-t2",
        "fl pread spans (max_over_read=tp), 2 threads",
        "fl",
        options={"strategy": "pread", "threads": 2, "max_over_read": "tp"},
        min_tp=2,
    ),
    Method("direct-t2", "fl pread O_DIRECT, 2 threads", "fl", ("cold",), options={"strategy": "pread", "threads": 2, "direct": True}),
    Method("mmap-t1", "fl mmap, 1 thread", "fl", ("hot",), options={"strategy": "mmap", "threads": 1}, default=False),
    Method("mmap-t2", "fl mmap, 2 threads", "fl", options={"strategy": "mmap", "threads": 2}),
    # eager reads every file whole whatever the tp; shown at tp=1 only (by default).
    Method("eager-t2", "fl eager, 2 threads", "fl", options={"strategy": "eager", "threads": 2}, tps=(1,)),
    Method("vllm", "vLLM-style (safe_open pt, get_tensor, narrow, copy_)", "vllm", family="baseline"),
    Method("load_file", "safetensors load_file + narrow + clone", "load_file", family="baseline"),
    Method("limit", "limit (see notes)", "limit", family="limit"),
    Method("limit-prefaulted", "copy into pre-faulted memory (no page faults)", "limit_prefaulted", ("hot",), family="limit"),
]
QUICK_SKIP = {"pread-t2"}


# --------------------------------------------------------------------------------------------
# Page cache control: drop, warm, residency (mincore)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache (mincore over a fresh shared read-only mapping)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            resident = sum(1 for b in bytes(vec) if b & 1) if pages < 4096 else _count_resident(vec)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, resident * PAGE)


def _count_resident(vec) -> int:
    import numpy as np

    return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths: list[Path]) -> None:
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while True:
                n = os.preadv(fd, [view], offset)
                if n <= 0:
                    break
                offset += n
        finally:
            os.close(fd)


def residency(paths: list[Path]) -> float:
    total = sum(p.stat().st_size for p in paths)
    return sum(resident_bytes(p) for p in paths) / total if total else 0.0


def prepare(scenario: str, paths: list[Path]) -> float:
    """Drop (cold) or re-warm (hot) every shard; returns the resident fraction afterwards."""
    if scenario == "cold":
        for _ in range(3):
            drop_cache(paths)
            frac = residency(paths)
            if frac < 0.01:
                return frac
            time.sleep(0.2)
        raise RuntimeError(f"could not drop the page cache: {frac:.1%} still resident")
    for _ in range(3):
        warm_cache(paths)
        frac = residency(paths)
        if frac > 0.99:
            return frac
    raise RuntimeError(f"could not warm the page cache: only {frac:.1%} resident (memory pressure?)")


# --------------------------------------------------------------------------------------------
# Checkpoint facts used by several methods


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


def shard_rule(name: str) -> str:
    """How vLLM shards a Llama checkpoint tensor: 'col' (dim 0), 'row' (dim 1), 'vocab', 'rep'."""
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
        return "col"
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return "row"
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return "vocab"
    return "rep"


def fused_slot(name: str, cfg: dict, tp: int, rank: int) -> tuple[str, int, int, int] | None:
    """For a q/k/v/gate/up tensor: (fused param name, offset in the param, source start, rows)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    inter = cfg["intermediate_size"]
    q_rows = heads // tp * head_dim
    kv_local = max(1, kv_heads // tp)
    kv_rows = kv_local * head_dim
    kv_start = (rank // max(1, tp // kv_heads)) * kv_rows
    i_rows = inter // tp
    table = {
        "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0, rank * q_rows, q_rows),
        "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", q_rows, kv_start, kv_rows),
        "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", q_rows + kv_rows, kv_start, kv_rows),
        "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0, rank * i_rows, i_rows),
        "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", i_rows, rank * i_rows, i_rows),
    }
    for suffix, (param, offset, start, rows) in table.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + param, offset, start, rows
    return None


# --------------------------------------------------------------------------------------------
# Worker side: one measured run per process


def _proc_io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _busy_cpu_s() -> float:
    with open("/proc/stat") as f:
        parts = f.readline().split()
    # user nice system idle iowait irq softirq (guest is part of user; steal is the host's)
    v = [int(x) for x in parts[1:8]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def _digest(t) -> str:
    import torch

    t = t.contiguous()
    raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)
    return hashlib.blake2b(raw.numpy().reshape(-1), digest_size=8).hexdigest()


def fingerprint(get, cfg: dict) -> dict[str, str]:
    """Hashes of a few rank-local vLLM parameters (``get(name)`` returns the tensor): every 7th
    row of fused qkv/gate_up and of o/down, whole norms, every 61st row of the vocabulary tensors."""
    last = cfg["num_hidden_layers"] - 1
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        f"model.layers.{last}.mlp.gate_up_proj.weight",
        f"model.layers.{last}.mlp.down_proj.weight",
        f"model.layers.{last}.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    out = {}
    for name in names:
        t = get(name)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            t = t[::61]
        elif t.dim() == 2:
            t = t[::7]
        out[name] = _digest(t)
    return out


def run_fl(job: dict) -> dict:
    import functional_load

    options = dict(job["options"])
    if options.get("max_over_read") == "tp":
        options["max_over_read"] = float(job["tp"])
    read = functional_load.ReadOptions(**options)
    state = functional_load.load(job["model_dir"], tp_size=job["tp"], rank=job["rank"], progress=False, read=read)
    return {"state": state, "out_bytes": state.stats.bytes_out, "logical_read": state.stats.bytes_read,
            "get": state.__getitem__}


def run_vllm(job: dict) -> dict:
    """vLLM's default path: preallocated params, safe_open(pt) mmap views, narrow, copy_."""
    import torch
    from safetensors import safe_open

    tp, rank, cfg = job["tp"], job["rank"], job["config"]
    params = {name: torch.empty(shape, dtype=torch.bfloat16) for name, shape in job["shapes"].items()}
    vocab = cfg["vocab_size"]
    for path in job["files"]:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                w = f.get_tensor(name)
                slot = fused_slot(name, cfg, tp, rank)
                if slot is not None:
                    param, offset, start, rows = slot
                    params[param].narrow(0, offset, rows).copy_(w.narrow(0, start, rows))
                    continue
                if name not in params:
                    continue  # e.g. rotary inv_freq
                p = params[name]
                rule = shard_rule(name)
                if rule == "row":
                    cols = p.shape[1]
                    p.copy_(w.narrow(1, rank * cols, cols))
                elif rule == "vocab":
                    per = p.shape[0]
                    start = rank * per
                    n = max(0, min(per, vocab - start))
                    p[:n].copy_(w.narrow(0, start, n))
                    p[n:].zero_()
                else:
                    p.copy_(w)
    out_bytes = sum(t.numel() * t.element_size() for t in params.values())
    return {"state": params, "out_bytes": out_bytes, "get": params.__getitem__}


def run_load_file(job: dict) -> dict:
    """safetensors.torch.load_file per shard, then narrow + clone into owned tensors
    (checkpoint names, unfused; fused only afterwards for the checksum)."""
    import torch
    from safetensors.torch import load_file

    tp, rank, cfg = job["tp"], job["rank"], job["config"]
    shapes = job["shapes"]
    out = {}
    for path in job["files"]:
        sd = load_file(path)
        for name, t in sd.items():
            slot = fused_slot(name, cfg, tp, rank)
            rule = shard_rule(name)
            if slot is not None:
                t = t.narrow(0, slot[2], slot[3])
            elif rule == "row":
                cols = t.shape[1] // tp
                t = t.narrow(1, rank * cols, cols)
            elif rule == "vocab":
                per = shapes[name][0]
                start = rank * per
                t = t.narrow(0, start, max(0, min(per, t.shape[0] - start)))
            out[name] = t.clone(memory_format=torch.contiguous_format)
        del sd
    out_bytes = sum(t.numel() * t.element_size() for t in out.values())

    def get(name: str):
        if name.endswith("qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            return torch.cat([out[base + s] for s in ("q_proj.weight", "k_proj.weight", "v_proj.weight")])
        if name.endswith("gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            return torch.cat([out[base + "gate_proj.weight"], out[base + "up_proj.weight"]])
        t = out[name]
        rows = shapes[name][0] if t.dim() == 2 and shard_rule(name) == "vocab" else None
        if rows is not None and t.shape[0] < rows:
            t = torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])])
        return t

    return {"state": out, "out_bytes": out_bytes, "get": get}


def run_limit_cold(job: dict) -> dict:
    """Four threads pull 16 MiB blocks in file order and pread them into per-thread,
    pre-faulted buffers: the storage's sequential-read ceiling for these byte ranges."""
    ranges = job["ranges"]  # [path, start, stop]
    blocks = [(p, off, min(BLOCK, stop - off)) for p, start, stop in ranges for off in range(start, stop, BLOCK)]
    lock = threading.Lock()
    position = [0]
    fds = {p: os.open(p, os.O_RDONLY) for p, _, _ in ranges}
    total = [0]

    def worker() -> None:
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        got_here = 0
        while True:
            with lock:
                i = position[0]
                position[0] += 1
            if i >= len(blocks):
                break
            path, off, n = blocks[i]
            done = 0
            while done < n:
                k = os.preadv(fds[path], [view[done:n]], off + done)
                if k <= 0:
                    break
                done += k
            got_here += done
        with lock:
            total[0] += got_here

    threads = [threading.Thread(target=worker) for _ in range(job.get("threads", 4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fd in fds.values():
        os.close(fd)
    return {"state": None, "out_bytes": total[0]}


def run_worker(job: dict) -> None:
    import numpy  # noqa: F401  (imports before the timer)
    import safetensors.torch  # noqa: F401
    import torch

    import functional_load

    kind = job["kind"]
    if job.get("nice"):
        try:
            os.nice(job["nice"])
        except OSError:
            pass
    if kind == "fl":
        # Imports are excluded from the timing, so do them first: the output targets and the jitted
        # kernels (and with them jax), as in every earlier run of this benchmark (a default-target
        # load no longer imports jax itself).
        import functional_load.transform.kernels
        import functional_load.transform.targets  # noqa: F401
    pre = None
    if kind in ("limit_hot", "limit_prefaulted"):
        n = job["out_bytes"]
        pre = torch.empty(n, dtype=torch.uint8)
        pre.fill_(1)  # the pre-loaded source, resident
        if kind == "limit_prefaulted":
            dst = torch.empty(n, dtype=torch.uint8)
            dst.fill_(0)
    if kind == "limit_cold":
        for p, _, _ in job["ranges"]:  # open files' metadata outside the timer
            os.stat(p)
    baseline = _status_kb("VmRSS")
    io0, cpu0, busy0 = _proc_io_read_bytes(), time.process_time(), _busy_cpu_s()
    t0 = time.perf_counter()
    if kind == "fl":
        result = run_fl(job)
    elif kind == "vllm":
        result = run_vllm(job)
    elif kind == "load_file":
        result = run_load_file(job)
    elif kind == "limit_cold":
        result = run_limit_cold(job)
    elif kind == "limit_hot":
        dst = torch.empty(job["out_bytes"], dtype=torch.uint8)
        dst.copy_(pre)
        result = {"state": dst, "out_bytes": dst.numel()}
    elif kind == "limit_prefaulted":
        dst.copy_(pre)
        result = {"state": dst, "out_bytes": dst.numel()}
    else:
        raise SystemExit(f"unknown worker kind {kind!r}")
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    other = _busy_cpu_s() - busy0 - cpu
    read_bytes = _proc_io_read_bytes() - io0
    peak = _status_kb("VmHWM")
    report = {
        "seconds": seconds,
        "out_bytes": int(result["out_bytes"]),
        "read_bytes": read_bytes,
        "peak_rss": peak,
        "baseline_rss": baseline,
        "cpu_s": cpu,
        "other_cpu_s": max(0.0, other),
        "torch_threads": torch.get_num_threads(),
        "niceness": os.nice(0),
    }
    if "logical_read" in result:
        report["logical_read"] = int(result["logical_read"])
    if "get" in result and job.get("checksums", True):
        report["fingerprint"] = fingerprint(result["get"], job["config"])
    print(RESULT_TAG + json.dumps(report), flush=True)


# --------------------------------------------------------------------------------------------
# Parent side


def tp_facts(model_dir: Path, tp: int, rank: int) -> dict:
    """Destination shapes (from functional_load's plan: the only use of it by the baselines),
    the exact bytes the rank needs by class, and the byte ranges for the cold limit."""
    import functional_load
    from functional_load.io.prefetch import planned_ranges

    plan = functional_load.plan(model_dir, tp_size=tp, rank=rank)
    shapes = {p.spec.name: list(p.spec.local_shape) for p in plan.params}
    need = {"col": 0, "row_needed": 0, "row_whole": 0, "rep": 0}
    row_seen = set()
    for p in plan.params:
        for c in p.copies:
            info = plan.tensors[c.tensor]
            nbytes = plan.copy_bytes(c)
            full = all(a == 0 and b == d for (a, b), d in zip(c.src, info.shape))
            last_full = not c.src or (c.src[-1][0] == 0 and c.src[-1][1] == info.shape[-1])
            if full:
                need["rep"] += nbytes
            elif last_full:
                need["col"] += nbytes
            else:
                need["row_needed"] += nbytes
                if c.tensor not in row_seen:
                    row_seen.add(c.tensor)
                    need["row_whole"] += info.nbytes
    files = weight_files(model_dir)
    if tp == 1:
        ranges = [[str(f), 0, f.stat().st_size] for f in files]
    else:
        ranges = [[str(path), a, b] for path, spans in sorted(planned_ranges(plan).items()) for a, b in spans]
    return {"shapes": shapes, "out_bytes": plan.output_bytes, "bytes_to_read": plan.bytes_to_read, "need": need,
            "ranges": ranges, "range_bytes": sum(b - a for _, a, b in ranges)}


def spawn(job: dict, timeout: float = 600) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)]
    env = dict(os.environ)
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    raise RuntimeError(f"worker {job['kind']} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def machine_facts(model_dir: Path) -> dict:
    def read(path: str, default: str = "?") -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return default

    cpu = "?"
    for line in read("/proc/cpuinfo", "").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = "?"
    for line in read("/proc/meminfo", "").splitlines():
        if line.startswith("MemTotal:"):
            mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    import safetensors
    import torch

    from functional_load.io.options import filesystem_type

    dev = "?"
    try:
        st = os.stat(model_dir)
        major, minor = os.major(st.st_dev), os.minor(st.st_dev)
        dev = Path(f"/sys/dev/block/{major}:{minor}").resolve().name
    except OSError:
        pass
    base = dev.rstrip("0123456789") if not Path(f"/sys/block/{dev}").exists() else dev
    return {
        "cpu": f"{os.cpu_count()} vCPU, {cpu}",
        "memory": mem,
        "kernel": platform.release(),
        "filesystem": filesystem_type(model_dir),
        "block_device": f"{base} (read_ahead_kb={read(f'/sys/block/{base}/queue/read_ahead_kb')}, "
                        f"rotational={read(f'/sys/block/{base}/queue/rotational')})",
        "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
    }


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[dict]) -> dict:
    secs = [r["seconds"] for r in runs]
    return {
        "n": len(runs),
        "median_s": median(secs),
        "min_s": min(secs),
        "out_bytes": runs[0]["out_bytes"],
        "read_bytes": median([r["read_bytes"] for r in runs]),
        "peak_rss": median([r["peak_rss"] for r in runs]),
        "baseline_rss": median([r["baseline_rss"] for r in runs]),
        "cpu_s": median([r["cpu_s"] for r in runs]),
        "other_cpu_s": median([r["other_cpu_s"] for r in runs]),
        "residency": max(r["residency"] for r in runs) if runs[0]["scenario"] == "cold" else min(r["residency"] for r in runs),
    }


def fmt_ratio(value: float, goal: float, higher_is_better: bool = True) -> str:
    ok = value >= goal if higher_is_better else value <= goal
    sign = "≥" if higher_is_better else "≤"
    return f"{value:.2f} (goal {sign} {goal:g}) {'PASS' if ok else 'MISS'}"


def goals(results: dict, facts: dict) -> list[str]:
    """The issue's goals, each as 'ratio (goal X) PASS/MISS'; evaluated on 'auto'."""
    lines = []

    def get(scenario: str, tp: int, key: str):
        return results.get((scenario, tp), {}).get(key)

    def rate(s: dict, key: str = "median_s") -> float:
        return s["out_bytes"] / s[key]

    def on_min(value: float) -> str:
        return f" — on min times: {value:.2f}"

    a, v = get("cold", 4, "auto"), get("cold", 4, "vllm")
    if a and v:
        lines.append(f"cold, tp=4 rank 1: speed vs vLLM-style = {fmt_ratio(v['median_s'] / a['median_s'], 2.0)}"
                     + on_min(v["min_s"] / a["min_s"]))
        need = facts[4]["need"]
        budget = need["col"] + need["rep"] + need["row_whole"]
        lines.append(
            f"cold, tp=4 rank 1: bytes read / (quarter of column-sharded + replicated + whole row-parallel tensors "
            f"= {budget / MB:,.0f} MB) = {fmt_ratio(a['read_bytes'] / budget, 1.2, False)}"
        )
        col_only = (a["read_bytes"] - need["row_whole"]) / (need["col"] + need["rep"])
        lines.append(
            f"cold, tp=4 rank 1: (bytes read − whole row-parallel tensors) / (column-sharded quarter + replicated) = "
            f"{fmt_ratio(col_only, 1.2, False)}; bytes read / exact bytes the rank keeps "
            f"({facts[4]['bytes_to_read'] / MB:,.0f} MB) = {a['read_bytes'] / facts[4]['bytes_to_read']:.2f}"
        )
    a, v, lim = get("cold", 1, "auto"), get("cold", 1, "vllm"), get("cold", 1, "limit")
    if a and v:
        lines.append(f"cold, tp=1: speed vs vLLM-style = {fmt_ratio(v['median_s'] / a['median_s'], 1.5)}"
                     + on_min(v["min_s"] / a["min_s"]))
    if a and lim:
        lines.append(f"cold, tp=1: GB/s vs 4-thread sequential read limit = {fmt_ratio(rate(a) / rate(lim), 0.8)}"
                     + on_min(rate(a, "min_s") / rate(lim, "min_s")))
    a, v, lim = get("hot", 1, "auto"), get("hot", 1, "vllm"), get("hot", 1, "limit")
    if a and lim:
        lines.append(f"hot, tp=1: GB/s vs fresh-memory copy limit = {fmt_ratio(rate(a) / rate(lim), 0.9)}"
                     + on_min(rate(a, "min_s") / rate(lim, "min_s")))
    if a and v:
        lines.append(f"hot, tp=1: speed vs vLLM-style = {fmt_ratio(v['median_s'] / a['median_s'], 1.0)}"
                     + on_min(v["min_s"] / a["min_s"]))
    for (scenario, tp), methods in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        a = methods.get("auto")
        if a:
            allowed = a["out_bytes"] * 1.1 + 300 * MB
            lines.append(
                f"{scenario}, tp={tp}: peak RSS {a['peak_rss'] / MB:,.0f} MB / (output {a['out_bytes'] / MB:,.0f} MB + 10 % + 300 MB) = "
                f"{fmt_ratio(a['peak_rss'] / allowed, 1.0, False)} (above baseline: "
                f"{(a['peak_rss'] - a['baseline_rss']) / allowed:.2f})"
            )
    return lines


def fastest(results: dict) -> list[str]:
    lines = []
    for (scenario, tp), methods in sorted(results.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        fl = sorted(((s["median_s"], k) for k, s in methods.items() if k in FL_KEYS), key=lambda x: x[0])
        if not fl:
            continue
        best_s, best = fl[0]
        rest = ", ".join(f"{k} {s:.2f}" for s, k in fl[1:4])
        auto = methods.get("auto")
        auto_txt = f"; auto {auto['median_s']:.2f} s" if auto else ""
        lines.append(f"{scenario}, tp={tp}: fastest **{best}** {best_s:.2f} s (next: {rest}){auto_txt}")
    return lines


FL_KEYS = {m.key for m in METHODS if m.kind == "fl"}


def table(scenario: str, tp: int, methods: dict, facts: dict) -> str:
    order = [m for m in METHODS if m.key in methods]
    rows = ["| method | median s | min s | GB/s (output) | read_bytes MB | peak RSS MB | above baseline MB | CPU s | other CPU s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in order:
        s = methods[m.key]
        label = m.label
        if m.key == "limit":
            label = ("limit: 4-thread sequential pread of " + ("the whole files" if tp == 1 else "the rank's merged byte ranges")
                     if scenario == "cold" else "limit: copy the rank's output bytes into fresh memory")
        rows.append(
            f"| {label} | {s['median_s']:.3f} | {s['min_s']:.3f} | {s['out_bytes'] / s['median_s'] / 1e9:.2f} | "
            f"{s['read_bytes'] / MB:,.0f} | {s['peak_rss'] / MB:,.0f} | {(s['peak_rss'] - s['baseline_rss']) / MB:,.0f} | "
            f"{s['cpu_s']:.2f} | {s['other_cpu_s']:.2f} |"
        )
    f = facts[tp]
    head = (f"### {scenario}, tp={tp} (rank {1 if tp > 1 else 0}): output {f['out_bytes'] / MB:,.0f} MB, "
            f"exact bytes to read {f['bytes_to_read'] / MB:,.0f} MB")
    if scenario == "cold" and tp > 1:
        head += f", cold-limit ranges {f['range_bytes'] / MB:,.0f} MB"
    return head + "\n\n" + "\n".join(rows)


def render(model_dir: Path, args, machine: dict, results: dict, facts: dict, ckpt_bytes: int, nfiles: int,
           checks: list[str], elapsed: float) -> str:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    out = [
        "# Load performance",
        "",
        f"Generated by `functional-load bench` (benchmarks/bench_load.py) on {now}, {elapsed / 60:.1f} min.",
        "",
        "## Machine",
        "",
    ]
    out += [f"* {k}: {v}" for k, v in machine.items()]
    out += [
        "",
        "Other processes ran on this VM during the measurements; each row's *other CPU s* is the CPU time",
        "they used during that run's timed section (median), so a row can be judged against it.",
        "",
        "## Method",
        "",
        f"* Checkpoint: `{model_dir}`, {ckpt_bytes / 1e9:.2f} GB in {nfiles} shards, Llama-2-7B shapes (hidden 4096,",
        "  intermediate 11008, 32 heads, 32 KV heads, vocab 32000), bf16 random data, written by",
        "  `benchmarks/make_checkpoint.py`.",
        "* tp=1 loads rank 0; tp=2 and tp=4 load rank 1.",
        f"* {args.runs} run(s) per method and scenario, methods interleaved round by round; medians (and min).",
        "* Every run is a fresh process; imports happen before the timer (for functional_load this includes",
        "  `functional_load.transform.kernels`, i.e. jax, which a default-target `load()` no longer needs), and the",
        "  timer covers the whole load (planning/header reads, allocation, reads, copies). Output tensors stay",
        f"  alive until peak RSS is read. Measured workers run at niceness {args.nice:+d} to be less disturbed by",
        "  the other jobs on this VM (the cache drop/warm and the parent run at normal priority).",
        "* **cold**: before each run every shard is dropped from the page cache with",
        "  `posix_fadvise(POSIX_FADV_DONTNEED)` and residency is verified with `mincore` (< 1 %).",
        "* **hot**: right before each run every shard is read once (re-warm; idle page cache is evicted",
        "  after ~60 s on this VM) and residency is verified (> 99 %).",
        "* *read_bytes*: `/proc/self/io` read_bytes delta (bytes the process made storage deliver,",
        "  readahead included). *peak RSS*: VmHWM, which counts mapped file pages; *above baseline*:",
        "  VmHWM minus VmRSS just before the timer (≈ 240 MB of interpreter, torch and safetensors; ≈ 355 MB",
        "  for functional_load workers, which have imported jax).",
        "* Methods:",
        "  * functional_load: `functional_load.load(dir, tp_size, rank, read=ReadOptions(strategy=..., threads=..., ...))`;",
        "    *auto* is the library's defaults (16 MiB chunks on 4 threads, exact preads with `FADV_RANDOM`,"
        " row-parallel slices read as sequential spans when not in the page cache);",
        "    the other rows change one option. *spans* reads a row-parallel slice as one span per",
        "    16 MiB chunk and scatters it (`max_over_read=tp`); *O_DIRECT* bypasses the page cache.",
        "  * vLLM-style: `torch.empty` parameters at rank-local vLLM shapes (fused qkv/gate_up); per",
        "    shard `safe_open(framework=\"pt\")`, per tensor `get_tensor`, `narrow` on the shard dim,",
        "    `copy_` into the parameter slot (vocab padding zeroed) — vLLM's default lazy path.",
        "  * `load_file` + narrow + clone: per shard `safetensors.torch.load_file`, then each tensor's",
        "    rank slice `clone`d into an owned contiguous tensor (checkpoint names, not fused).",
        "  * limit, cold: four threads pread 16 MiB blocks in file order into reused buffers. tp=1 reads",
        "    the whole files; tp>1 reads the rank's byte ranges merged with a 1 MiB gap (its row-slices of",
        "    dim-0-sharded tensors, and whole row-parallel tensors, whose slices touch every page).",
        "  * limit, hot: `torch.empty(n)` + `copy_` of the rank's output bytes from a resident source in",
        "    the same process (only the copy is timed, page faults of the fresh destination included).",
        "    *copy into pre-faulted memory* is the same without page faults (the memcpy ceiling).",
        "* Correctness guard: every loader's result for a few tensors (fused qkv and gate_up, o_proj,",
        "  down_proj, norms, sampled embedding/lm_head rows) is hashed; all methods must agree per tp.",
        "",
        "Rerun (about 10–15 minutes; `--quick` for a 1-layer checkpoint and one run):",
        "",
        "```",
        "python benchmarks/make_checkpoint.py            # /tmp/fl-bench/llama7b-4l, 2.15 GB",
        f"functional-load bench /tmp/fl-bench/llama7b-4l --runs {args.runs} --tp {','.join(map(str, args.tp))}"
        " --out docs/performance.md \\",
        "    --json /tmp/fl-bench/full.json        # raw runs; re-render later with --from-json /tmp/fl-bench/full.json",
        "```",
        "",
        "## Goals (functional_load with its defaults)",
        "",
    ]
    out += ["Ratios are computed from medians; \"on min times\" repeats a speed ratio with each method's best",
            "run, as a check against the noise from other jobs. Peak RSS is the absolute VmHWM.", ""]
    out += [f"* {g}" for g in goals(results, facts)]
    out += ["", "## Fastest functional_load variant per scenario (median s)", ""]
    out += [f"* {line}" for line in fastest(results)]
    out += ["", "## Correctness guard", ""]
    out += [f"* {c}" for c in checks]
    out += ["", "## Results", ""]
    for scenario in ("cold", "hot"):
        for tp in args.tp:
            if (scenario, tp) in results:
                out += [table(scenario, tp, results[(scenario, tp)], facts), ""]
    return "\n".join(out) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="functional-load bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", help="checkpoint directory (default /tmp/fl-bench/llama7b-4l, generated if missing)")
    parser.add_argument("--quick", action="store_true", help="1-layer checkpoint, one run, fewer variants")
    parser.add_argument("--runs", type=int, default=None, help="runs per method and scenario (default 3, 1 with --quick)")
    parser.add_argument("--tp", default="1,2,4", help="tp sizes, comma-separated (default 1,2,4)")
    parser.add_argument("--scenarios", default="cold,hot", help="cold,hot (default both)")
    parser.add_argument("--methods", default=None, help="comma-separated method keys (default all): " + ",".join(m.key for m in METHODS))
    parser.add_argument("--layers", type=int, default=None, help="layers of a generated checkpoint (default 4, 1 with --quick)")
    parser.add_argument("--out", default=None, help="markdown file to write (default docs/performance.md; none with --quick)")
    parser.add_argument("--nice", type=int, default=-10,
                        help="niceness added to each measured worker (default -10: less disturbed by other jobs; needs root)")
    parser.add_argument("--json", default=None, help="also write raw per-run results as JSON here")
    parser.add_argument("--from-json", default=None, help="render the tables from a --json file instead of measuring")
    args = parser.parse_args(argv)
    args.tp = [int(x) for x in str(args.tp).split(",") if x]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    if args.runs is None:
        args.runs = 1 if args.quick else 3
    if args.layers is None:
        args.layers = 1 if args.quick else 4
    if args.out is None and not args.quick:
        args.out = str(REPO / "docs" / "performance.md")
    return args


def measure(args, methods, model_dir: Path, cfg: dict, files: list[Path], facts: dict):
    """Run every (tp, scenario, round, method) in a fresh worker; returns the runs and seconds taken."""
    runs: dict[tuple[str, int, str], list[dict]] = {}
    start = time.perf_counter()
    for tp in args.tp:
        rank = 1 if tp > 1 else 0
        f = facts[tp]
        for scenario in args.scenarios:
            for r in range(args.runs):
                for m in methods:
                    if not m.applies(scenario, tp):
                        continue
                    kind = m.kind
                    if kind == "limit":
                        kind = "limit_cold" if scenario == "cold" else "limit_hot"
                    job = {"kind": kind, "model_dir": str(model_dir), "tp": tp, "rank": rank, "options": m.options,
                           "shapes": f["shapes"], "config": cfg, "files": [str(p) for p in files],
                           "out_bytes": f["out_bytes"], "nice": args.nice}
                    if kind == "limit_cold":
                        job["ranges"] = f["ranges"]
                    frac = prepare(scenario, files)
                    res = spawn(job)
                    res.update(scenario=scenario, tp=tp, method=m.key, run=r, residency=frac)
                    runs.setdefault((scenario, tp, m.key), []).append(res)
                    print(f"[{time.perf_counter() - start:6.0f} s] {scenario} tp={tp} run {r + 1}/{args.runs} {m.key:17s} "
                          f"{res['seconds']:7.3f} s  {res['out_bytes'] / res['seconds'] / 1e9:5.2f} GB/s  "
                          f"read {res['read_bytes'] / MB:7,.0f} MB  peak {res['peak_rss'] / MB:6,.0f} MB  "
                          f"other cpu {res['other_cpu_s']:.2f} s  (resident before {frac:.1%})", flush=True)
    return runs, time.perf_counter() - start


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--worker":
        run_worker(json.loads(argv[1]))
        return 0
    args = parse_args(argv)
    sys.path.insert(0, str(HERE))
    from make_checkpoint import default_dir, write_checkpoint

    model_dir = Path(args.model_dir) if args.model_dir else default_dir(args.layers)
    if not (model_dir / "config.json").exists():
        write_checkpoint(model_dir, args.layers)
    cfg = json.loads((model_dir / "config.json").read_text())
    if "LlamaForCausalLM" not in (cfg.get("architectures") or []):
        raise SystemExit(f"{model_dir}: the vLLM-style baseline knows Llama only; got {cfg.get('architectures')}")
    files = weight_files(model_dir)
    ckpt_bytes = sum(f.stat().st_size for f in files)
    wanted = set(args.methods.split(",")) if args.methods else None
    if wanted is None:
        methods = [m for m in METHODS if m.default and not (args.quick and m.key in QUICK_SKIP)]
    else:
        unknown = wanted - {m.key for m in METHODS}
        if unknown:
            raise SystemExit(f"unknown methods {sorted(unknown)}; known: {[m.key for m in METHODS]}")
        methods = [m for m in METHODS if m.key in wanted]
        if "auto" not in wanted:
            print("note: without 'auto' the goals are not evaluated", flush=True)
    facts = {tp: tp_facts(model_dir, tp, 1 if tp > 1 else 0) for tp in args.tp}
    machine = machine_facts(model_dir)
    print(f"{model_dir}: {ckpt_bytes / 1e9:.2f} GB in {len(files)} shards; tp {args.tp}; {args.runs} run(s); "
          f"methods {[m.key for m in methods]}", flush=True)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        runs = {}
        for res in saved["runs"]:
            runs.setdefault((res["scenario"], res["tp"], res["method"]), []).append(res)
        elapsed = saved.get("elapsed_s", float("nan"))
        args.runs = saved.get("runs_per", args.runs)
        args.nice = saved.get("nice", args.nice)
        args.tp = [tp for tp in args.tp if any(k[1] == tp for k in runs)]
    else:
        runs, elapsed = measure(args, methods, model_dir, cfg, files, facts)
    results: dict[tuple[str, int], dict[str, dict]] = {}
    for (scenario, tp, key), rs in runs.items():
        results.setdefault((scenario, tp), {})[key] = summarize(rs)
    # Correctness guard: every fingerprinted run of a tp agrees.
    checks = []
    for tp in args.tp:
        prints = {}
        for (scenario, t, key), rs in runs.items():
            if t != tp:
                continue
            for res in rs:
                if "fingerprint" in res:
                    prints.setdefault(json.dumps(res["fingerprint"], sort_keys=True), []).append(f"{scenario}/{key}")
        if len(prints) == 1:
            n = len(next(iter(prints.values())))
            checks.append(f"tp={tp}: {n} runs, {len(json.loads(next(iter(prints))))} tensors hashed: all equal — OK")
        elif prints:
            groups = "; ".join(f"{sorted(set(v))}" for v in prints.values())
            checks.append(f"tp={tp}: MISMATCH between groups {groups}")
    text = render(model_dir, args, machine, results, facts, ckpt_bytes, len(files), checks, elapsed)
    print()
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    if args.json and not args.from_json:
        saved = {"model_dir": str(model_dir), "elapsed_s": elapsed, "runs_per": args.runs, "nice": args.nice,
                 "runs": [r for rs in runs.values() for r in rs]}
        Path(args.json).write_text(json.dumps(saved, indent=1))
    return 1 if any("MISMATCH" in c for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
