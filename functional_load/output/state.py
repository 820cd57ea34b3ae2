"""What ``load`` returns: a read-only mapping of parameter name to torch tensor.

Its plan, output target and load statistics are set once, when it is built. Tied aliases
(``lm_head.weight`` of tied embeddings) map to the very same tensor object as their canonical
parameter; :meth:`LoadedState.unique` lists each tensor once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..io.execute import LoadStats
from ..plan.plan import Plan

if TYPE_CHECKING:
    import torch


class LoadedState(Mapping[str, "torch.Tensor"]):  # quoted: torch is imported only for type checking
    """``{name: torch.Tensor}`` of one rank, read-only, with the ``plan`` that made it, the
    output ``target`` layout and the load's ``stats``."""

    __slots__ = ("_plan", "_stats", "_target", "_tensors")

    def __init__(self, tensors: Mapping[str, torch.Tensor], plan: Plan, target: str = "checkpoint", stats: LoadStats | None = None):
        self._tensors = dict(tensors)
        self._plan = plan
        self._target = target
        self._stats = stats

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def target(self) -> str:
        return self._target

    @property
    def stats(self) -> LoadStats | None:
        return self._stats

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        p = self._plan.parallel
        return f"LoadedState({len(self)} tensors, {self._plan.arch}, rank {p.rank} of tp {p.tp_size}, target {self._target!r})"

    def unique(self) -> dict[str, torch.Tensor]:
        """Each tensor once, under its first name (a tied alias is left out)."""
        seen: dict[int, str] = {}
        for name, tensor in self._tensors.items():
            seen.setdefault(id(tensor), name)
        return {name: self._tensors[name] for name in seen.values()}


def check_device(device: str | int | torch.device) -> None:
    """A device the tensors can go to, checked before anything is read."""
    import torch

    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r} is not a torch device ({exc})") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}, but this machine has no CUDA device torch can use; load with device='cpu'")
    if target.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r}: only 'cpu' and CUDA devices are supported")


def to_device(state: LoadedState, device: str | int | torch.device) -> LoadedState:
    """The state on a torch ``device`` (e.g. ``"cuda:0"``): each tensor is staged through pinned
    host memory and copied asynchronously; tied aliases stay one tensor."""
    import torch

    moved: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in state.items():
        if id(tensor) not in moved:
            source = tensor.pin_memory() if torch.cuda.is_available() else tensor
            moved[id(tensor)] = source.to(device, non_blocking=True)
        out[name] = moved[id(tensor)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return LoadedState(out, state.plan, state.target, state.stats)
