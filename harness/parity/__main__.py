"""``python -m harness.parity [NAME ...]``: one line per (case, tp, rank, options)
and a summary; exit status 1 when any rank state differs from real vLLM's.

By default vLLM's answers come from the record (``tests/oracle/vllm/``, no vLLM needed); a
missing or stale one fails. ``--refresh`` has real vLLM recompute the stale answers (``--all``:
every one) and stores them; ``--check`` only lists the stale ones; ``--sample F --seed S``
recomputes a fraction of the cases with real vLLM and fails when any answer differs from the
record; ``--live`` compares with real vLLM and stores nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from functional_load.testing import records
from functional_load.testing.parity import env
from functional_load.testing.parity.case import Case
from functional_load.testing.parity.record import STORE, Live, Recorded, stale_jobs, store_answers
from functional_load.testing.parity.run import ACCEPTED, Row, case_jobs, run_parity, summary

from .cases import CASES, CHECK_SPEC, RECORDED, select
from .coverage import update_coverage
from .report import update


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness.parity", description=__doc__)
    parser.add_argument("names", nargs="*", help="run only the cases whose name contains one of these")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--refresh", action="store_true", help="real vLLM recomputes the stale answers and the record is rewritten")
    mode.add_argument("--check", action="store_true", help="list the missing or stale answers (no vLLM); exit 1 when any")
    mode.add_argument("--sample", type=float, metavar="F", help="real vLLM recomputes this fraction of the cases; compared with the record")
    mode.add_argument("--live", action="store_true", help="compare with real vLLM directly; store nothing")
    parser.add_argument("--all", action="store_true", help="with --refresh: recompute every answer, stale or not")
    parser.add_argument("--seed", default="", help="with --sample: what picks the sample (CI: the commit hash)")
    parser.add_argument("--workers", type=int, default=2, help="vLLM processes at once (default 2)")
    parser.add_argument("--work", type=Path, help="keep checkpoints and vLLM's rank states here (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    parser.add_argument("--markdown", type=Path, help="update the table of docs/parity.md (between its markers)")
    parser.add_argument("--coverage", type=Path, help="update the coverage table of docs/coverage.md (between its markers)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cases = select(CASES, args.names)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fl-parity-") as tmp:
        work = args.work or Path(tmp)
        recorded = select(RECORDED, args.names)  # the parity cases and check-spec's
        if args.check:
            return _check(recorded, work)
        if args.sample is not None:
            return _sample(recorded, work, args)
        if args.refresh:
            _refresh(recorded, work, args)
        live = Live(env.ensure(), args.workers, progress=True) if args.live else None
        rows = run_parity(cases, work, oracle=live or Recorded())
    _report(rows, args)
    print(f"({time.perf_counter() - start:.0f} s, vLLM {env.VLLM_VERSION}, {'live' if args.live else 'recorded'})", file=sys.stderr)
    return 0 if all(r.outcome in ACCEPTED for r in rows) else 1


def _check(cases: tuple[Case, ...], work: Path) -> int:
    stale = stale_jobs(case_jobs(cases, work)[1])
    if stale:
        print(records.stale_error("vLLM parity", [j["id"] for j in stale], "python -m harness.parity --refresh"))
        return 1
    print(f"every recorded vLLM parity answer is current ({len(cases)} cases)")
    return 0


def _refresh(cases: tuple[Case, ...], work: Path, args: argparse.Namespace) -> None:
    jobs = case_jobs(cases, work)[1]
    todo = jobs if args.all else stale_jobs(jobs)
    print(f"real vLLM recomputes {len(todo)} of {len(jobs)} answers", file=sys.stderr)
    if todo:
        store_answers(todo, Live(env.ensure(), args.workers, progress=True).answers(todo, work / "refresh"))


def _sample(cases: tuple[Case, ...], work: Path, args: argparse.Namespace) -> int:
    """Real vLLM recomputes the answers of a sample of the cases; each must equal the record."""
    kinds = ([c.name for c in cases if c in CHECK_SPEC], [c.name for c in cases if c not in CHECK_SPEC])  # each kind sampled
    chosen = {name for names in kinds for name in records.sample(names, args.sample, args.seed)}
    jobs = case_jobs(tuple(c for c in cases if c.name in chosen), work)[1]
    recorded = Recorded(STORE).answers(jobs, work)  # stale answers fail first, with the refresh command
    fresh = Live(env.ensure(), args.workers, progress=True).answers(jobs, work / "sample")
    differ = [j["id"] for j in jobs if fresh[j["id"]] != recorded[j["id"]]]
    print(f"sample of {len(chosen)} cases ({len(jobs)} vLLM jobs, seed {args.seed!r}): {', '.join(sorted(chosen))}")
    for job_id in differ:
        print(f"DIFFERENT from the record: {job_id} (vLLM nondeterministic, or the record was not written by vLLM)")
    return 1 if differ else 0


def _report(rows: list[Row], args: argparse.Namespace) -> None:
    for row in rows:
        print(row.line())
    text = summary(rows)
    print(text)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.markdown:
        update(args.markdown, rows, text)
    if args.coverage:
        uncovered = update_coverage(args.coverage, rows)
        if uncovered:
            print(f"no parity case and no reason for: {', '.join(uncovered)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
