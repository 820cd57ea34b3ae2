"""Multimodal checkpoints under the names other transformers releases save.

:func:`~functional_load.testing.checkpoints.write_checkpoint` writes Qwen2.5-VL and Gemma 3 with
the names of the released checkpoints (Qwen2.5-VL: ``model.*``, ``lm_head.*``, ``visual.*``;
Gemma 3: ``language_model.model.*``, ``vision_tower.vision_model.*``,
``multi_modal_projector.*``). transformers 4.52 to 4.57 saved them nested under ``model.``
instead; vLLM 0.32's ``hf_to_vllm_mapper`` reads both. :func:`rename_checkpoint` rewrites a
checkpoint to those names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .files import read_checkpoint_tensors, write_shards

# (old prefix, new prefix), the first that matches a name applies
TRANSFORMERS_4_52: Mapping[str, tuple[tuple[str, str], ...]] = {
    "qwen2_5_vl": (("model.", "model.language_model."), ("visual.", "model.visual.")),
    "gemma3": (
        ("language_model.model.", "model.language_model."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ),
}
LAYOUTS: Mapping[str, Mapping[str, tuple[tuple[str, str], ...]]] = {"transformers_4_52": TRANSFORMERS_4_52}


def renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """``name`` with the first matching prefix of ``renames`` replaced."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def rename_checkpoint(directory: str | os.PathLike[str], arch: str, layout: str, max_shard_size: str | int = "100KB") -> Path:
    """Rewrite the checkpoint in ``directory`` (written for ``arch``) to the names of ``layout``
    (``"transformers_4_52"``); the tensors themselves are unchanged."""
    try:
        renames = LAYOUTS[layout][arch]
    except KeyError:
        raise ValueError(f"no {layout!r} names for {arch!r}; known: { {k: sorted(v) for k, v in LAYOUTS.items()} }") from None
    tensors = read_checkpoint_tensors(directory)
    write_shards(directory, {renamed(name, renames): t for name, t in tensors.items()}, max_shard_size)
    return Path(directory)
