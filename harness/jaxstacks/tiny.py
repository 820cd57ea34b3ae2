"""Tiny float32 transformers checkpoints for the JAX-stack runs, and their reference logits.

Needs torch and transformers (the repository's ``.venv`` has both: the stacks' checks and the
recorder ask it to write the checkpoints, ``python -m harness.jaxstacks.tiny ARCH DIR
[--head-dim N]``, so every stack reads the same files).

Sizes: 2 layers, hidden 64, 4 attention heads, 2 KV heads, intermediate 128, vocab 256, RoPE theta
10000 (set in ``rope_parameters``, the transformers 5 spelling), untied ``lm_head``, norms and every
weight random (seeded) so no all-ones norm hides a missing transform. head_dim 16 unless a stack
needs another (tpu-inference qwen3: 128 or 64).

The files are byte-for-byte the same whatever the transformers release: ``config.json`` is
:func:`config_dict` itself, ``model.safetensors`` the seeded tensors in name order (torch's
generator decides them), ``tiny.json`` the tokens. The reference logits (float32 transformers, one
thread) go next to the directory, in :func:`reference_path`, not in it: the recorded oracle
answers are keyed by the directory's bytes, and the oracle never reads the reference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

TOKENS = (1, 5, 9, 17, 33, 65, 129, 255)
ARCHS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def config_dict(arch: str, head_dim: int = 16, tie: bool = False) -> dict[str, Any]:
    return {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "vocab_size": 256,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        "attention_bias": False,
        "dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def reference_path(directory: str | Path) -> Path:
    """Where :func:`write` puts the reference logits of ``directory``: ``<directory>.logits.npy``."""
    directory = Path(directory)
    return directory.with_name(directory.name + ".logits.npy")


def write(arch: str, directory: str | Path, head_dim: int = 16, seed: int = 0) -> Path:
    """Write the tiny checkpoint (``config.json``, ``model.safetensors``, ``tiny.json``) and the
    float32 transformers logits of :data:`TOKENS` (:func:`reference_path`); returns the directory."""
    import torch
    import transformers
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = transformers.AutoConfig.for_model(**config_dict(arch, head_dim))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if param.ndim == 1 else 0.0))
    model.eval()
    tensors = {name: tensor.contiguous() for name, tensor in sorted(model.state_dict().items())}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config_dict(arch, head_dim), indent=2, sort_keys=True) + "\n")
    (directory / "tiny.json").write_text(json.dumps({"arch": arch, "head_dim": head_dim, "tokens": TOKENS, "seed": seed}))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one summation order whatever the machine
    try:
        with torch.no_grad():
            logits = model(torch.tensor([TOKENS])).logits[0].float().numpy()
    finally:
        torch.set_num_threads(threads)
    np.save(reference_path(directory), logits)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.jaxstacks.tiny")
    parser.add_argument("arch", choices=sorted(ARCHS))
    parser.add_argument("directory")
    parser.add_argument("--head-dim", type=int, default=16)
    args = parser.parse_args(argv)
    print(write(args.arch, args.directory, args.head_dim))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
