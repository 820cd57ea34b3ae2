"""The coverage table of docs/coverage.md, from the rows of a parity run.

One line per architecture: the spec that serves it, the class real vLLM built, the tp sizes at
which every rank of some case was identical (and those refused by both), expert parallelism
proven, and the quantized checkpoints proven. Every architecture a shipped spec lists appears:
those no parity case covers are listed below the table with the reason (:data:`NOT_JUDGED`: real
vLLM's CPU build cannot build them), and an architecture with neither is an error of the run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

from functional_load.model.spec import builtin_specs
from functional_load.testing.parity.run import IDENTICAL, REFUSED_BOTH, Row
from functional_load.vllm_target import VLLM_VERSION

from .report import replace_between

# architectures real vLLM 0.32's CPU build cannot build: their specs are checked against vLLM's
# source (tests/test_unjudged_specs.py), not by the parity harness
NOT_JUDGED: Mapping[str, str] = {
    "DeepseekV32ForCausalLM": "vLLM CPU: 'Sparse Attention is not supported on CPU.'",
    "GlmMoeDsaForCausalLM": "vLLM CPU: 'Sparse Attention is not supported on CPU.' (the DeepSeek-V3.2 class)",
    "KimiLinearForCausalLM": "vLLM CPU: its KDA kernels need CUDA (No module named 'cutlass')",
    "NemotronHForCausalLM": "vLLM CPU: non-gated MoE experts are CUDA/XPU/ROCm only",
    "DbrxForCausalLM": "vLLM 0.32's DBRX loader looks up a stale expert parameter name (blocks.N.ffn.experts.w13_weight)",
    "NemotronHPuzzleForCausalLM": "vLLM CPU: non-gated MoE experts are CUDA/XPU/ROCm only (the Nemotron-H class)",
}

BEGIN, END = "<!-- coverage table: begin -->", "<!-- coverage table: end -->"


def _tps(values: Iterable[int]) -> str:
    return ", ".join(str(t) for t in sorted(set(values))) or "-"


def coverage(rows: list[Row]) -> tuple[str, list[str]]:
    """The table, and the architectures of shipped specs that neither a row nor NOT_JUDGED covers."""
    configs: dict[tuple[str, int, str], list[Row]] = defaultdict(list)
    for row in rows:
        if not row.grid:  # the tensor-parallel runs; pipeline and data-parallel ones are docs/multinode.md's
            configs[(row.case, row.tp, row.options)].append(row)
    by_arch: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for (case, tp, options), group in configs.items():
        first = group[0]
        arch = by_arch[first.architecture or "?"]
        arch["spec"].add(first.spec)
        arch["class"] |= {r.vllm_class for r in group if r.vllm_class}
        arch["cases"].add(case)
        identical = all(r.outcome == IDENTICAL for r in group)
        if identical and not first.quantization:
            arch["ep" if "ep" in options.split(",") else "tp"].add(str(tp))
        if identical and first.quantization:
            arch["quant"].add(first.quantization)
        if all(r.outcome == REFUSED_BOTH for r in group):
            arch["refused"].add(str(tp))
    lines = [
        f"<!-- written by `python -m harness.parity --markdown docs/parity.md --coverage docs/coverage.md` "
        f"against vLLM {VLLM_VERSION} -->",
        "",
        "| architecture | spec | vLLM class | tp proven | refused by both | expert parallel | quantized proven | cases |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(by_arch):
        a = by_arch[name]
        lines.append(
            f"| {name} | {', '.join(sorted(a['spec'] - {''})) or '-'} | {', '.join(sorted(a['class'])) or '-'} | "
            f"{_tps(map(int, a['tp']))} | {_tps(map(int, a['refused']))} | {_tps(map(int, a['ep']))} | "
            f"{'; '.join(sorted(a['quant'])) or '-'} | {len(a['cases'])} |"
        )
    shipped = {arch: spec.name for spec in builtin_specs().values() for arch in spec.architectures}
    unjudged = sorted(a for a in shipped if a not in by_arch)
    lines += ["", f"Architectures real vLLM {VLLM_VERSION} (CPU build) did not judge; their specs are checked against vLLM's source:", ""]
    lines += [f"* {a} (spec `{shipped[a]}`): {NOT_JUDGED[a]}" for a in unjudged if a in NOT_JUDGED]
    return "\n".join(lines) + "\n", [a for a in unjudged if a not in NOT_JUDGED]


def update_coverage(path: Path, rows: list[Row]) -> list[str]:
    """Write the table between the markers of ``path``; returns the uncovered architectures."""
    table, uncovered = coverage(rows)
    replace_between(path, BEGIN, END, table, new_head="# Coverage\n\n")
    return uncovered
