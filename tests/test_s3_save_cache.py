"""Saving pre-sharded checkpoints to S3, and the rank-local cache of loads from S3, against a real
S3 server (SeaweedFS, started once per session: the ``seaweed`` fixture).

* ``save_sharded(model, "s3://...")`` uploads each rank file (a multipart upload past the part
  size) and puts the manifest after every rank file; the save reloads at its layout and reshards
  to another, bit for bit equal to loading the original. A save that fails before the manifest
  leaves nothing loadable (an existing save under the prefix stays loadable, its files intact);
  a save over an existing one deletes the old files only after its manifest. A read-only
  identity or a missing bucket is a LoadError naming the URI and the fix.
* ``cache_dir``: the first load from S3 fetches the rank's bytes and writes the cache; the second
  fetches 0 bytes and is bit-identical; an object replaced since is noticed (the cache is not
  used, the result is the new data, the cache refreshed); another layout does not use it; a
  cache write interrupted (a leftover temporary folder, a failed commit) or a truncated cached
  file is never used.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import assert_same_state

import functional_load as fl
from functional_load.checkpoint.sharded import MANIFEST
from functional_load.cli import main
from functional_load.errors import ConfigError, LoadError, MissingFileError
from functional_load.output import rank_cache, save_remote
from functional_load.storage import S3Path, S3Storage, StorageError, as_path, register_scheme
from functional_load.storage.s3 import open_s3
from functional_load.storage.s3_config import S3Config
from functional_load.testing.faults import FaultProxy
from functional_load.testing.seaweed import SeaweedServer

BUCKET = "saves"
Use = Callable[..., S3Storage]


@pytest.fixture(scope="module")
def llama(seaweed: SeaweedServer, tiny_checkpoint) -> tuple[Path, str]:
    """The tiny llama checkpoint, local and uploaded (``s3://saves/llama``)."""
    local = tiny_checkpoint("llama")
    return local, seaweed.upload(local, BUCKET, "llama")


@pytest.fixture()
def use(seaweed: SeaweedServer) -> Iterator[Use]:
    """``use(env, **overrides)``: serve ``s3://`` from a fresh storage for the server (parts of 5 MiB)."""

    def configure(env: dict[str, str] | None = None, **overrides: object) -> S3Storage:
        settings = {"backoff_seconds": 0.01, "upload_part_bytes": 5 << 20, **overrides}
        storage = S3Storage(S3Config.from_environment({**seaweed.env(), **(env or {})}, **settings))
        register_scheme(S3Path, lambda: storage)
        return storage

    yield configure
    register_scheme(S3Path, open_s3)


def _names(storage: S3Storage, uri: str) -> list[str]:
    """The files under ``uri`` (SeaweedFS lists an emptied folder as an object of the folder's name)."""
    return [p.name for p in storage.list_files(as_path(uri), "*") if p.name != as_path(uri).name]


def _reference(local: Path, tp: int) -> list[fl.LoadedState]:
    return [fl.load(local, tp_size=tp, rank=r, progress=False) for r in range(tp)]


def test_save_to_s3_reloads_and_reshards(llama, use: Use, seaweed: SeaweedServer) -> None:
    local, _ = llama
    with FaultProxy(seaweed.endpoint) as proxy:
        use({"AWS_ENDPOINT_URL_S3": proxy.endpoint})
        out = fl.save_sharded(local, f"s3://{BUCKET}/save-tp2", tp_size=2)
        writes = [(method, path) for method, path, _, _ in proxy.log if method in ("PUT", "POST")]
    assert str(out) == f"s3://{BUCKET}/save-tp2"
    ranks = [i for i, (_, path) in enumerate(writes) if "model-rank-" in path]
    assert len(ranks) == 2  # each rank file (~210 kB, under a part) one PUT
    manifest = [i for i, (_, path) in enumerate(writes) if path.endswith(MANIFEST)]
    config = [i for i, (_, path) in enumerate(writes) if path.endswith("/config.json")]
    assert len(manifest) == 1 and max(ranks) < manifest[0] < config[0]  # the manifest after every rank file
    use()
    for tp in (2, 4):  # the saved layout (each rank its own file) and a reshard
        for r, want in enumerate(_reference(local, tp)):
            assert_same_state(fl.load(str(out), tp_size=tp, rank=r, progress=False), want, f"tp {tp} rank {r}")


def test_a_large_file_is_a_multipart_upload(use: Use, seaweed: SeaweedServer, tmp_path: Path) -> None:
    """Past ``upload_part_bytes`` (5 MiB, S3's smallest part) a write is a multipart upload; the object appears whole."""
    data = bytes(range(256)) * (11 << 12)  # 11 MiB: 3 parts
    (tmp_path / "big").write_bytes(data)
    with FaultProxy(seaweed.endpoint) as proxy:
        storage = use({"AWS_ENDPOINT_URL_S3": proxy.endpoint})
        file = as_path(f"s3://{BUCKET}/multipart/big.safetensors")
        stamp = storage.write_file(file, tmp_path / "big")
        writes = [(method, path) for method, path, _, _ in proxy.log if method in ("PUT", "POST")]
        assert stamp == storage.stamp(file) and storage.read(file, 0, len(data) + 1) == data
    assert [m for m, p in writes if "?uploads" in p] == ["POST"] and sum("partNumber=" in p for _, p in writes) == 3, writes
    with pytest.raises(ConfigError, match="upload_part_bytes must be an integer of at least 5242880"):
        S3Config(upload_part_bytes=1 << 20)


def test_an_interrupted_save_is_not_loadable_and_an_older_one_stays(llama, use: Use, monkeypatch) -> None:
    local, source = llama
    storage = use()

    def fail(step: str) -> None:
        if step == "write manifest":
            raise OSError(5, "injected before the manifest")

    monkeypatch.setattr(save_remote, "_step", fail)
    with pytest.raises(LoadError, match="injected"):
        fl.save_sharded(source, f"s3://{BUCKET}/crash", tp_size=2)
    assert _names(storage, f"s3://{BUCKET}/crash") == []  # what it uploaded is deleted
    with pytest.raises(LoadError, match=f"s3://{BUCKET}/crash"):
        fl.load(f"s3://{BUCKET}/crash", progress=False)
    monkeypatch.setattr(save_remote, "_discard", lambda uploaded: None)  # as if killed: the rank files stay
    with pytest.raises(LoadError):
        fl.save_sharded(local, f"s3://{BUCKET}/crash", tp_size=2)
    assert len(_names(storage, f"s3://{BUCKET}/crash")) == 2
    with pytest.raises(ConfigError, match=f"s3://{BUCKET}/crash/config.json: .*no manifest {MANIFEST}.*interrupted"):
        fl.load(f"s3://{BUCKET}/crash", progress=False)

    monkeypatch.setattr(save_remote, "_step", lambda step: None)
    old = fl.save_sharded(local, f"s3://{BUCKET}/keep", tp_size=2)
    before = _names(storage, str(old))
    monkeypatch.setattr(save_remote, "_step", fail)
    with pytest.raises(LoadError):  # a tp-4 save over it, interrupted before its manifest: the rank files stay (as killed)
        fl.save_sharded(local, str(old), tp_size=4)
    assert len(_names(storage, str(old))) == len(before) + 4
    for r, want in enumerate(_reference(local, 2)):
        assert_same_state(fl.load(str(old), tp_size=2, rank=r, progress=False), want, f"old save rank {r}")
    monkeypatch.setattr(save_remote, "_step", lambda step: None)
    fl.save_sharded(local, str(old), tp_size=4)  # committed: the tp-2 files go after the manifest
    assert not set(before) - {"config.json", MANIFEST} & set(_names(storage, str(old)))
    assert_same_state(fl.load(str(old), tp_size=4, rank=3, progress=False), _reference(local, 4)[3], "new save")


def test_no_write_permission_and_a_missing_bucket_are_load_errors(llama, use: Use, seaweed: SeaweedServer) -> None:
    local, _ = llama
    use(seaweed.reader_env())
    with pytest.raises(StorageError, match=rf"s3://{BUCKET}/denied/model-rank-0-of-2-\w+\.safetensors: .*denied PUT .*403"
                                           r".*may write to the bucket"):
        fl.save_sharded(local, f"s3://{BUCKET}/denied", tp_size=2)
    use()
    with pytest.raises(MissingFileError, match=r"s3://no-such-bucket/save: bucket 'no-such-bucket' does not exist.*create the bucket"):
        fl.save_sharded(local, "s3://no-such-bucket/save", tp_size=2)


def _load(uri: str, cache: Path, tp: int = 2, rank: int = 0) -> fl.LoadedState:
    return fl.load(uri, tp_size=tp, rank=rank, cache_dir=cache, progress=False)


def test_the_rank_cache(llama, use: Use, seaweed: SeaweedServer, tmp_path: Path, caplog) -> None:
    local, _ = llama
    uri = seaweed.upload(local, BUCKET, "cached")
    storage, cache = use(), tmp_path / "cache"
    want = fl.load(local, tp_size=2, rank=1, progress=False)
    fetched = storage.counts()["bytes"]
    first = _load(uri, cache, rank=1)
    first_bytes, fetched = storage.counts()["bytes"] - fetched, storage.counts()["bytes"]
    assert first_bytes >= first.plan.bytes_to_read > 0
    (folder,) = cache.iterdir()
    assert folder.name.startswith("rank-1-of-2-") and (folder / MANIFEST).is_file()
    second = _load(uri, cache, rank=1)
    assert storage.counts()["bytes"] == fetched  # 0 bytes from S3: local disk
    assert second.plan.model_dir == str(folder) and second.stats is not None and second.stats.bytes_read > 0
    assert_same_state(second, want, "cached")
    assert_same_state(first, want, "first")

    _load(uri, cache, tp=4, rank=1)  # another layout: its own folder, this one not used
    assert storage.counts()["bytes"] > fetched and len(list(cache.iterdir())) == 2

    changed = tmp_path / "changed"
    shutil.copytree(local, changed)
    shard = max(changed.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-2:] = bytes([data[-2] ^ 0x7F, data[-1] ^ 0x01])  # the same size, another version (and another value)
    shard.write_bytes(bytes(data))
    seaweed.put(BUCKET, f"cached/{shard.name}", bytes(data))
    fetched = storage.counts()["bytes"]
    with caplog.at_level(logging.WARNING, logger="functional_load"):
        third = _load(uri, cache, rank=1)
    assert storage.counts()["bytes"] > fetched
    assert any("objects changed" in r.getMessage() and f"{shard.name}: replaced" in r.getMessage() for r in caplog.records)
    assert_same_state(third, fl.load(changed, tp_size=2, rank=1, progress=False), "new data")
    fetched = storage.counts()["bytes"]
    assert_same_state(_load(uri, cache, rank=1), third, "refreshed")  # the cache holds the new version now
    assert storage.counts()["bytes"] == fetched


def test_an_interrupted_or_damaged_cache_is_not_used(llama, use: Use, seaweed: SeaweedServer, tmp_path: Path, monkeypatch) -> None:
    local, _ = llama
    uri = seaweed.upload(local, BUCKET, "cached-broken")
    storage, cache = use(), tmp_path / "cache"
    want = fl.load(local, tp_size=2, rank=0, progress=False)

    def killed(self: rank_cache.RankCache, tmp: Path) -> None:
        raise OSError(5, "killed before the rename")

    monkeypatch.setattr(rank_cache.RankCache, "_commit", killed)
    _load(uri, cache)
    assert list(cache.iterdir()) == []  # a write failed in-process: its temporary folder removed, nothing to use
    monkeypatch.undo()
    _load(uri, cache)
    (folder,) = cache.iterdir()
    partial = cache / f".{folder.name}.tmp-0123456789ab"  # a writer killed mid-write: its temporary folder, complete or not
    shutil.copytree(folder, partial)
    shutil.rmtree(folder)
    fetched = storage.counts()["bytes"]
    assert_same_state(_load(uri, cache), want, "after a killed write")
    assert storage.counts()["bytes"] > fetched  # the temporary folder was not read; the cache is written again
    assert sorted(p.name for p in cache.iterdir()) == [folder.name]  # and the leftover removed

    rank_file = next(folder.glob("model-rank-*.safetensors"))
    with open(rank_file, "r+b") as f:
        f.truncate(rank_file.stat().st_size - 8)
    fetched = storage.counts()["bytes"]
    assert_same_state(_load(uri, cache), want, "after a truncated cache file")
    assert storage.counts()["bytes"] > fetched


def test_cache_dir_is_an_option_and_a_cli_flag(llama, use: Use, seaweed: SeaweedServer, tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ConfigError, match="cache_dir must be a local folder"):
        fl.LoadOptions(cache_dir="s3://bucket/cache")
    assert fl.LoadOptions(cache_dir=tmp_path).cache_dir == tmp_path
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    register_scheme(S3Path, open_s3)
    _, uri = llama
    out = tmp_path / "rank0.safetensors"
    assert main(["load", uri, "--tp", "2", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 0
    assert [p.name[:12] for p in (tmp_path / "cache").iterdir()] == ["rank-0-of-2-"]
