"""The rotary permutation of q/k rows, head by head (written once, with einops).

Meta's checkpoints (Llama 4's, Mistral's consolidated files) store each head's rows as rotary
pairs interleaved, ``[x0, y0, x1, y1, ...]``; vLLM's loaders (and HF's converters) permute them to
halves, ``[x0, x1, ..., y0, y1, ...]``. Any array type einops knows (torch, numpy, JAX) works; the
rows are the first dimension, ``head`` rows per head.
"""

from __future__ import annotations

from typing import TypeVar

import einops

ArrayT = TypeVar("ArrayT")  # torch, numpy or JAX: the rows come back as the same kind of array


def to_halves(rows: ArrayT, head: int) -> ArrayT:
    """Interleaved rotary pairs -> halves, for every ``head``-row head of ``rows``."""
    return einops.rearrange(rows, "(h d two) ... -> (h two d) ...", d=head // 2, two=2)


def to_pairs(rows: ArrayT, head: int) -> ArrayT:
    """Halves -> interleaved rotary pairs (the inverse of :func:`to_halves`)."""
    return einops.rearrange(rows, "(h two d) ... -> (h d two) ...", d=head // 2, two=2)
