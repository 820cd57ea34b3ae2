"""Measurement machinery of the load benchmark: page-cache control (drop, warm, ``mincore``),
the measured worker (one fresh process per run, optionally started behind a barrier), the
correctness fingerprint, and the facts about a checkpoint the baselines need.

The worker prints ``RESULT_TAG`` + JSON (timing, ``/proc/self/io`` read_bytes, VmHWM, CPU) and
then ``PRINT_TAG`` + JSON (the fingerprint), which is computed after the timing is reported: a
group of ranks started together is told to fingerprint only once every rank has finished.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 1e6
BLOCK = 16 << 20
RESULT_TAG = "@@BENCH-RESULT "
PRINT_TAG = "@@BENCH-PRINT "
READY_TAG = "@@BENCH-READY"
ENTRY = Path(__file__).resolve().parent / "bench_load.py"

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
            import numpy as np

            resident = int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, resident * PAGE)


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths: list[Path]) -> None:
    view = memoryview(bytearray(BLOCK))
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while (n := os.preadv(fd, [view], offset)) > 0:
                offset += n
        finally:
            os.close(fd)


def residency(paths: list[Path]) -> float:
    total = sum(p.stat().st_size for p in paths)
    return sum(resident_bytes(p) for p in paths) / total if total else 0.0


def prepare(scenario: str, paths: list[Path]) -> float:
    """Drop (cold) or re-warm (hot) every file; returns the resident fraction afterwards."""
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

    t = t.detach().contiguous()
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


def run_worker(job: dict, kinds: dict) -> None:
    """Import, (wait at the barrier,) time ``kinds[job['kind']]``, report, fingerprint.

    ``kinds`` maps a kind to ``(modules to import before the timer, fn(job) -> result)``; a
    result has ``out_bytes`` and optionally ``get`` (for the fingerprint), ``logical_read`` and
    ``setup`` (a callable run before the timer; its return value goes to ``fn`` as ``job['_pre']``)."""
    import numpy  # noqa: F401  (imports before the timer)
    import safetensors.torch  # noqa: F401
    import torch

    imports, fn = kinds[job["kind"]]
    for name in imports:
        importlib.import_module(name)
    if job.get("nice"):
        try:
            os.nice(job["nice"])
        except OSError:
            pass
    setup = getattr(fn, "setup", None)
    if setup is not None:
        job["_pre"] = setup(job)
    baseline = _status_kb("VmRSS")
    if job.get("barrier"):
        print(READY_TAG, flush=True)
        sys.stdin.readline()
    io0, cpu0, busy0 = _proc_io_read_bytes(), time.process_time(), _busy_cpu_s()
    start = time.monotonic()
    t0 = time.perf_counter()
    result = fn(job)
    seconds = time.perf_counter() - t0
    end = time.monotonic()
    cpu = time.process_time() - cpu0
    other = _busy_cpu_s() - busy0 - cpu
    read_bytes = _proc_io_read_bytes() - io0
    peak = _status_kb("VmHWM")
    report = {
        "seconds": seconds,
        "start": start,
        "end": end,
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
    print(RESULT_TAG + json.dumps(report), flush=True)
    if job.get("barrier"):
        sys.stdin.readline()
    prints = fingerprint(result["get"], job["config"]) if "get" in result and job.get("checksums", True) else None
    print(PRINT_TAG + json.dumps(prints), flush=True)


# --------------------------------------------------------------------------------------------
# Parent side


def _worker_env(job: dict) -> dict:
    env = dict(os.environ)
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    for key, value in (job.get("env") or {}).items():  # None unsets
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _parse(job: dict, stdout: str, stderr: str, returncode: int | None) -> dict:
    res = prints = None
    for line in stdout.splitlines():
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG):])
        elif line.startswith(PRINT_TAG):
            prints = json.loads(line[len(PRINT_TAG):])
    if res is None:
        raise RuntimeError(f"worker {job['kind']} failed (exit {returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}")
    if prints:
        res["fingerprint"] = prints
    return res


def spawn(job: dict, timeout: float = 600) -> dict:
    cmd = [sys.executable, str(ENTRY), "--worker", json.dumps(job)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_worker_env(job))
    return _parse(job, proc.stdout, proc.stderr, proc.returncode)


def spawn_group(jobs: list[dict], before_start, timeout: float = 60) -> tuple[list[dict], object]:
    """Start one worker per job; once all have imported and wait at the barrier, call
    ``before_start()`` (the cache drop or warm), release them together, and let them fingerprint
    only after the last one has finished. Returns the per-job results and ``before_start()``'s value."""
    procs, errs = [], []
    try:
        for job in jobs:
            err = tempfile.TemporaryFile(mode="w+")
            cmd = [sys.executable, str(ENTRY), "--worker", json.dumps(dict(job, barrier=True))]
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                          env=_worker_env(job)))
            errs.append(err)
        outs: list[list[str]] = [[] for _ in jobs]

        def read_until(i: int, tag: str) -> None:
            for line in procs[i].stdout:
                outs[i].append(line)
                if line.startswith(tag):
                    return
            errs[i].seek(0)
            raise RuntimeError(f"worker {jobs[i]['kind']} rank {jobs[i]['rank']} ended early:\n{''.join(outs[i])[-2000:]}"
                               f"\n{errs[i].read()[-4000:]}")

        for i in range(len(jobs)):
            read_until(i, READY_TAG)
        started = before_start()
        for p in procs:  # release every rank (a pipe write each: microseconds apart)
            p.stdin.write("go\n")
            p.stdin.flush()
        for i in range(len(jobs)):
            read_until(i, RESULT_TAG)
        for p in procs:
            p.stdin.write("print\n")
            p.stdin.close()
        results = []
        for i, p in enumerate(procs):
            rest = p.stdout.read()
            p.wait(timeout=timeout)
            errs[i].seek(0)
            results.append(_parse(jobs[i], "".join(outs[i]) + rest, errs[i].read(), p.returncode))
        return results, started
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for err in errs:
            err.close()


# --------------------------------------------------------------------------------------------
# Checkpoint facts used by several methods


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


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


def machine_facts(model_dir: Path, packages: dict[str, str]) -> dict:
    import platform

    def read(path: str, default: str = "?") -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return default

    cpu = next((line.split(":", 1)[1].strip() for line in read("/proc/cpuinfo", "").splitlines()
                if line.startswith("model name")), "?")
    mem = next((f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB" for line in read("/proc/meminfo", "").splitlines()
                if line.startswith("MemTotal:")), "?")
    from functional_load.io.options import filesystem_type

    dev = "?"
    try:
        st = os.stat(model_dir)
        dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve().name
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
        **packages,
    }
