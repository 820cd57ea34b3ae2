"""The storage seam: a checkpoint served by a storage other than the local file system.

:class:`MemoryStorage` (a test double: objects in a dict, each with a version, every request
counted) holds a real transformers checkpoint under ``memory://bucket/...``. Planning, loading,
``load_jax``, a pre-sharded save and its reload run over it unchanged, equal the local load bit
for bit, fetch exactly the planned tensor bytes, and refuse an object replaced during the load.
"""

from __future__ import annotations

import fnmatch
import threading
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

import functional_load as fl
from functional_load.errors import IntegrityError, MissingFileError
from functional_load.io import ReadOptions, execute
from functional_load.storage import LOCAL, Kind, LocalStorage, ObjectPath, ObjectStamp, Stamp, StoredPath, as_path, register_scheme


class MemoryPath(ObjectPath):
    scheme = "memory"


def _key(path: StoredPath) -> str:
    assert isinstance(path, MemoryPath), path
    return path.key


class MemoryStorage:
    """Objects ``/bucket/key`` -> bytes, versioned like ETags; counts requests and bytes."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, str]] = {}
        self.requests = 0
        self.data_bytes = 0  # bytes served by ranged reads into buffers (tensor data)
        self.served: Counter[str] = Counter()  # the same, per object
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        old = self.objects.get(key)
        self.objects[key] = (data, f"v{int(old[1][1:]) + 1}" if old else "v1")

    def _get(self, path: StoredPath) -> tuple[bytes, str]:
        key = _key(path)
        if key not in self.objects:
            raise MissingFileError(f"{path}: no such object")
        with self._lock:
            self.requests += 1
        return self.objects[key]

    def kind(self, path: StoredPath) -> Kind:
        key = _key(path)
        if key in self.objects:
            return "file"
        return "directory" if any(k.startswith(key.rstrip("/") + "/") for k in self.objects) else "missing"

    def list_files(self, directory: StoredPath, pattern: str) -> list[StoredPath]:
        prefix = _key(directory).rstrip("/") + "/"
        names = [k[len(prefix):] for k in self.objects if k.startswith(prefix)]
        return [directory / n for n in sorted(names) if "/" not in n and fnmatch.fnmatch(n, pattern)]

    def contained(self, path: StoredPath, directory: StoredPath, what: str) -> None:
        pass  # an object cannot point elsewhere

    def stamp(self, file: StoredPath) -> Stamp:
        data, version = self._get(file)
        return ObjectStamp(len(data), version)

    def read(self, file: StoredPath, offset: int, size: int) -> bytes:
        return self._get(file)[0][offset : offset + size]

    def read_into(self, file: StoredPath, offset: int, out: memoryview, stamp: Stamp | None) -> int:
        data, version = self._get(file)
        if stamp is not None and stamp != ObjectStamp(len(data), version):
            raise IntegrityError(f"{file}: replaced since it was indexed ({stamp} -> {version}); re-plan the load")
        chunk = data[offset : offset + out.nbytes]
        if len(chunk) < out.nbytes:
            raise IntegrityError(f"{file}: ends early")
        out[:] = chunk
        with self._lock:
            self.data_bytes += len(chunk)
            self.served[_key(file)] += len(chunk)
        return len(chunk)


@pytest.fixture()
def store(tiny_checkpoint) -> tuple[MemoryStorage, Path]:
    storage = MemoryStorage()
    register_scheme(MemoryPath, lambda: storage)
    local = tiny_checkpoint("llama")
    for file in sorted(local.iterdir()):
        if file.is_file():
            storage.put(f"/bucket/llama/{file.name}", file.read_bytes())
    return storage, local


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1), (4, 2)])
def test_load_from_another_storage_equals_the_local_load(store, tp: int, rank: int) -> None:
    storage, local = store
    uri = "memory://bucket/llama"
    assert str(as_path(uri)) == uri and isinstance(as_path(uri), MemoryPath)
    plan = fl.plan(uri, tp_size=tp, rank=rank)
    assert {str(info.file) for info in plan.tensors.values()} <= {f"memory:/{k}" for k in storage.objects}
    before = storage.data_bytes
    remote = fl.load(uri, tp_size=tp, rank=rank, progress=False)
    ours = fl.load(local, tp_size=tp, rank=rank, progress=False)
    assert remote.keys() == ours.keys()
    for name in ours:
        np.testing.assert_array_equal(_bits(remote[name]), _bits(ours[name]), err_msg=name)
    stats = remote.stats
    assert stats is not None and storage.data_bytes - before == stats.bytes_read == plan.bytes_to_read + stats.over_read


def test_object_replaced_during_the_load_is_refused(store) -> None:
    storage, _ = store
    plan = fl.plan("memory://bucket/llama", tp_size=2, rank=0)
    key = next(k for k in storage.objects if k.endswith(".safetensors"))
    storage.put(key, storage.objects[key][0])  # the same bytes, a new version: another object
    with pytest.raises(IntegrityError, match=f"memory:/{key}"):
        execute(plan)
    assert storage.served[key] == 0  # no byte of the new version was used (each read names the version)


def test_missing_directory_names_the_uri(store) -> None:
    with pytest.raises(MissingFileError, match="memory://bucket/nothing"):
        fl.plan("memory://bucket/nothing")


def test_load_jax_and_a_save_from_another_storage(store, tmp_path: Path) -> None:
    _, local = store
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    remote, ours = fl.load_jax("memory://bucket/llama", mesh), fl.load_jax(local, mesh)
    assert remote.keys() == ours.keys()
    for name in ours:
        np.testing.assert_array_equal(np.asarray(remote[name]), np.asarray(ours[name]), err_msg=name)
    saved = fl.save_sharded("memory://bucket/llama", tmp_path / "saved", tp_size=2)
    for rank in range(2):
        again, want = fl.load(saved, tp_size=2, rank=rank, progress=False), fl.load(local, tp_size=2, rank=rank, progress=False)
        for name in want:
            np.testing.assert_array_equal(_bits(again[name]), _bits(want[name]), err_msg=name)


@pytest.mark.parametrize("which", ["local", "memory"])
def test_every_storage_keeps_the_protocol(tmp_path: Path, which: str) -> None:
    """The Storage contract, on the local file system and the in-memory double alike: kinds,
    listing, stamps, short reads at the end only, reads into buffers that refuse another version
    of the file and an early end."""
    data = bytes(range(256)) * 4
    if which == "local":
        storage: LocalStorage | MemoryStorage = LOCAL
        directory: StoredPath = tmp_path / "model"
        directory.mkdir()
        (directory / "a.safetensors").write_bytes(data)
        (directory / "b.json").write_bytes(b"{}")
        replace = lambda: (directory / "a.safetensors").write_bytes(data[:-1] + b"x")
    else:
        storage = MemoryStorage()
        directory = MemoryPath("/bucket/model")
        storage.put("/bucket/model/a.safetensors", data)
        storage.put("/bucket/model/b.json", b"{}")
        replace = lambda: storage.put("/bucket/model/a.safetensors", data)
    file = directory / "a.safetensors"
    assert storage.kind(directory) == "directory" and storage.kind(file) == "file" and storage.kind(directory / "c") == "missing"
    assert storage.list_files(directory, "*.safetensors") == [file]
    stamp = storage.stamp(file)
    assert stamp.size == len(data) and storage.read(file, 1000, 100) == data[1000:]
    out = bytearray(16)
    assert storage.read_into(file, 8, memoryview(out), stamp) == 16 and bytes(out) == data[8:24]
    with pytest.raises(IntegrityError):
        storage.read_into(file, len(data) - 4, memoryview(bytearray(16)), stamp)
    with pytest.raises(MissingFileError):
        storage.stamp(directory / "c")
    replace()
    with pytest.raises(IntegrityError, match=str(file)):
        storage.read_into(file, 0, memoryview(out), stamp)


def test_row_slices_read_as_one_range_when_the_cost_model_says(store) -> None:
    """By default (the cost model: a request costs 20 ms, a stream moves 100 MB/s) a row-parallel
    slice is one ranged read of its span, gathered; with a 1 ns request every run is a read of its
    own. The same tensors; more bytes fetched (the over-read), far fewer requests."""
    storage, _ = store
    exact_requests = storage.requests
    want = fl.load("memory://bucket/llama", tp_size=4, rank=1, progress=False, read=ReadOptions(request_latency=1e-9))
    exact = storage.requests - exact_requests
    spans_requests = storage.requests
    spans = fl.load("memory://bucket/llama", tp_size=4, rank=1, progress=False)
    for name in want:
        np.testing.assert_array_equal(_bits(spans[name]), _bits(want[name]), err_msg=name)
    assert spans.stats is not None and want.stats is not None and want.stats.over_read == 0
    assert spans.stats.bytes_read == want.stats.bytes_read + spans.stats.over_read > want.stats.bytes_read
    assert (storage.requests - spans_requests) * 5 < exact
