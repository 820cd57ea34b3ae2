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
from .. import records
from .case import Case, Grid, Options
from .record import Oracle

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
    rank: int | None  # None: the whole configuration (refused before any rank); a flat rank over a grid

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
    grid: str = ""  # the pipeline / data-parallel layout ("" for a tensor-parallel run)

    def line(self) -> str:
        rank = "*" if self.rank is None else str(self.rank)
        text = f"{self.case:<24} tp={self.tp:<2}{' ' + self.grid if self.grid else ''} rank={rank:<2} {self.options:<16} {self.outcome}"
        return text + (f": {self.detail}" if self.detail else "")


def job_id(case: Case, grid: Grid, options: Options) -> str:
    """vLLM's run for (case, grid, options); options that are ours alone (text_only) share it."""
    label = options.vllm_label
    layout = f"{grid.label}.tp{grid.tp}" if grid.label else f"tp{grid.tp}"
    return f"{case.name}.{layout}" + ("" if label == "-" else "." + label.replace(",", "."))


def _jobs(cases: Iterable[Case], models: Mapping[str, Path]) -> list[dict[str, Any]]:
    jobs = {
        job_id(c, grid, o): {
            "id": job_id(c, grid, o),
            "case": c.name,
            "model": str(models[c.name]),
            **grid.job(),
            **o.vllm(),
            "multimodal": c.multimodal,
        }
        for c in cases
        for grid in c.layouts
        for o in c.options
    }
    return list(jobs.values())


def compare_state(ours: Mapping[str, Any], theirs: Mapping[str, Any], aliases: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(problems, listed): every name, shape, dtype and byte must agree (``theirs`` holds vLLM's
    ``[dtype, shape, sha256]`` of each tensor, :func:`records.tensor_digest`); vLLM aliases of a
    compared tensor that functional_load does not name are listed."""
    problems, listed = [], []
    for name in sorted(set(ours) | set(theirs) | set(aliases)):
        mine = records.tensor_digest(ours[name]) if name in ours else None
        other = theirs.get(name)
        if other is None and name in aliases:
            if mine is None:
                listed.append(f"{name} (alias of {aliases[name]})")
                continue
            other = theirs.get(aliases[name])
        if mine is None:
            problems.append(f"{name}: only vLLM has it, {other[0]} {other[1]}" if other else f"{name}: an alias of nothing")
        elif other is None:
            problems.append(f"{name}: only functional_load has it, {mine[0]} {mine[1]}")
        elif mine[:2] != list(other[:2]):
            problems.append(f"{name}: ours {mine[0]} {mine[1]}, vLLM {other[0]} {other[1]}")
        elif mine[2] != other[2]:
            problems.append(f"{name}: the bytes differ (sha256 ours {mine[2][:12]}, vLLM {other[2][:12]})")
    return problems, listed


def _ours(model: Path, grid: Grid, rank: int, options: Options, plan_only: bool) -> Any:
    kwargs = {**grid.ours(rank), **options.ours()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a placement fallback warns; the rows say what was served
        if plan_only:
            return fl.plan(model, **kwargs)
        return fl.load(model, progress=False, **kwargs)


def _short(message: str, limit: int = 160) -> str:
    first = " ".join(message.split())
    return first if len(first) <= limit else first[: limit - 3] + "..."


def compare_job(case: Case, grid: Grid, options: Options, model: Path, result: Mapping[str, Any]) -> list[Row]:
    """The rows of one (case, grid, options) job, from vLLM's answer (:mod:`.record`)."""
    rows = []
    row = lambda rank, outcome, detail="", listed=(): Row(case.name, grid.tp, rank, options.label, outcome, detail, tuple(listed),
                                                          grid=grid.label)
    refused = result.get("refused")
    ranks = result.get("ranks", {})
    for rank in range(grid.size) if refused is None else [None]:
        vllm: dict[str, Any] = ranks.get(str(rank), {}) if rank is not None else {"status": "refused", "error": refused}
        check_ranks = [rank] if rank is not None else list(range(grid.size))
        errors = []  # functional_load must refuse on every rank vLLM refuses, before reading
        for r in check_ranks:
            try:
                _ours(model, grid, r, options, plan_only=True)
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
        ours = _ours(model, grid, rank, options, plan_only=False)
        saved = vllm["tensors"]
        vision: list[str] = []
        if options.text_only:  # vLLM's whole model, less the parameters text_only leaves out
            saved, vision = _language_model(saved, model, grid, rank, options)
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
    return [dataclasses.replace(r, architecture=architecture, spec=spec, vllm_class=vllm_class, quantization=quantization) for r in rows]


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


def _language_model(saved: dict[str, Any], model: Path, grid: Grid, rank: int, options: Options) -> tuple[dict[str, Any], list[str]]:
    """vLLM's rank state less the parameters that only our layout without text_only has (the
    vision tower and projector), and a problem for each of those vLLM does not have."""
    kwargs = {**grid.ours(rank), **{k: v for k, v in options.ours().items() if k not in ("text_only", "load_format")}}
    whole = fl.layout(model, **kwargs).params
    left_out = set(whole) - set(fl.layout(model, text_only=True, **kwargs).params)
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


def case_jobs(cases: Iterable[Case], work: Path) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    """The cases' checkpoints (written under ``work/models``) and vLLM's jobs over them."""
    cases = list(cases)
    models = {c.name: c.write(work / "models") for c in cases}
    return models, _jobs(cases, models)


def run_parity(cases: Iterable[Case], work: Path, *, oracle: Oracle, progress: bool = True) -> list[Row]:
    """Build the checkpoints, get vLLM's answers from ``oracle`` (:class:`.record.Recorded` or
    :class:`.record.Live`), compare; one Row per (case, tp, rank, options)."""
    cases = list(cases)
    models, jobs = case_jobs(cases, work)
    answers = oracle.answers(jobs, work)
    start = time.perf_counter()
    rows = []
    for case in cases:
        for grid in case.layouts:
            for options in case.options:
                answer = answers[job_id(case, grid, options)]
                rows.extend(compare_job(case, grid, options, models[case.name], answer))
    if progress:
        print(f"functional_load compared {len(rows)} rows in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return rows


def summary(rows: list[Row]) -> str:
    states = [r for r in rows if r.rank is not None]
    identical = sum(r.outcome == IDENTICAL for r in states)
    refused_configs = {(r.case, r.tp, r.grid, r.options) for r in rows if r.outcome == REFUSED_BOTH}
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
