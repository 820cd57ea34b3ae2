"""Hand tensors between torch and JAX through DLPack, without copies where the platform allows.

On CPU, torch and JAX (XLA) share the buffer for every dtype this loader produces: float32,
bfloat16, float16, float8_e4m3fn, int8, uint8, int32 (checked by the tests). A buffer that is
not contiguous is made so first (one copy); the loader's own buffers always are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax
    import torch


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """A ``jax.Array`` over the same memory as a CPU torch ``tensor`` (copies only if the
    tensor is not contiguous)."""
    import jax

    return jax.dlpack.from_dlpack(tensor.contiguous())


def to_torch(array: jax.Array) -> torch.Tensor:
    """A torch tensor over the same memory as a single-device ``jax.Array``."""
    import torch

    return torch.from_dlpack(array)


def shares_memory(tensor: torch.Tensor, array: jax.Array) -> bool:
    """Whether a torch tensor and a jax array use the same buffer (zero-copy check)."""
    return int(array.unsafe_buffer_pointer()) == int(tensor.data_ptr())
