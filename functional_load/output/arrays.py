"""Global ``jax.Array``s from per-device blocks: the read engine of every JAX load.

Each leaf's sharding says which box of the leaf each of this process's devices holds
(``addressable_devices_indices_map``); a block is made once per distinct box (a leaf replicated
over several local devices is read once per process) on a pool of threads, in the order of the
leaves' first bytes in the files, and at most ``budget`` bytes of blocks are in flight: a leaf's
blocks are placed on their devices and dropped as soon as they are all made, so host memory stays
near the output plus the window, never a whole rank staged twice.
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from ..dtypes import to_numpy
from ..layout.axes import Range
from ..plan.target import Leaf

if TYPE_CHECKING:
    import jax

Block = Callable[[int, tuple[Range, ...]], np.ndarray]  # (leaf number, box) -> numpy block of the leaf's dtype
WINDOW_BYTES = 1 << 30  # blocks read ahead of the leaf being placed


class Progress(Protocol):
    """A progress bar (tqdm's), counting bytes."""

    def update(self, n: int) -> bool | None: ...

    def close(self) -> None: ...


def device_boxes(leaf: Leaf) -> dict[tuple[Range, ...], list[jax.Device]]:
    """This process's devices of ``leaf`` grouped by the box of the leaf they hold."""
    boxes: dict[tuple[Range, ...], list[jax.Device]] = {}
    for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
        box = tuple(s.indices(n)[:2] for s, n in zip(index, leaf.shape)) if index else ()
        boxes.setdefault(tuple((int(a), int(b)) for a, b in box), []).append(device)
    return boxes


def build_arrays(
    leaves: Sequence[Leaf], block: Block, *, threads: int = 4, order: Sequence[int] | None = None, bar: Progress | None = None,
    budget: int = WINDOW_BYTES,
) -> list[jax.Array]:
    """One global array per leaf (in ``leaves``' order); ``order`` is the order to read them in."""
    import jax

    order = list(range(len(leaves))) if order is None else list(order)
    boxes = [device_boxes(leaf) for leaf in leaves]
    out: list[Any] = [None] * len(leaves)  # each a jax.Array once its leaf is placed
    pending: collections.deque[tuple[int, dict[tuple[Range, ...], Future[np.ndarray]]]] = collections.deque()
    in_flight = [0]

    def make(i: int, box: tuple[Range, ...]) -> np.ndarray:
        data = block(i, box)
        if bar is not None:
            bar.update(data.nbytes)
        return data

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="functional-load-jax") as pool:
        queue = collections.deque(order)

        def submit() -> None:
            while queue and (not pending or in_flight[0] < budget):
                i = queue.popleft()
                leaf = leaves[i]
                size = sum(block_bytes(b, to_numpy(leaf.dtype)) for b in boxes[i])
                in_flight[0] += size
                pending.append((i, {b: pool.submit(make, i, b) for b in boxes[i]}))

        submit()
        while pending:
            i, futures = pending.popleft()
            leaf = leaves[i]
            singles = []
            for box, future in futures.items():
                data = future.result()
                singles += [jax.device_put(data, device) for device in boxes[i][box]]
                in_flight[0] -= data.nbytes
            out[i] = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, singles)
            del singles, futures
            submit()
    return out


def block_bytes(index: tuple[Range, ...], dtype: npt.DTypeLike) -> int:
    """Bytes of a block of ``index`` (one range per dimension) of ``dtype``."""
    return math.prod(b - a for a, b in index) * np.dtype(dtype).itemsize


def file_order(first_bytes: Sequence[tuple[str, int]]) -> list[int]:
    """Leaf numbers sorted by where their first source bytes are (file, offset)."""
    return sorted(range(len(first_bytes)), key=lambda i: (os.fspath(first_bytes[i][0]), first_bytes[i][1]))
