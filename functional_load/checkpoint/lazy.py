"""A lazily indexed checkpoint: tensors a rank never touches cost no :class:`TensorInfo`.

Planning DeepSeek-V3 (92,000 tensors) at tp 8 with expert parallelism touches an eighth of its
experts. :func:`parse_header` checks a safetensors header as a whole (the JSON, the names, and
that the data ranges of all tensors tile the data region exactly, with numpy), and keeps each
tensor's entry as the JSON parser made it; :class:`LazyTensors` builds a tensor's validated
:class:`TensorInfo` on first access (the entry's dtype, shape and size checked then, as
:func:`~.index.read_header` checks every entry). So a tensor whose bytes are never read costs its
parsed entry and a dict slot, and a malformed entry is an error as soon as a plan looks at it.
A header the fast checks cannot vouch for is read by :func:`~.index.read_header` in full.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter

import numpy as np

from ..paths import JsonObject
from ..storage import Stamp, StoredPath
from . import IndexedTensors, TensorInfo

MAX_NAME_LENGTH = 1024
_OFFSETS = itemgetter("data_offsets")


@dataclass(frozen=True, slots=True)
class Header:
    """One file's parsed header: its entries (``name -> {dtype, shape, data_offsets}``) in data order."""

    path: StoredPath
    entries: JsonObject
    data_start: int
    file_size: int
    stamp: Stamp


def tiles(entries: JsonObject, data_size: int) -> list[str] | None:
    """The names in data order when the entries' ``data_offsets`` tile ``[0, data_size)`` exactly
    (no overlap, no hole, nothing past the end) and the names are printable and bounded; None
    when anything is unusual (the strict reader then decides, and names the problem)."""
    names = list(entries)
    if not names:
        return names if data_size == 0 else None
    if not all(names) or max(map(len, names)) > MAX_NAME_LENGTH or not "".join(names).isprintable():
        return None
    try:
        offsets = list(map(_OFFSETS, entries.values()))
        flat = list(chain.from_iterable(offsets))
        if set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2} or set(map(type, flat)) != {int}:
            return None  # not pairs of integers (a float or a bool would pass numpy's int64 conversion)
        spans = np.array(flat, dtype=np.int64).reshape(-1, 2)  # from a flat list: 3x faster than from pairs
    except (TypeError, KeyError, ValueError, OverflowError):
        return None
    if (spans[:, 0] > spans[:, 1]).any():
        return None
    order = np.lexsort((np.arange(len(names)), spans[:, 0]))  # by begin; ties (empty tensors) in header order
    begins, ends = spans[order, 0], spans[order, 1]
    if begins[0] != 0 or ends[-1] != data_size or (begins[1:] != ends[:-1]).any():
        return None
    if (order[1:] > order[:-1]).all():  # already in data order, as the safetensors library writes them
        return names
    return [names[i] for i in order.tolist()]


class LazyTensors(IndexedTensors):
    """The tensors of a checkpoint by name, each :class:`TensorInfo` built on first access from
    its file's :class:`Header` (names in file order, then data order)."""

    def __init__(
        self, where: Mapping[str, Header], build: Callable[[Header, str], TensorInfo], built: Mapping[str, TensorInfo] | None = None
    ) -> None:
        self._where = where  # name -> its file's header
        self._build = build  # (header, name) -> TensorInfo, validated
        self._built: dict[str, TensorInfo] = dict(built or {})  # built already (a file read in full)

    def __getitem__(self, name: str) -> TensorInfo:
        info = self._built.get(name)
        if info is None:
            info = self._built[name] = self._build(self._where[name], name)
        return info

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def dtype(self, name: str) -> str:
        """The tensor's dtype code without building its info (validated when it is built)."""
        info = self._built.get(name)
        if info is not None:
            return info.dtype
        dtype = self._where[name].entries[name].get("dtype")
        return dtype if isinstance(dtype, str) else self[name].dtype

    def dtypes(self) -> dict[str, str]:
        """Every tensor's dtype code (:meth:`dtype` of each, at dict speed)."""
        built = self._built
        codes = {name: header.entries[name].get("dtype") for name, header in self._where.items() if name not in built}
        codes.update({name: info.dtype for name, info in built.items()})
        for name, code in codes.items():
            if not isinstance(code, str):
                codes[name] = self[name].dtype  # raises: the entry is malformed
        return codes

    @property
    def built(self) -> int:
        """How many infos were built (for tests and the planning benchmark)."""
        return len(self._built)
