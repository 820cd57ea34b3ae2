"""Write a Llama-2-7B-shaped bf16 checkpoint for the load benchmarks.

Real shapes (hidden 4096, intermediate 11008, 32 heads, 32 KV heads, vocab 32000), ``N``
decoder layers plus embeddings, final norm and an untied ``lm_head``, as several safetensors
shards with a transformers index and ``config.json``. The data is random bf16 (random 16-bit
patterns with the exponent kept small, so there are no NaN/Inf values). The default (4 layers)
is about 2.15 GB and goes outside the repository, to ``/tmp/fl-bench/llama7b-4l``.

    python benchmarks/make_checkpoint.py [OUT_DIR] [--layers N] [--shard-mb 600] [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HIDDEN = 4096
INTERMEDIATE = 11008
HEADS = 32
KV_HEADS = 32
VOCAB = 32000
HEAD_DIM = HIDDEN // HEADS


def default_dir(layers: int) -> Path:
    return Path(f"/tmp/fl-bench/llama7b-{layers}l")


def tensor_shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """Checkpoint tensors in transformers' module order."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    kv = KV_HEADS * HEAD_DIM
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.k_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.v_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
            (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return shapes


def checkpoint_bytes(layers: int) -> int:
    total = 0
    for _, shape in tensor_shapes(layers):
        n = 2
        for d in shape:
            n *= d
        total += n
    return total


def config(layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": 4096,
        "mlp_bias": False,
        "num_attention_heads": HEADS,
        "num_hidden_layers": layers,
        "num_key_value_heads": KV_HEADS,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": VOCAB,
    }


def _random_bf16(shape: tuple[int, ...], generator):  # -> torch.Tensor
    import torch

    # Random 16-bit patterns below 0x3F80 are finite bf16 values in [0, 1); a random sign bit
    # is added by flipping bit 15 where bit 0 is set.
    bits = torch.randint(0, 0x3F80, shape, dtype=torch.int16, generator=generator)
    sign = torch.bitwise_and(bits, 1).mul_(-32768)  # 0 or 0x8000 as int16
    bits.bitwise_or_(sign)
    return bits.view(torch.bfloat16)


def write_checkpoint(out: Path, layers: int = 4, shard_bytes: int = 600_000_000, seed: int = 0, force: bool = False) -> Path:
    """Write the checkpoint into ``out`` (replacing an existing one only with ``force``).
    Returns ``out``. Files are fsync'ed so the page cache can be dropped afterwards."""
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    need = checkpoint_bytes(layers)
    marker = out / ".complete"
    if marker.exists() and not force:
        info = json.loads(marker.read_text())
        if info.get("layers") == layers and info.get("bytes") == need:
            print(f"{out}: checkpoint already there ({need / 1e9:.2f} GB, {layers} layers)")
            return out
    if out.exists():
        if not force and any(out.iterdir()) and not marker.exists():
            raise SystemExit(f"{out} exists and is not a checkpoint written by this script; pass --force to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    free = shutil.disk_usage(out).free
    if free < need * 1.1 + (1 << 30):
        shutil.rmtree(out)
        raise SystemExit(f"{out}: needs {need / 1e9:.2f} GB (+10 % and 1 GiB headroom) but only {free / 1e9:.2f} GB are free")

    generator = torch.Generator().manual_seed(seed)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(layers):
        nbytes = 2
        for d in shape:
            nbytes *= d
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    n = len(shards)
    start = time.perf_counter()
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {name: _random_bf16(shape, generator) for name, shape in shard}
        path = out / fname
        save_file(tensors, str(path), metadata={"format": "pt"})
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        weight_map.update({name: fname for name, _ in shard})
        del tensors
        print(f"  {fname}: {len(shard)} tensors, {path.stat().st_size / 1e6:,.0f} MB", flush=True)
    index = {
        "metadata": {"total_size": need, "total_parameters": need // 2},
        "weight_map": weight_map,
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config(layers), indent=2) + "\n")
    marker.write_text(json.dumps({"layers": layers, "bytes": need, "shards": n, "seed": seed}) + "\n")
    print(f"{out}: {n} shards, {need / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="output directory (default /tmp/fl-bench/llama7b-<N>l)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4: about 2.15 GB)")
    parser.add_argument("--shard-mb", type=int, default=600, help="maximum shard size in MB (default 600)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rewrite an existing checkpoint")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else default_dir(args.layers)
    write_checkpoint(out, args.layers, args.shard_mb * 1_000_000, args.seed, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
