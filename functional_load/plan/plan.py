"""The load plan: which bytes of which checkpoint tensor land in which slice of which parameter.

A :class:`Plan` is a plain, validated value (made by :func:`.make.make_plan`) that prints,
diffs and serialises to JSON. :func:`functional_load.io.execute` is the only thing that turns
it into bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..checkpoint import TensorInfo
from ..dtypes import itemsize, torch_itemsize
from ..layout.build import ParamSpec
from ..layout.parallel import Parallel
from ..layout.quantized import Scheme
from ..layout.segments import Box, box_volume, full_box
from ..paths import JsonDict
from ..storage import StoredPath
from .copy import Copy

__all__ = ["Copy", "Dummy", "ParamPlan", "Plan"]


@dataclass(frozen=True, slots=True)
class Dummy:
    """vLLM's dummy initialisation of one parameter (``load_format="dummy"``, vLLM's
    ``initialize_single_dummy_weight``): a floating parameter takes ``uniform_(low, high)`` from a
    CPU generator seeded with ``seed`` for this parameter alone, drawn on its rank-local shape
    (formats under 16 bits drawn in float16, then cast); any other parameter is zero."""

    low: float = -1e-3
    high: float = 1e-3
    seed: int = 1234

    def describe(self, dtype: str) -> str:
        if dtype.startswith(("float", "bfloat")):
            return f"dummy uniform [{self.low:g}, {self.high:g}), seed {self.seed}"
        return "dummy zeros"


@dataclass(frozen=True, slots=True)
class ParamPlan:
    """How one parameter of one rank is filled: copies, plus boxes that are zero (vocab padding),
    or a default value when the checkpoint does not have it, or dummy values (no copies)."""

    spec: ParamSpec
    copies: tuple[Copy, ...]
    zeros: tuple[Box, ...] = ()
    fill: float | None = None  # the whole parameter takes this value (a default, e.g. KV scale 1.0)
    checks: tuple[Copy, ...] = ()  # read and compared with what the copies wrote (Shared tensors)
    dummy: Dummy | None = None  # load_format="dummy": vLLM's dummy values, nothing is read


@dataclass(frozen=True, slots=True)
class Plan:
    """A validated per-rank load plan. ``execute`` is the only thing that turns it into bytes."""

    model_dir: str
    arch: str
    parallel: Parallel
    dtype: str
    params: tuple[ParamPlan, ...]
    tensors: Mapping[str, TensorInfo]  # the checkpoint tensors this plan reads
    aliases: Mapping[str, str] = field(default_factory=dict)  # tied alias -> canonical parameter
    dropped: tuple[tuple[str, str], ...] = ()  # (checkpoint tensor, why it is not loaded)
    schemes: Mapping[str, Scheme] = field(default_factory=dict)  # quantized module -> scheme
    checksums: Mapping[StoredPath, str] = field(default_factory=dict)  # file -> SHA-256 where recorded (pre-sharded saves)
    _index: Mapping[str, ParamPlan] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        object.__setattr__(self, "aliases", MappingProxyType(dict(self.aliases)))
        object.__setattr__(self, "schemes", MappingProxyType(dict(self.schemes)))
        object.__setattr__(self, "checksums", MappingProxyType(dict(self.checksums)))
        object.__setattr__(self, "_index", MappingProxyType({p.spec.name: p for p in self.params}))

    @property
    def dummy(self) -> bool:
        """A dummy load's plan (``load_format="dummy"``): every parameter takes vLLM's dummy values."""
        return bool(self.params) and all(p.dummy is not None for p in self.params)

    def param(self, name: str) -> ParamPlan:
        """The plan of one parameter, by name (KeyError if the rank has no such parameter)."""
        return self._index[name]

    def copy_bytes(self, copy: Copy) -> int:
        """Bytes of checkpoint data one copy reads."""
        info = self.tensors[copy.tensor]
        return box_volume(copy.src) * itemsize(info.dtype)

    @property
    def bytes_to_read(self) -> int:
        """Exact bytes of tensor data this rank reads from the checkpoint."""
        return sum(self.copy_bytes(c) for p in self.params for c in p.copies + p.checks)

    @property
    def output_bytes(self) -> int:
        return sum(box_volume(full_box(p.spec.local_shape)) * torch_itemsize(p.spec.dtype) for p in self.params)

    def to_json(self) -> JsonDict:
        """A JSON-serialisable description of the plan."""

        def box(b: Box) -> list[list[int]]:
            return [list(r) for r in b]

        return {
            "model_dir": self.model_dir,
            "arch": self.arch,
            **self.parallel.to_json(),
            "dtype": self.dtype,
            "dummy": self.dummy,
            "bytes_to_read": self.bytes_to_read,
            "output_bytes": self.output_bytes,
            "params": [
                {
                    "name": p.spec.name,
                    "local_shape": list(p.spec.local_shape),
                    "global_shape": list(p.spec.shape),
                    "dtype": p.spec.dtype,
                    "sharding": p.spec.sharding.to_json(),
                    "copies": [
                        {
                            "tensor": c.tensor,
                            "file": self.tensors[c.tensor].where(c.stored_src),
                            "src": box(c.stored_src),
                            "dst": box(c.dst),
                            "ops": c.describe(),
                            "bytes": self.copy_bytes(c),
                        }
                        for c in p.copies
                    ],
                    "zeros": [box(z) for z in p.zeros],
                    "fill": p.fill,
                    "dummy": None if p.dummy is None else {"low": p.dummy.low, "high": p.dummy.high, "seed": p.dummy.seed},
                }
                for p in self.params
            ],
            "aliases": dict(self.aliases),
            "schemes": {m: q.to_json() for m, q in self.schemes.items()},
            "checksums": {str(f): h for f, h in self.checksums.items()},
            "dropped": [{"tensor": t, "reason": r} for t, r in self.dropped],
        }

    def table(self) -> str:
        """A readable per-rank table: parameter, local shape, source tensors and slices, bytes."""
        rows = [("parameter", "local shape", "source (file)", "src slice -> dst slice", "bytes")]
        for p in self.params:
            for i, c in enumerate(p.copies):
                rows.append(
                    (
                        p.spec.name if i == 0 else "",
                        _shape(p.spec.local_shape) if i == 0 else "",
                        f"{c.tensor} ({self.tensors[c.tensor].where(c.stored_src)})",
                        f"{_slices(c.stored_src)}{_ops(c)} -> {_slices(c.dst)}",
                        f"{self.copy_bytes(c):,}",
                    )
                )
            for z in p.zeros:
                rows.append(("", "", "(zero padding)", f"-> {_slices(z)}", "0"))
            if p.fill is not None:
                rows.append((p.spec.name, _shape(p.spec.local_shape), f"(default {p.fill})", "", "0"))
            if p.dummy is not None:
                rows.append((p.spec.name, _shape(p.spec.local_shape), f"({p.dummy.describe(p.spec.dtype)})", "", "0"))
        for alias, target in self.aliases.items():
            rows.append((alias, "", f"(same tensor as {target})", "", "0"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(
            f"{self.parallel.describe()}: {len(self.params)} parameters, "
            f"{self.bytes_to_read:,} bytes to read, {self.output_bytes:,} bytes out, {len(self.dropped)} tensors dropped"
            + (" (dummy weights: no checkpoint is read)" if self.dummy else "")
        )
        return "\n".join(lines)


def _ops(copy: Copy) -> str:
    if copy.transposed:
        return "ᵀ"
    return f" ({'; '.join(copy.describe())})" if not copy.plain else ""


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _slices(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"
