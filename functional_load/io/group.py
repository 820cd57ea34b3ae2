"""A node fetches each byte once: the processes of a load group split their byte ranges.

The processes of a ``torch.distributed`` process group that load together (one node's tensor
ranks, say) each make their own plan, then, before reading (:func:`group_reader`):

1. exchange the exact byte ranges their plans read from object storage (:func:`.needs.needed`:
   per object its identity and sorted ranges) with ``all_gather_object``: one small collective;
2. each compute the same :class:`Exchange` (:func:`plan_exchange`, a pure function): the union of
   the ranges per object, cut into pieces of at most 16 MiB, each piece fetched by one process
   (one that needs some of it, the least loaded so far), the pieces taken in rounds of about
   ``round_bytes`` in file order;
3. per round, fetch their own pieces (ranged GETs naming the object's ETag, ``threads`` at a time),
   agree that every fetch succeeded (one small collective: a failure on one process fails all of
   them with its message, never a hang), and send every other process exactly the bytes of its
   ranges inside those pieces (point-to-point ``isend``/``irecv`` of byte tensors: gloo on CPU,
   NCCL on the current CUDA device), keeping their own;
4. load their plan from the staged bytes (:class:`.needs.StagedReader`).

So the node's traffic from the store is the union of its ranks' ranges, each byte once. Host
memory: a process stages its own ranges (its plan's bytes from object storage) plus, per round,
its fetched pieces and the bytes in flight to and from the others (at most about ``round_bytes``).
Local files are read by each process itself, as without a group.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError, LoadError
from ..plan.plan import Plan
from ..storage import Stamp, StoredPath, storage_for
from .needs import Intervals, Need, Staged, StagedReader, clip, merge, needed, size
from .options import ReadOptions
from .reader import Reader, reader_for

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

ROUND_BYTES = 256 << 20  # bytes of the union fetched and exchanged per round
PIECE_BYTES = 16 << 20  # the largest ranged GET
MIN_PIECE_BYTES = 1 << 20  # pieces are cut smaller only to give every process a share, not below this


class GroupError(LoadError):
    """Another process of a load group failed, or the processes disagree about the checkpoint."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes ``[start, stop)`` of one object, fetched by group rank ``owner``."""

    uri: str
    start: int
    stop: int
    owner: int


@dataclass(frozen=True)
class Exchange:
    """What every process of a group computes alike from the gathered needs."""

    files: dict[str, tuple[StoredPath, Stamp | None]]  # uri -> (path, identity when indexed)
    needs: list[dict[str, Intervals]]  # per group rank: uri -> its ranges
    rounds: list[list[Piece]]
    union: int  # bytes of the union of every process's ranges

    def fetched(self, rank: int) -> int:
        return sum(p.stop - p.start for r in self.rounds for p in r if p.owner == rank)


@dataclass
class GroupStats:
    """What one process did in a group load: bytes fetched from the store (and GETs), sent to
    and received from the others, and the node's figures (every process's needs, their union)."""

    fetched: int = 0
    requests: int = 0
    sent: int = 0
    received: int = 0
    rounds: int = 0
    seconds: float = 0.0
    union: int = 0
    needs: list[int] = field(default_factory=list)


def plan_exchange(gathered: Sequence[dict[str, Need]], round_bytes: int = ROUND_BYTES) -> Exchange:
    """The pieces and rounds of a group whose process ``i`` needs ``gathered[i]`` (see the module)."""
    files: dict[str, tuple[StoredPath, Stamp | None]] = {}
    for rank, theirs in enumerate(gathered):
        for uri, need in theirs.items():
            if uri in files and need.stamp is not None and files[uri][1] not in (None, need.stamp):
                raise GroupError(
                    f"{uri}: the processes of the load group indexed different versions of it ({files[uri][1]} vs "
                    f"{need.stamp} on group rank {rank}); it was replaced while they planned: re-plan the load once it is stable"
                )
            if uri not in files or files[uri][1] is None:
                files[uri] = (need.file, need.stamp)
    world = len(gathered)
    needs = [{uri: need.ranges for uri, need in g.items()} for g in gathered]
    unions = {uri: _union([n[uri] for n in needs if uri in n]) for uri in sorted(files)}
    union = sum(size(u) for u in unions.values())
    cut = min(PIECE_BYTES, max(MIN_PIECE_BYTES, -(-union // (4 * world)) if world > 1 else PIECE_BYTES))
    load, pieces = [0] * world, []
    for uri, (starts, stops) in unions.items():
        for a, b in zip(starts.tolist(), stops.tolist()):
            for s in range(a, b, cut):
                e = min(b, s + cut)
                users = [r for r in range(world) if uri in needs[r] and size(clip(needs[r][uri], s, e))]
                owner = min(users, key=lambda r: (load[r], r))
                load[owner] += e - s
                pieces.append(Piece(uri, s, e, owner))
    rounds: list[list[Piece]] = []
    taken = round_bytes
    for piece in pieces:
        if taken + piece.stop - piece.start > round_bytes and (not rounds or rounds[-1]):
            rounds.append([])
            taken = 0
        rounds[-1].append(piece)
        taken += piece.stop - piece.start
    return Exchange(files, needs, rounds, union)


def _union(ranges: list[Intervals]) -> Intervals:
    return merge(np.concatenate([r[0] for r in ranges]), np.concatenate([r[1] for r in ranges]))


def group_reader(
    plan: Plan, group: ProcessGroup, options: ReadOptions | None = None, round_bytes: int = ROUND_BYTES
) -> tuple[Reader, GroupStats]:
    """A reader of ``plan`` whose object-storage bytes the processes of ``group`` fetched once
    between them (see the module); every process of the group calls this, each with its own
    plan, at the same point. Use the reader with :func:`.execute.execute` and close it."""
    options = options or ReadOptions()
    start = time.perf_counter()
    mine = needed(plan)
    exchange = plan_exchange(_gather(group, mine), round_bytes)
    rank = _rank(group)
    staged = Staged(exchange.needs[rank])
    reader = reader_for(plan, options)
    source = StagedReader(reader.tally, staged)
    stats = GroupStats(union=exchange.union, needs=[sum(size(r) for r in n.values()) for n in exchange.needs])
    for pieces in exchange.rounds:
        fetched = _fetch([p for p in pieces if p.owner == rank], exchange, options.threads, source, stats)
        _agree(group, fetched if isinstance(fetched, BaseException) else None)
        if isinstance(fetched, BaseException):  # _agree raised it already
            raise fetched
        for piece, data in fetched.items():  # our own share of our own pieces
            _place(staged, piece, data, exchange.needs[rank])
        _swap(group, rank, pieces, fetched, exchange, staged, stats)
        stats.rounds += 1
    if staged.filled != staged.nbytes:
        raise GroupError(f"the load group delivered {staged.filled} of the {staged.nbytes} bytes group rank {rank} needs; "
                         "this is a functional_load bug: report it (load without group= meanwhile)")
    reader.remote = source
    stats.seconds = time.perf_counter() - start
    return reader, stats


def fail_group(group: ProcessGroup, error: BaseException) -> None:
    """Tell the other processes of ``group``, waiting in :func:`group_reader`, that this one
    failed before it could plan (they raise :class:`GroupError` with its message)."""
    _gather(group, f"{type(error).__name__}: {error}")


def _rank(group: ProcessGroup) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def _gather(group: ProcessGroup, mine: dict[str, Need] | str) -> list[dict[str, Need]]:
    """Every process's needs (``mine``: this one's, or what stopped it); a :class:`GroupError`
    when another failed."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("load(..., group=...) needs torch.distributed initialised: call torch.distributed.init_process_group first")
    gathered: list[dict[str, Need] | str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if isinstance(mine, str):
        return []
    _raise_first(gathered, dist.get_rank(group))
    return [g for g in gathered if isinstance(g, dict)]


def _agree(group: ProcessGroup, error: BaseException | None) -> None:
    """Every process learns whether every fetch of the round succeeded; a failure fails them all."""
    import torch.distributed as dist

    said: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    _raise_first(said, dist.get_rank(group))


def _raise_first(gathered: Sequence[object], rank: int) -> None:
    """A :class:`GroupError` for the first other process that said it failed (a message)."""
    for other, said in enumerate(gathered):
        if isinstance(said, str) and other != rank:
            raise GroupError(f"group rank {other} of the load group failed, so this load stops too: {said}")


def _fetch(
    pieces: list[Piece], exchange: Exchange, threads: int, source: StagedReader, stats: GroupStats
) -> dict[Piece, np.ndarray] | BaseException:
    """This process's pieces of a round, each one ranged GET naming the object's identity; the
    first failure instead of raising (the round's agreement reports it to every process)."""

    def get(piece: Piece) -> np.ndarray:
        file, stamp = exchange.files[piece.uri]
        data = np.empty(piece.stop - piece.start, dtype=np.uint8)
        source.tally.add(storage_for(file).read_into(file, piece.start, data.data.cast("B"), stamp))
        return data

    try:
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="functional-load-group") as pool:
            out = dict(zip(pieces, pool.map(get, pieces)))
    except Exception as exc:  # reported to the group by the caller, then raised
        return exc
    stats.fetched += sum(len(d) for d in out.values())
    stats.requests += len(pieces)
    source.requests += len(pieces)
    return out


def _place(staged: Staged, piece: Piece, data: np.ndarray, needs: dict[str, Intervals]) -> None:
    """Keep the parts of our own piece that we need."""
    if piece.uri in needs:
        starts, stops = clip(needs[piece.uri], piece.start, piece.stop)
        staged.place_all(piece.uri, starts, stops, data, starts - piece.start)


Part = tuple[Piece, np.ndarray, np.ndarray]  # a piece, and the starts and stops of the ranges inside it


def _parts(pieces: list[Piece], owner: int, needs: dict[str, Intervals]) -> list[Part]:
    """The ranges of ``needs`` inside ``owner``'s pieces, in order: what ``owner`` sends that process."""
    out = []
    for piece in (p for p in pieces if p.owner == owner and p.uri in needs):
        starts, stops = clip(needs[piece.uri], piece.start, piece.stop)
        if len(starts):
            out.append((piece, starts, stops))
    return out


def _swap(
    group: ProcessGroup, rank: int, pieces: list[Piece], fetched: dict[Piece, np.ndarray], exchange: Exchange, staged: Staged,
    stats: GroupStats,
) -> None:
    """Send each other process its ranges of our pieces of the round; receive ours of theirs."""
    sends: dict[int, np.ndarray] = {}
    receives: dict[int, list[Part]] = {}
    for peer in range(len(exchange.needs)):
        if peer == rank:
            continue
        out = _parts(pieces, rank, exchange.needs[peer])
        if out:
            sends[peer] = np.concatenate([fetched[p][a - p.start : b - p.start] for p, s, e in out for a, b in zip(s.tolist(), e.tolist())])
        incoming = _parts(pieces, peer, exchange.needs[rank])
        if incoming:
            receives[peer] = incoming
    got = _send_recv(group, sends, {peer: sum(int((e - s).sum()) for _, s, e in parts) for peer, parts in receives.items()})
    for peer, parts in receives.items():
        at = 0
        for piece, starts, stops in parts:
            lengths = stops - starts
            staged.place_all(piece.uri, starts, stops, got[peer], at + np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64))
            at += int(lengths.sum())
    stats.sent += sum(len(b) for b in sends.values())
    stats.received += sum(len(b) for b in got.values())


def _send_recv(group: ProcessGroup, sends: dict[int, np.ndarray], sizes: dict[int, int]) -> dict[int, np.ndarray]:
    """Point-to-point byte tensors to and from group ranks (on the current CUDA device for NCCL)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    ops, buffers = [], {}
    for peer, data in sends.items():
        ops.append(dist.P2POp(dist.isend, torch.from_numpy(data).to(device), dist.get_global_rank(group, peer), group))
    for peer, n in sizes.items():
        buffers[peer] = torch.empty(n, dtype=torch.uint8, device=device)
        ops.append(dist.P2POp(dist.irecv, buffers[peer], dist.get_global_rank(group, peer), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return {peer: _host(t) for peer, t in buffers.items()}


def _host(tensor: torch.Tensor) -> np.ndarray:
    return tensor.cpu().numpy()
