"""Reliability under real operating conditions: many processes, a full disk, files that change
while they are read.

* Concurrency: eight processes, released together by one barrier, each load a different rank
  (tp 8) of one checkpoint directory; every rank state equals, bit for bit, the same rank loaded
  in this process.
* Disk full: ``save_sharded`` over an earlier save on a small tmpfs runs out of space (in the
  first new rank file, in the second, in the manifest). Each time: a ``LoadError`` (never a bare
  ``OSError`` or a safetensors error) that says the device has no space left; the earlier save
  still loads exactly (hashes checked); no stray file keeps space; once space is freed, a save
  into the same directory works.
* Files changed during a load: a shard truncated, replaced (other bytes, same size, atomic
  rename) or grown in the middle of a load (after the third read) or after its last read, the
  shard being read or another one, with the ``pread``, ``mmap`` and ``eager`` strategies: an
  ``IntegrityError`` that names the shard, and no ``LoadedState`` is ever built.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_load as fl
from functional_load import api
from functional_load.checkpoint.sharded import MANIFEST
from functional_load.errors import IntegrityError, LoadError
from functional_load.io.reader import Reader
from functional_load.output import save as save_module


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_state(got: Any, want: Any, what: str) -> None:
    assert set(got) == set(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    for name, tensor in want.items():
        other = got[name]
        assert (other.dtype, tuple(other.shape)) == (tensor.dtype, tuple(tensor.shape)), (
            f"{what} {name}: {other.dtype}{list(other.shape)} vs {tensor.dtype}{list(tensor.shape)}"
        )
        assert torch.equal(as_bytes(other), as_bytes(tensor)), f"{what} {name}: bytes differ"


@pytest.fixture(scope="module")
def llama(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama", kv_heads=2)


# 1. eight processes, one directory ---------------------------------------------------------------

TP = 8


def _load_rank_in_child(model_dir: str, rank: int, barrier: Any, out: str) -> None:
    """A child process: wait for every sibling, load ``rank`` of ``TP``, save the state."""
    try:
        from safetensors.torch import save_file

        barrier.wait(timeout=120)
        start = time.monotonic()
        state = fl.load(model_dir, tp_size=TP, rank=rank, progress=False)
        stop = time.monotonic()
        tensors = {name: t.contiguous().clone() for name, t in state.items()}
        save_file(tensors, out + ".part", metadata={"start": repr(start), "stop": repr(stop)})
        os.replace(out + ".part", out)
    except BaseException:
        Path(out + ".error").write_text(traceback.format_exc())
        raise


def test_eight_processes_load_every_rank_at_once(llama, tmp_path):
    """Eight processes pass one barrier together and load ranks 0..7 of tp 8 from the same
    directory at the same time; each rank state is the parent's load of that rank, bit for bit.

    The children come from a forkserver that imported torch once (a fresh interpreter, not a
    fork of pytest): eight spawned interpreters importing torch take 10-40 s on two cores, the
    forkserver's children start in well under a second, so they really load concurrently."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "safetensors.torch", "functional_load", "pytest"])
    barrier = ctx.Barrier(TP)
    outs = [str(tmp_path / f"rank-{r}.safetensors") for r in range(TP)]
    procs = [
        ctx.Process(target=_load_rank_in_child, args=(str(llama), r, barrier, outs[r]), name=f"load-rank-{r}")
        for r in range(TP)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=180)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    problems = []
    for r, p in enumerate(procs):
        error = Path(outs[r] + ".error")
        if p.exitcode != 0 or not Path(outs[r]).is_file():
            problems.append(f"rank {r}: exit code {p.exitcode}\n{error.read_text() if error.exists() else ''}")
    assert not problems, "\n".join(problems)

    spans = []
    for r in range(TP):
        want = fl.load(llama, tp_size=TP, rank=r, progress=False)
        assert_same_state(load_file(outs[r]), want, f"rank {r} (child process)")
        with safe_open(outs[r], "pt") as f:
            meta = f.metadata()
        spans.append((float(meta["start"]), float(meta["stop"])))
    # The barrier released them together, and their loads overlapped in time (monotonic clocks
    # are system-wide); usually all eight are in flight at once.
    starts = sorted(start for start, _ in spans)
    assert starts[-1] - starts[0] < 2.0, f"the children did not start loading together: {spans}"
    in_flight = max(sum(a <= t < b for a, b in spans) for t in starts)
    assert in_flight >= 2, f"the loads ran one after another, not concurrently: {spans}"


# 2. a disk that fills up during save_sharded -----------------------------------------------------

SAVE_TP = 2
PAGE = 4096


def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _mount_tmpfs(where: Path, size: int) -> None:
    where.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k", "tmpfs", str(where)], capture_output=True, text=True)
    if run.returncode != 0:
        pytest.fail(
            f"cannot mount a {size // 1024} KiB tmpfs on {where} (uid {os.getuid()}): {run.stderr.strip() or run.returncode}. "
            "This test needs root (CAP_SYS_ADMIN) to fill a real filesystem; CI runs as root"
        )


def _remount(where: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size // 1024}k", str(where)], check=True, capture_output=True)


def _umount(where: Path) -> None:
    subprocess.run(["umount", str(where)], check=True, capture_output=True)


def _used(where: Path) -> int:
    st = os.statvfs(where)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _tree(where: Path) -> dict[str, int]:
    return {str(p.relative_to(where)): p.stat().st_size for p in sorted(where.rglob("*"))}


@pytest.fixture(scope="module")
def llama_b(tiny_checkpoint: Callable[..., Path]) -> Path:
    """Same architecture and sizes, other values: a second save must not be mistaken for the first."""
    return tiny_checkpoint("llama", kv_heads=2, seed=1)


FAILS_IN = {"first rank file": "write rank 0", "second rank file": "write rank 1", "manifest": "write manifest"}


@pytest.mark.parametrize("fails_in", list(FAILS_IN))
def test_disk_full_during_save_keeps_the_previous_save(llama, llama_b, tmp_path, monkeypatch, fails_in):
    """The tmpfs holds the first save and, depending on ``fails_in``, half of one new rank file,
    one and a half, or both and half of the new manifest."""
    probe = fl.save_sharded(llama, tmp_path / "probe", SAVE_TP)
    sizes = _tree(probe)
    rank_files = sorted(n for n in sizes if n.startswith("model-rank-"))
    assert len(rank_files) == SAVE_TP
    first = sum(_pages(n) for n in sizes.values())  # what the first save occupies on a tmpfs
    rank = _pages(sizes[rank_files[0]])
    config = _pages(sizes["config.json"])
    manifest = _pages(sizes[MANIFEST])
    free = {
        "first rank file": rank // 2,
        "second rank file": rank + rank // 2,
        "manifest": 2 * rank + config + manifest // 2,
    }[fails_in]
    size = first + _pages(free)

    mnt = tmp_path / "mnt"
    _mount_tmpfs(mnt, size)
    try:
        out = mnt / "save"
        fl.save_sharded(llama, out, SAVE_TP)
        before, used = _tree(mnt), _used(mnt)
        assert used == first, f"the first save should occupy {first} bytes of the tmpfs, it occupies {used}"

        steps: list[str] = []
        monkeypatch.setattr(save_module, "_step", steps.append)
        with pytest.raises(Exception) as info:
            fl.save_sharded(llama_b, out, SAVE_TP)
        monkeypatch.undo()
        assert steps and steps[-1] == FAILS_IN[fails_in], f"the disk filled after step {steps[-1:]}, not in the {fails_in}"
        error = info.value
        assert isinstance(error, LoadError) and not isinstance(error, OSError), f"{type(error).__mro__}: {error}"
        assert "No space left on device" in str(error), str(error)
        assert str(out) in str(error), str(error)

        # Nothing of the failed save is left: the same files, the same space used.
        assert _tree(mnt) == before, f"stray files after the failed save: {set(_tree(mnt)) ^ set(before)}"
        assert _used(mnt) == used
        # The earlier save loads exactly (and its files still have the recorded hashes).
        for r in range(SAVE_TP):
            got = fl.load(out, tp_size=SAVE_TP, rank=r, progress=False, read=fl.ReadOptions(verify_hashes=True))
            assert_same_state(got, fl.load(llama, tp_size=SAVE_TP, rank=r, progress=False), f"earlier save, rank {r}")

        # Once there is room, a save over it in the same directory works and replaces it.
        _remount(mnt, 3 * first)
        fl.save_sharded(llama_b, out, SAVE_TP)
        assert len([n for n in _tree(out) if n.startswith("model-rank-")]) == SAVE_TP
        assert not [n for n in _tree(mnt) if n.startswith(".") or "/." in n], _tree(mnt)
        for r in range(SAVE_TP):
            got = fl.load(out, tp_size=SAVE_TP, rank=r, progress=False, read=fl.ReadOptions(verify_hashes=True))
            assert_same_state(got, fl.load(llama_b, tp_size=SAVE_TP, rank=r, progress=False), f"later save, rank {r}")
    finally:
        _umount(mnt)


# 3. a shard that changes while it is read --------------------------------------------------------


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _replace(path: Path) -> None:
    """Other data bytes, same header and size, atomically renamed over the shard."""
    blob = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(blob[:8], "little")
    blob[start:] = bytes(b ^ 0xFF for b in blob[start:])
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(blob)
    os.replace(tmp, path)


def _grow(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)


CHANGES = {"truncated": _truncate, "replaced": _replace, "grown": _grow}
TRIGGER_READ = 3


class ChangeDuringLoad:
    """Wraps ``Reader.read_into``; reads are serialised so the change falls between two reads.

    ``when="middle"``: before the ``TRIGGER_READ``-th read; ``when="end"``: right after the last
    read (``total``) returns. ``target="current"``: the shard that read touches; ``"other"``: in
    the middle a shard not read yet, at the end one read earlier.
    """

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, change: Callable[[Path], None], when: str, target: str, total: int,
        shards: tuple[Path, ...] = (),
    ):
        self.change, self.when, self.target, self.total, self.shards = change, when, target, total, shards
        self.calls = 0
        self.changed: Path | None = None
        self.reads_after = 0
        self.seen: list[Path] = []
        lock = threading.Lock()
        real = Reader.read_into
        test = self

        def read_into(reader: Reader, info: Any, box: Any, out: memoryview) -> None:
            with lock:
                test.calls += 1
                if test.changed is not None:
                    test.reads_after += 1
                # in the middle: from the TRIGGER_READ-th read on, at the first read of a shard already
                # read from ("current"; with several threads the TRIGGER_READ-th may open a new one)
                ready = test.target != "current" or info.file in test.seen
                if test.when == "middle" and test.changed is None and test.calls >= TRIGGER_READ and ready:
                    test.fire(info.file)
                real(reader, info, box, out)
                if info.file not in test.seen:
                    test.seen.append(info.file)
                if test.when == "end" and test.calls == test.total:
                    test.fire(info.file)

        monkeypatch.setattr(Reader, "read_into", read_into)

    def fire(self, current: Path) -> None:
        files = sorted({*self.seen, current, *self.shards})
        if self.target == "current":
            assert self.when == "end" or current in self.seen, f"{current} was not open yet at read {TRIGGER_READ}"
            victim = current
        elif self.when == "middle":
            unread = [f for f in files if f not in self.seen and f != current]
            assert unread, f"every shard was read before read {TRIGGER_READ}"
            victim = unread[-1]
        else:
            earlier = [f for f in self.seen if f != current]
            assert earlier, "the load read one shard only"
            victim = earlier[0]
        self.change(victim)
        self.changed = victim


def _built_states(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    built: list[Any] = []
    real = api.LoadedState

    def record(*args: Any, **kwargs: Any) -> Any:
        state = real(*args, **kwargs)
        built.append(state)
        return state

    monkeypatch.setattr(api, "LoadedState", record)
    return built


@pytest.mark.parametrize("threads,when", [(1, "middle"), (1, "end"), (4, "middle")], ids=["t1-middle", "t1-end", "t4-middle"])
@pytest.mark.parametrize("target", ["current", "other"])
@pytest.mark.parametrize("strategy", ["pread", "mmap", "eager"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_shard_changed_during_load_is_an_integrity_error(llama, tmp_path, monkeypatch, change, strategy, target, threads, when):
    """A shard changes between two reads of a load (tp 2, rank 1): an IntegrityError naming it,
    raised out of ``load``, and no LoadedState built.

    The readers re-check a file's stamp (``fstat`` of their descriptor) before each read, which
    sees a truncated or grown shard and a shard opened after it was replaced. They cannot see a
    shard replaced by rename after they opened it (their descriptor and mapping still hold the
    old inode, so its old bytes are read, consistently), nor any change to a shard the eager
    reader already holds whole, nor a change after the last read: those 28 of the 54 cases are
    caught only by ``verify_unchanged``, the ``stat`` of every file by path after the reads, and
    fail if it is removed."""
    model = tmp_path / "model"
    shutil.copytree(llama, model)
    read = fl.ReadOptions(strategy=strategy, threads=threads)
    kwargs = dict(tp_size=2, rank=1, read=read, progress=False)

    counter = ChangeDuringLoad(monkeypatch, lambda p: None, "never", target, 0)
    fl.load(model, **kwargs)  # the reads of an undisturbed load
    total = counter.calls
    shards = tuple(sorted(model.glob("*.safetensors")))
    assert total > TRIGGER_READ and len(counter.seen) == len(shards) > 1
    monkeypatch.undo()

    built = _built_states(monkeypatch)
    hook = ChangeDuringLoad(monkeypatch, CHANGES[change], when, target, total, shards)
    result = None
    with pytest.raises(Exception) as info:
        result = fl.load(model, **kwargs)
    assert hook.changed is not None, "the change never happened"
    assert isinstance(info.value, IntegrityError), f"{type(info.value).__name__}: {info.value}"
    assert str(hook.changed) in str(info.value), f"the error does not name {hook.changed}: {info.value}"
    assert result is None and built == [], "a LoadedState was built from a changed checkpoint"
    if when == "end":
        assert hook.calls == total and hook.reads_after == 0  # only the check after the reads could see it
