"""Pre-check a multi-node layout: plan every rank of ``tp x pp x dp`` (headers only, no tensor
data) and sum each rank's bytes per node, before a deployment starts.

Ranks are numbered as vLLM numbers its workers: global rank ``(dp_rank * pp_size + pp_rank) *
tp_size + tp_rank`` (``initialize_model_parallel``: ``arange(world_size).reshape(-1, dp, pp, pcp,
tp)``, without prefill context parallelism), and a node runs ``ranks_per_node`` consecutive global
ranks (as torchrun numbers them: ``RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``). Every plan
that fails is collected, and the failures are raised together as one :class:`PlanError`.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

from .api import Model, plan, resolve_model_dir
from .errors import ConfigError, LoadError, PlanError, ShardingError
from .options import LoadOptions, resolve_options

OUTPUT_BYTES = (
    "output bytes: the rank's loaded state (fl.load's tensors, in the destination dtype), the memory its weights take on the "
    "host, or on the device it is loaded onto; a load adds at most one staging buffer per reader thread (32 MiB, only for "
    "copies that are cast or rearranged)"
)


@dataclass(frozen=True, slots=True)
class RankCheck:
    """One planned rank: its global rank, node and coordinates, and what it reads and holds."""

    rank: int
    node: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    parameters: int
    bytes_to_read: int
    output_bytes: int


@dataclass(frozen=True, slots=True)
class NodeCheck:
    """The sums of one node's planned ranks."""

    node: int
    ranks: tuple[int, ...]
    bytes_to_read: int
    output_bytes: int
    largest_rank_bytes: int  # the largest output_bytes of one of its ranks


@dataclass(frozen=True, slots=True)
class Precheck:
    """Every planned rank of a layout (all of them, or one node's), and what they read and hold."""

    model_dir: str
    arch: str
    tp_size: int
    pp_size: int
    dp_size: int
    expert_parallel: bool
    ranks_per_node: int
    node: int | None  # the one node planned, or None: every node
    host: str
    ranks: tuple[RankCheck, ...]
    distinct_bytes: int  # bytes of the checkpoint tensors the planned ranks read, each tensor counted once

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def nodes(self) -> tuple[NodeCheck, ...]:
        out = []
        for node in sorted({r.node for r in self.ranks}):
            held = [r for r in self.ranks if r.node == node]
            out.append(NodeCheck(node, tuple(r.rank for r in held), sum(r.bytes_to_read for r in held),
                                 sum(r.output_bytes for r in held), max(r.output_bytes for r in held)))
        return tuple(out)

    def layout_words(self) -> str:
        ep = ", expert parallel" if self.expert_parallel else ""
        return f"tp {self.tp_size} x pp {self.pp_size} x dp {self.dp_size}{ep} = {self.world_size} ranks"

    def to_json(self) -> dict[str, object]:
        return {
            "model_dir": self.model_dir, "arch": self.arch, "tp_size": self.tp_size, "pp_size": self.pp_size,
            "dp_size": self.dp_size, "expert_parallel": self.expert_parallel, "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node, "node": self.node, "host": self.host,
            "ranks": [{f: getattr(r, f) for f in RankCheck.__slots__} for r in self.ranks],
            "nodes": [{"node": n.node, "ranks": list(n.ranks), "bytes_to_read": n.bytes_to_read, "output_bytes": n.output_bytes,
                       "largest_rank_bytes": n.largest_rank_bytes} for n in self.nodes],
            "bytes_to_read": sum(r.bytes_to_read for r in self.ranks),
            "output_bytes": sum(r.output_bytes for r in self.ranks),
            "distinct_bytes": self.distinct_bytes,
            "output_bytes_are": OUTPUT_BYTES,
        }

    def table(self) -> str:
        where = f"node {self.node} (host {self.host}) of " if self.node is not None else ""
        lines = [f"{self.model_dir}: {self.arch}, {where}{self.layout_words()}, {self.ranks_per_node} ranks per node; "
                 f"planned from headers, no tensor data read"]
        rows = [("rank", "node", "pp", "dp", "tp", "parameters", "bytes to read", "output bytes")]
        rows += [(str(r.rank), str(r.node), str(r.pp_rank), str(r.dp_rank), str(r.tp_rank), str(r.parameters),
                  f"{r.bytes_to_read:,}", f"{r.output_bytes:,}") for r in self.ranks]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
        for n in self.nodes:
            lines.append(f"node {n.node} (ranks {n.ranks[0]}-{n.ranks[-1]}): {n.bytes_to_read:,} bytes to read, "
                         f"{n.output_bytes:,} output bytes (largest rank {n.largest_rank_bytes:,})")
        total = sum(r.bytes_to_read for r in self.ranks)
        lines.append(f"{len(self.ranks)} ranks planned: {total:,} bytes to read, "
                     f"{sum(r.output_bytes for r in self.ranks):,} output bytes; "
                     f"the checkpoint tensors they read hold {self.distinct_bytes:,} bytes")
        lines.append(OUTPUT_BYTES)
        return "\n".join(lines)


def rank_coordinates(rank: int, tp_size: int, pp_size: int = 1, dp_size: int = 1) -> tuple[int, int, int]:
    """``(pp_rank, dp_rank, tp_rank)`` of global rank ``rank`` in vLLM's order, the inverse of
    ``rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank``."""
    for name, size in (("tp_size", tp_size), ("pp_size", pp_size), ("dp_size", dp_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ShardingError(f"{name} must be a positive integer, got {size!r}")
    world = tp_size * pp_size * dp_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ShardingError(f"rank {rank!r} is not a rank of tp {tp_size} x pp {pp_size} x dp {dp_size}; "
                          f"global ranks are 0..{world - 1}")
    rest, tp_rank = divmod(rank, tp_size)
    dp_rank, pp_rank = divmod(rest, pp_size)
    return pp_rank, dp_rank, tp_rank


def node_ranks(world_size: int, ranks_per_node: int, node: int | None) -> range:
    """The global ranks to plan: every rank, or node ``node``'s ``ranks_per_node`` consecutive ones."""
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ConfigError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
    if node is None:
        return range(world_size)
    nodes = -(-world_size // ranks_per_node)
    if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < nodes:
        raise ConfigError(f"node {node!r} is not a node of {world_size} ranks at {ranks_per_node} ranks per node "
                          f"(nodes 0..{nodes - 1}); check --node, or torchrun's --node-rank and --nnodes")
    return range(node * ranks_per_node, min((node + 1) * ranks_per_node, world_size))


def torchrun_node(env: Mapping[str, str]) -> int | None:
    """The node torchrun started this process on (its ``GROUP_RANK``), or None outside torchrun."""
    value = env.get("GROUP_RANK")
    if value is None:
        return None
    if not value.isdigit():
        raise ConfigError(f"GROUP_RANK={value!r} (torchrun's node rank) is not a non-negative integer; pass --node instead")
    return int(value)


def precheck(
    model: Model, *, tp_size: int = 1, ranks_per_node: int = 8, node: int | None = None, options: LoadOptions = LoadOptions(),
    **overrides: object,
) -> Precheck:
    """Plan every rank of the layout ``tp_size x options.pp_size x options.dp_size`` (or node
    ``node``'s ranks only) from the checkpoint's headers. ``options`` (or its fields as
    keywords) as for :func:`functional_load.plan`; ``pp_rank`` and ``dp_rank`` name one rank and
    do not apply. Raises :class:`PlanError` listing every rank whose plan fails, and why."""
    opts = resolve_options(options, overrides)
    if (opts.pp_rank, opts.dp_rank) != (0, 0):
        raise ConfigError("precheck plans every rank of the layout: pp_rank and dp_rank name one rank; "
                          "leave them out (or use plan() for one rank)")
    directory = resolve_model_dir(model, opts.revision, opts.load_format, opts.allow_pickle)
    opts = opts.replace(revision=None)
    rank_coordinates(0, tp_size, opts.pp_size, opts.dp_size)  # the sizes are checked
    world = tp_size * opts.pp_size * opts.dp_size
    checks: list[RankCheck] = []
    failures: dict[str, list[int]] = {}
    distinct: dict[str, int] = {}
    arch = ""
    for rank in node_ranks(world, ranks_per_node, node):
        pp_rank, dp_rank, tp_rank = rank_coordinates(rank, tp_size, opts.pp_size, opts.dp_size)
        try:
            the_plan = plan(directory, tp_size=tp_size, rank=tp_rank, options=opts.replace(pp_rank=pp_rank, dp_rank=dp_rank))
        except LoadError as exc:
            failures.setdefault(str(exc), []).append(rank)
            continue
        arch = the_plan.arch
        distinct.update({name: info.nbytes for name, info in the_plan.tensors.items()})
        checks.append(RankCheck(rank, rank // ranks_per_node, pp_rank, dp_rank, tp_rank, len(the_plan.params),
                                the_plan.bytes_to_read, the_plan.output_bytes))
    if failures:
        raise PlanError(_failure_lines(failures, len(checks) + sum(map(len, failures.values())), tp_size, opts))
    return Precheck(str(directory), arch, tp_size, opts.pp_size, opts.dp_size, opts.expert_parallel, ranks_per_node, node,
                    socket.gethostname(), tuple(checks), sum(distinct.values()))


def _failure_lines(failures: dict[str, list[int]], planned: int, tp_size: int, opts: LoadOptions) -> list[str]:
    """One problem per distinct message: the ranks it failed, then the library's message, indented."""
    layout = f"tp {tp_size} x pp {opts.pp_size} x dp {opts.dp_size}"
    lines = []
    for message, ranks in failures.items():
        if len(ranks) == planned:
            who = f"every planned rank of {layout} (global ranks {ranks[0]}-{ranks[-1]})"
        else:
            coords = [(r, *rank_coordinates(r, tp_size, opts.pp_size, opts.dp_size)) for r in ranks[:8]]
            named = ", ".join(f"{r} (pp {p}, dp {d}, tp {t})" for r, p, d, t in coords) + (" ..." if len(ranks) > 8 else "")
            who = f"{len(ranks)} of {planned} planned ranks of {layout}: global rank {named}"
        lines.append(f"{who}:\n    " + message.replace("\n", "\n    "))
    return lines
