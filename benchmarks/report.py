"""Summaries, goals, the correctness guard and the markdown of the load benchmark."""

from __future__ import annotations

import datetime
import json
import re
import statistics
from pathlib import Path

MB = 1e6


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
    }


def group_summary(ranks: list[dict]) -> dict:
    """One all-ranks run: wall time from the first start to the last end, totals over the ranks."""
    return {
        "seconds": max(r["end"] for r in ranks) - min(r["start"] for r in ranks),
        "slowest_s": max(r["seconds"] for r in ranks),
        "out_bytes": sum(r["out_bytes"] for r in ranks),
        "read_bytes": sum(r["read_bytes"] for r in ranks),
        "peak_rss": sum(r["peak_rss"] for r in ranks),
        "baseline_rss": sum(r["baseline_rss"] for r in ranks),
        "cpu_s": sum(r["cpu_s"] for r in ranks),
        # Machine CPU during the slowest rank's window (about the group's), less all the ranks' own.
        "other_cpu_s": max(0.0, max(r["other_cpu_s"] + r["cpu_s"] for r in ranks) - sum(r["cpu_s"] for r in ranks)),
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


def fastest(results: dict, fl_keys: set[str]) -> list[str]:
    lines = []
    for (scenario, tp), methods in sorted(results.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        fl = sorted(((s["median_s"], k) for k, s in methods.items() if k in fl_keys), key=lambda x: x[0])
        if len(fl) < 2:
            continue
        best_s, best = fl[0]
        rest = ", ".join(f"{k} {s:.2f}" for s, k in fl[1:4])
        auto = methods.get("auto")
        auto_txt = f"; auto {auto['median_s']:.2f} s" if auto else ""
        lines.append(f"{scenario}, tp={tp}: fastest **{best}** {best_s:.2f} s (next: {rest}){auto_txt}")
    return lines


def guard(fingerprints: dict[tuple[int, int], dict[str, list[str]]]) -> list[str]:
    """``fingerprints[(tp, rank)][json of hashes] = ["scenario/method", ...]``: all must agree."""
    checks = []
    for (tp, rank), prints in sorted(fingerprints.items()):
        if len(prints) == 1:
            who = next(iter(prints.values()))
            methods = sorted({w.split("/", 1)[1] for w in who})
            checks.append(f"tp={tp} rank {rank}: {len(who)} runs of {len(methods)} methods, "
                          f"{len(json.loads(next(iter(prints))))} tensors hashed: all equal — OK")
        elif prints:
            groups = "; ".join(f"{sorted(set(v))}" for v in prints.values())
            checks.append(f"tp={tp} rank {rank}: MISMATCH between groups {groups}")
    return checks


HEADER = ("| method | median s | min s | GB/s (output) | read_bytes MB | peak RSS MB | above baseline MB | CPU s | other CPU s |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def _row(label: str, s: dict) -> str:
    return (f"| {label} | {s['median_s']:.3f} | {s['min_s']:.3f} | {s['out_bytes'] / s['median_s'] / 1e9:.2f} | "
            f"{s['read_bytes'] / MB:,.0f} | {s['peak_rss'] / MB:,.0f} | {(s['peak_rss'] - s['baseline_rss']) / MB:,.0f} | "
            f"{s['cpu_s']:.2f} | {s['other_cpu_s']:.2f} |")


def table(scenario: str, tp: int, methods: dict, facts: dict, labels: dict[str, str]) -> str:
    rows = [HEADER]
    for key, label in labels.items():
        if key not in methods:
            continue
        if key == "limit":
            label = ("limit: 4-thread sequential pread of " + ("the whole files" if tp == 1 else "the rank's merged byte ranges")
                     if scenario == "cold" else "limit: copy the rank's output bytes into fresh memory")
        rows.append(_row(label, methods[key]))
    f = facts[tp]
    head = (f"### {scenario}, tp={tp} (rank {1 if tp > 1 else 0}): output {f['out_bytes'] / MB:,.0f} MB, "
            f"exact bytes to read {f['bytes_to_read'] / MB:,.0f} MB")
    if scenario == "cold" and tp > 1:
        head += f", cold-limit ranges {f['range_bytes'] / MB:,.0f} MB"
    return head + "\n\n" + "\n".join(rows)


def all_ranks_table(tp: int, group_results: dict, labels: dict[str, str]) -> list[str]:
    out = []
    for scenario in ("cold", "hot"):
        methods = group_results.get(scenario)
        if not methods:
            continue
        out += [f"### {scenario}, all {tp} ranks at once (one process per rank, common start)", "",
                HEADER.replace("median s", "median s (wall, to the last rank)").replace("peak RSS MB", "peak RSS MB (sum)")
                .replace("CPU s |", "CPU s (sum) |", 1)]
        out += [_row(labels[key], s) for key, s in methods.items()]
        out.append("")
    return out


def keep_foreign_sections(old: str, new: str) -> str:
    """Append the ``## `` sections of ``old`` that this benchmark does not write (those of other
    benchmarks, e.g. bench_plan's "Planning at scale"), so a rerun does not drop them."""
    def sections(text: str) -> dict[str, str]:
        parts = re.split(r"(?m)^(?=## )", text)
        return {p.splitlines()[0]: p for p in parts[1:]}

    ours = ("## Machine", "## Method", "## Peers", "## Goals", "## Fastest functional_load", "## Correctness guard", "## Results")
    extra = [body for head, body in sections(old).items() if not head.startswith(ours)]
    return new if not extra else new.rstrip("\n") + "\n\n" + "\n".join(b.rstrip("\n") + "\n" for b in extra)


def render(*, model_dir: Path, args, machine: dict, results: dict, group_results: dict, facts: dict, ckpt_bytes: int,
           nfiles: int, checks: list[str], elapsed: float, labels: dict[str, str], fl_keys: set[str], peer_notes: list[str]) -> str:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    out = ["# Load performance", "",
           f"Generated by `functional-load bench` (benchmarks/bench_load.py) on {now}, {elapsed / 60:.1f} min.", "",
           "## Machine", ""]
    out += [f"* {k}: {v}" for k, v in machine.items()]
    out += ["", "Other processes ran on this VM during the measurements; each row's *other CPU s* is the CPU time",
            "they used during that run's timed section (median), so a row can be judged against it.", "",
            "## Method", "",
            f"* Checkpoint: `{model_dir}`, {ckpt_bytes / 1e9:.2f} GB in {nfiles} shards, Llama-2-7B shapes (hidden 4096,",
            "  intermediate 11008, 32 heads, 32 KV heads, vocab 32000), bf16 random data, written by",
            "  `benchmarks/make_checkpoint.py`.",
            "* tp=1 loads rank 0; tp=2 and tp=4 load rank 1.",
            f"* {args.runs} run(s) per method and scenario, methods interleaved round by round; medians (and min).",
            f"  Measured workers run at niceness {args.nice:+d} (the cache drop/warm and the parent at normal priority)."]
    out += METHOD_NOTES.format(all_ranks=args.all_ranks).splitlines()
    out += ["", "Rerun (about 15 minutes with the peers installed: `pip install -e \".[bench]\"`; `--quick` for a",
            "1-layer checkpoint and one run):", "", "```",
            "python benchmarks/make_checkpoint.py            # /tmp/fl-bench/llama7b-4l, 2.15 GB",
            f"functional-load bench /tmp/fl-bench/llama7b-4l --runs {args.runs} --tp {','.join(map(str, args.tp))}"
            " --out docs/performance.md \\",
            "    --json /tmp/fl-bench/full.json        # raw runs; re-render with benchmarks/bench_load.py --from-json",
            "```", "", "## Peers", ""]
    out += [f"* {n}" for n in peer_notes]
    out += ["", "## Goals (functional_load with its defaults)", "",
            "Ratios are computed from medians; \"on min times\" repeats a speed ratio with each method's best",
            "run, as a check against the noise from other jobs. Peak RSS is the absolute VmHWM.", ""]
    out += [f"* {g}" for g in goals(results, facts)]
    fast = fastest(results, fl_keys)
    if fast:
        out += ["", "## Fastest functional_load variant per scenario (median s)", ""]
        out += [f"* {line}" for line in fast]
    out += ["", "## Correctness guard", ""]
    out += [f"* {c}" for c in checks]
    out += ["", "## Results", ""]
    for scenario in ("cold", "hot"):
        for tp in args.tp:
            if (scenario, tp) in results:
                out += [table(scenario, tp, results[(scenario, tp)], facts, labels), ""]
    if group_results:
        out += all_ranks_table(args.all_ranks, group_results, labels)
    return "\n".join(out) + "\n"


METHOD_NOTES = """\
* Every run is a fresh process; imports happen before the timer (for functional_load this includes
  `functional_load.quant.fp8_kernels`, i.e. jax, which a default-target `load()` no longer needs), and the
  timer covers the whole load (planning/header reads, allocation, reads, copies). Output tensors stay
  alive until peak RSS is read.
* **cold**: before each run every file the run may read (the checkpoint's shards and the peer's own
  files) is dropped from the page cache with `posix_fadvise(POSIX_FADV_DONTNEED)` and residency is
  verified with `mincore` (< 1 %).
* **hot**: right before each run every file the method reads is read once (re-warm; idle page cache is
  evicted after ~60 s on this VM) and residency is verified (> 99 %).
* *read_bytes*: `/proc/self/io` read_bytes delta (bytes the process made storage deliver,
  readahead included). *peak RSS*: VmHWM, which counts mapped file pages; *above baseline*:
  VmHWM minus VmRSS just before the timer (≈ 240 MB of interpreter, torch and safetensors; ≈ 355 MB
  for functional_load workers, which have imported jax).
* Methods:
  * functional_load: `functional_load.load(dir, tp_size, rank, read=ReadOptions(strategy=..., threads=..., ...))`;
    *auto* is the library's defaults (16 MiB chunks on 4 threads, exact preads with `FADV_RANDOM`,
    row-parallel slices read as sequential spans when not in the page cache, copied strided out of a
    mapping of their span when they are; sequential runs of abutting tensors in one `preadv`). Other variants
    (`--methods pread-t1,pread-t2,span-t2,direct-t2,mmap-t2,eager-t2,...`) change one option and are
    not run by default.
  * vLLM-style: `torch.empty` parameters at rank-local vLLM shapes (fused qkv/gate_up); per
    shard `safe_open(framework="pt")`, per tensor `get_tensor`, `narrow` on the shard dim,
    `copy_` into the parameter slot (vocab padding zeroed) — vLLM's default lazy path.
  * `load_file` + narrow + clone (`--methods ...,load_file`; not run by default): per shard
    `safetensors.torch.load_file`, then each tensor's rank slice `clone`d into an owned contiguous
    tensor (checkpoint names, not fused).
  * Peers (optional extra `bench`; benchmarks/peers.py). Each streams the **whole** checkpoint
    whatever the tp, as vLLM does with them; *→ vLLM layout* rows feed every tensor to the
    vLLM-style loader's code (narrow + `copy_` into the rank's parameters), *raw* rows only keep
    what the peer hands out (whole checkpoint tensors; the same at every tp, so measured at the
    first tp only; their GB/s is over the whole checkpoint).
    * Run:ai model streamer: `SafetensorsStreamer().stream_files(files, device="cpu")` +
      `get_tensors()` (vLLM's `runai_safetensors_weights_iterator`), `RUNAI_STREAMER_CONCURRENCY=16`;
      cold with its default file strategy (`io_uring_direct`, i.e. O_DIRECT), hot with
      `RUNAI_STREAMER_FS_STRATEGY=io_uring_buffered,sync_buffered` (O_DIRECT would skip the page cache).
    * fastsafetensors: per shard `SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)`,
      `add_filenames`, `copy_files_to_device()`, `get_tensor` per key (vLLM's
      `fastsafetensors_weights_iterator` with a single-process group); cold with its default
      (O_DIRECT on a local filesystem), hot with `FASTSAFETENSORS_ODIRECT=0` (buffered).
    * tensorizer, whole model: the checkpoint serialized once (untimed) with
      `TensorSerializer.write_state_dict`; timed: `TensorDeserializer(file, device="cpu")`, every key.
    * tensorizer, per-rank file (tp > 1): the rank's vLLM-layout state (from the vLLM-style loader)
      serialized once, one file per rank as vLLM's tensorizer path writes them; timed: deserializing
      that file (vLLM's `load_into_module` registers these tensors as the parameters: no layout step).
    * functional_load pre-sharded (tp > 1): `functional_load.save_sharded(dir, out, tp)` once
      (untimed), then `functional_load.load(out, tp_size=tp, rank=r)` (reads the rank's own file).
  * limit, cold: four threads pread 16 MiB blocks in file order into reused buffers. tp=1 reads
    the whole files; tp>1 reads the rank's byte ranges merged with a 1 MiB gap (its row-slices of
    dim-0-sharded tensors, and whole row-parallel tensors, whose slices touch every page).
  * limit, hot: `torch.empty(n)` + `copy_` of the rank's output bytes from a resident source in
    the same process (only the copy is timed, page faults of the fresh destination included).
    *copy into pre-faulted memory* is the same without page faults (the memcpy ceiling).
* All ranks at once (tp={all_ranks}): one process per rank, each imports, then waits at a barrier (a
  line on its stdin) that the parent releases for all ranks together, after the cache drop or warm;
  time is the wall time from the first start to the last rank's end (`time.monotonic` in each),
  *read_bytes*, peak RSS and CPU are summed over the ranks; fingerprints are computed only after the
  last rank finished.
* Correctness guard: every loader's result for a few tensors (fused qkv and gate_up, o_proj,
  down_proj, norms, sampled embedding/lm_head rows) is hashed; all methods (peers and their raw
  output included, brought into the rank's layout after the timer) must agree per tp and rank."""
