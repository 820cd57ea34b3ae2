"""The parity table of docs/parity.md, from the rows of a run."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from functional_load.testing.parity.run import Row
from functional_load.vllm_target import VLLM_VERSION


def markdown(rows: list[Row], summary: str) -> str:
    """One line per (case, layout, options): how many ranks were identical, or what happened."""
    groups: dict[tuple[str, str, str], list[Row]] = defaultdict(list)
    for row in rows:
        groups[(row.case, f"{row.tp} ({row.grid})" if row.grid else str(row.tp), row.options)].append(row)
    lines = [
        f"<!-- written by `python -m harness.parity --markdown ...` against vLLM {VLLM_VERSION} -->",
        "",
        f"**{summary}** (vLLM {VLLM_VERSION}, CPU build).",
        "",
        "| case | tp | options | ranks | outcome | detail |",
        "|---|---|---|---|---|---|",
    ]
    for (case, tp, options), group in groups.items():
        outcomes = sorted({r.outcome for r in group})
        ranks = "all" if group[0].rank is None else str(len(group))
        detail = next((r.detail for r in group if r.detail), "")
        detail = detail.replace("|", "\\|")
        lines.append(f"| {case} | {tp} | {options} | {ranks} | {', '.join(outcomes)} | {detail} |")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- parity table: begin -->", "<!-- parity table: end -->"


def update(path: Path, rows: list[Row], summary: str) -> None:
    """Replace the table between the markers of ``path`` (docs/parity.md), or write a new file."""
    replace_between(path, BEGIN, END, markdown(rows, summary))


def replace_between(path: Path, begin: str, end: str, table: str, new_head: str = "") -> None:
    """Put ``table`` between the markers ``begin`` and ``end`` of ``path``, keeping the text
    around them; a file without them becomes ``new_head`` and the marked table."""
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = f"{head}{begin}\n{table}{end}{rest.split(end, 1)[1]}"
    else:
        text = f"{new_head}{begin}\n{table}{end}\n"
    path.write_text(text)
