"""A real torchrun job: 4 processes (gloo), each loading its own rank from one checkpoint directory.

``tests/_torchrun_worker.py`` runs under ``python -m torch.distributed.run --standalone
--nproc-per-node 4``; each process takes ``(pp_rank, dp_rank, tp_rank)`` from the global rank
torchrun gave it, in vLLM's order (``(dp_rank * pp_size + pp_rank) * tp_size + tp_rank``), loads
its rank of three layouts and all-gathers what it loaded and every ``preadv`` it made:

* PP 2 x TP 2 of a 5-layer Llama (vLLM's uneven split: layers 0-2, then 3-4);
* DP 2 x TP 2 of a Qwen3-MoE, without expert parallelism (each expert split over the 4 ranks);
* DP 4 x TP 1 of the same, with expert parallelism (2 whole experts per rank). DP 2 x TP 2 with
  expert parallelism is refused by the library (``tests/test_parallel_axes.py``).

Here the gathered states are put back together with the layout rules of ``test_reassembly`` and
``test_moe`` (written independently of the planner) and must equal the checkpoint bit for bit;
every byte each process read is accounted for, against the safetensors headers.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _subprocess_runner import REPO, child_env
from helpers import assert_same_bits, assert_same_state
from test_bytes_read import read_counts
from test_moe import PER_EXPERT_NAMES, checkpoint_options, rebuild_experts
from test_moe import reassemble as reassemble_moe
from test_reassembly import reassemble as reassemble_dense

from functional_load.precheck import precheck
from functional_load.testing.checkpoints import read_checkpoint_tensors

WORKER = Path(__file__).resolve().parent / "_torchrun_worker.py"
LAYOUTS = {  # name -> (checkpoint, tp, pp, dp, expert parallel)
    "pp2-tp2": ("llama5", 2, 2, 1, False),
    "dp2-tp2": ("qwen3_moe", 2, 1, 2, False),
    "dp4-ep": ("qwen3_moe", 1, 1, 4, True),
}
EXPERT_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.\w+\.weight$")
REPLICATED_RE = re.compile(r"(layernorm|model\.norm|q_norm|k_norm|mlp\.gate)\.weight$")  # every tensor rank of a replica reads it


def torchrun() -> list[str]:
    """The torchrun command; a failure, not a skip, when this torch has none."""
    if not torch.distributed.is_available() or importlib.util.find_spec("torch.distributed.run") is None:
        pytest.fail(f"torchrun (torch.distributed.run) is not available in torch {torch.__version__}: these tests need it")
    return [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint) -> dict[str, Path]:
    return {"llama5": tiny_checkpoint("llama", kv_heads=2, num_hidden_layers=5),
            "qwen3_moe": tiny_checkpoint("qwen3_moe", **checkpoint_options("qwen3_moe", False))}


@pytest.fixture(scope="module")
def job(checkpoints, tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    """One torchrun job of 4 processes over every layout: per layout, the records of global ranks 0..3."""
    out = tmp_path_factory.mktemp("torchrun")
    layouts = [{"name": name, "model": str(checkpoints[ckpt]), "tp": tp, "pp": pp, "dp": dp, "expert_parallel": ep}
               for name, (ckpt, tp, pp, dp, ep) in LAYOUTS.items()]
    (out / "layouts.json").write_text(json.dumps(layouts))
    command = [*torchrun(), "--standalone", "--nproc-per-node", "4", str(WORKER), str(out / "layouts.json"), str(out)]
    done = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"torchrun exited with {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}"
    return {name: torch.load(out / f"{name}.pt", weights_only=True) for name in LAYOUTS}


def tensor_spans(directory: Path) -> dict[str, tuple[Path, int, int]]:
    """Checkpoint tensor -> (file, first byte, end byte), from the safetensors headers themselves."""
    spans = {}
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                spans[name] = (path, 8 + size + start, 8 + size + end)
    return spans


def reads_per_tensor(directory: Path, records: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Checkpoint tensor -> [ranks, bytes]: how many times each process's ``preadv`` calls returned each byte."""
    files = sorted(directory.glob("*.safetensors"))
    counts = [read_counts(r["preadv"], files) for r in records]
    return {name: np.stack([c[path][start:end] for c in counts]) for name, (path, start, end) in tensor_spans(directory).items()}


def expected_readers(layout: str, name: str) -> tuple[set[int], int]:
    """The global ranks that read tensor ``name`` in ``layout``, and how many times all of them
    together read each of its bytes (vLLM's layout rules, from the names alone)."""
    _, tp, pp, dp, ep = LAYOUTS[layout]
    everyone = set(range(tp * pp * dp))
    if layout == "pp2-tp2":  # vLLM's get_pp_indices(5, rank, 2): layers 0-2, then 3-4; embedding first, norm and head last
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        stage = int(layer >= 3) if layer is not None else 0 if "embed_tokens" in name else 1
        return {2 * stage, 2 * stage + 1}, 2 if REPLICATED_RE.search(name) else 1
    expert = EXPERT_RE.match(name)
    if expert is not None:  # experts: split (or, with EP, spread whole, linear) over the dp x tp ranks: each byte read once
        return ({int(expert[1]) // 2} if ep else everyone), 1
    return everyone, dp * (tp if REPLICATED_RE.search(name) else 1)  # every replica reads its tensor rank's share


def by_coordinates(records: list[dict[str, Any]]) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    return {tuple(r["coordinates"]): r["state"] for r in records}


def test_a_missing_torchrun_fails_the_tests_rather_than_skipping_them(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(pytest.fail.Exception, match=r"torchrun \(torch.distributed.run\) is not available"):
        torchrun()


# --- the job ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_process_loaded_its_own_rank_and_read_its_plans_bytes(job, checkpoints, layout: str) -> None:
    """4 distinct processes, global ranks 0..3 in vLLM's order, each loading the plan of its coordinates;
    each read exactly its plan's bytes (the reader's count and the preadv calls), which the
    precheck of the layout predicted, and holds exactly the output bytes it predicted."""
    records = job[layout]
    ckpt, tp, pp, dp, ep = LAYOUTS[layout]
    assert [r["rank"] for r in records] == [0, 1, 2, 3] and len({r["pid"] for r in records}) == 4
    coordinates = [tuple(r["coordinates"]) for r in records]
    assert coordinates == [(p, d, t) for d in range(dp) for p in range(pp) for t in range(tp)], coordinates
    for r, (p, d, t) in zip(records, coordinates):
        assert (d * pp + p) * tp + t == r["rank"] and tuple(r["planned"]) == (p, d, t, tp, pp, dp), r["planned"]
    predicted = precheck(checkpoints[ckpt], tp_size=tp, pp_size=pp, dp_size=dp, expert_parallel=ep).ranks
    for r, want in zip(records, predicted):
        syscalls = sum(got for _, _, got in r["preadv"])
        assert syscalls == r["bytes_read"] == r["bytes_to_read"] == want.bytes_to_read > 0, (layout, r["rank"])
        held = sum(t.numel() * t.element_size() for t in r["state"].values())
        assert held == r["output_bytes"] == want.output_bytes, (layout, r["rank"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_byte_is_read_by_the_ranks_that_hold_it(job, checkpoints, layout: str) -> None:
    """Per checkpoint tensor, the processes that read any of its bytes are those vLLM's layout
    gives it, and together they read every byte exactly as often as the layout says: a pipeline
    stage reads no byte of the other stage's layers, an expert-parallel rank none of another's
    experts, and replicas each read their share once."""
    directory = checkpoints[LAYOUTS[layout][0]]
    reads = reads_per_tensor(directory, job[layout])
    for name, counts in reads.items():
        readers, times = expected_readers(layout, name)
        assert {r for r in range(len(counts)) if counts[r].any()} == readers, (layout, name)
        assert (counts.sum(axis=0) == times).all(), (layout, name, np.unique(counts.sum(axis=0)))
    if layout == "pp2-tp2":
        total = sum(c.shape[1] for c in reads.values())
        for stage in (0, 1):
            stage_bytes = sum(int(c[2 * stage : 2 * stage + 2].sum()) for c in reads.values())
            assert 0 < stage_bytes < total, (stage, stage_bytes, total)


def test_pp2_tp2_stages_reassemble_to_the_checkpoint(job, checkpoints) -> None:
    """Each stage's two tensor ranks put back together (test_reassembly's rules) give that stage's
    tensors; the stages hold disjoint tensors, and together every checkpoint tensor, bit for bit."""
    states = by_coordinates(job["pp2-tp2"])
    rebuilt: dict[str, torch.Tensor] = {}
    for stage in (0, 1):
        part = reassemble_dense("llama", 2, 2, [states[(stage, 0, t)] for t in (0, 1)])
        layers = {int(n.split(".")[2]) for n in part if n.startswith("model.layers.")}
        assert layers == ({0, 1, 2} if stage == 0 else {3, 4}), (stage, layers)
        assert not set(part) & set(rebuilt), f"stage {stage} holds tensors of stage 0: {sorted(set(part) & set(rebuilt))}"
        rebuilt.update(part)
    assert_same_state(rebuilt, read_checkpoint_tensors(checkpoints["llama5"]), "pp2-tp2")


@pytest.mark.parametrize("layout", ["dp2-tp2", "dp4-ep"])
def test_dp_replicas_and_experts_reassemble_to_the_checkpoint(job, checkpoints, layout: str) -> None:
    """The replicas hold identical attention, norms and router (per tensor rank); the experts,
    rebuilt from all 4 ranks (test_moe's rules: split over dp x tp without EP, spread whole with
    it), and replica 0's tensor ranks (test_moe's reassembly) give every checkpoint tensor."""
    _, tp, _, dp, ep = LAYOUTS[layout]
    states = by_coordinates(job[layout])
    experts = {n for n in states[(0, 0, 0)] if ".experts." in n}
    for (_, d, t), state in states.items():
        for name in set(state) - experts:
            assert_same_bits(state[name], states[(0, 0, t)][name], f"{layout}: {name} on replica {d} vs replica 0")
    replica = [{n: v for n, v in states[(0, 0, t)].items() if n not in experts} for t in range(tp)]
    rebuilt = reassemble_moe("qwen3_moe", False, tp, replica, ep, "linear")
    flat = [states[(0, d, t)] for d in range(dp) for t in range(tp)]  # the MoE group: rank dp_rank * tp + tp_rank
    prefix, gate, up, down = PER_EXPERT_NAMES["qwen3_moe"]
    for w13 in sorted(n for n in experts if n.endswith("w13_weight")):
        layer = w13.split(".mlp.")[0]
        w2 = w13.replace("w13_weight", "w2_weight")
        held = rebuild_experts([s[w13] for s in flat], [s[w2] for s in flat], dp * tp, ep, "linear", f"{layout} {w13}")
        for e, matrices in held.items():
            for part, tensor in zip((gate, up, down), matrices):
                rebuilt[f"{layer}.{prefix}.{e}.{part}.weight"] = tensor
    assert_same_state(rebuilt, read_checkpoint_tensors(checkpoints["qwen3_moe"]), layout)
