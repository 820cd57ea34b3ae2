"""``python -m functional_load.testing.parity [NAME ...]``: one line per (case, tp, rank, options)
and a summary; exit status 1 when any rank state differs from real vLLM's."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from . import env
from .cases import CASES, select
from .coverage import update_coverage
from .report import update
from .run import ACCEPTED, run_parity, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m functional_load.testing.parity", description=__doc__)
    parser.add_argument("names", nargs="*", help="run only the cases whose name contains one of these")
    parser.add_argument("--workers", type=int, default=2, help="vLLM processes at once (default 2)")
    parser.add_argument("--work", type=Path, help="keep checkpoints and vLLM's rank states here (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    parser.add_argument("--markdown", type=Path, help="update the table of docs/parity.md (between its markers)")
    parser.add_argument("--coverage", type=Path, help="update the coverage table of docs/coverage.md (between its markers)")
    args = parser.parse_args(argv)
    python = env.ensure()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fl-parity-") as tmp:
        work = args.work or Path(tmp)
        rows = run_parity(select(CASES, args.names), work, python=python, workers=args.workers)
    for row in rows:
        print(row.line())
    text = summary(rows)
    print(text)
    print(f"({time.perf_counter() - start:.0f} s, vLLM {env.VLLM_VERSION})", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.markdown:
        update(args.markdown, rows, text)
    if args.coverage:
        uncovered = update_coverage(args.coverage, rows)
        if uncovered:
            print(f"no parity case and no reason for: {', '.join(uncovered)}", file=sys.stderr)
    return 0 if all(r.outcome in ACCEPTED for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
