"""A node fetches each byte once: a real torchrun job of 4 processes (gloo) loading from S3 as one group.

``tests/_group_worker.py`` runs under ``python -m torch.distributed.run --standalone
--nproc-per-node 4`` against the session's SeaweedFS (endpoint and credentials in the standard
AWS environment). Each process loads its tensor rank (tp 4) of a tiny Llama and of a Qwen3-MoE
with expert parallelism from ``s3://``, in one load group, and records every ranged GET its
storage answered. Here: each rank's state equals the local load bit for bit; the processes'
fetches are disjoint and together are exactly the union of the ranks' byte ranges (each byte
once, so the node's traffic is at most 1.1 x the union, and far below the sum of the ranks'
needs); a process whose plan fails stops the others with a ``GroupError``, not a hang; a local
model directory loads in a group as without one. :func:`plan_exchange` is checked alone too.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _subprocess_runner import REPO, child_env
from test_torchrun import torchrun

import functional_load as fl
from functional_load.io.group import GroupError, plan_exchange
from functional_load.io.needs import Need, merge
from functional_load.storage import ObjectStamp, as_path
from functional_load.testing.seaweed import SeaweedServer

WORKER = Path(__file__).resolve().parent / "_group_worker.py"
BUCKET = "group"
LAYOUTS = {"llama-tp4": ("llama", False), "moe-tp4-ep": ("qwen3_moe", True), "local-llama": ("llama", False)}


@pytest.fixture(scope="module")
def local(tiny_checkpoint) -> dict[str, Path]:
    return {"llama": tiny_checkpoint("llama"), "qwen3_moe": tiny_checkpoint("qwen3_moe")}


@pytest.fixture(scope="module")
def job(seaweed: SeaweedServer, local: dict[str, Path], tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    """One torchrun job of 4 processes over every layout: per layout, the records of ranks 0..3."""
    for name, directory in local.items():
        seaweed.upload(directory, BUCKET, name)
    out = tmp_path_factory.mktemp("group")
    layouts = [{"name": name, "model": str(local[arch]) if name.startswith("local") else f"s3://{BUCKET}/{arch}", "tp": 4,
                "expert_parallel": ep} for name, (arch, ep) in LAYOUTS.items()]
    layouts.append({"name": "fail", "model": f"s3://{BUCKET}/llama", "tp": 4, "expert_parallel": False, "fail_rank": 3})
    (out / "layouts.json").write_text(json.dumps(layouts))
    command = [*torchrun(), "--standalone", "--nproc-per-node", "4", str(WORKER), str(out / "layouts.json"), str(out)]
    done = subprocess.run(command, cwd=REPO, env=child_env(**seaweed.env()), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"torchrun exited with {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}"
    return {layout["name"]: torch.load(out / f"{layout['name']}.pt", weights_only=True) for layout in layouts}


def _masks(ranges: dict[str, list[tuple[int, int]]], sizes: dict[str, int]) -> dict[str, np.ndarray]:
    """Per object, how many times each byte is in ``ranges``."""
    out = {uri: np.zeros(n, dtype=np.int64) for uri, n in sizes.items()}
    for uri, spans in ranges.items():
        for start, stop in spans:
            out[uri][start:stop] += 1
    return out


def _sizes(local: Path, arch: str) -> dict[str, int]:
    return {f"s3://{BUCKET}/{arch}/{p.name}": p.stat().st_size for p in local.glob("*.safetensors")}


@pytest.mark.parametrize("layout", ["llama-tp4", "moe-tp4-ep", "local-llama"])
def test_each_rank_loads_in_the_group_as_alone(job, local, layout: str) -> None:
    """Both paths (the low-level group reader in rounds of one piece, and ``fl.load(group=...)``)
    give every rank the local load's state, bit for bit, with no box read outside the group's bytes."""
    arch, ep = LAYOUTS[layout]
    for record in job[layout]:
        alone = fl.load(local[arch], tp_size=4, rank=record["rank"], expert_parallel=ep, progress=False)
        for got in (record["low_level"], record["state"]):
            assert got.keys() == alone.keys()
            for name in alone:
                assert torch.equal(got[name].view(torch.uint8), alone[name].contiguous().view(torch.uint8)), (layout, name)
        assert record["misses"] == 0, record["misses"]
    if layout.startswith("local"):  # a local directory: every process reads its own bytes, nothing is exchanged
        assert all(not r["gets"] and not r["needs"] and r["bytes_read"] == r["bytes_to_read"] for r in job[layout])


@pytest.mark.parametrize("layout", ["llama-tp4", "moe-tp4-ep"])
def test_the_node_fetches_each_needed_byte_once(job, local, layout: str) -> None:
    """The processes' GETs are disjoint and together are exactly the union of the ranks' byte
    ranges: the node's traffic is 1.0 x that union (the goal: <= 1.1 x), below the sum of the
    ranks' needs; every process fetched a share and received the rest over the group."""
    records = job[layout]
    arch = LAYOUTS[layout][0]
    sizes = _sizes(local[arch], arch)
    needs = [_masks({uri: list(zip(*ranges)) for uri, ranges in r["needs"].items()}, sizes) for r in records]
    fetched = [_masks({uri: [(o, o + n) for u, o, n in r["gets"] if u == uri] for uri in sizes}, sizes) for r in records]
    union = sum(int((sum(m[uri] for m in needs) > 0).sum()) for uri in sizes)
    total = sum(r["counted"] for r in records)
    assert total == sum(sum(n for _, _, n in r["gets"]) for r in records) == sum(r["stats"]["fetched"] for r in records)
    for uri in sizes:
        node = sum(f[uri] for f in fetched)
        assert node.max() <= 1, f"{uri}: a byte fetched {node.max()} times"
        assert ((node > 0) == (sum(m[uri] for m in needs) > 0)).all(), f"{uri}: fetched bytes differ from the union of the needs"
    assert total <= 1.1 * union and total == union, (total, union)
    per_rank = [sum(int((m[uri] > 0).sum()) for uri in sizes) for m in needs]
    assert sum(per_rank) > union, (per_rank, union)  # the ranks' needs overlap (replicated norms): fetched once
    gets = sum(len(r["gets"]) for r in records)
    assert gets <= sum(len(set(r["needs"])) for r in records), gets  # whole stretches of the union, not one GET per row
    for r, need in zip(records, per_rank):
        assert r["stats"]["fetched"] > 0 and r["bytes_read"] == r["stats"]["fetched"] and need <= r["bytes_to_read"]
        assert 0 < r["stats"]["received"] <= need and r["stats"]["sent"] > 0, r["stats"]
        assert r["stats"]["rounds"] > 1 and r["stats"]["union"] == union and r["stats"]["needs"] == per_rank
    print(f"{layout}: node fetched {total:,} B; union of needs {union:,} B; sum of needs {sum(per_rank):,} B; "
          f"checkpoint {sum(sizes.values()):,} B; per process {[r['stats']['fetched'] for r in records]}; {gets} GETs")


def test_a_failed_plan_stops_the_whole_group(job) -> None:
    """Rank 3's model does not exist: it raises its own error, the others a GroupError naming it (no hang)."""
    errors = {r["rank"]: r["error"] for r in job["fail"]}
    assert errors[3] is not None and errors[3].startswith("MissingFileError") and "-missing" in errors[3]
    for rank in (0, 1, 2):
        assert errors[rank] is not None and errors[rank].startswith("GroupError") and "group rank 3" in errors[rank], errors[rank]


def _need(uri: str, ranges: list[tuple[int, int]], etag: str = "a") -> Need:
    starts, stops = (np.array(x, dtype=np.int64) for x in zip(*ranges))
    return Need(as_path(uri), ObjectStamp(1 << 30, etag), merge(starts, stops))


def test_the_exchange_splits_the_union_into_disjoint_pieces_of_processes_that_need_them() -> None:
    a, b = "s3://m/a.safetensors", "s3://m/b.safetensors"
    gathered = [
        {a: _need(a, [(i * 4096 + r * 1024, i * 4096 + (r + 1) * 1024) for i in range(3000)] + [(0, 100)])} for r in range(4)
    ]
    gathered[1][b] = _need(b, [(0, 5 << 20)])  # only rank 1 needs b: it fetches it
    exchange = plan_exchange(gathered, round_bytes=4 << 20)
    pieces = [p for r in exchange.rounds for p in r]
    assert exchange.union == 3000 * 4096 + (5 << 20)
    assert sum(p.stop - p.start for p in pieces) == exchange.union
    for uri in (a, b):
        spans = sorted((p.start, p.stop) for p in pieces if p.uri == uri)
        assert all(s1 <= s0 for (_, s1), (s0, _) in zip(spans, spans[1:]))
    assert {p.owner for p in pieces if p.uri == b} == {1}
    assert min(exchange.fetched(r) for r in range(4)) > 0 and len(exchange.rounds) > 1
    assert all(sum(p.stop - p.start for p in r) <= (4 << 20) or len(r) == 1 for r in exchange.rounds)
    gathered[2][a] = _need(a, [(0, 10)], etag="b")
    with pytest.raises(GroupError, match="indexed different versions"):
        plan_exchange(gathered)
