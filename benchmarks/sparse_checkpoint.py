"""Write full-size checkpoints as *sparse* safetensors files, for planning at scale.

Every shard has a valid safetensors header with the real tensor names, shapes and dtypes; the
data region is not written but the file is extended to its full size with ``os.truncate``, so a
671B checkpoint takes a few megabytes of disk (the filesystem must support sparse files) and reads
as zeros. The shards and ``model.safetensors.index.json`` follow the real repositories:

* ``deepseek-v3``: deepseek-ai/DeepSeek-V3 (671B, FP8 e4m3 128 x 128 block quantization: every
  quantized Linear has an ``F8_E4M3`` weight and an ``F32`` ``weight_scale_inv``
  ``[ceil(out / 128), ceil(in / 128)]``; norms, embeddings, routers and the MTP layer's
  ``eh_proj``/heads stay BF16), 163 shards, the multi-token-prediction layer as layer
  ``num_hidden_layers``;
* ``llama-405b``: meta-llama/Llama-3.1-405B-Instruct (BF16), 191 shards;
* ``kimi-k2``: moonshotai/Kimi-K2-Instruct (1.04T, the DeepSeek-V3 architecture and FP8 blocks
  with 384 routed experts: 138,000 tensors), 61 shards;
* ``qwen3-235b``: Qwen/Qwen3-235B-A22B (BF16, 94 layers of 128 experts), 118 shards.

``--layers`` sets ``num_hidden_layers`` (the MTP layer follows the last one); the shard count
scales with it unless ``--shards`` is given.

    python benchmarks/sparse_checkpoint.py deepseek-v3 [OUT_DIR] [--layers N] [--shards N]
    python benchmarks/sparse_checkpoint.py llama-405b [OUT_DIR] [--layers N]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ITEMSIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
BLOCK = 128

DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

LLAMA_405B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 16384,
    "initializer_range": 0.02,
    "intermediate_size": 53248,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 128,
    "num_hidden_layers": 126,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 128256,
}

# moonshotai/Kimi-K2-Instruct (1.04T, FP8 block as DeepSeek-V3): the DeepSeek-V3 architecture with
# 384 routed experts, 64 heads, one dense layer, no MTP layer
KIMI_K2: dict[str, Any] = {
    **DEEPSEEK_V3,
    "model_type": "kimi_k2", "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "n_routed_experts": 384,
    "num_attention_heads": 64, "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "routed_scaling_factor": 2.827,
    "vocab_size": 163840, "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}

# Qwen/Qwen3-235B-A22B (BF16): 94 layers of 128 experts, q/k norms
QWEN3_235B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 94, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645,
}

MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "deepseek-v3": (DEEPSEEK_V3, 163), "llama-405b": (LLAMA_405B, 191), "kimi-k2": (KIMI_K2, 61), "qwen3-235b": (QWEN3_235B, 118),
}

Tensor = tuple[str, str, tuple[int, ...]]


def _linear(name: str, out: int, inp: int, fp8: bool) -> Iterator[Tensor]:
    if not fp8:
        yield name + ".weight", "BF16", (out, inp)
        return
    yield name + ".weight", "F8_E4M3", (out, inp)
    yield name + ".weight_scale_inv", "F32", (math.ceil(out / BLOCK), math.ceil(inp / BLOCK))


def _deepseek_layer(c: dict[str, Any], i: int) -> Iterator[Tensor]:
    h, p = c["hidden_size"], f"model.layers.{i}."
    heads, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_lora, kv_lora = c["q_lora_rank"], c["kv_lora_rank"]
    yield p + "input_layernorm.weight", "BF16", (h,)
    yield from _linear(p + "self_attn.q_a_proj", q_lora, h, True)
    yield p + "self_attn.q_a_layernorm.weight", "BF16", (q_lora,)
    yield from _linear(p + "self_attn.q_b_proj", heads * (nope + rope), q_lora, True)
    yield from _linear(p + "self_attn.kv_a_proj_with_mqa", kv_lora + rope, h, True)
    yield p + "self_attn.kv_a_layernorm.weight", "BF16", (kv_lora,)
    yield from _linear(p + "self_attn.kv_b_proj", heads * (nope + v), kv_lora, True)
    yield from _linear(p + "self_attn.o_proj", h, heads * v, True)
    yield p + "post_attention_layernorm.weight", "BF16", (h,)
    if i < c["first_k_dense_replace"]:
        inter = c["intermediate_size"]
        yield from _linear(p + "mlp.gate_proj", inter, h, True)
        yield from _linear(p + "mlp.up_proj", inter, h, True)
        yield from _linear(p + "mlp.down_proj", h, inter, True)
        return
    experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    yield p + "mlp.gate.weight", "BF16", (experts, h)
    yield p + "mlp.gate.e_score_correction_bias", "F32", (experts,)
    for e in range(experts):
        q = f"{p}mlp.experts.{e}."
        yield from _linear(q + "gate_proj", inter, h, True)
        yield from _linear(q + "up_proj", inter, h, True)
        yield from _linear(q + "down_proj", h, inter, True)
    shared = inter * c["n_shared_experts"]
    yield from _linear(p + "mlp.shared_experts.gate_proj", shared, h, True)
    yield from _linear(p + "mlp.shared_experts.up_proj", shared, h, True)
    yield from _linear(p + "mlp.shared_experts.down_proj", h, shared, True)


def deepseek_tensors(c: dict[str, Any]) -> Iterator[Tensor]:
    h, vocab, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    yield "model.embed_tokens.weight", "BF16", (vocab, h)
    for i in range(n):
        yield from _deepseek_layer(c, i)
    for i in range(n, n + c.get("num_nextn_predict_layers", 0)):  # MTP: a full MoE layer plus its heads
        p = f"model.layers.{i}."
        yield p + "embed_tokens.weight", "BF16", (vocab, h)
        yield p + "enorm.weight", "BF16", (h,)
        yield p + "hnorm.weight", "BF16", (h,)
        yield p + "eh_proj.weight", "BF16", (h, 2 * h)
        yield from _deepseek_layer(c, i)
        yield p + "shared_head.norm.weight", "BF16", (h,)
        yield p + "shared_head.head.weight", "BF16", (vocab, h)
    yield "model.norm.weight", "BF16", (h,)
    yield "lm_head.weight", "BF16", (vocab, h)


def llama_tensors(c: dict[str, Any]) -> Iterator[Tensor]:
    h, vocab, inter = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    head_dim = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    yield "model.embed_tokens.weight", "BF16", (vocab, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", "BF16", (h,)
        yield p + "self_attn.q_proj.weight", "BF16", (h, h)
        yield p + "self_attn.k_proj.weight", "BF16", (kv, h)
        yield p + "self_attn.v_proj.weight", "BF16", (kv, h)
        yield p + "self_attn.o_proj.weight", "BF16", (h, h)
        yield p + "post_attention_layernorm.weight", "BF16", (h,)
        yield p + "mlp.gate_proj.weight", "BF16", (inter, h)
        yield p + "mlp.up_proj.weight", "BF16", (inter, h)
        yield p + "mlp.down_proj.weight", "BF16", (h, inter)
    yield "model.norm.weight", "BF16", (h,)
    yield "lm_head.weight", "BF16", (vocab, h)


def qwen3_moe_tensors(c: dict[str, Any]) -> Iterator[Tensor]:
    h, vocab, d = c["hidden_size"], c["vocab_size"], c["head_dim"]
    heads, kv, experts, inter = c["num_attention_heads"], c["num_key_value_heads"], c["num_experts"], c["moe_intermediate_size"]
    yield "model.embed_tokens.weight", "BF16", (vocab, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", "BF16", (h,)
        yield p + "self_attn.q_proj.weight", "BF16", (heads * d, h)
        yield p + "self_attn.k_proj.weight", "BF16", (kv * d, h)
        yield p + "self_attn.v_proj.weight", "BF16", (kv * d, h)
        yield p + "self_attn.o_proj.weight", "BF16", (h, heads * d)
        yield p + "self_attn.q_norm.weight", "BF16", (d,)
        yield p + "self_attn.k_norm.weight", "BF16", (d,)
        yield p + "post_attention_layernorm.weight", "BF16", (h,)
        yield p + "mlp.gate.weight", "BF16", (experts, h)
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            yield q + "gate_proj.weight", "BF16", (inter, h)
            yield q + "up_proj.weight", "BF16", (inter, h)
            yield q + "down_proj.weight", "BF16", (h, inter)
    yield "model.norm.weight", "BF16", (h,)
    yield "lm_head.weight", "BF16", (vocab, h)


def nbytes(t: Tensor) -> int:
    return math.prod(t[2]) * ITEMSIZE[t[1]]


def config_for(model: str, layers: int | None = None, **overrides: Any) -> dict[str, Any]:
    config = dict(MODELS[model][0])
    if layers is not None:
        config["num_hidden_layers"] = layers
    config.update(overrides)
    return config


def tensors_for(config: dict[str, Any]) -> list[Tensor]:
    arch = config["architectures"][0]
    writer = {"DeepseekV3ForCausalLM": deepseek_tensors, "Qwen3MoeForCausalLM": qwen3_moe_tensors}.get(arch, llama_tensors)
    return list(writer(config))


def _write_shard(path: Path, tensors: list[Tensor]) -> int:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        size = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
    os.truncate(path, 8 + len(raw) + offset)  # the data: a hole, reads as zeros
    return offset


def write_sparse(model: str, out: str | Path, layers: int | None = None, shards: int | None = None, **overrides: Any) -> Path:
    """Write ``config.json``, sparse shards and the index for ``model`` to ``out`` (replaced)."""
    config = config_for(model, layers, **overrides)
    tensors = tensors_for(config)
    if shards is None:  # the real repo's count, scaled with the layer count
        full = MODELS[model][0]["num_hidden_layers"]
        shards = max(1, round(MODELS[model][1] * config["num_hidden_layers"] / full))
    total = sum(nbytes(t) for t in tensors)
    target = total / shards
    groups: list[list[Tensor]] = [[]]
    done = 0
    for t in tensors:  # greedy by bytes, in module order, as save_pretrained shards
        if groups[-1] and done >= target * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(t)
        done += nbytes(t)
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    width = 6 if model == "deepseek-v3" else 5  # the repos' own file names
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups, 1):
        name = f"model-{k:05d}-of-{len(groups):0{width}d}.safetensors"
        _write_shard(out / name, group)
        weight_map.update((t[0], name) for t in group)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("out", nargs="?")
    ap.add_argument("--layers", type=int, help="num_hidden_layers (default: the real model's)")
    ap.add_argument("--shards", type=int, help="shard count (default: the real repo's, scaled with --layers)")
    args = ap.parse_args(argv)
    layers = args.layers or MODELS[args.model][0]["num_hidden_layers"]
    out = Path(args.out or f"/tmp/fl-bench/{args.model}-{layers}l")
    write_sparse(args.model, out, layers, args.shards)
    files = sorted(out.glob("*.safetensors"))
    logical = sum(f.stat().st_size for f in files)
    on_disk = sum(f.stat().st_blocks * 512 for f in files)
    n = len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    print(f"{out}: {len(files)} shards, {n} tensors, {logical / 1e9:,.1f} GB logical, {on_disk / 1e6:.1f} MB on disk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
