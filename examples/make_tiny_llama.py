"""Write the shipped demo checkpoint ``examples/tiny-llama/``.

A real transformers ``LlamaForCausalLM`` built from a tiny config with seeded random bf16
weights (never downloaded): hidden 64, 8 attention heads of head_dim 8, 2 KV heads (GQA),
intermediate 128, vocab 1000, 2 layers, untied LM head. Saved with ``max_shard_size="100KB"``,
so the directory holds 4 safetensors shards, ``model.safetensors.index.json``, ``config.json``
and ``generation_config.json`` (about 400 KB in all). Rerunning rewrites the same bytes.

Usage: ``python examples/make_tiny_llama.py [OUT_DIR]`` (default: ``examples/tiny-llama`` next
to this script).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
try:
    from functional_load.testing.checkpoints import list_tensors, write_checkpoint
except ModuleNotFoundError:  # run from a source checkout without installing
    sys.path.insert(0, str(HERE.parent))
    from functional_load.testing.checkpoints import list_tensors, write_checkpoint


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else HERE / "tiny-llama"
    path = write_checkpoint("llama", out, kv_heads=2, num_layers=2, dtype="bfloat16", max_shard_size="100KB", seed=0)
    files = sorted(p for p in path.iterdir() if p.is_file())
    for p in files:
        print(f"{p.stat().st_size:>9,d}  {p.name}")
    print(f"{sum(p.stat().st_size for p in files):>9,d}  total in {path}")
    for name, (shape, dtype) in list_tensors(path).items():
        print(f"  {name:48s} {dtype:5s} {list(shape)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
