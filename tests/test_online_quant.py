"""Online FP8 quantization while loading: ``load(..., quantization="fp8" | "fp8_block")``.

The quantized weights are compared bit for bit with a numpy / ml_dtypes quantization of the
rank-local bf16 weight (the same checkpoint loaded without ``quantization``), with vLLM's
conventions: per tensor, ``scale = amax / 448`` (float32) over the whole rank-local weight and
``fp8(clip(x * (1 / scale), -448, 448))``; per block, one ``amax / 448`` per 128 x 128 tile of
each output segment (q, k, v; gate, up), edge tiles partial.

Also: the peak resident memory of an online-quantized load of a ~400 MB bf16 model, measured in
a fresh interpreter, stays below the bf16 model plus one layer (the loader holds one dense weight
at a time, not the model).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import functional_load as fl

FIXTURES = Path(__file__).parent / "fixtures" / "quant"
E4M3FN = ml_dtypes.float8_e4m3fn
F32 = np.float32

# tiny llama variants: (name, write_checkpoint options). The default has 64-wide everything, so
# every 128 x 128 tile is partial; "wide" has full and partial row tiles at tp 1 and 2; "ragged"
# has partial row and column tiles (hidden 192, intermediate 320) but does not shard block-aligned
# over tp 2 (vLLM's rule), so it is used at tp 1 for blocks.
CHECKPOINTS = {
    "default": {},
    "wide": {"num_layers": 1, "kv_heads": 2, "hidden_size": 256, "head_dim": 32, "intermediate_size": 768},
    "ragged": {"num_layers": 1, "kv_heads": 2, "hidden_size": 192, "num_attention_heads": 6, "head_dim": 32, "intermediate_size": 320},
}


from fp8_reference import ref_block, ref_per_tensor  # noqa: E402
from helpers import segment_rows  # noqa: E402


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU torch tensor as numpy with the ml_dtypes type of the same bits."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(E4M3FN)
    return t.numpy()


def u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def linear_modules(config: dict) -> list[str]:
    return [
        f"model.layers.{i}.{m}"
        for i in range(config["num_hidden_layers"])
        for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ]


# Rounding bound (derivation in tests/test_transforms.py, _fp8_bound): e4m3fn rounds y = x / s to
# within 2^-4 |y| (normal range: half a spacing 2^(e-3) in binade 2^e) or 2^-10 (subnormal
# spacing 2^-9), so |q s - x| <= 2^-4 |x| + 2^-10 s; 2^-20 |x| covers the float32 arithmetic.
def within_bound(dequant: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> tuple[bool, float]:
    x, dequant, scale = x.double(), dequant.double(), scale.double()
    bound = 2.0**-4 * x.abs() + 2.0**-10 * scale + 2.0**-20 * x.abs()
    error = (dequant - x).abs()
    return bool((error <= bound).all()), float((error / bound).max())


def _check_extra_keys(config: dict, dense, quantized, modules: list[str], scale_name: str) -> None:
    """The quantized state has the dense state's names plus each linear's weight scale and each
    layer's KV-cache parameters (vLLM's fp8 config creates q/k/v/prob_scale, 0-dim in the model
    dtype, -1.0 when the checkpoint has none)."""
    kv = {
        f"model.layers.{i}.self_attn.attn.{s}_scale"
        for i in range(config["num_hidden_layers"])
        for s in ("q", "k", "v", "prob")
    }
    assert set(quantized) == set(dense) | {f"{m}.{scale_name}" for m in modules} | kv
    for name in kv - set(dense):
        assert quantized[name].dim() == 0 and float(quantized[name]) == -1.0, name
        assert quantized[name].dtype == dense["model.embed_tokens.weight"].dtype, name


CASES = [("default", 1, 0), ("default", 2, 0), ("default", 2, 1), ("wide", 1, 0), ("wide", 2, 0), ("wide", 2, 1)]


def _pair(tiny_checkpoint, which: str, tp: int, rank: int, method: str):
    directory = tiny_checkpoint("llama", **CHECKPOINTS[which])
    config = json.loads((directory / "config.json").read_text())
    dense = fl.load(directory, tp_size=tp, rank=rank, progress=False)
    quantized = fl.load(directory, tp_size=tp, rank=rank, quantization=method, progress=False)
    return config, dense, quantized


@pytest.mark.parametrize(("which", "tp", "rank"), CASES + [("ragged", 2, 1)])
def test_online_fp8_per_tensor(tiny_checkpoint, which: str, tp: int, rank: int) -> None:
    config, dense, quantized = _pair(tiny_checkpoint, which, tp, rank, "fp8")
    modules = linear_modules(config)
    assert set(quantized.plan.schemes) == set(modules)
    _check_extra_keys(config, dense, quantized, modules, "weight_scale")
    worst = 0.0
    for module in modules:
        x = dense[f"{module}.weight"]
        weight, scale = quantized[f"{module}.weight"], quantized[f"{module}.weight_scale"]
        assert x.dtype == torch.bfloat16
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == x.shape
        segments = segment_rows(config, module, tp)
        assert sum(segments) == x.shape[0]
        # one slot per logical shard (q, k, v / gate, up; one for row-parallel), all equal
        assert scale.dtype == torch.float32 and tuple(scale.shape) == (len(segments),)
        assert bool((scale == scale[0]).all())
        ref_q, ref_s = ref_per_tensor(as_numpy(x))
        assert F32(scale[0].item()) == ref_s, module
        np.testing.assert_array_equal(u8(weight), ref_q.view(np.uint8), err_msg=module)
        ok, ratio = within_bound(fl.dequantize(quantized, module), x, scale[0])
        assert ok, f"{module}: error / bound {ratio:.3f}"
        worst = max(worst, ratio)
    assert worst > 0.5  # the bound is not vacuous
    for name in dense:  # everything else (embeddings, norms, lm_head, KV scales) as without quantization
        if not any(name.startswith(m + ".") for m in modules):
            assert torch.equal(quantized[name], dense[name]), name


@pytest.mark.parametrize(("which", "tp", "rank"), CASES + [("ragged", 1, 0)])
def test_online_fp8_block(tiny_checkpoint, which: str, tp: int, rank: int) -> None:
    config, dense, quantized = _pair(tiny_checkpoint, which, tp, rank, "fp8_block")
    modules = linear_modules(config)
    _check_extra_keys(config, dense, quantized, modules, "weight_scale_inv")
    worst = 0.0
    for module in modules:
        x = dense[f"{module}.weight"]
        weight, scale = quantized[f"{module}.weight"], quantized[f"{module}.weight_scale_inv"]
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == x.shape
        segments = segment_rows(config, module, tp)
        # scale rows: ceil(rows / 128) per segment, so each segment's blocks start at its first row
        expected_shape = (sum(math.ceil(r / 128) for r in segments), math.ceil(x.shape[1] / 128))
        assert scale.dtype == torch.float32 and tuple(scale.shape) == expected_shape, module
        ref_q, ref_s, start = [], [], 0
        for rows in segments:
            q, s = ref_block(as_numpy(x[start : start + rows]))
            ref_q.append(q)
            ref_s.append(s)
            start += rows
        np.testing.assert_array_equal(scale.numpy(), np.concatenate(ref_s), err_msg=module)
        np.testing.assert_array_equal(u8(weight), np.concatenate(ref_q).view(np.uint8), err_msg=module)
        # per-element scales, expanded per segment as the quantization did
        per_element, start, block_row = torch.empty(x.shape, dtype=torch.float32), 0, 0
        for rows in segments:
            blocks = math.ceil(rows / 128)
            expanded = scale[block_row : block_row + blocks].repeat_interleave(128, 0).repeat_interleave(128, 1)
            per_element[start : start + rows] = expanded[:rows, : x.shape[1]]
            start, block_row = start + rows, block_row + blocks
        ok, ratio = within_bound(fl.dequantize(quantized, module), x, per_element)
        assert ok, f"{module}: error / bound {ratio:.3f}"
        worst = max(worst, ratio)
    assert worst > 0.5


@pytest.mark.parametrize("tp", [1, 2])
def test_online_fp8_then_cuda_target(tiny_checkpoint, tp: int) -> None:
    """Online per-tensor slots all hold one scale, so the cuda-fp8 target only transposes."""
    directory = tiny_checkpoint("llama", **CHECKPOINTS["wide"])
    quantized = fl.load(directory, tp_size=tp, rank=tp - 1, quantization="fp8", progress=False)
    kernel = fl.load(directory, tp_size=tp, rank=tp - 1, quantization="fp8", target="cuda-fp8", progress=False)
    for module in quantized.plan.schemes:
        assert torch.equal(kernel[f"{module}.weight"].view(torch.uint8), quantized[f"{module}.weight"].T.contiguous().view(torch.uint8))
        assert kernel[f"{module}.weight_scale"].dim() == 0
        assert float(kernel[f"{module}.weight_scale"]) == float(quantized[f"{module}.weight_scale"][0])
        assert torch.equal(fl.dequantize(kernel, module), fl.dequantize(quantized, module))


@pytest.mark.parametrize("method", ["fp8", "fp8_block"])
@pytest.mark.parametrize("name", ["ct_fp8_tensor", "hf_fp8_block", "quark_fp8", "gptq_v2", "awq_gemm"])
def test_quantizing_a_quantized_checkpoint_is_a_config_error(name: str, method: str) -> None:
    with pytest.raises(fl.ConfigError, match="already quantized"):
        fl.load(FIXTURES / name, quantization=method)


@pytest.mark.parametrize("method", ["fp4", "int8", "FP8", "fp8_per_tensor", "awq"])
def test_unknown_online_method_is_a_config_error(tiny_checkpoint, method: str) -> None:
    with pytest.raises(fl.ConfigError, match="not supported"):
        fl.load(tiny_checkpoint("llama"), quantization=method)
    with pytest.raises(fl.ConfigError):
        fl.plan(tiny_checkpoint("llama"), quantization=method)


# --- peak resident memory --------------------------------------------------------------------

RSS_MODEL = {"hidden": 1024, "intermediate": 4096, "layers": 8, "vocab": 32000, "heads": 16}

RSS_CHILD = textwrap.dedent(
    """
    import json, re, sys

    def status(key):
        with open("/proc/self/status") as f:
            return int(re.search(key + r":\\s+(\\d+) kB", f.read()).group(1)) * 1024

    import jax, jax.numpy as jnp, torch
    import functional_load as fl
    from functional_load.quant import fp8_kernels as transforms
    from functional_load.dlpack import to_torch

    # warm up: the runtimes (torch is imported lazily by the loader: ~200 MB of its own that
    # must not count), one small jitted kernel through DLPack
    to_torch(transforms.quantize_fp8_per_tensor(jnp.ones((16, 16), jnp.bfloat16))[0]).float().sum()
    baseline = status("VmRSS")
    state = fl.load(sys.argv[1], quantization="fp8", progress=False)
    peak = status("VmHWM")
    kept = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    print(json.dumps({"baseline": baseline, "peak": peak, "kept": kept}))
    """
)


def _write_llama(directory: Path) -> tuple[int, int]:
    """A bf16 Llama checkpoint of RSS_MODEL's sizes (untied), in ~100 MB shards with an index;
    returns (bytes of all tensors, bytes of one decoder layer)."""
    import transformers

    from functional_load.testing.checkpoints import write_shards

    h, i, n, v, heads = (RSS_MODEL[k] for k in ("hidden", "intermediate", "layers", "vocab", "heads"))
    config = transformers.LlamaConfig(
        hidden_size=h, intermediate_size=i, num_hidden_layers=n, vocab_size=v, num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=h // heads, max_position_embeddings=256, tie_word_embeddings=False,
    ).to_dict()
    config.update(architectures=["LlamaForCausalLM"], dtype="bfloat16")
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": weight(v, h)}
    for layer in range(n):
        p = f"model.layers.{layer}."
        for name, shape in [
            ("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (h, h)), ("self_attn.v_proj", (h, h)),
            ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)), ("mlp.down_proj", (h, i)),
        ]:
            tensors[f"{p}{name}.weight"] = weight(*shape)
        tensors[f"{p}input_layernorm.weight"] = weight(h)
        tensors[f"{p}post_attention_layernorm.weight"] = weight(h)
    tensors["model.norm.weight"] = weight(h)
    tensors["lm_head.weight"] = weight(v, h)
    write_shards(directory, tensors, 100_000_000)
    (directory / "config.json").write_text(json.dumps(config))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    layer = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.startswith("model.layers.0."))
    return total, layer


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS/VmHWM from /proc (Linux)")
def test_online_fp8_peak_rss_stays_below_bf16_model_plus_one_layer(tmp_path: Path) -> None:
    directory = tmp_path / "llama-400mb"
    try:
        bf16_bytes, layer_bytes = _write_llama(directory)
        assert bf16_bytes >= 200e6
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        run = subprocess.run([sys.executable, "-c", RSS_CHILD, str(directory)], capture_output=True, text=True, env=env, timeout=110)
        assert run.returncode == 0, run.stderr[-4000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
    grown = result["peak"] - result["baseline"]
    print(
        f"\nonline fp8 load of a {bf16_bytes / 1e6:.0f} MB bf16 model (one layer {layer_bytes / 1e6:.1f} MB): "
        f"peak RSS - baseline = {grown / 1e6:.0f} MB, (peak - baseline) / bf16 size = {grown / bf16_bytes:.3f}; "
        f"state kept {result['kept'] / 1e6:.0f} MB"
    )
    assert result["kept"] < bf16_bytes  # the fp8 state itself: fp8 linears, bf16 embeddings and norms
    assert grown < bf16_bytes + layer_bytes, f"peak grew by {grown / 1e6:.0f} MB; bound {(bf16_bytes + layer_bytes) / 1e6:.0f} MB"
