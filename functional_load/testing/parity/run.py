"""Run the parity harness: real vLLM and functional_load load the same ranks; compare.

``run_parity(cases, work)`` builds the cases' checkpoints, has real vLLM load every rank (in the
vLLM environment, :mod:`.vllm_worker`), loads the same ranks with :func:`functional_load.load`,
and returns one :class:`Row` per (case, tp, rank, options). A rank state is identical when both
have the same names, shapes, dtypes and bytes; names only vLLM has that alias a compared tensor
are listed, not counted (vLLM's buffers are never compared).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import functional_load as fl

from ...model.config import read_config
from ...model.spec import spec_for_config
from . import env
from .case import Case, Options

WORKER = Path(__file__).with_name("vllm_worker.py")

IDENTICAL = "identical"
REFUSED_BOTH = "refused by both"
VLLM_CANNOT = "vLLM cannot (listed)"
WE_REFUSE = "functional_load refuses (listed)"
DIFFERENT = "DIFFERENT"
ACCEPTED = (IDENTICAL, REFUSED_BOTH, VLLM_CANNOT, WE_REFUSE)


@dataclass(frozen=True)
class Row:
    case: str
    tp: int
    rank: int | None  # None: the whole configuration (refused before any rank)
    options: str
    outcome: str
    detail: str = ""
    listed: tuple[str, ...] = field(default=())  # vLLM-only names that alias a compared tensor
    # what the case is, for the coverage table: config.json's architecture, the spec that served
    # it, the class vLLM built, the checkpoint's quantization ("" when none)
    architecture: str = ""
    spec: str = ""
    vllm_class: str = ""
    quantization: str = ""

    def line(self) -> str:
        rank = "*" if self.rank is None else str(self.rank)
        text = f"{self.case:<24} tp={self.tp:<2} rank={rank:<2} {self.options:<16} {self.outcome}"
        return text + (f": {self.detail}" if self.detail else "")


def job_id(case: Case, tp: int, options: Options) -> str:
    """vLLM's run for (case, tp, options); options that are ours alone (text_only) share it."""
    label = options.vllm_label
    return f"{case.name}.tp{tp}" + ("" if label == "-" else "." + label.replace(",", "."))


def _jobs(cases: Iterable[Case], models: Mapping[str, Path]) -> list[dict[str, Any]]:
    jobs = {
        job_id(c, tp, o): {"id": job_id(c, tp, o), "model": str(models[c.name]), "tp": tp, **o.vllm(), "multimodal": c.multimodal}
        for c in cases
        for tp in c.tps
        for o in c.options
    }
    return list(jobs.values())


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
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
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


def _bits(t: Any) -> Any:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def compare_state(ours: Mapping[str, Any], theirs: Mapping[str, Any], aliases: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(problems, listed): every name, shape, dtype and byte must agree; vLLM aliases of a
    compared tensor that functional_load does not name are listed."""
    import torch

    problems, listed = [], []
    for name in sorted(set(ours) | set(theirs) | set(aliases)):
        mine = ours.get(name)
        other = theirs.get(name)
        if other is None and name in aliases:
            if mine is None:
                listed.append(f"{name} (alias of {aliases[name]})")
                continue
            other = theirs.get(aliases[name])
        if mine is None:
            assert other is not None
            problems.append(f"{name}: only vLLM has it, {other.dtype} {list(other.shape)}")
        elif other is None:
            problems.append(f"{name}: only functional_load has it, {mine.dtype} {list(mine.shape)}")
        elif mine.dtype != other.dtype or tuple(mine.shape) != tuple(other.shape):
            problems.append(f"{name}: ours {mine.dtype} {list(mine.shape)}, vLLM {other.dtype} {list(other.shape)}")
        elif not torch.equal(_bits(mine), _bits(other)):
            differ = int((_bits(mine) != _bits(other)).sum())
            problems.append(f"{name}: {differ} of {mine.numel() * mine.element_size()} bytes differ")
    return problems, listed


def _ours(model: Path, tp: int, rank: int, options: Options, plan_only: bool) -> Any:
    kwargs = {"tp_size": tp, "rank": rank, **options.ours()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a placement fallback warns; the rows say what was served
        if plan_only:
            return fl.plan(model, **kwargs)
        return fl.load(model, progress=False, **kwargs)


def _short(message: str, limit: int = 160) -> str:
    first = " ".join(message.split())
    return first if len(first) <= limit else first[: limit - 3] + "..."


def compare_job(case: Case, tp: int, options: Options, model: Path, result: Mapping[str, Any], out: Path) -> list[Row]:
    """The rows of one (case, tp, options) job."""
    from safetensors.torch import load_file

    rows = []
    row = lambda rank, outcome, detail="", listed=(): Row(case.name, tp, rank, options.label, outcome, detail, tuple(listed))
    refused = result.get("refused")
    ranks = result.get("ranks", {})
    for rank in range(tp) if refused is None else [None]:
        vllm: dict[str, Any] = ranks.get(str(rank), {}) if rank is not None else {"status": "refused", "error": refused}
        check_ranks = [rank] if rank is not None else list(range(tp))
        errors = []  # functional_load must refuse on every rank vLLM refuses, before reading
        for r in check_ranks:
            try:
                _ours(model, tp, r, options, plan_only=True)
            except fl.LoadError as exc:
                errors.append(f"{type(exc).__name__}: {_short(str(exc))}")
        ours_error = errors[0] if errors and len(errors) == len(check_ranks) else None
        if errors and ours_error is None:
            rows.append(row(rank, DIFFERENT, f"functional_load refuses {len(errors)} of {len(check_ranks)} ranks: {errors[0]}"))
            continue
        if vllm["status"] != "ok":
            theirs = f"{vllm['error']['type']}: {_short(vllm['error']['message'])}"
            if ours_error is not None:
                rows.append(row(rank, REFUSED_BOTH, f"vLLM {theirs} | ours {ours_error}"))
            elif case.vllm_cannot or options.text_only:
                why = case.vllm_cannot or "text_only loads the language model alone, vLLM builds the whole model"
                rows.append(row(rank, VLLM_CANNOT, f"{why} (vLLM {theirs})"))
            else:
                rows.append(row(rank, DIFFERENT, f"vLLM refuses ({theirs}), functional_load loads"))
            continue
        if ours_error is not None:
            outcome = WE_REFUSE if case.we_refuse else DIFFERENT
            rows.append(row(rank, outcome, f"{case.we_refuse or 'vLLM loads'}; ours {ours_error}"))
            continue
        assert rank is not None
        ours = _ours(model, tp, rank, options, plan_only=False)
        saved = load_file(str(out / job_id(case, tp, options) / f"rank{rank}.safetensors"))
        vision: list[str] = []
        if options.text_only:  # vLLM's whole model, less the parameters text_only leaves out
            saved, vision = _language_model(saved, model, tp, rank, options)
        problems, listed = compare_state(ours, saved, vllm.get("aliases", {}))
        problems += vision
        placement = _placement_problem(ours, vllm.get("experts", {}))
        if placement:
            problems.append(placement)
        if problems:
            more = " ..." if len(problems) > 4 else ""
            rows.append(row(rank, DIFFERENT, f"{len(problems)} problems: " + "; ".join(problems[:4]) + more))
        else:
            rows.append(row(rank, IDENTICAL, "", listed))
    architecture, spec, vllm_class, quantization = _about(model, result)
    return [
        dataclasses.replace(r, architecture=architecture, spec=spec, vllm_class=vllm_class, quantization=quantization) for r in rows
    ]


def _about(model: Path, result: Mapping[str, Any]) -> tuple[str, str, str, str]:
    """The coverage fields of a job's rows (see :class:`Row`): architecture, spec, vLLM class, quantization."""
    config = json.loads((model / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    method = str(quant.get("quant_method", ""))
    if method == "compressed-tensors":
        formats = sorted({str(g.get("format") or quant.get("format")) for g in (quant.get("config_groups") or {}).values()})
        method += f" ({', '.join(formats or [str(quant.get('format'))])})"
    try:
        spec = spec_for_config(read_config(model)).name
    except fl.LoadError:
        spec = ""
    classes = {r.get("model_class", "") for r in result.get("ranks", {}).values()} - {""}
    return str((config.get("architectures") or [""])[0]), spec, ", ".join(sorted(classes)), method


def _language_model(saved: dict[str, Any], model: Path, tp: int, rank: int, options: Options) -> tuple[dict[str, Any], list[str]]:
    """vLLM's rank state less the parameters that only our layout without text_only has (the
    vision tower and projector), and a problem for each of those vLLM does not have."""
    kwargs = {k: v for k, v in options.ours().items() if k not in ("text_only", "load_format")}
    whole = fl.layout(model, tp_size=tp, rank=rank, **kwargs).params
    left_out = set(whole) - set(fl.layout(model, tp_size=tp, rank=rank, text_only=True, **kwargs).params)
    problems = [f"{name}: text_only leaves it out, but vLLM has no such parameter" for name in sorted(left_out - set(saved))]
    return {name: t for name, t in saved.items() if name not in left_out}, problems


def _placement_problem(state: Any, experts: Mapping[str, Any]) -> str:
    """The expert placement the plan records must be the one vLLM used."""
    used = {v["placement"] for v in experts.values()}
    if not used:
        return ""
    recorded = state.plan.parallel.expert_placement
    if {recorded} != used:
        return f"expert placement: plan records {recorded!r}, vLLM used {sorted(used)}"
    return ""


def run_parity(cases: Iterable[Case], work: Path, *, python: Path, workers: int = 2, progress: bool = True) -> list[Row]:
    """Build, run vLLM, compare; one Row per (case, tp, rank, options)."""
    cases = list(cases)
    models_root = work / "models"
    models = {c.name: c.write(models_root) for c in cases}
    out = work / "vllm"
    jobs = _jobs(cases, models)
    torchvision = env.ensure_torchvision() if any(c.multimodal for c in cases) else None
    start = time.perf_counter()
    run_vllm(python, jobs, out, workers, torchvision=torchvision)
    if progress:
        print(f"vLLM loaded {len(jobs)} configurations in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    rows = []
    for case in cases:
        for tp in case.tps:
            for options in case.options:
                result_file = out / job_id(case, tp, options) / "result.json"
                if not result_file.exists():
                    rows.append(Row(case.name, tp, None, options.label, DIFFERENT, f"vLLM wrote no result ({result_file})"))
                    continue
                result = json.loads(result_file.read_text())
                rows.extend(compare_job(case, tp, options, models[case.name], result, out))
    return rows


def summary(rows: list[Row]) -> str:
    states = [r for r in rows if r.rank is not None]
    identical = sum(r.outcome == IDENTICAL for r in states)
    refused_configs = {(r.case, r.tp, r.options) for r in rows if r.outcome == REFUSED_BOTH}
    compared = sum(r.outcome in (IDENTICAL, DIFFERENT) for r in states)
    text = f"{identical} of {compared} rank states identical; {len(refused_configs)} configurations refused by both"
    for outcome, what in ((VLLM_CANNOT, "vLLM cannot load"), (WE_REFUSE, "functional_load refuses what vLLM loads")):
        listed = sum(r.outcome == outcome for r in rows)
        if listed:
            text += f"; {listed} rows {what} (listed with the reason)"
    different = sum(r.outcome == DIFFERENT for r in rows)
    if different:
        text += f"; {different} rows DIFFERENT"
    return text
