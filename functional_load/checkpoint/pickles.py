"""PyTorch pickle checkpoints (``.bin`` / ``.pt``), only on explicit request.

Unpickling can run code, so these files are read only with ``allow_pickle=True``, only through
``torch.load(weights_only=True)`` (never a fallback to anything else), only on a torch without
the known ``weights_only`` escapes (CVE-2025-32434 <= 2.5.1, CVE-2026-24747 <= 2.9.1), and only
after the zip archive's directory is checked: every entry stored uncompressed, no declared size
beyond the file. The result must be a plain ``{name: tensor}`` mapping.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..dtypes import TORCH_TO_SAFETENSORS
from ..errors import CheckpointError, FormatError, IntegrityError, SecurityError
from ..storage import StoredPath
from ..storage.local import file_stamp
from . import PickleEntry, TensorInfo

if TYPE_CHECKING:
    import torch

MIN_TORCH = (2, 10)


def _torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_archive(path: Path) -> None:
    """Refuse what ``torch.load`` should never see: not a zip (legacy or TorchScript formats),
    compressed entries, or entries that claim more bytes than the file has (zip bombs)."""
    size = path.stat().st_size
    if not zipfile.is_zipfile(path):
        raise FormatError(
            f"{path}: not a zip-format torch checkpoint (a legacy or non-torch pickle); re-save it with a current "
            f"torch.save, or better, as safetensors"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise FormatError(f"{path}: unreadable zip archive ({exc})") from None
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED:
            raise SecurityError(f"{path}: archive entry {entry.filename!r} is compressed; torch never writes that")
        if entry.file_size > size or entry.header_offset + entry.file_size > size:
            raise SecurityError(
                f"{path}: archive entry {entry.filename!r} declares {entry.file_size} bytes, more than the file's "
                f"{size}; refusing a zip bomb"
            )
        if "/.." in entry.filename or entry.filename.startswith(("/", "..")):
            raise SecurityError(f"{path}: archive entry name {entry.filename!r} escapes the archive")


def _refusal(exc: Exception) -> str:
    """torch's reason for a refusal (the blocked global), without its generic advice to retry
    with ``weights_only=False``, which would otherwise fill the first 300 characters."""
    lines = [line.strip() for line in str(exc).splitlines()]
    kept = [line for line in lines if line and "weights_only" not in line and not line.startswith("Weights only load failed")]
    return " ".join(kept or lines)[:300]


def safe_torch_load(path: Path) -> dict[str, torch.Tensor]:
    """The ``{name: tensor}`` of one pickle checkpoint, memory-mapped, with every check above."""
    import torch

    if _torch_version() < MIN_TORCH:
        raise SecurityError(
            f"{path}: loading pickles needs torch >= {'.'.join(map(str, MIN_TORCH))} (torch {torch.__version__} has "
            f"known torch.load(weights_only=True) escapes); upgrade torch or convert the checkpoint to safetensors"
        )
    check_archive(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except OSError as exc:  # the file, not the pickle: vanished, unreadable, a read error
        raise IntegrityError(f"{path}: cannot be read ({exc.strerror or exc}); check the file and re-download it") from None
    except pickle.UnpicklingError as exc:  # the restricted unpickler refused it: nothing ran
        raise SecurityError(
            f"{path}: torch.load(weights_only=True) refused this pickle ({type(exc).__name__}: {_refusal(exc)}); "
            f"no code from it ran. Do not load it with weights_only=False; convert it to safetensors in a sandbox"
        ) from None
    except (RuntimeError, ValueError, EOFError, KeyError, AttributeError) as exc:  # a damaged archive
        raise FormatError(f"{path}: not a readable torch checkpoint ({type(exc).__name__}: {_refusal(exc)})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise FormatError(f"{path}: expected a mapping of tensor names to tensors, found {type(state).__name__}")
    return dict(state)


def index_pickles(files: tuple[StoredPath, ...]) -> dict[str, TensorInfo]:
    """TensorInfo for every tensor of the pickle files (read through torch, not pread; local files only)."""
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        if not isinstance(path, Path):
            raise CheckpointError(f"{path}: pickle weights are read from local disk only; convert them to safetensors")
        stamp = file_stamp(os.stat(path))
        for name, tensor in safe_torch_load(path).items():
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in TORCH_TO_SAFETENSORS:
                raise FormatError(f"{path}: tensor {name!r} has dtype {dtype}, which this loader does not handle")
            if name in tensors:
                raise FormatError(f"tensor {name!r} appears in both {tensors[name].file} and {path}")
            tensors[name] = TensorInfo(name, TORCH_TO_SAFETENSORS[dtype], tuple(tensor.shape), PickleEntry(path, stamp))
    return tensors
