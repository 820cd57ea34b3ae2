"""Each rank reads only the bytes it keeps.

Three independent views of what a rank read must agree:

* the plan's count (``plan.bytes_to_read``);
* the reader's count (``Reader.bytes_read``);
* the bytes the ``preadv`` system calls actually returned, recorded per file byte.

The recorded bytes must be exactly the planned source boxes (computed here with numpy index
arithmetic, not with the reader's ``byte_runs``), and across ranks every byte of a sharded
tensor must be read by exactly one rank.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from functional_load import Plan, Replicated, Split, VocabSplit, plan
from functional_load.dtypes import itemsize
from functional_load.io import Reader, ReadOptions, execute, reader_for
from functional_load.testing.checkpoints import list_tensors, write_checkpoint

CASES = [  # (kv_heads, tp_size)
    pytest.param(2, 4, id="gqa2-tp4"),  # 2 KV heads over 4 ranks: each KV head read by 2 ranks
    pytest.param(8, 4, id="mha-tp4"),  # 8 KV heads over 4 ranks: nothing replicated but norms
    pytest.param(2, 8, id="gqa2-tp8"),  # each KV head read by 4 ranks
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[int, Path] = {}

    def get(kv_heads: int) -> Path:
        if kv_heads not in made:
            made[kv_heads] = write_checkpoint("llama", tmp_path_factory.mktemp(f"llama-kv{kv_heads}"), kv_heads=kv_heads)
        return made[kv_heads]

    return get


def checkpoint_bytes(directory: Path) -> dict[str, int]:
    """Data bytes of every tensor, from the safetensors library's view of the headers."""
    return {name: math.prod(shape) * itemsize(dtype) for name, (shape, dtype) in list_tensors(directory).items()}


def kv_replicas(name: str, kv_heads: int, tp: int) -> int:
    """How many ranks read each byte of checkpoint tensor ``name`` of a llama checkpoint."""
    if name.endswith(("layernorm.weight", "model.norm.weight")):
        return tp  # replicated
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        return max(1, tp // kv_heads)  # vLLM's num_kv_head_replicas
    return 1  # column/row/vocab split: one owner per byte


# --- recording what the system calls read --------------------------------------------------------


class SyscallLog:
    """Wraps ``os.preadv`` and records ``(file identity, offset, bytes returned)`` per call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[tuple[tuple[int, int], int, int]] = []
        real = os.preadv

        def preadv(fd, buffers, offset, *args):
            got = real(fd, buffers, offset, *args)
            st = os.fstat(fd)
            self.calls.append(((st.st_dev, st.st_ino), offset, got))
            return got

        monkeypatch.setattr(os, "preadv", preadv)

    def take(self) -> list[tuple[tuple[int, int], int, int]]:
        calls, self.calls = self.calls, []
        return calls


def file_id(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def read_counts(calls, files: list[Path]) -> dict[Path, np.ndarray]:
    """Per file, how many times each byte was returned by a ``preadv``."""
    by_id = {file_id(f): f for f in files}
    counts = {f: np.zeros(f.stat().st_size, dtype=np.int64) for f in files}
    for fid, offset, got in calls:
        assert fid in by_id, "a preadv on a file that is not a checkpoint shard"
        counts[by_id[fid]][offset : offset + got] += 1
    return counts


def planned_counts(the_plan: Plan, files: list[Path]) -> dict[Path, np.ndarray]:
    """Per file, how many copies of the plan cover each byte (element boxes -> byte offsets)."""
    counts = {f: np.zeros(f.stat().st_size, dtype=np.int64) for f in files}
    for p in the_plan.params:
        for c in p.copies:
            info = the_plan.tensors[c.tensor]
            item = itemsize(info.dtype)
            elements = np.arange(math.prod(info.shape)).reshape(info.shape)[tuple(slice(a, b) for a, b in c.src)]
            byte_offsets = info.location.offset + (elements.reshape(-1, 1) * item + np.arange(item)).reshape(-1)
            np.add.at(counts[info.file], byte_offsets, 1)
    return counts


# --- the allowed per-rank bound, from the plan's sharding descriptors ---------------------------


def rank_bound(the_plan: Plan) -> dict[str, int]:
    """Bytes a rank may read, by category, from each parameter's sharding and its source tensors.

    ``sharded`` and ``replicated`` are the checkpoint bytes behind Split/VocabSplit and Replicated
    destinations; the plain bound is ``sharded / tp + replicated``. Two honest allowances on top:

    * ``kv_replication``: a replicated segment (KV heads) with fewer heads than ranks cannot be
      split ``tp`` ways; a rank reads one whole head, ``segment_bytes / kv_heads``, instead of
      ``segment_bytes / tp``. The allowance is the difference (0 when kv_heads >= tp).
    * ``vocab_padding``: the vocab is padded to a multiple of 64 and the padded rows split evenly,
      so a rank owns up to ``padded_vocab / tp`` real rows, not ``vocab / tp``.
    """
    tp = the_plan.parallel.tp_size
    sharded = replicated = kv_replication = vocab_padding = 0
    for p in the_plan.params:
        tensors = {c.tensor for c in p.copies}
        nbytes = sum(the_plan.tensors[t].nbytes for t in tensors)
        sharding = p.spec.sharding
        if isinstance(sharding, Replicated):
            replicated += nbytes
            continue
        sharded += nbytes
        if isinstance(sharding, VocabSplit):
            padded = -(-sharding.vocab // sharding.padding) * sharding.padding
            row_bytes = nbytes // sharding.vocab
            vocab_padding += row_bytes * padded // tp - nbytes // tp
        else:
            assert isinstance(sharding, Split)
            (item,) = {itemsize(the_plan.tensors[t].dtype) for t in tensors}
            other = math.prod(p.spec.shape) // p.spec.shape[sharding.dim]
            assert nbytes == sum(s.rows for s in sharding.segments) * other * item
            for s in sharding.segments:
                if s.replicate and s.count < tp:
                    segment_bytes = s.rows * other * item
                    kv_replication += segment_bytes // s.count - segment_bytes // tp
    return {
        "sharded": sharded,
        "replicated": replicated,
        "kv_replication": kv_replication,
        "vocab_padding": vocab_padding,
    }


# --- tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kv_heads", "tp"), CASES)
def test_each_rank_reads_only_its_share(checkpoints, monkeypatch, kv_heads, tp):
    directory = checkpoints(kv_heads)
    sizes = checkpoint_bytes(directory)
    log = SyscallLog(monkeypatch)
    files: list[Path] = []
    reads_by_rank: list[dict[Path, np.ndarray]] = []
    split_bytes_by_rank: list[Counter] = []

    for rank in range(tp):
        the_plan = plan(directory, tp_size=tp, rank=rank)
        assert the_plan.dropped == ()
        files = sorted({info.file for info in the_plan.tensors.values()})
        with reader_for(the_plan, ReadOptions(strategy="pread")) as reader:
            execute(the_plan, reader=reader, progress=False)
        counts = read_counts(log.take(), files)

        # the reader's count, the plan's count and the system calls agree
        assert reader.bytes_read == the_plan.bytes_to_read
        assert sum(int(c.sum()) for c in counts.values()) == reader.bytes_read

        # every byte read is a byte of a planned box, read once; every planned byte is read
        planned = planned_counts(the_plan, files)
        for f in files:
            assert planned[f].max() <= 1, f"{f.name}: two copies of the plan read the same byte"
            np.testing.assert_array_equal(counts[f], planned[f], err_msg=f"rank {rank}: {f.name}")

        # the per-rank bound, with the allowances spelled out
        bound = rank_bound(the_plan)
        assert bound["sharded"] + bound["replicated"] == sum(sizes.values())
        kv_bytes = sum(n for name, n in sizes.items() if name.endswith(("k_proj.weight", "v_proj.weight")))
        assert bound["kv_replication"] == (kv_bytes // kv_heads - kv_bytes // tp if kv_heads < tp else 0)
        limit = bound["sharded"] // tp + bound["replicated"] + bound["kv_replication"] + bound["vocab_padding"]
        assert reader.bytes_read <= limit, bound
        assert the_plan.bytes_to_read <= limit

        # bytes this rank read of each tensor whose destination is split
        split_tensors = {
            c.tensor for p in the_plan.params if not isinstance(p.spec.sharding, Replicated) for c in p.copies
        }
        per_tensor: Counter = Counter()
        for name in split_tensors:
            info = the_plan.tensors[name]
            per_tensor[name] = int(counts[info.file][info.location.offset : info.location.offset + info.nbytes].sum())
        split_bytes_by_rank.append(per_tensor)
        reads_by_rank.append(counts)

    # across ranks: sharded tensors are read exactly once per byte, KV heads tp/kv_heads times,
    # norms by every rank; nothing outside tensor data (headers are not counted) is read
    total = {f: sum(r[f] for r in reads_by_rank) for f in files}
    indexed = plan(directory, tp_size=tp, rank=0).tensors
    covered = {f: np.zeros(f.stat().st_size, dtype=bool) for f in files}
    for name, info in indexed.items():
        data = total[info.file][info.location.offset : info.location.offset + info.nbytes]
        expected = kv_replicas(name, kv_heads, tp)
        assert (data == expected).all(), f"{name}: bytes read {sorted(set(data.tolist()))} times, expected {expected}"
        covered[info.file][info.location.offset : info.location.offset + info.nbytes] = True
    for f in files:
        assert not total[f][~covered[f]].any(), f"{f.name}: bytes outside tensor data were read"

    split_sums: Counter = Counter()
    for per_tensor in split_bytes_by_rank:
        split_sums.update(per_tensor)
    one_owner = {name for name in split_sums if kv_replicas(name, kv_heads, tp) == 1}
    assert one_owner and all(split_sums[name] == sizes[name] for name in one_owner)
    assert sum(split_sums[n] for n in one_owner) == sum(sizes[n] for n in one_owner)
    replicated_kv = set(split_sums) - one_owner
    assert bool(replicated_kv) == (kv_heads < tp)
    for name in replicated_kv:
        assert split_sums[name] == sizes[name] * tp // kv_heads


@pytest.mark.parametrize("kv_heads", [2, 8])
def test_tp1_reads_the_whole_checkpoint_once(checkpoints, monkeypatch, kv_heads):
    directory = checkpoints(kv_heads)
    sizes = checkpoint_bytes(directory)
    the_plan = plan(directory)
    assert the_plan.dropped == ()  # a transformers llama checkpoint has nothing to drop
    assert set(the_plan.tensors) == set(sizes)
    log = SyscallLog(monkeypatch)
    with reader_for(the_plan, ReadOptions(strategy="pread")) as reader:
        execute(the_plan, reader=reader, progress=False)
    files = sorted({info.file for info in the_plan.tensors.values()})
    counts = read_counts(log.take(), files)
    assert reader.bytes_read == the_plan.bytes_to_read == sum(sizes.values())
    for info in the_plan.tensors.values():
        assert (counts[info.file][info.location.offset : info.location.offset + info.nbytes] == 1).all(), info.name


class WastefulReader(Reader):
    """Reads each whole tensor before the box it was asked for, but counts only the box."""

    def read_into(self, info, box, out):
        fd = os.open(info.file, os.O_RDONLY)
        os.preadv(fd, [bytearray(info.nbytes)], info.location.offset)
        os.close(fd)
        super().read_into(info, box, out)

    def read_run(self, run):
        fd = os.open(run.info.file, os.O_RDONLY)
        os.preadv(fd, [bytearray(run.nbytes * 2)], run.offset)
        os.close(fd)
        super().read_run(run)


def test_the_syscall_check_catches_a_reader_that_reads_too_much(checkpoints, monkeypatch):
    """The checks above can fail: a reader that over-reads passes a count check but not the
    system-call check."""
    directory = checkpoints(2)
    the_plan = plan(directory, tp_size=4, rank=1)
    files = sorted({info.file for info in the_plan.tensors.values()})
    log = SyscallLog(monkeypatch)
    with WastefulReader(ReadOptions(strategy="pread")) as reader:
        execute(the_plan, reader=reader, progress=False)
    counts = read_counts(log.take(), files)
    planned = planned_counts(the_plan, files)
    assert reader.bytes_read == the_plan.bytes_to_read  # its own count is fooled
    assert sum(int(c.sum()) for c in counts.values()) > the_plan.bytes_to_read
    assert any((counts[f] != planned[f]).any() for f in files)


def test_a_pipeline_stage_reads_no_byte_of_another_stages_layers(tmp_path, monkeypatch):
    """PP 2 x TP 2 over 5 layers (vLLM's split: layers 0-2, then 3-4): each rank's system calls
    read exactly its plan's boxes, and every byte of a checkpoint tensor is read by the ranks of
    the one stage holding it (the embedding by the first, the final norm and head by the last).
    Negative control: the union over both stages is the whole checkpoint, so a stage reading
    another's layers would show up as a tensor read by two stages."""
    directory = write_checkpoint("llama", tmp_path / "llama5", kv_heads=2, num_hidden_layers=5)
    sizes = checkpoint_bytes(directory)
    log = SyscallLog(monkeypatch)
    stages_of: dict[str, set[int]] = {}
    for stage in (0, 1):
        for rank in (0, 1):
            the_plan = plan(directory, tp_size=2, rank=rank, pp_size=2, pp_rank=stage)
            files = sorted({info.file for info in the_plan.tensors.values()})
            with reader_for(the_plan, ReadOptions(strategy="pread")) as reader:
                execute(the_plan, reader=reader, progress=False)
            counts = read_counts(log.take(), files)
            assert reader.bytes_read == the_plan.bytes_to_read == sum(int(c.sum()) for c in counts.values())
            planned = planned_counts(the_plan, files)
            for f in files:
                np.testing.assert_array_equal(counts[f], planned[f], err_msg=f"stage {stage} rank {rank}: {f.name}")
            for p in the_plan.params:
                for c in p.copies:
                    stages_of.setdefault(c.tensor, set()).add(stage)
            dropped = dict(the_plan.dropped)
            assert all("pipeline stage" in why for why in dropped.values()), dropped
    assert set(stages_of) == set(sizes), "every checkpoint tensor is read by some stage"
    for name, stages in stages_of.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        want = {0 if layer < 3 else 1} if layer is not None else {0} if "embed_tokens" in name else {1}
        assert stages == want, (name, stages)
