"""Jitted JAX transforms (``functional_load.quant.fp8_kernels``) against torch eager equivalents, on CPU.

For each operation and shape: the median wall time of ``--runs`` calls after ``--warmup`` calls
(JAX: compiled once per shape during the warm-up, results waited for with
``block_until_ready``), side by side, with torch / JAX time ratios (> 1: JAX is faster) and
whether both produce the same bits.

Operations (the conventions of ``functional_load.quant.fp8_kernels``' docstring, i.e. vLLM's):

* ``requant``: per-tensor FP8 weight with one scale per logical shard -> one max scale
  (``requantize_with_max_scale``; torch does it as vLLM's ``requantize_with_max_scale``:
  ``fp16(q) * scale_i`` then ``scaled_fp8_quant`` with the max);
* ``fnuz``: e4m3fn -> e4m3fnuz bit patch (``e4m3fn_to_e4m3fnuz``);
* ``per-tensor``: online FP8 of a bf16 weight, ``amax / 448`` (``quantize_fp8_per_tensor``);
* ``block``: online 128 x 128 block FP8 of a bf16 weight (``quantize_fp8_block``).

    python benchmarks/bench_transforms.py            # 4096 x 4096 and 14336 x 4096
    python benchmarks/bench_transforms.py --quick    # small shapes, a few seconds
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

FP8_MAX = 448.0


# --- torch eager equivalents -----------------------------------------------------------------


def torch_static_quant(x: Any, scale: Any) -> Any:
    import torch

    inverse = 1.0 / scale.float()
    return (x.float() * inverse).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def torch_requant(weight: Any, scales: Any, widths: tuple[int, ...]) -> tuple[Any, Any]:
    import torch

    top = scales.max()
    out, start = [], 0
    for i, width in enumerate(widths):
        segment = weight[start : start + width]
        if scales[i] == top:
            out.append(segment)
        else:
            out.append(torch_static_quant(segment.to(torch.float16) * scales[i], top))
        start += width
    return torch.cat(out), top


def torch_fnuz(weight: Any) -> Any:
    import torch

    bits = weight.view(torch.uint8)
    return torch.where(bits == 0x80, torch.zeros_like(bits), bits).view(torch.float8_e4m3fnuz)


def torch_per_tensor(weight: Any) -> tuple[Any, Any]:
    import torch

    amax = weight.abs().max().float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return torch_static_quant(weight, scale), scale


def torch_block(weight: Any, block: tuple[int, int] = (128, 128)) -> tuple[Any, Any]:
    import torch

    bn, bk = block
    rows, cols = weight.shape
    nr, nc = -(-rows // bn), -(-cols // bk)
    padded = torch.zeros(nr * bn, nc * bk, dtype=torch.float32)
    padded[:rows, :cols] = weight
    amax = padded.view(nr, bn, nc, bk).abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    inverse = (1.0 / scales).repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:rows, :cols]
    quantized = (weight.float() * inverse).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized, scales


# --- harness ---------------------------------------------------------------------------------


def median_ms(fn: Callable[[], Any], runs: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def same_bits(a: Any, b: Any) -> bool:
    import numpy as np
    import torch

    a = a if isinstance(a, torch.Tensor) else torch.from_dlpack(a)
    return bool(np.array_equal(a.reshape(-1).contiguous().view(torch.uint8).numpy(), b.reshape(-1).contiguous().view(torch.uint8).numpy()))


def cases(quick: bool) -> list[tuple[str, tuple[int, int], tuple[int, ...]]]:
    """(label, [N, K], logical widths of the per-tensor requantization)."""
    if quick:
        return [("qkv 512x512", (512, 512), (256, 128, 128)), ("gate_up 1000x700", (1000, 700), (500, 500))]
    return [("qkv 4096x4096", (4096, 4096), (2048, 1024, 1024)), ("gate_up 14336x4096", (14336, 4096), (7168, 7168))]


def operations(dense: Any, fp8: Any, scales: Any, widths: tuple[int, ...]) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """(name, JAX call, torch call) for each operation, on the same bf16 / FP8 inputs."""
    import jax
    import jax.numpy as jnp

    from functional_load.quant import fp8_kernels as transforms

    jdense = jnp.asarray(dense.float().numpy()).astype(jnp.bfloat16)
    jfp8 = jax.dlpack.from_dlpack(fp8)
    jscales = jnp.asarray(scales.numpy())
    return [
        ("requant", lambda: transforms.requantize_with_max_scale(jfp8, jscales, widths), lambda: torch_requant(fp8, scales, widths)),
        ("fnuz", lambda: transforms.e4m3fn_to_e4m3fnuz(jfp8), lambda: torch_fnuz(fp8)),
        ("per-tensor", lambda: transforms.quantize_fp8_per_tensor(jdense), lambda: torch_per_tensor(dense)),
        ("block", lambda: transforms.quantize_fp8_block(jdense), lambda: torch_block(dense)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (seconds)")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per measurement (default 5, quick 20)")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    runs = args.runs or (20 if args.quick else 5)

    import jax
    import jax.numpy as jnp
    import torch

    print(
        f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), jax {jax.__version__} ({jax.devices()[0].platform}); "
        f"median of {runs} runs after {args.warmup} warm-up calls"
    )
    header = f"{'operation':<11} {'shape':<20} {'jax ms':>9} {'torch ms':>9} {'torch/jax':>9}  same bits"
    print(header)
    print("-" * len(header))
    generator = torch.Generator().manual_seed(0)
    for label, (n, k), widths in cases(args.quick):
        dense = (torch.randn(n, k, generator=generator) * 0.02).to(torch.bfloat16)
        raw = torch.randint(0, 256, (n, k), generator=generator, dtype=torch.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0  # no NaN codes
        fp8 = raw.view(torch.float8_e4m3fn)
        scales = (torch.rand(len(widths), generator=generator) * 1e-3 + 1e-4).float()
        for name, jax_fn, torch_fn in operations(dense, fp8, scales, widths):
            jax_ms = median_ms(lambda fn=jax_fn: jax.block_until_ready(fn()), runs, args.warmup)
            torch_ms = median_ms(torch_fn, runs, args.warmup)
            jax_out, torch_out = jax_fn(), torch_fn()
            if isinstance(jax_out, tuple):
                equal = same_bits(jax_out[0], torch_out[0]) and same_bits(jnp.asarray(jax_out[1], jnp.float32), torch_out[1].float())
            else:
                equal = same_bits(jax_out, torch_out)
            print(f"{name:<11} {label:<20} {jax_ms:9.2f} {torch_ms:9.2f} {torch_ms / jax_ms:9.2f}  {'yes' if equal else 'NO'}")


if __name__ == "__main__":
    main()
