"""``functional-load precheck``: every rank of a tp x pp x dp layout planned from headers, in
vLLM's rank order, with each node's sums; any rank whose plan fails is exit status 2 with the
library's message, naming the ranks; under torchrun, each node plans its own ranks.

What each process of a real job reads and holds is checked against these numbers in
``tests/test_torchrun.py``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from _subprocess_runner import REPO, child_env, free_port
from safetensors.torch import load_file, save_file
from test_bytes_read import checkpoint_bytes
from test_moe import checkpoint_options
from test_torchrun import torchrun

import functional_load as fl
from functional_load.cli import main
from functional_load.precheck import precheck, rank_coordinates
from functional_load.testing.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def llama5(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", kv_heads=2, num_hidden_layers=5)


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    status = main(["precheck", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def test_ranks_are_numbered_as_vllm_numbers_them() -> None:
    """The inverse of vLLM's global rank (dp_rank * pp_size + pp_rank) * tp_size + tp_rank, over every rank."""
    tp, pp, dp = 2, 3, 2
    coordinates = [rank_coordinates(r, tp, pp, dp) for r in range(tp * pp * dp)]
    assert coordinates[:4] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)] and coordinates[6] == (0, 1, 0)
    assert [(d * pp + p) * tp + t for p, d, t in coordinates] == list(range(12))
    with pytest.raises(fl.ShardingError, match=r"rank 12 is not a rank of tp 2 x pp 3 x dp 2; global ranks are 0..11"):
        rank_coordinates(12, tp, pp, dp)


def test_every_rank_is_planned_and_each_nodes_bytes_summed(llama5: Path, capsys) -> None:
    """PP 2 x TP 2 over 5 layers at 2 ranks per node: each rank's numbers are its own plan's, the
    nodes sum their ranks, and the stages together read each checkpoint tensor once."""
    status, out, _ = run(capsys, llama5, "--tp", 2, "--pp-size", 2, "--ranks-per-node", 2, "--json")
    assert status == 0
    report = json.loads(out)
    assert (report["arch"], report["world_size"], report["node"]) == ("llama", 4, None)
    for row in report["ranks"]:
        the_plan = fl.plan(llama5, tp_size=2, rank=row["tp_rank"], pp_size=2, pp_rank=row["pp_rank"])
        assert (row["bytes_to_read"], row["output_bytes"], row["parameters"]) == (
            the_plan.bytes_to_read, the_plan.output_bytes, len(the_plan.params)), row
    assert [(r["rank"], r["node"], r["pp_rank"], r["dp_rank"], r["tp_rank"]) for r in report["ranks"]] == [
        (0, 0, 0, 0, 0), (1, 0, 0, 0, 1), (2, 1, 1, 0, 0), (3, 1, 1, 0, 1)]
    for node in report["nodes"]:
        held = [r for r in report["ranks"] if r["node"] == node["node"]]
        assert node["ranks"] == [r["rank"] for r in held]
        assert node["bytes_to_read"] == sum(r["bytes_to_read"] for r in held)
        assert node["output_bytes"] == sum(r["output_bytes"] for r in held)
    assert report["distinct_bytes"] == sum(checkpoint_bytes(llama5).values())
    assert report["nodes"][0]["bytes_to_read"] < report["distinct_bytes"], "a stage reads only its layers"
    status, text, _ = run(capsys, llama5, "--tp", 2, "--pp-size", 2, "--ranks-per-node", 2)
    assert status == 0 and "rank  node  pp  dp  tp  parameters  bytes to read  output bytes" in text
    first = report["nodes"][0]
    assert f"node 0 (ranks 0-1): {first['bytes_to_read']:,} bytes to read, {first['output_bytes']:,} output bytes" in text
    assert "output bytes: the rank's loaded state" in text


def test_a_layout_that_does_not_divide_is_exit_2_with_the_librarys_message(llama5: Path, capsys) -> None:
    status, out, err = run(capsys, llama5, "--tp", 3, "--dp-size", 2)
    assert status == 2 and out == "" and "Traceback" not in err
    assert err.startswith("functional-load: error: 1 problem found while planning the load:\n"
                          "  - every planned rank of tp 3 x pp 1 x dp 2 (global ranks 0-5):\n    llama does not shard over tp_size=3"), err
    assert "8 attention heads (segment 'q') cannot divide over tp=3; valid tp sizes: [1, 2, 4, 8]" in err


def test_only_the_ranks_that_fail_are_named(llama5: Path, tmp_path: Path, capsys) -> None:
    """A checkpoint without lm_head.weight: the last stage's ranks fail, the first stage's do not."""
    broken = write_checkpoint("llama", tmp_path / "no-head", kv_heads=2, num_hidden_layers=5)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = broken / index["weight_map"].pop("lm_head.weight")
    save_file({n: t for n, t in load_file(shard).items() if n != "lm_head.weight"}, shard, metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    status, _, err = run(capsys, broken, "--tp", 2, "--pp-size", 2)
    assert status == 2
    assert "  - 2 of 4 planned ranks of tp 2 x pp 2 x dp 1: global rank 2 (pp 1, dp 0, tp 0), 3 (pp 1, dp 0, tp 1):\n" in err, err
    assert "lm_head.weight" in err and "global rank 0" not in err and "global rank 1" not in err


def test_dp_x_tp_with_expert_parallelism_plans_every_rank(tiny_checkpoint, capsys) -> None:
    """DP 2 x TP 2 with EP (vLLM's sequence-parallel MoE) and wide EP: every rank plans, each with its own experts."""
    moe = tiny_checkpoint("qwen3_moe", **checkpoint_options("qwen3_moe", False))
    status, out, err = run(capsys, moe, "--tp", 2, "--dp-size", 2, "--expert-parallel", "--json")
    assert status == 0, err
    ranks = json.loads(out)["ranks"]
    assert [(r["dp_rank"], r["tp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    status, out, _ = run(capsys, moe, "--tp", 1, "--dp-size", 4, "--expert-parallel", "--json")
    assert status == 0 and [r["dp_rank"] for r in json.loads(out)["ranks"]] == [0, 1, 2, 3]


def test_one_nodes_ranks(llama5: Path, capsys, monkeypatch) -> None:
    """--node K plans node K's ranks; under torchrun (GROUP_RANK set) the node's first process plans them, and the others nothing."""
    status, out, _ = run(capsys, llama5, "--tp", 2, "--pp-size", 2, "--ranks-per-node", 2, "--node", 1, "--json")
    assert status == 0 and [r["rank"] for r in json.loads(out)["ranks"]] == [2, 3]
    status, _, err = run(capsys, llama5, "--tp", 2, "--pp-size", 2, "--ranks-per-node", 2, "--node", 2)
    assert status == 2 and "node 2 is not a node of 4 ranks at 2 ranks per node (nodes 0..1)" in err, err
    with pytest.raises(fl.ConfigError, match="pp_rank and dp_rank name one rank"):
        precheck(llama5, tp_size=2, pp_size=2, pp_rank=1)
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    status, out, _ = run(capsys, llama5, "--tp", 2, "--pp-size", 2, "--ranks-per-node", 2, "--json")
    assert status == 0 and json.loads(out)["node"] == 1
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert run(capsys, llama5, "--tp", 2, "--pp-size", 2, "--ranks-per-node", 2) == (0, "", "")


def test_each_node_of_a_torchrun_job_checks_its_own_ranks(llama5: Path) -> None:
    """Two torchrun agents (static rendezvous, --nnodes 2, one process each) run the command as
    docs/cli.md shows: node k plans global ranks 2k and 2k + 1 only."""
    port = free_port()
    nodes = [
        subprocess.Popen([*torchrun(), "--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                          "--master-port", str(port), "-m", "functional_load.cli", "precheck", str(llama5), "--tp", "2",
                          "--pp-size", "2", "--ranks-per-node", "2", "--json"],
                         cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k in (0, 1)
    ]
    try:
        done = [p.communicate(timeout=120) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    for k, (p, (out, err)) in enumerate(zip(nodes, done)):
        assert p.returncode == 0, f"node {k}: {err[-3000:]}"
        report = json.loads(out)
        assert report["node"] == k and [r["rank"] for r in report["ranks"]] == [2 * k, 2 * k + 1], out
        assert [r["pp_rank"] for r in report["ranks"]] == [k, k]
