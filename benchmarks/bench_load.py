"""Load benchmark: functional_load against a vLLM-style loader, ``safetensors.torch.load_file``,
the loaders vLLM users pick instead (Run:ai streamer, fastsafetensors, tensorizer, functional_load's
pre-sharded reload: the ``bench`` extra) and the machine's limits, cold (page cache dropped) and
hot (page cache re-warmed), tp 1/2/4, plus all ranks of tp 4 loading at once.

Every measured run is a fresh Python process (``--worker``; benchmarks/measure.py) that imports
everything first, then times only the load and reports one JSON line: seconds, output bytes,
``/proc/self/io`` read_bytes delta, peak RSS (VmHWM, which includes mapped file pages), baseline
RSS, its own CPU seconds and the CPU seconds other processes used meanwhile.

    python benchmarks/bench_load.py [DIR] [--quick] [--runs N] [--tp 1,2,4] [--out FILE.md]
    functional-load bench [DIR] ...            (the same)

``DIR`` defaults to /tmp/fl-bench/llama7b-4l and is generated with benchmarks/make_checkpoint.py
when it does not exist. Files derived from it (the tensorizer and pre-sharded copies) go to
/tmp/fl-bench/derived, written once. ``--quick`` without ``DIR`` generates a 1-layer checkpoint and
its derived files in a temporary directory and removes them at the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the sibling modules, also when loaded by path (functional-load bench)
    sys.path.insert(0, str(HERE))

import loaders  # noqa: E402
import measure  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402

REPO = HERE.parent
MB = 1e6


class Method:
    def __init__(self, key: str, label: str, kind: str, scenarios: tuple[str, ...] = ("cold", "hot"), *,
                 options: dict | None = None, tps: tuple[int, ...] | None = None, min_tp: int = 1,
                 default: bool = True, family: str = "functional_load", peer: str | None = None,
                 derived: str | None = None, once: bool = False, all_ranks: bool = False):
        self.key, self.label, self.kind, self.scenarios = key, label, kind, scenarios
        self.options = options or {}
        self.tps, self.min_tp = tps, min_tp
        self.default = default  # in the default method set
        self.family = family
        self.peer = peer  # key of peers.PEERS that must be installed
        self.derived = derived  # None (reads the checkpoint), "tzr-whole", "tzr-rank" or "sharded"
        self.once = once  # measured at the first tp only (its work does not depend on tp)
        self.all_ranks = all_ranks  # also in the all-ranks-at-once scenario

    def applies(self, scenario: str, tp: int) -> bool:
        return scenario in self.scenarios and tp >= self.min_tp and (self.tps is None or tp in self.tps)


RAW = {"raw": True}
METHODS = [
    Method("auto", "functional_load, defaults (auto)", "fl", all_ranks=True),
    # Variants that change one option: not run by default (--methods adds them).
    Method("pread-t1", "fl pread exact, 1 thread", "fl", options={"strategy": "pread", "threads": 1}, default=False),
    Method("pread-t2", "fl pread exact, 2 threads", "fl", options={"strategy": "pread", "threads": 2}, default=False),
    Method("pread-t4", "fl pread exact, 4 threads", "fl", options={"strategy": "pread", "threads": 4}, default=False),
    Method("span-t2", "fl pread spans (max_over_read=tp), 2 threads", "fl",
           options={"strategy": "pread", "threads": 2, "max_over_read": "tp"}, min_tp=2, default=False),
    Method("direct-t2", "fl pread O_DIRECT, 2 threads", "fl", ("cold",), options={"strategy": "pread", "threads": 2, "direct": True},
           default=False),
    Method("mmap-t1", "fl mmap, 1 thread", "fl", ("hot",), options={"strategy": "mmap", "threads": 1}, default=False),
    Method("mmap-t2", "fl mmap, 2 threads", "fl", options={"strategy": "mmap", "threads": 2}, default=False),
    Method("eager-t2", "fl eager, 2 threads", "fl", options={"strategy": "eager", "threads": 2}, tps=(1,), default=False),
    Method("vllm", "vLLM-style (safe_open pt, get_tensor, narrow, copy_)", "vllm", family="baseline", all_ranks=True),
    # Not a path vLLM takes; off by default to keep the full run near 15 minutes (--methods adds it).
    Method("load_file", "safetensors load_file + narrow + clone", "load_file", family="baseline", default=False),
    Method("runai", "Run:ai streamer → vLLM layout (narrow + copy_)", "runai", family="peer", peer="runai"),
    Method("runai-raw", "Run:ai streamer, raw (whole checkpoint)", "runai", options=RAW, family="peer", peer="runai", once=True),
    Method("fst", "fastsafetensors (nogds) → vLLM layout (narrow + copy_)", "fastsafetensors", family="peer",
           peer="fastsafetensors"),
    Method("fst-raw", "fastsafetensors (nogds), raw (whole checkpoint)", "fastsafetensors", options=RAW, family="peer",
           peer="fastsafetensors", once=True),
    Method("tzr", "tensorizer whole-model file → vLLM layout (narrow + copy_)", "tensorizer", family="peer", peer="tensorizer",
           derived="tzr-whole"),
    Method("tzr-raw", "tensorizer whole-model file, raw (whole checkpoint)", "tensorizer", options=RAW, family="peer",
           peer="tensorizer", derived="tzr-whole", once=True),
    Method("tzr-rank", "tensorizer per-rank file (vLLM layout, as vLLM's sharded tensorizer)", "tensorizer",
           options={"rank_file": True}, family="peer", peer="tensorizer", derived="tzr-rank", min_tp=2),
    Method("presharded", "functional_load pre-sharded reload (save_sharded once, load)", "fl", family="peer", derived="sharded",
           min_tp=2),
    Method("limit", "limit (see notes)", "limit", family="limit"),
    Method("limit-prefaulted", "copy into pre-faulted memory (no page faults)", "limit_prefaulted", ("hot",), family="limit"),
]
LABELS = {m.key: m.label for m in METHODS}
FL_KEYS = {m.key for m in METHODS if m.kind == "fl" and m.family == "functional_load"}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="functional-load bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", help="checkpoint directory (default /tmp/fl-bench/llama7b-4l, generated if missing)")
    parser.add_argument("--quick", action="store_true", help="1-layer checkpoint, one run")
    parser.add_argument("--runs", type=int, default=None, help="runs per method and scenario (default 3, 1 with --quick)")
    parser.add_argument("--tp", default="1,2,4", help="tp sizes, comma-separated (default 1,2,4)")
    parser.add_argument("--scenarios", default="cold,hot", help="cold,hot (default both)")
    parser.add_argument("--methods", default=None, help="comma-separated method keys (default: those marked default): "
                        + ",".join(m.key for m in METHODS))
    parser.add_argument("--all-ranks", type=int, default=4, help="tp size of the all-ranks-at-once scenario (default 4; 0: skip)")
    parser.add_argument("--layers", type=int, default=None, help="layers of a generated checkpoint (default 4, 1 with --quick)")
    parser.add_argument("--out", default=None, help="markdown file to write the results into (default: none, printed only)")
    parser.add_argument("--nice", type=int, default=0,
                        help="niceness added to each measured worker (default 0; -10 disturbs them less, as root)")
    parser.add_argument("--json", default=None, help="also write raw per-run results as JSON here")
    parser.add_argument("--from-json", default=None, help="render the tables from a --json file instead of measuring")
    args = parser.parse_args(argv)
    args.tp = [int(x) for x in str(args.tp).split(",") if x]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    if args.runs is None:
        args.runs = 1 if args.quick else 3
    if args.layers is None:
        args.layers = 1 if args.quick else 4
    return args


class Bench:
    """What every measured run needs: the checkpoint, per-tp facts and the derived files."""

    def __init__(self, args, model_dir: Path, cfg: dict, files: list[Path], methods: list[Method]):
        self.args, self.model_dir, self.cfg, self.files, self.methods = args, model_dir, cfg, files, methods
        tps = sorted(set(args.tp) | ({args.all_ranks} if args.all_ranks else set()))
        self.facts = {tp: measure.tp_facts(model_dir, tp, 1 if tp > 1 else 0) for tp in tps}
        self.shapes: dict[tuple[int, int], dict] = {}
        self.root = peers.derived_root(model_dir, files)
        self.derived: dict[tuple[str, int], tuple[str, list[Path]]] = {}

    def shapes_of(self, tp: int, rank: int) -> dict:
        if (tp, rank) not in self.shapes:
            if rank == (1 if tp > 1 else 0):
                self.shapes[(tp, rank)] = self.facts[tp]["shapes"]
            else:
                self.shapes[(tp, rank)] = measure.tp_facts(self.model_dir, tp, rank)["shapes"]
        return self.shapes[(tp, rank)]

    def job(self, m: Method, scenario: str, tp: int, rank: int) -> tuple[dict, list[Path]]:
        """The worker's job and the files whose page-cache state the scenario sets."""
        kind = m.kind
        if kind == "limit":
            kind = "limit_cold" if scenario == "cold" else "limit_hot"
        f = self.facts.get(tp, {})
        job = {"kind": kind, "model_dir": str(self.model_dir), "tp": tp, "rank": rank, "options": m.options,
               "shapes": self.shapes_of(tp, rank), "config": self.cfg, "files": [str(p) for p in self.files],
               "out_bytes": f.get("out_bytes"), "nice": self.args.nice}
        if kind == "limit_cold":
            job["ranges"] = f["ranges"]
        if m.peer in peers.ENV:
            job["env"] = peers.ENV[m.peer][scenario]
        cache = list(self.files)
        if m.derived:
            source, own = self.derived_files(m.derived, tp, rank)
            job["source"] = source
            cache = (cache + own) if scenario == "cold" else own
        return job, cache

    def derived_files(self, what: str, tp: int, rank: int) -> tuple[str, list[Path]]:
        key = (what, tp if what != "tzr-whole" else 0, rank if what == "tzr-rank" else 0)
        if key not in self.derived:
            t0 = time.perf_counter()
            if what == "tzr-whole":
                path = peers.tensorizer_whole(self.root, self.files)
                self.derived[key] = (str(path), [path])
            elif what == "tzr-rank":
                job = {"tp": tp, "rank": rank, "config": self.cfg, "shapes": self.shapes_of(tp, rank),
                       "files": [str(p) for p in self.files]}
                path = peers.tensorizer_rank(self.root, job)
                self.derived[key] = (str(path), [path])
            else:
                out = peers.presharded(self.root, self.model_dir, tp)
                self.derived[key] = (str(out), peers.presharded_files(out, tp, rank))
            print(f"derived {what} tp={tp} rank {rank}: {self.derived[key][0]} ({time.perf_counter() - t0:.1f} s, untimed)",
                  flush=True)
        return self.derived[key]

    def prepare_derived(self) -> None:
        """Write every derived file the selected methods need before any timing."""
        for m in self.methods:
            for tp in self.args.tp:
                if m.derived and any(m.applies(s, tp) for s in self.args.scenarios) and not (m.once and tp != self.args.tp[0]):
                    self.derived_files(m.derived, tp, 1 if tp > 1 else 0)

    def run_singles(self, start: float) -> dict:
        """Every (tp, scenario, round, method) in a fresh worker."""
        args, runs = self.args, {}
        for tp in args.tp:
            rank = 1 if tp > 1 else 0
            for scenario in args.scenarios:
                for r in range(args.runs):
                    for m in self.methods:
                        if not m.applies(scenario, tp) or (m.once and tp != args.tp[0]):
                            continue
                        job, cache = self.job(m, scenario, tp, rank)
                        frac = measure.prepare(scenario, cache)
                        res = measure.spawn(job)
                        res.update(scenario=scenario, tp=tp, rank=rank, method=m.key, run=r, residency=frac)
                        runs.setdefault((scenario, tp, m.key), []).append(res)
                        print(f"[{time.perf_counter() - start:6.0f} s] {scenario} tp={tp} run {r + 1}/{args.runs} {m.key:17s} "
                              f"{res['seconds']:7.3f} s  {res['out_bytes'] / res['seconds'] / 1e9:5.2f} GB/s  "
                              f"read {res['read_bytes'] / MB:7,.0f} MB  peak {res['peak_rss'] / MB:6,.0f} MB  "
                              f"other cpu {res['other_cpu_s']:.2f} s  (resident before {frac:.1%})", flush=True)
        return runs

    def run_groups(self, start: float) -> dict:
        """All ranks of ``--all-ranks`` at once, one process each, released together."""
        args, runs = self.args, {}
        tp = args.all_ranks
        methods = [m for m in self.methods if m.all_ranks]
        if not tp or not methods:
            return runs
        for scenario in args.scenarios:
            for r in range(args.runs):
                for m in methods:
                    jobs, cache = [], []
                    for rank in range(tp):
                        job, files = self.job(m, scenario, tp, rank)
                        jobs.append(job)
                        cache += [p for p in files if p not in cache]
                    ranks, frac = measure.spawn_group(jobs, functools.partial(measure.prepare, scenario, cache))
                    for rank, res in enumerate(ranks):
                        res.update(rank=rank)
                    g = report.group_summary(ranks)
                    g.update(scenario=scenario, tp=tp, method=m.key, run=r, residency=frac, ranks=ranks)
                    runs.setdefault((scenario, m.key), []).append(g)
                    print(f"[{time.perf_counter() - start:6.0f} s] {scenario} all {tp} ranks run {r + 1}/{args.runs} {m.key:9s} "
                          f"{g['seconds']:7.3f} s wall (slowest rank {g['slowest_s']:.3f} s)  read {g['read_bytes'] / MB:7,.0f} MB  "
                          f"peak sum {g['peak_rss'] / MB:6,.0f} MB", flush=True)
        return runs


def select_methods(args) -> tuple[list[Method], list[str]]:
    """The methods to run, and one note per peer (version, or skipped because not installed)."""
    wanted = set(args.methods.split(",")) if args.methods else None
    if wanted is None:
        methods = [m for m in METHODS if m.default]
    else:
        unknown = wanted - {m.key for m in METHODS}
        if unknown:
            raise SystemExit(f"unknown methods {sorted(unknown)}; known: {[m.key for m in METHODS]}")
        methods = [m for m in METHODS if m.key in wanted]
        if "auto" not in wanted:
            print("note: without 'auto' the goals are not evaluated", flush=True)
    notes = []
    for peer, (_, dist, pin) in peers.PEERS.items():
        keys = [m.key for m in methods if m.peer == peer]
        version = peers.peer_status(peer)
        if version is None:
            methods = [m for m in methods if m.peer != peer]
            if keys:
                notes.append(f"{dist}: not installed — skipped ({', '.join(keys)}); `pip install \"{dist}=={pin}\"` "
                             "or the `bench` extra")
        elif keys:
            notes.append(f"{dist} {version}: {', '.join(keys)}")
    return methods, notes


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--worker":
        measure.run_worker(json.loads(argv[1]), {**loaders.KINDS, **peers.KINDS})
        return 0
    args = parse_args(argv)
    if args.quick and not args.model_dir:  # a smoke run: everything it generates goes with it
        import os
        import shutil
        import tempfile

        scratch = Path(tempfile.mkdtemp(prefix="fl-bench-quick-"))
        os.environ["FL_BENCH_DERIVED"] = str(scratch / "derived")
        try:
            return _main(args, scratch / "llama7b-1l")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return _main(args, None)


def _main(args, generated: Path | None) -> int:
    from make_checkpoint import default_dir, write_checkpoint

    model_dir = Path(args.model_dir) if args.model_dir else generated or default_dir(args.layers)
    if not (model_dir / "config.json").exists():
        write_checkpoint(model_dir, args.layers)
    cfg = json.loads((model_dir / "config.json").read_text())
    if "LlamaForCausalLM" not in (cfg.get("architectures") or []):
        raise SystemExit(f"{model_dir}: the vLLM-style baseline knows Llama only; got {cfg.get('architectures')}")
    files = measure.weight_files(model_dir)
    ckpt_bytes = sum(f.stat().st_size for f in files)
    methods, peer_notes = select_methods(args)
    for note in peer_notes:
        print("peer:", note, flush=True)
    bench = Bench(args, model_dir, cfg, files, methods)
    import safetensors
    import torch

    versions = {"torch": torch.__version__, "safetensors": safetensors.__version__}
    versions.update({peers.PEERS[p][1]: v for p in peers.PEERS if (v := peers.peer_status(p))})
    machine = measure.machine_facts(model_dir, versions)
    print(f"{model_dir}: {ckpt_bytes / 1e9:.2f} GB in {len(files)} shards; tp {args.tp}; {args.runs} run(s); "
          f"methods {[m.key for m in methods]}; all ranks of tp {args.all_ranks} at once", flush=True)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        runs, groups = {}, {}
        for res in saved["runs"]:
            runs.setdefault((res["scenario"], res["tp"], res["method"]), []).append(res)
        for g in saved.get("groups", []):
            groups.setdefault((g["scenario"], g["method"]), []).append(g)
        elapsed = saved.get("elapsed_s", float("nan"))
        args.runs = saved.get("runs_per", args.runs)
        args.nice = saved.get("nice", args.nice)
        args.tp = [tp for tp in args.tp if any(k[1] == tp for k in runs)]
        args.all_ranks = next((g["tp"] for g in saved.get("groups", [])), args.all_ranks)
    else:
        start = time.perf_counter()
        bench.prepare_derived()
        runs = bench.run_singles(start)
        groups = bench.run_groups(start)
        elapsed = time.perf_counter() - start
    results: dict[tuple[str, int], dict[str, dict]] = {}
    for (scenario, tp, key), rs in runs.items():
        results.setdefault((scenario, tp), {})[key] = report.summarize(rs)
    group_results: dict[str, dict[str, dict]] = {}
    for (scenario, key), gs in groups.items():
        group_results.setdefault(scenario, {})[key] = report.summarize(gs)
    # Correctness guard: every fingerprinted run of a (tp, rank) agrees, all-ranks runs included.
    prints: dict[tuple[int, int], dict[str, list[str]]] = {}
    single = [r for rs in runs.values() for r in rs]
    grouped = [dict(r, scenario=g["scenario"] + "-all", method=g["method"], tp=g["tp"]) for gs in groups.values() for g in gs
               for r in g["ranks"]]
    for res in single + grouped:
        if "fingerprint" in res:
            rank = res.get("rank", 1 if res["tp"] > 1 else 0)
            prints.setdefault((res["tp"], rank), {}).setdefault(json.dumps(res["fingerprint"], sort_keys=True), []).append(
                f"{res['scenario']}/{res['method']}")
    checks = report.guard(prints)
    text = report.render(model_dir=model_dir, args=args, machine=machine, results=results, group_results=group_results,
                         facts=bench.facts, ckpt_bytes=ckpt_bytes, nfiles=len(files), checks=checks, elapsed=elapsed,
                         labels=LABELS, fl_keys=FL_KEYS, peer_notes=peer_notes)
    print()
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            text = report.keep_foreign_sections(out.read_text(), text)
        out.write_text(text)
        print(f"wrote {args.out}")
    if args.json and not args.from_json:
        saved = {"model_dir": str(model_dir), "elapsed_s": elapsed, "runs_per": args.runs, "nice": args.nice,
                 "runs": single, "groups": [g for gs in groups.values() for g in gs]}
        Path(args.json).write_text(json.dumps(saved, indent=1))
    return 1 if any("MISMATCH" in c for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
