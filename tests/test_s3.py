"""Loading straight from S3, against a real S3 server (SeaweedFS, started once per session).

Tiny transformers checkpoints (dense llama, MoE qwen3_moe) are uploaded to the server; loads of
``s3://bucket/model`` equal the local loads bit for bit at tp 1/2/4 and with expert parallelism,
for every rank, and each rank fetches its planned bytes (and the over-read its stats report) in the
requests its stats count.
Headers cost one ranged GET each (two past 64 KiB). Faults injected by a proxy between client and
server (throttling, 500s, resets and cuts mid-body, consistent short bodies) are retried into the
same bits, or fail after the bounded attempts with a LoadError; wrong credentials, a missing
bucket or object, an unreachable endpoint and an object replaced after planning are LoadErrors
naming the URI and the fix. ``plan``, ``layout``, ``verify`` and the CLI take the URI too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import functional_load as fl
from functional_load.checkpoint.index import HEADER_PROBE_BYTES, read_header
from functional_load.cli import main
from functional_load.errors import IntegrityError, LoadError, MissingFileError
from functional_load.io import execute
from functional_load.storage import S3Path, S3Storage, StorageError, as_path, register_scheme, storage_for
from functional_load.storage.s3 import open_s3
from functional_load.storage.s3_config import S3Config
from functional_load.testing.faults import FaultProxy
from functional_load.testing.seaweed import SeaweedServer, free_ports
from functional_load.verify import verify_ranks

BUCKET = "models"
Use = Callable[..., S3Storage]


@pytest.fixture(scope="module")
def uploaded(seaweed: SeaweedServer, tiny_checkpoint) -> dict[str, Path]:
    """Local checkpoint directories by name, each uploaded to ``s3://models/<name>``."""
    local = {"llama": tiny_checkpoint("llama"), "qwen3_moe": tiny_checkpoint("qwen3_moe")}
    for name, directory in local.items():
        seaweed.upload(directory, BUCKET, name)
    return local


@pytest.fixture()
def use(seaweed: SeaweedServer) -> Iterator[Use]:
    """``use(**overrides)``: serve ``s3://`` from a fresh storage configured for the server (with
    ``overrides`` of :class:`S3Config` and of its environment); the default storage afterwards."""

    def configure(env: dict[str, str] | None = None, **overrides: object) -> S3Storage:
        storage = S3Storage(S3Config.from_environment({**seaweed.env(), **(env or {})}, backoff_seconds=0.01, **overrides))
        register_scheme(S3Path, lambda: storage)
        return storage

    yield configure
    register_scheme(S3Path, open_s3)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def _same(remote: fl.LoadedState, local: fl.LoadedState) -> None:
    assert remote.keys() == local.keys()
    for name in local:
        np.testing.assert_array_equal(_bits(remote[name]), _bits(local[name]), err_msg=name)


@pytest.mark.parametrize(("arch", "tp", "ep"), [("llama", 1, False), ("llama", 2, False), ("llama", 4, False),
                                                ("qwen3_moe", 2, False), ("qwen3_moe", 4, True)])
def test_every_rank_loads_from_s3_as_from_disk(uploaded, use: Use, arch: str, tp: int, ep: bool) -> None:
    """Bit-identical to the local load; each rank fetches its planned bytes and the gaps the cost
    model reads through (the stats' over-read), in the ranged GETs its stats count (plus one HEAD
    per file: the check after the load that nothing changed)."""
    storage = use()
    for rank in range(tp):
        plan = fl.plan(f"s3://{BUCKET}/{arch}", tp_size=tp, rank=rank, expert_parallel=ep)
        before = storage.counts()
        tensors, stats = execute(plan)
        after = storage.counts()
        files = {info.file for info in plan.tensors.values()}
        assert after["bytes"] - before["bytes"] == stats.bytes_read == plan.bytes_to_read + stats.over_read
        assert after["requests"] - before["requests"] == stats.requests + len(files) and after["retries"] == 0
        assert stats.requests >= len(files)
        local = fl.load(uploaded[arch], tp_size=tp, rank=rank, expert_parallel=ep, progress=False)
        remote = fl.load(f"s3://{BUCKET}/{arch}", tp_size=tp, rank=rank, expert_parallel=ep, progress=False)
        _same(remote, local)
        assert remote.stats is not None and remote.stats.requests == stats.requests
        for name in tensors:
            np.testing.assert_array_equal(_bits(tensors[name]), _bits(local[name]), err_msg=name)


def test_plan_layout_verify_and_the_cli_take_an_s3_uri(uploaded, use: Use, seaweed: SeaweedServer, monkeypatch, capsys) -> None:
    use()
    uri = f"s3://{BUCKET}/llama"
    assert fl.layout(uri, tp_size=2, rank=1) == fl.layout(uploaded["llama"], tp_size=2, rank=1)
    report = verify_ranks(uri, tp_size=2)
    assert report.ok, report.summary()
    for key, value in seaweed.env().items():  # the CLI's storage: the standard AWS environment
        monkeypatch.setenv(key, value)
    register_scheme(S3Path, open_s3)
    assert main(["plan", uri, "--tp", "2", "--rank", "1"]) == 0
    assert "model.layers.0.self_attn.o_proj.weight" in capsys.readouterr().out
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    register_scheme(S3Path, open_s3)
    assert main(["plan", uri, "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and uri in err and "AWS_SECRET_ACCESS_KEY" in err, err


def test_a_header_is_one_get_and_a_long_one_two(uploaded, use: Use, seaweed: SeaweedServer, tmp_path: Path) -> None:
    """Plan: per safetensors file one HEAD (its identity) and one ranged GET of its first 64 KiB;
    a header longer than that costs one more GET, of the rest."""
    with FaultProxy(seaweed.endpoint) as proxy:
        use({"AWS_ENDPOINT_URL_S3": proxy.endpoint})
        plan = fl.plan(f"s3://{BUCKET}/llama", tp_size=2, rank=0)
        shards = {str(info.file) for info in plan.tensors.values()}
        ranged = [(path, rng) for method, path, rng, _ in proxy.log if method == "GET" and path.endswith(".safetensors")]
        assert sorted(ranged) == sorted((f"/{s.removeprefix('s3://')}", f"bytes=0-{HEADER_PROBE_BYTES - 1}") for s in shards)
        many = {f"layer.{i:05d}.{'a_long_tensor_name_' * 4}": torch.full((2,), float(i)) for i in range(1200)}
        save_file(many, tmp_path / "long.safetensors")
        seaweed.put(BUCKET, "long/long.safetensors", (tmp_path / "long.safetensors").read_bytes())
        before = len(proxy.log)
        infos = read_header(as_path(f"s3://{BUCKET}/long/long.safetensors"))
        assert [entry[0] for entry in proxy.log[before:]] == ["HEAD", "GET", "GET"]
    local = read_header(tmp_path / "long.safetensors")
    spans = lambda found: [(i.name, i.location.offset, i.nbytes) for i in found.values()]
    assert spans(infos) == spans(local)


def test_the_storage_keeps_the_protocol(use: Use, seaweed: SeaweedServer) -> None:
    storage = use()
    data = bytes(range(256)) * 4
    seaweed.put(BUCKET, "proto/a.safetensors", data)
    seaweed.put(BUCKET, "proto/b.json", b"{}")
    seaweed.put(BUCKET, "proto/sub/c.safetensors", b"x")
    directory = as_path(f"s3://{BUCKET}/proto")
    file = directory / "a.safetensors"
    assert isinstance(file, S3Path) and str(file) == f"s3://{BUCKET}/proto/a.safetensors"
    kinds = [storage.kind(p) for p in (directory, file, directory / "c", as_path(f"s3://{BUCKET}"))]
    assert kinds == ["directory", "file", "missing", "directory"]
    assert storage.list_files(directory, "*.safetensors") == [file]
    stamp = storage.stamp(file)
    assert stamp.size == len(data) and storage.read(file, 1000, 100) == data[1000:] and storage.read(file, 2000, 10) == b""
    out = bytearray(16)
    assert storage.read_into(file, 8, memoryview(out), stamp) == 16 and bytes(out) == data[8:24]
    with pytest.raises(IntegrityError, match=f"{file}: ends at byte 1024"):
        storage.read_into(file, len(data) - 4, memoryview(bytearray(16)), stamp)
    with pytest.raises(MissingFileError, match=f"{directory}/c: no such object"):
        storage.stamp(directory / "c")
    with pytest.raises(MissingFileError, match="bucket 'no-such-bucket' does not exist"):
        storage.kind(as_path("s3://no-such-bucket/model"))


def test_missing_models_and_wrong_credentials_are_load_errors(uploaded, use: Use) -> None:
    use()
    with pytest.raises(MissingFileError, match="s3://models/nothing: model directory not found"):
        fl.plan(f"s3://{BUCKET}/nothing")
    with pytest.raises(MissingFileError, match=r"s3://no-such-bucket/llama: bucket 'no-such-bucket' does not exist.*AWS_ENDPOINT_URL_S3"):
        fl.plan("s3://no-such-bucket/llama")
    use({"AWS_SECRET_ACCESS_KEY": "wrong"})
    with pytest.raises(StorageError, match=r"s3://models/llama: .* denied .*403.*check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        fl.load(f"s3://{BUCKET}/llama", progress=False)
    (port,) = free_ports(1)
    use({"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}, max_attempts=2)
    with pytest.raises(StorageError, match=rf"s3://models/llama: .*no whole answer from .*:{port} in 2 .*AWS_ENDPOINT_URL_S3"):
        fl.plan(f"s3://{BUCKET}/llama")


def test_an_object_replaced_after_planning_is_refused(uploaded, use: Use, seaweed: SeaweedServer) -> None:
    """Every read of tensor data names the ETag the plan indexed (If-Match): a replaced shard
    fails the load, naming it, and none of its new bytes is used."""
    uri = seaweed.upload(uploaded["llama"], BUCKET, "replaced")
    with FaultProxy(seaweed.endpoint) as proxy:
        storage = use({"AWS_ENDPOINT_URL_S3": proxy.endpoint})
        plan = fl.plan(uri, tp_size=2, rank=0)
        stamps = {f"/{str(info.file).removeprefix('s3://')}": info.location.stamp for info in plan.tensors.values()}
        planned = len(proxy.log)
        execute(plan)
        reads = [(path, match) for method, path, _, match in proxy.log[planned:] if method == "GET"]
        assert reads and all(match == stamps[path].version for path, match in reads)
        shard = max({info.file for info in plan.tensors.values()}, key=str)
        data = bytearray((uploaded["llama"] / shard.name).read_bytes())
        data[-1] ^= 0xFF  # the same size, another version
        seaweed.put(BUCKET, f"replaced/{shard.name}", bytes(data))
        before = storage.counts()["bytes"]
        with pytest.raises(IntegrityError, match=f"{shard}: replaced since it was indexed"):
            execute(plan)
        assert storage.counts()["bytes"] - before < plan.bytes_to_read


def test_faults_are_retried_into_the_same_bits(uploaded, use: Use, seaweed: SeaweedServer) -> None:
    """Throttling, a 500, resets and cuts mid-body and consistent short bodies, on the ranged GETs
    of the plan (config, index, headers) and of the load (tensor data): each retried, none used;
    the load is the same, bit for bit."""
    local = fl.load(uploaded["qwen3_moe"], tp_size=2, rank=1, progress=False)
    kinds = ("slowdown", "error", "reset", "truncate", "short")
    with FaultProxy(seaweed.endpoint) as proxy:
        storage = use({"AWS_ENDPOINT_URL_S3": proxy.endpoint}, max_attempts=11, backoff_cap_seconds=0.05)  # 10 may hit one GET
        for kind in kinds:
            proxy.inject(kind, after=8)
        plan = fl.plan(f"s3://{BUCKET}/qwen3_moe", tp_size=2, rank=1)
        assert proxy.pending == 0 and storage.counts()["retries"] == 5
        for kind in kinds:
            proxy.inject(kind, times=2, after=8)
        tensors, _ = execute(plan)
        assert proxy.pending == 0 and sum(proxy.injected.values()) == 15
    assert storage.counts()["retries"] == 15  # every fault seen, and retried
    assert tensors.keys() == local.keys()
    for name in local:
        np.testing.assert_array_equal(_bits(tensors[name]), _bits(local[name]), err_msg=name)


def test_faults_past_the_attempts_are_a_load_error(uploaded, use: Use, seaweed: SeaweedServer) -> None:
    with FaultProxy(seaweed.endpoint) as proxy:
        storage = use({"AWS_ENDPOINT_URL_S3": proxy.endpoint}, max_attempts=3)
        file = as_path(f"s3://{BUCKET}/llama/config.json")
        stamp = storage_for(file).stamp(file)
        proxy.inject("slowdown", times=1000)
        gets = proxy.seen["GET"]
        with pytest.raises(StorageError, match=f"{file}: GET failed 3 time.*503 SlowDown.*AWS_MAX_ATTEMPTS"):
            storage.read_into(file, 0, memoryview(bytearray(10)), stamp)
        assert proxy.seen["GET"] - gets == 3  # bounded: exactly max_attempts tries
        with pytest.raises(LoadError, match=f"s3://{BUCKET}/llama/.*SlowDown"):  # ConfigError: config.json unreadable
            fl.load(f"s3://{BUCKET}/llama", progress=False)


def test_the_standard_aws_configuration(tmp_path: Path) -> None:
    (tmp_path / "config").write_text("[profile lab]\nregion = eu-west-3\nendpoint_url = http://127.0.0.1:9000\nmax_attempts = 7\n")
    (tmp_path / "credentials").write_text("[lab]\naws_access_key_id = AK\naws_secret_access_key = SK\n")
    files = {"AWS_CONFIG_FILE": str(tmp_path / "config"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials")}
    lab = S3Config.from_environment({**files, "AWS_PROFILE": "lab"})
    assert (lab.endpoint, lab.region, lab.access_key_id, lab.secret_access_key, lab.max_attempts) == (
        "http://127.0.0.1:9000", "eu-west-3", "AK", "SK", 7)
    env = S3Config.from_environment({**files, "AWS_PROFILE": "lab", "AWS_ENDPOINT_URL": "http://a:1", "AWS_ENDPOINT_URL_S3": "http://b:2",
                                     "AWS_REGION": "ap-south-1", "AWS_ACCESS_KEY_ID": "K", "AWS_SECRET_ACCESS_KEY": "S"})
    assert (env.endpoint, env.region, env.access_key_id, env.max_attempts) == ("http://b:2", "ap-south-1", "K", 7)
    bare = S3Config.from_environment({**files})
    assert (bare.endpoint, bare.region, bare.access_key_id, bare.max_attempts) == (None, "us-east-1", None, 5)
    token = S3Config.from_environment({**files, "AWS_ACCESS_KEY_ID": "K", "AWS_SECRET_ACCESS_KEY": "S", "AWS_SESSION_TOKEN": "T"})
    assert token.session_token == "T" and S3Storage(token)._store("bucket") is not None  # the client takes every setting
    with pytest.raises(LoadError, match="AWS profile 'nope'"):
        S3Config.from_environment({**files, "AWS_PROFILE": "nope"})
    with pytest.raises(LoadError, match="AWS_SECRET_ACCESS_KEY is not set"):
        S3Config.from_environment({**files, "AWS_ACCESS_KEY_ID": "K"})
