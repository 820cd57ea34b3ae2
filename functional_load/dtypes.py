"""Dtype tables as data: safetensors codes, their sizes, and torch/numpy names.

The plan speaks safetensors codes (``"BF16"``) for checkpoint tensors and torch names
(``"bfloat16"``) for destination parameters; torch is imported only when a tensor is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

# safetensors dtype code -> (bits per element, torch dtype name)
SAFETENSORS_DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (8, "bool"),
    "U8": (8, "uint8"),
    "I8": (8, "int8"),
    "F8_E4M3": (8, "float8_e4m3fn"),
    "F8_E5M2": (8, "float8_e5m2"),
    "F8_E8M0": (8, "float8_e8m0fnu"),
    "I16": (16, "int16"),
    "U16": (16, "uint16"),
    "F16": (16, "float16"),
    "BF16": (16, "bfloat16"),
    "I32": (32, "int32"),
    "U32": (32, "uint32"),
    "F32": (32, "float32"),
    "I64": (64, "int64"),
    "U64": (64, "uint64"),
    "F64": (64, "float64"),
}

TORCH_TO_SAFETENSORS: dict[str, str] = {name: code for code, (_, name) in SAFETENSORS_DTYPES.items()}

# Spellings accepted for a model dtype (config.json ``torch_dtype`` / ``dtype``, or the ``dtype`` argument).
_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16", "float16": "float16",
    "fp32": "float32", "f32": "float32", "float": "float32", "float32": "float32",
    "fp64": "float64", "float64": "float64", "double": "float64",
}

DtypeChoice: TypeAlias = "str | torch.dtype | None"  # a model dtype as a user gives it (canonical_dtype reads it)


def itemsize(code: str) -> int:
    """Bytes per element of a safetensors dtype code."""
    return SAFETENSORS_DTYPES[code][0] // 8


def torch_name(code: str) -> str:
    """The torch dtype name of a safetensors dtype code (``"BF16"`` -> ``"bfloat16"``)."""
    return SAFETENSORS_DTYPES[code][1]


def torch_itemsize(name: str) -> int:
    """Bytes per element of a torch dtype name."""
    return itemsize(TORCH_TO_SAFETENSORS[name])


def canonical_dtype(value: object) -> str | None:
    """A torch dtype name for a user or config dtype (``torch.bfloat16``, ``"bf16"``, ``"auto"``...).

    Returns ``None`` for ``None``/``"auto"`` (meaning: use the config's dtype); raises ``ValueError``
    for anything else that is not a floating model dtype.
    """
    if value is None or value == "auto":
        return None
    text = str(value).removeprefix("torch.").lower()
    if text not in _DTYPE_ALIASES:
        raise ValueError(
            f"unsupported model dtype {value!r}; use one of bfloat16, float16, float32 (or None for the config's)"
        )
    return _DTYPE_ALIASES[text]


def to_torch(name: str) -> torch.dtype:
    """The ``torch.dtype`` for a torch dtype name (imports torch)."""
    import torch

    return getattr(torch, name)


def to_numpy(name: str) -> np.dtype:
    """The numpy dtype for a torch dtype name (bfloat16 and the float8 formats from ml_dtypes)."""
    import ml_dtypes
    import numpy as np

    if name == "bfloat16" or name.startswith("float8"):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def numpy_name(dtype: npt.DTypeLike) -> str:
    """The torch dtype name of a numpy or JAX dtype (``jnp.bfloat16`` -> ``"bfloat16"``)."""
    import numpy as np

    name = np.dtype(dtype).name
    if name not in TORCH_TO_SAFETENSORS:
        raise ValueError(f"dtype {name!r} has no safetensors equivalent")
    return name


FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")  # never cast without their scales
