"""Tensor-parallel forwards over the loaded shards equal transformers' own model.

* JAX: ``jax_tp_forward`` (``functional_load.testing.forward``) over ``load_jax`` arrays on an
  8-device CPU mesh ``("dp", "tp")`` of shape ``(8 // tp, tp)``, tp 2, 4, 8, for a tiny Llama
  with 2 KV heads (replicated over ranks at tp 4 and 8) and a tiny Qwen3-MoE, gives the logits
  of ``AutoModelForCausalLM.from_pretrained(dir)`` in eval mode, computed in float32.
* torch: 4 ``torch.distributed`` gloo processes each load their rank (rank from
  ``rank_from_torch_distributed``) and run decoder layer 0 with all-reduces after ``o_proj`` and
  ``down_proj``; the output equals transformers' ``LlamaDecoderLayer`` on the full checkpoint.

Checkpoints: mainly ``write_unit_scale_checkpoint`` models (the tiny ``write_checkpoint`` models
rescaled so every activation is O(1) and a wrong block anywhere moves the logits by O(0.1-1);
with the raw ``0.02 * randn`` weights a wrong MLP or q/k-norm block moves them by only ~1e-5
relative), in float32 and in bfloat16; plus the raw bf16 ``write_checkpoint`` models as written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if str(Path(__file__).resolve().parent) not in sys.path:  # --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _subprocess_runner import Cases, child_env, finish, free_port, spawn

HERE = str(Path(__file__).resolve())
TPS = [2, 4, 8]
ARCHS = ["llama", "qwen3_moe"]
VARIANTS = {  # id -> (unit scale?, checkpoint dtype)
    "fp32": (True, "float32"),
    "bf16": (True, "bfloat16"),  # weights bf16; both sides compute in fp32 from the same bf16 values
    "bf16-raw": (False, "bfloat16"),  # write_checkpoint as is (0.02 * randn everywhere)
}
# Token ids 2 x 9 that hit the first and last rows of vocab shards at every tp (1024 padded
# rows: shard boundaries at multiples of 128) and the last real token 999.
IDS = np.array(
    [[0, 127, 128, 255, 256, 511, 512, 895, 999], [896, 1, 640, 383, 384, 767, 768, 998, 5]], dtype=np.int64
)


def tolerance(reference: np.ndarray) -> dict[str, float]:
    """Both sides compute in float32 from identical weight values; they differ only in summation
    order (per-rank partial sums over heads / intermediate / experts followed by an all-reduce,
    XLA vs torch matmul blocking) and in exp/rsqrt/sin/cos implementations. Measured: max
    |diff| ~2.6e-6 with max |logit| ~4 (about 5 float32 ulps of the largest logit), ~4e-9 with
    max |logit| ~0.013 (raw). Allowed: 1e-5 of the largest logit (15-30x headroom)."""
    return {"rtol": 1e-5, "atol": 1e-5 * float(np.abs(reference).max())}


# -------------------------------------------------------------------------------------------
# JAX forward (child process with 8 devices)


def jax_logits(path: str, tp: int, out: str) -> list[int]:
    import jax
    from jax.sharding import Mesh

    import functional_load as fl
    from functional_load.testing.forward import jax_tp_forward

    devices = jax.devices()
    assert len(devices) >= 8, f"need 8 devices, have {len(devices)}"
    mesh = Mesh(np.array(devices[:8]).reshape(8 // tp, tp), ("dp", "tp"))
    config = json.loads((Path(path) / "config.json").read_text())
    params = fl.load_jax(path, mesh, dtype=config["dtype"])  # the checkpoint's own dtype (vLLM's auto serves fp32 in bf16)
    logits = np.asarray(jax_tp_forward(params, config, mesh, IDS))
    np.save(out, logits)
    return list(logits.shape)


def transformers_logits(path: Path) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


@pytest.fixture(scope="module")
def forward(tiny_checkpoint, tmp_path_factory):
    from functional_load.testing.forward import write_unit_scale_checkpoint

    root = tmp_path_factory.mktemp("forward")
    paths, references, calls = {}, {}, {}
    for arch in ARCHS:
        for variant, (unit, dtype) in VARIANTS.items():
            key = f"{arch}-{variant}"
            if unit:
                paths[key] = write_unit_scale_checkpoint(arch, root / key, dtype=dtype, kv_heads=2)
            else:
                paths[key] = tiny_checkpoint(arch, kv_heads=2, dtype=dtype)
            references[key] = transformers_logits(paths[key])
            for tp in TPS:
                calls[f"{key}-tp{tp}"] = ("jax_logits", {"path": str(paths[key]), "tp": tp, "out": str(root / f"{key}-tp{tp}.npy")})
    cases = Cases(HERE, globals(), calls, devices=8, timeout=240)
    return cases, references


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_jax_tp_forward_matches_transformers(forward, arch, variant, tp):
    cases, references = forward
    key = f"{arch}-{variant}"
    case = f"{key}-tp{tp}"
    cases.check(case)
    logits = np.load(cases.calls[case][1]["out"])
    reference = references[key]
    assert logits.shape == reference.shape == (2, 9, 1000)
    assert np.isfinite(logits).all()
    np.testing.assert_allclose(logits, reference, **tolerance(reference), err_msg=case)


# -------------------------------------------------------------------------------------------
# torch.distributed: one decoder layer over 4 gloo processes

WORLD = 4
LAYER_TOL = {"rtol": 1e-5, "atol": 1e-5}
# fp32 on both sides, outputs O(1) (unit-scale weights, unit-scale input): the TP layer sums
# per-rank partial products of o_proj/down_proj through gloo's all-reduce, a different
# summation order from transformers' full matmuls; measured max |diff| ~1e-6 (a few ulps of
# O(1) values). 1e-5 leaves ~10x headroom; a wrong block changes the output by O(0.1-1).


def torch_layer_worker(rank: int, port: int, path: str, out_dir: str) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import functional_load as fl
    from functional_load.output.jax import rank_from_torch_distributed
    from functional_load.testing.forward import torch_tp_decoder_layer

    torch.set_num_threads(2)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        tp_size, tp_rank = rank_from_torch_distributed()
        assert (tp_size, tp_rank) == (WORLD, rank)
        config = json.loads((Path(path) / "config.json").read_text())
        state = fl.load(path, tp_size=tp_size, rank=tp_rank, dtype=torch.float32, progress=False)
        hidden = torch.randn(2, 9, config["hidden_size"], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            out = torch_tp_decoder_layer(state, config, 0, hidden, group=None)
        np.save(Path(out_dir) / f"rank{rank}.npy", out.numpy())
        if rank == 0:
            reference = decoder_layer_reference(path, hidden)
            np.save(Path(out_dir) / "reference.npy", reference.numpy())
            torch.testing.assert_close(out, reference, **LAYER_TOL)
        dist.barrier()
        return {"rank": tp_rank, "shapes": {k: list(v.shape) for k, v in state.items() if ".layers.0." in k}}
    finally:
        dist.destroy_process_group()


def decoder_layer_reference(path: str, hidden: Any) -> Any:
    """transformers' own layer 0 (``LlamaDecoderLayer``) on the full fp32 checkpoint, called by
    the model with its own causal mask and rotary embeddings: its output is captured by a hook."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layer = model.model.layers[0]
    assert type(layer).__name__ == "LlamaDecoderLayer", type(layer)
    seen: dict[str, Any] = {}

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        seen["input"] = args[0] if args else kwargs["hidden_states"]
        seen["output"] = output[0] if isinstance(output, tuple) else output

    handle = layer.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(inputs_embeds=hidden)
    finally:
        handle.remove()
    assert torch.equal(seen["input"], hidden), "layer 0 did not get the given hidden states"
    return seen["output"]


def test_torch_distributed_tp_layer_matches_transformers(tmp_path):
    from functional_load.testing.forward import write_unit_scale_checkpoint

    # fp32 llama, 2 KV heads: at tp 4 each KV head is replicated on 2 ranks
    path = write_unit_scale_checkpoint("llama", tmp_path / "ckpt", dtype="float32", kv_heads=2)
    port = free_port()
    env = child_env(None, OMP_NUM_THREADS="2")
    procs = []
    for rank in range(WORLD):
        out = tmp_path / f"rank{rank}.json"
        calls = {"w": ("torch_layer_worker", {"rank": rank, "port": port, "path": str(path), "out_dir": str(tmp_path)})}
        procs.append((spawn(HERE, calls, out, env), out))
    failures = []
    for rank, (proc, out) in enumerate(procs):
        try:
            got = finish(proc, out, timeout=120)["w"]
        except AssertionError as e:
            failures.append(f"rank {rank}: {e}")
            continue
        if not got["ok"]:
            failures.append(f"rank {rank}:\n{got['error']}")
        else:
            assert got["result"]["shapes"]["model.layers.0.self_attn.qkv_proj.weight"] == [(2 + 2 * 1) * 8, 64]
    assert not failures, "\n\n".join(failures)
    reference = np.load(tmp_path / "reference.npy")
    for rank in range(WORLD):
        np.testing.assert_allclose(np.load(tmp_path / f"rank{rank}.npy"), reference, **LAYER_TOL, err_msg=f"rank {rank}")
