"""One process of the torchrun job of ``tests/test_torchrun.py`` (not a test module itself).

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/_torchrun_worker.py LAYOUTS_JSON OUT_DIR

``LAYOUTS_JSON`` is a file holding ``[{"name", "model", "tp", "pp", "dp", "expert_parallel"}, ...]``.
Each process joins a gloo process group with the rank torchrun gave it (``RANK``, ``WORLD_SIZE``)
and, for each layout in turn, takes its ``(pp_rank, dp_rank, tp_rank)`` from its global rank in
vLLM's order, loads its own rank from the one checkpoint directory while recording every
``preadv`` system call, and all-gathers a record of its load over gloo; global rank 0 writes the
gathered records to ``OUT_DIR/<name>.pt`` (``torch.load(..., weights_only=True)`` reads them).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import functional_load as fl
from functional_load.precheck import rank_coordinates


class PreadvLog:
    """While open, ``os.preadv`` also records ``((st_dev, st_ino), offset, bytes returned)`` per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, int], int, int]] = []
        self.real = os.preadv

    def __enter__(self) -> PreadvLog:
        def preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
            got = self.real(fd, buffers, offset, *args)
            st = os.fstat(fd)
            self.calls.append(((st.st_dev, st.st_ino), offset, got))
            return got

        os.preadv = preadv
        return self

    def __exit__(self, *exc: object) -> None:
        os.preadv = self.real


def load_own_rank(layout: dict[str, Any], rank: int) -> dict[str, Any]:
    """Load global rank ``rank``'s own state of ``layout``, and what it read."""
    pp_rank, dp_rank, tp_rank = rank_coordinates(rank, layout["tp"], layout["pp"], layout["dp"])
    with PreadvLog() as log:
        state = fl.load(
            layout["model"], tp_size=layout["tp"], rank=tp_rank, pp_size=layout["pp"], pp_rank=pp_rank, dp_size=layout["dp"],
            dp_rank=dp_rank, expert_parallel=layout["expert_parallel"], read=fl.ReadOptions(strategy="pread"), progress=False,
        )
    assert state.stats is not None
    the_plan, parallel = state.plan, state.plan.parallel
    return {
        "rank": rank, "pid": os.getpid(), "coordinates": (pp_rank, dp_rank, tp_rank),
        "planned": (parallel.pp_rank, parallel.dp_rank, parallel.rank, parallel.tp_size, parallel.pp_size, parallel.dp_size),
        "bytes_read": state.stats.bytes_read, "bytes_to_read": the_plan.bytes_to_read, "output_bytes": the_plan.output_bytes,
        "preadv": log.calls, "state": {name: tensor.clone() for name, tensor in state.items()},
    }


def gather_layouts(argv: list[str], load: Callable[[dict[str, Any], int], Any]) -> int:
    """For each layout of the JSON file ``argv[0]``: ``load(layout, global rank)`` in every process
    of the gloo job, gathered into ``argv[1]/<name>.pt`` by rank 0."""
    layouts, out = json.loads(Path(argv[0]).read_text()), Path(argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"]), "torchrun's RANK / WORLD_SIZE"
    for layout in layouts:
        assert world == layout["tp"] * layout.get("pp", 1) * layout.get("dp", 1), f"{layout['name']}: {world} processes"
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, load(layout, rank))
        if rank == 0:
            torch.save(gathered, out / f"{layout['name']}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    return gather_layouts(argv, load_own_rank)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
