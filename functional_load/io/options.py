"""How a load reads bytes: :class:`ReadOptions`, a frozen value, and the filesystem facts it uses."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..errors import ConfigError

STRATEGIES = ("auto", "pread", "mmap", "eager")
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "lustre", "virtiofs", "ceph", "fuse.ceph", "fuse.juicefs", "gpfs", "beegfs")
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class RequestCost:
    """What a ranged request to object storage costs: ``latency`` seconds beyond its bytes, which
    arrive at ``bandwidth`` bytes per second (one request stream). A gap between two runs of a
    rank's bytes is read through, not skipped by a new request, when reading it costs less than a
    request: ``gap / bandwidth < latency``. ``chunk_bytes`` is the largest request (host memory
    holds at most one such buffer per request in flight)."""

    latency: float
    bandwidth: float
    chunk_bytes: int
    in_flight: int = 8  # ranged requests at once, over every thread of the load

    def reads_through(self, gap: int) -> bool:
        """Whether a gap of ``gap`` bytes between two runs is cheaper to read than to skip."""
        return gap / self.bandwidth < self.latency


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """How a load reads bytes. ``strategy="auto"`` picks by measurement (docs/performance.md).

    * ``strategy``: ``"auto"`` | ``"pread"`` (exact positional reads) | ``"mmap"`` | ``"eager"``
      (each file read whole, sequentially);
    * ``threads``: parallel readers; ``prefetch`` (``None``: automatic on network filesystems
      when the bytes to read fit in 90 % of available memory) with ``prefetch_threads`` and
      ``prefetch_block_size``;
    * ``direct``: ``O_DIRECT``; ``max_over_read``: read a row-parallel slice of a local file as
      one span when that reads at most this many times the needed bytes;
    * object storage (any storage but the local file system): ``request_latency`` (seconds a
      ranged request costs beyond its bytes) and ``link_bandwidth`` (bytes per second of one
      request stream) choose the runs: a gap shorter than ``request_latency x link_bandwidth``
      (2 MB by default) is read through (see :class:`RequestCost`); ``request_bytes`` is the
      largest ranged request; ``requests_in_flight`` is the number of requests at once over every
      thread of the load (a load from object storage copies on that many threads at least, and a
      large tensor's chunks are fetched side by side), so host memory holds at most that many such
      buffers per reading thread;
    * ``verify_hashes``: check the SHA-256 of every file whose checksum the checkpoint records
      (a pre-sharded save's manifest) before reading from it.

    Contradictory combinations raise a ConfigError when the value is built.
    """

    strategy: str = "auto"
    threads: int = 4
    prefetch: bool | None = None
    prefetch_threads: int = 8
    prefetch_block_size: int = 16 * MiB
    direct: bool = False
    max_over_read: float = 1.0
    verify_hashes: bool = False  # check each file's SHA-256 where the checkpoint records it (pre-sharded saves)
    request_latency: float = 0.02  # s; S3 from EC2: tens of ms per small GET (docs/object-storage.md)
    link_bandwidth: float = 100e6  # bytes/s of one request stream; S3 from EC2: ~100 MB/s per connection
    request_bytes: int = 16 * MiB  # the largest ranged request (AWS's advice: 8 or 16 MB)
    requests_in_flight: int = 8  # at tp 1 over a 1 Gbit/s link, 8 reach the link's speed and 4 do not (docs/performance.md)

    @property
    def request_cost(self) -> RequestCost:
        """The cost model of object-storage reads these options give."""
        return RequestCost(self.request_latency, self.link_bandwidth, self.request_bytes, self.requests_in_flight)

    def __post_init__(self) -> None:
        for name in ("direct", "verify_hashes"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.prefetch is not None and not isinstance(self.prefetch, bool):
            raise ConfigError(f"prefetch must be None, True or False, got {self.prefetch!r}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"read strategy {self.strategy!r} is unknown; use one of {STRATEGIES}")
        for name in ("threads", "prefetch_threads", "prefetch_block_size", "request_bytes", "requests_in_flight"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        latency, bandwidth = self.request_latency, self.link_bandwidth
        if not _finite(latency) or latency < 0:
            raise ConfigError(f"request_latency must be a finite number of seconds >= 0, got {latency!r}")
        if not _finite(bandwidth) or bandwidth <= 0:
            raise ConfigError(f"link_bandwidth must be a finite number of bytes per second > 0, got {bandwidth!r}")
        if not self.max_over_read >= 1.0:
            raise ConfigError(f"max_over_read must be >= 1.0 (1.0 reads exactly the needed bytes), got {self.max_over_read!r}")
        if self.direct and self.strategy not in ("pread", "auto"):
            raise ConfigError(f"direct=True (O_DIRECT) needs the pread strategy, not {self.strategy!r}")
        if self.max_over_read != 1.0 and self.strategy not in ("pread", "auto"):
            raise ConfigError(f"max_over_read applies to the pread strategy only, not {self.strategy!r}")
        if self.prefetch and self.strategy == "eager":
            raise ConfigError("prefetch=True with strategy='eager' is contradictory: eager already reads every file whole")
        if self.prefetch and self.direct:
            raise ConfigError("prefetch=True warms the page cache, which direct=True (O_DIRECT) bypasses; pick one")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def filesystem_type(path: str | os.PathLike) -> str:
    """The filesystem type of ``path`` (longest matching mount point in /proc/mounts)."""
    best, kind = "", "unknown"
    try:
        target = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                under = len(parts) >= 3 and (target == parts[1] or target.startswith(parts[1].rstrip("/") + "/"))
                if under and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def available_memory() -> int:
    """MemAvailable, capped by a cgroup v2 memory limit when there is one."""
    available = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        return 0
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def should_prefetch(options: ReadOptions, model_dir: str | os.PathLike, bytes_to_read: int) -> bool:
    """vLLM's rule, extended: prefetch on network filesystems when the reads fit in 90 % of RAM."""
    if options.prefetch is not None:
        return options.prefetch
    return filesystem_type(model_dir) in NETWORK_FILESYSTEMS and bytes_to_read <= 0.9 * available_memory()
