"""One process of the torchrun job of ``tests/test_s3_group.py`` (not a test module itself).

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/_group_worker.py LAYOUTS_JSON OUT_DIR

The S3 endpoint and credentials come from the standard AWS environment. ``LAYOUTS_JSON`` holds
``[{"name", "model", "tp", "expert_parallel", "fail_rank"}, ...]``. For each layout every process
loads its own tensor rank twice in one load group (the whole gloo world): once through
``group_reader`` + ``execute`` in rounds of one piece, recording every ranged GET its S3 storage
answers, and once through ``fl.load(..., group=...)``. ``fail_rank``: that process asks for a
model that does not exist instead, and every process records the error it got. Global rank 0
writes the gathered records to ``OUT_DIR/<name>.pt``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch.distributed as dist
from _torchrun_worker import gather_layouts

import functional_load as fl
from functional_load.io import execute
from functional_load.io.group import group_reader
from functional_load.io.needs import StagedReader, needed
from functional_load.storage import S3Path, S3Storage, StoredPath, register_scheme
from functional_load.storage.base import Stamp

STORAGE = S3Storage()
GETS: list[tuple[str, int, int]] = []
_real_read_into = STORAGE.read_into


def _logged_read_into(file: StoredPath, offset: int, out: memoryview, stamp: Stamp | None) -> int:
    got = _real_read_into(file, offset, out, stamp)
    GETS.append((str(file), offset, got))
    return got


STORAGE.read_into = _logged_read_into  # type: ignore[method-assign]
register_scheme(S3Path, lambda: STORAGE)


def load_in_group(layout: dict[str, Any], rank: int) -> dict[str, Any]:
    tp, ep = layout["tp"], layout["expert_parallel"]
    if layout.get("fail_rank") is not None:
        model = layout["model"] + ("-missing" if rank == layout["fail_rank"] else "")
        try:
            fl.load(model, tp_size=tp, rank=rank, expert_parallel=ep, group=dist.group.WORLD, progress=False)
        except fl.LoadError as exc:
            return {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
        return {"rank": rank, "error": None}
    plan = fl.plan(layout["model"], tp_size=tp, rank=rank, expert_parallel=ep)
    GETS.clear()
    before = STORAGE.counts()
    reader, stats = group_reader(plan, dist.group.WORLD, round_bytes=1)  # rounds of one piece each
    with reader:
        tensors, load_stats = execute(plan, reader=reader)
    after = STORAGE.counts()
    assert isinstance(reader.remote, StagedReader)
    gets = list(GETS)
    state = fl.load(layout["model"], tp_size=tp, rank=rank, expert_parallel=ep, group=dist.group.WORLD, progress=False)
    assert state.stats is not None
    return {
        "rank": rank, "gets": gets, "counted": after["bytes"] - before["bytes"], "misses": reader.remote.misses,
        "needs": {uri: (n.ranges[0].tolist(), n.ranges[1].tolist()) for uri, n in needed(plan).items()},
        "bytes_to_read": plan.bytes_to_read, "stats": dataclasses.asdict(stats),
        "bytes_read": load_stats.bytes_read, "requests": load_stats.requests, "api_bytes_read": state.stats.bytes_read,
        "low_level": {name: t.clone() for name, t in tensors.items()}, "state": {name: t.clone() for name, t in state.items()},
    }


def main(argv: list[str]) -> int:
    return gather_layouts(argv, load_in_group)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
