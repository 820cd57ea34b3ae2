"""Sequential runs (``functional_load.io.runs``): abutting direct copies read with one ``preadv``.

* ``join_runs`` joins exactly the copies that abut in one file and can be read straight into
  their destination; a cast, a transpose, another file, a gap or the size limit starts a new unit.
* ``read_run`` fills every destination however the kernel cuts the reads (short reads at every
  byte count), and a file that ends early is an IntegrityError naming the tensors.
* A tp-1 load of a real checkpoint reads each file in a few ``preadv`` calls (far fewer than its
  tensors) and gives the same state as a load with runs switched off; a tp-4 rank too.
* A pre-sharded save reloaded at its saved layout is planned rank-local (its own file, as is),
  and at another tp or another layout (text_only) through the virtual checkpoint, equal either way.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch
from helpers import assert_same_state

import functional_load as fl
from functional_load.checkpoint import FileSpan, TensorInfo
from functional_load.errors import IntegrityError
from functional_load.io import runs
from functional_load.io.files import PreadReader
from functional_load.io.runs import Run, join_runs, read_run
from functional_load.plan.plan import Copy
from functional_load.testing.checkpoints import write_checkpoint

execute_module = importlib.import_module("functional_load.io.execute")  # the package exports the function


def _plan_of(tensors: dict[str, TensorInfo]) -> object:
    class P:
        pass

    p = P()
    p.tensors = tensors  # type: ignore[attr-defined]
    return p


def _info(name: str, file: str, offset: int, rows: int, dtype: str = "BF16") -> TensorInfo:
    return TensorInfo(name, dtype, (rows, 4), FileSpan(Path(file), offset, rows * 8))


def test_join_runs_joins_abutting_direct_copies_only():
    infos = {
        "a": _info("a", "f1", 100, 2),  # bytes 100..116
        "b": _info("b", "f1", 116, 2),  # abuts a
        "c": _info("c", "f1", 132, 2),  # abuts b, but cast (no direct destination)
        "d": _info("d", "f1", 148, 2),
        "e": _info("e", "f1", 200, 2),  # a gap before it
        "g": _info("g", "f2", 216, 2),  # another file
    }
    plan = _plan_of(infos)
    full = ((0, 2), (0, 4))
    jobs = [(name, Copy(name, full, full)) for name in "abcdeg"]
    direct = {n: memoryview(bytearray(16)) for n in "abdeg"}
    units = join_runs(plan, jobs, lambda job: direct.get(job[0]), limit=1 << 20)  # type: ignore[arg-type]
    shapes = [u.tensors if isinstance(u, Run) else u[0] for u in units]
    assert shapes == [("a", "b"), "c", "d", "e", "g"]
    first = units[0]
    assert isinstance(first, Run) and first.offset == 100 and first.nbytes == 32
    # a column slice is many byte runs: never part of a run
    column = [("a", Copy("a", ((0, 2), (0, 2)), ((0, 2), (0, 2)))), ("b", Copy("b", full, full))]
    assert [u[0] for u in join_runs(plan, column, lambda job: memoryview(bytearray(8 if job[0] == "a" else 16)), 1 << 20)] == ["a", "b"]  # type: ignore[index, arg-type]
    # the limit cuts runs
    units = join_runs(plan, jobs[:2], lambda job: direct.get(job[0]), limit=16)  # type: ignore[arg-type]
    assert [u[0] for u in units] == ["a", "b"]  # type: ignore[index]


@pytest.mark.parametrize("cut", [1, 3, 7, 16, 1000])
def test_read_run_survives_short_reads(tmp_path, monkeypatch, cut):
    data = os.urandom(4096)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    real = os.preadv

    def short_preadv(fd, buffers, offset, *flags):
        first = buffers[0]
        take = min(cut, first.nbytes)
        return real(fd, [first[:take]], offset, *flags)

    monkeypatch.setattr(runs.os, "preadv", short_preadv)
    views = [memoryview(bytearray(n)) for n in (5, 0, 100, 1, 900)]
    info = TensorInfo("t", "U8", (1006,), FileSpan(path, 10, 1006))
    fd = os.open(path, os.O_RDONLY)
    try:
        got = read_run(fd, Run(info, 10, tuple(views), 1006, ("t",)), lambda n: IntegrityError(str(n)))
    finally:
        os.close(fd)
    assert got == 1006
    assert b"".join(bytes(v) for v in views) == data[10:1016]


def test_read_run_names_the_tensors_when_the_file_ends_early(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 50)
    info = TensorInfo("w", "U8", (50,), FileSpan(path, 0, 50))  # the first tensor is whole, the second is cut off
    reader = PreadReader()
    with pytest.raises(IntegrityError, match=r"'w', 'v' end early: read 50 of 100 bytes"):
        reader.read_run(Run(info, 0, (memoryview(bytearray(50)), memoryview(bytearray(50))), 100, ("w", "v")))
    reader.close()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("llama", tmp_path_factory.mktemp("llama"), kv_heads=2, max_shard_size="200KB")


class Preadv:
    """Counts preadv calls on weight files."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = os.preadv

        def counting(fd, buffers, offset, *flags):
            self.calls += 1
            return real(fd, buffers, offset, *flags)

        monkeypatch.setattr(os, "preadv", counting)


@pytest.mark.parametrize("tp", [1, 4])
def test_a_load_reads_in_runs_and_equals_the_load_without_them(llama, monkeypatch, tp):
    rank = tp - 1
    with monkeypatch.context() as m:
        m.setattr(execute_module, "join_runs", lambda plan, jobs, destination, limit: list(jobs))
        without = Preadv(m)
        reference = fl.load(llama, tp_size=tp, rank=rank, dtype="bfloat16", read=fl.ReadOptions(threads=1))
    counter = Preadv(monkeypatch)
    state = fl.load(llama, tp_size=tp, rank=rank, dtype="bfloat16", read=fl.ReadOptions(threads=1))
    assert_same_state(state, reference)
    files = len({info.file for info in state.plan.tensors.values()})
    if tp == 1:  # whole tensors abut: one call per file (a 16 MiB run holds a whole tiny file)
        assert counter.calls <= files < without.calls, (counter.calls, files, without.calls)
    else:  # q/k/v/gate/up/vocab slices of neighbouring tensors abut less, but some still join
        assert counter.calls < without.calls, (counter.calls, without.calls)


def test_a_cast_load_reads_copy_by_copy(llama, monkeypatch):
    """Runs need the destination's dtype to be the file's: a float32 load casts each tensor."""
    counter = Preadv(monkeypatch)
    state = fl.load(llama, dtype="float32", read=fl.ReadOptions(threads=1))
    assert counter.calls >= sum(len(p.copies) for p in state.plan.params)
    assert all(t.dtype == torch.float32 for t in state.values())


def test_a_save_reloads_at_its_layout_from_its_own_file_as_is(llama, tmp_path):
    out = tmp_path / "saved"
    fl.save_sharded([fl.load(llama, tp_size=2, rank=r, dtype="bfloat16") for r in range(2)], out)
    for rank in range(2):
        reload = fl.plan(out, tp_size=2, rank=rank)
        assert all(isinstance(info.location, FileSpan) for info in reload.tensors.values())  # its own file, as is
        assert {info.file.name for info in reload.tensors.values()} == {f for f in os.listdir(out) if f"rank-{rank}-" in f}
        assert_same_state(fl.load(out, tp_size=2, rank=rank), fl.load(llama, tp_size=2, rank=rank, dtype="bfloat16"))
    resharded = fl.plan(out, tp_size=4, rank=1)  # another tp: the virtual original checkpoint
    assert not any(isinstance(info.location, FileSpan) for info in resharded.tensors.values())
    assert_same_state(fl.load(out, tp_size=4, rank=1), fl.load(llama, tp_size=4, rank=1, dtype="bfloat16"))


def test_auto_reads_a_hot_row_slice_with_one_strided_copy_and_a_cold_one_as_spans(tmp_path, monkeypatch):
    """A box of many short runs (a row-parallel slice): in the page cache, ``auto`` copies it out
    of a mapping of the file (no ``preadv`` per row); not in it, it reads sequential spans. The
    bytes are the box's either way."""
    rows, cols = 256, 64
    data = torch.arange(rows * cols, dtype=torch.int32).to(torch.bfloat16).view(rows, cols)
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0" * 8 + data.view(torch.uint8).numpy().tobytes())
    info = TensorInfo("w", "BF16", (rows, cols), FileSpan(path, 8, rows * cols * 2))
    box = ((0, rows), (16, 32))
    expected = data[:, 16:32].contiguous().view(torch.uint8).numpy().tobytes()
    calls: list[int] = []
    real = os.preadv

    def counting(fd, buffers, offset, *flags):
        calls.append(sum(memoryview(b).nbytes for b in buffers))
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", counting)
    for resident in (True, False):
        monkeypatch.setattr("functional_load.io.files._resident", lambda fd, offset, resident=resident: resident)
        calls.clear()
        out = bytearray(rows * 16 * 2)
        with PreadReader(adaptive=True) as reader:
            reader.read_into(info, box, memoryview(out))
            read = reader.bytes_read
        assert bytes(out) == expected
        assert read == (len(out) if resident else sum(calls))  # what it copied, or what it asked the kernel for
        if resident:
            assert calls == [], f"hot: {len(calls)} preadv calls for a strided copy"
        else:
            assert 0 < len(calls) <= 2 and sum(calls) >= (rows - 1) * cols * 2, calls  # one span, not a read per row
    calls.clear()
    with PreadReader(adaptive=False) as reader:  # strategy pread: exact reads, one per row
        out = bytearray(rows * 16 * 2)
        reader.read_into(info, box, memoryview(out))
    assert bytes(out) == expected and len(calls) == rows
