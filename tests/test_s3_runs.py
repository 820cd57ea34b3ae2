"""Object-storage runs chosen by a cost model (issue 33, item 2).

* :func:`merge_runs` against hand-computed cases: a gap is read through exactly when it costs
  less to read than a request (``gap / bandwidth < latency``; a gap at the threshold is not),
  requests are cut at ``chunk_bytes``, a run longer than a chunk is a request of its own.
* Over a recording storage (every ranged read's size): no request is longer than
  ``request_bytes`` (host memory bounded by the requests in flight), the state is the local
  load's bit for bit, a 1 ns latency reproduces the exact runs (no over-read), and the stats'
  over-read is the bytes fetched less the bytes needed.
* Against SeaweedFS: a tp-2/tp-4 llama rank and a tp-2 qwen3_moe rank need a tenth of the
  requests of exact runs, bit-identical to the local load; the storage's own byte count equals
  the stats' ``bytes_read`` (needed + over-read).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from test_storage import MemoryPath, MemoryStorage

import functional_load as fl
from functional_load.errors import ConfigError
from functional_load.io import execute
from functional_load.io.options import RequestCost
from functional_load.io.runs import merge_runs
from functional_load.storage import S3Path, S3Storage, StoredPath, register_scheme
from functional_load.storage.base import Stamp
from functional_load.storage.s3 import open_s3
from functional_load.storage.s3_config import S3Config
from functional_load.testing.seaweed import SeaweedServer

EXACT = fl.ReadOptions(request_latency=1e-9)  # no gap is worth reading through: one request per run
COST = RequestCost(latency=0.001, bandwidth=1e6, chunk_bytes=10_000)  # break-even gap: 1,000 bytes


def _merge(offsets: list[int], run: int, cost: RequestCost = COST) -> list[tuple[int, int]]:
    return merge_runs(np.array(offsets, dtype=np.int64), run, cost)


def test_a_gap_is_read_through_when_cheaper_than_a_request() -> None:
    assert _merge([0, 1099, 2198], 100) == [(0, 3)]  # gaps of 999 bytes: 0.999 ms < 1 ms
    assert _merge([0, 1100, 2200], 100) == [(0, 1), (1, 2), (2, 3)]  # gaps of exactly 1,000: not cheaper
    assert _merge([0, 200, 1300, 1400], 100) == [(0, 2), (2, 4)]  # gaps 100 | 1,000 | 0 (abutting)
    assert _merge([5000], 100) == [(0, 1)] and _merge([], 100) == []
    assert COST.reads_through(999) and not COST.reads_through(1000)


def test_requests_are_cut_at_the_chunk() -> None:
    small = RequestCost(latency=0.001, bandwidth=1e6, chunk_bytes=1000)
    assert _merge([0, 300, 600, 900], 100, small) == [(0, 4)]  # bytes 0..1000: exactly a chunk
    assert _merge([0, 300, 600, 901], 100, small) == [(0, 3), (3, 4)]  # one byte more: a second request
    assert _merge([0, 300, 600, 900, 1200, 1500], 100, small) == [(0, 4), (4, 6)]
    assert _merge([0, 1500, 3000], 1200, small) == [(0, 1), (1, 2), (2, 3)]  # a run past the chunk: alone (read in pieces)


def test_a_tiny_latency_keeps_the_exact_runs() -> None:
    tiny = RequestCost(latency=1e-9, bandwidth=1e9, chunk_bytes=16 << 20)
    assert _merge([0, 101, 300, 500], 100, tiny) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # a 1-byte gap: 1 ns, not less
    assert _merge([0, 100], 100, tiny) == [(0, 2)]  # abutting runs are one range


def test_the_cost_options_are_checked() -> None:
    options = fl.ReadOptions(request_latency=0.005, link_bandwidth=125e6, request_bytes=8 << 20)
    assert options.request_cost == RequestCost(0.005, 125e6, 8 << 20, 8)
    for bad in ({"request_latency": -1.0}, {"link_bandwidth": 0}, {"link_bandwidth": float("inf")}, {"request_bytes": 0},
                {"request_latency": True}, {"requests_in_flight": 0}):
        with pytest.raises(ConfigError):
            fl.ReadOptions(**bad)


class RecordingStorage(MemoryStorage):
    """A :class:`MemoryStorage` that records the size of every ranged read."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.busy = self.most = 0  # requests at once now, and at most

    def read_into(self, file: StoredPath, offset: int, out: memoryview, stamp: Stamp | None) -> int:
        with self._lock:
            self.sizes.append(out.nbytes)
            self.busy += 1
            self.most = max(self.most, self.busy)
        try:
            time.sleep(0.001)  # a request takes a while: the ones in flight overlap
            return super().read_into(file, offset, out, stamp)
        finally:
            with self._lock:
                self.busy -= 1


@pytest.fixture()
def recorded(tiny_checkpoint) -> tuple[RecordingStorage, dict[str, Path]]:
    storage = RecordingStorage()
    register_scheme(MemoryPath, lambda: storage)
    local = {arch: tiny_checkpoint(arch) for arch in ("llama", "qwen3_moe")}
    for arch, directory in local.items():
        for file in sorted(directory.iterdir()):
            if file.is_file():
                storage.put(f"/bucket/{arch}/{file.name}", file.read_bytes())
    return storage, local


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def _same(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(_bits(got[name]), _bits(want[name]), err_msg=name)


@pytest.mark.parametrize("chunk", [4096, 1000])
def test_no_request_is_longer_than_a_chunk(recorded, chunk: int) -> None:
    """Host memory beyond the destinations is one request's buffer per request in flight: every
    ranged read (straight into a destination, or into a buffer scattered from) is at most a chunk,
    however long the tensor (the embedding is 64 kB) or the span a row-parallel slice merges into."""
    storage, local = recorded
    for arch, tp, rank in (("llama", 1, 0), ("llama", 2, 0), ("qwen3_moe", 4, 1)):
        plan = fl.plan(f"memory://bucket/{arch}", tp_size=tp, rank=rank)
        storage.sizes.clear()
        state, stats = execute(plan, fl.ReadOptions(request_bytes=chunk), progress=False)
        assert max(storage.sizes) == chunk and len(storage.sizes) == stats.requests, (arch, tp, max(storage.sizes))
        _same(state, fl.load(local[arch], tp_size=tp, rank=rank, progress=False))


@pytest.mark.parametrize(("threads", "in_flight"), [(1, 3), (4, 2), (2, 8)])
def test_requests_in_flight_are_bounded_over_every_thread(recorded, threads: int, in_flight: int) -> None:
    """A long tensor's chunks are fetched side by side (one reading thread still has several
    requests in flight), and never more than ``requests_in_flight`` at once over every thread."""
    storage, local = recorded
    storage.most = 0
    plan = fl.plan("memory://bucket/llama", tp_size=1, rank=0)
    state, _ = execute(plan, fl.ReadOptions(threads=threads, request_bytes=4096, requests_in_flight=in_flight), progress=False)
    assert storage.most == in_flight, (threads, in_flight, storage.most)
    _same(state, fl.load(local["llama"], progress=False))


def test_over_read_is_fetched_less_needed(recorded) -> None:
    """The default cost reads a row-parallel slice's span (over-read > 0, far fewer requests); a
    1 ns latency reads exactly the runs (over-read 0); the state is the same either way."""
    storage, local = recorded
    plan = fl.plan("memory://bucket/llama", tp_size=4, rank=1)
    loads = {}
    for name, options in (("exact", EXACT), ("cost", fl.ReadOptions())):
        before = storage.data_bytes
        loads[name] = execute(plan, options, progress=False)
        stats = loads[name][1]
        assert storage.data_bytes - before == stats.bytes_read == plan.bytes_to_read + stats.over_read
    (exact_state, exact), (state, cost) = loads["exact"], loads["cost"]
    assert exact.over_read == 0 and cost.over_read > 0 and cost.requests * 10 < exact.requests
    assert "over-read" in cost.summary() and f"{cost.requests:,} ranged requests" in cost.summary()
    want = fl.load(local["llama"], tp_size=4, rank=1, progress=False)
    _same(exact_state, want)
    _same(state, want)


BUCKET = "costs"


@pytest.fixture(scope="module")
def in_seaweed(seaweed: SeaweedServer, tiny_checkpoint) -> Iterator[tuple[S3Storage, dict[str, Path]]]:
    local = {arch: tiny_checkpoint(arch) for arch in ("llama", "qwen3_moe")}
    for arch, directory in local.items():
        seaweed.upload(directory, BUCKET, arch)
    storage = S3Storage(S3Config.from_environment(seaweed.env()))
    register_scheme(S3Path, lambda: storage)
    yield storage, local
    register_scheme(S3Path, open_s3)


@pytest.mark.parametrize(("arch", "tp", "rank", "most"), [("llama", 2, 0, 20), ("llama", 4, 1, 21), ("qwen3_moe", 2, 0, 62)])
def test_a_rank_from_s3_needs_few_requests(in_seaweed, arch: str, tp: int, rank: int, most: int) -> None:
    """272 / 273 / 1,196 ranged GETs with exact runs; with the default cost model at most ``most``,
    the same bits, and the storage fetched exactly the stats' bytes (needed + over-read)."""
    storage, local = in_seaweed
    plan = fl.plan(f"s3://{BUCKET}/{arch}", tp_size=tp, rank=rank)
    _, exact = execute(plan, EXACT, progress=False)
    before = storage.counts()
    state, stats = execute(plan, progress=False)
    after = storage.counts()
    files = {info.file for info in plan.tensors.values()}
    assert after["requests"] - before["requests"] == stats.requests + len(files)  # + the HEAD per file after the load
    assert after["bytes"] - before["bytes"] == stats.bytes_read == plan.bytes_to_read + stats.over_read
    assert stats.requests <= most and stats.requests * 10 < exact.requests and exact.over_read == 0
    assert stats.over_read < plan.bytes_to_read  # the tiny models' gaps: far under the default 2 MB break-even
    _same(state, fl.load(local[arch], tp_size=tp, rank=rank, progress=False))
