"""``load_jax`` on real multi-device meshes.

* 8 CPU devices, mesh ``("dp", "tp")`` of shape ``(8 // tp, tp)`` for tp 2, 4, 8: every array
  has the expected ``NamedSharding`` (``PartitionSpec`` naming ``tp`` on the sharded dimension,
  ``P()`` for replicated ones), the expected global shape and dtype, and every addressable shard
  is the torch rank tensor of ``functional_load.load`` at that shard's tp coordinate, bit for bit.
* Two ``jax.distributed`` processes on loopback with 4 CPU devices each (one global mesh of 8):
  each process reads only the ranks its devices hold (counted by its ``Reader``), its
  shards are the torch rank tensors, and a cross-process tensor-parallel forward over the arrays
  matches transformers.

JAX fixes its device count when its backend starts, usually before these tests run, so the
checks run in child processes that set ``XLA_FLAGS=--xla_force_host_platform_device_count``
first (``_subprocess_runner.py``), unless this process already has 8 devices. The check
functions below run in the child; the tests only collect their results.
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
CHECKPOINTS = {  # id -> (arch, write_checkpoint options); bf16, several shards each
    "llama-gqa2": ("llama", {"kv_heads": 2}),  # KV heads replicated at tp 4 and 8
    "llama-mha-tied": ("llama", {"kv_heads": 8, "tie_word_embeddings": True}),
    "qwen2-gqa2": ("qwen2", {"kv_heads": 2}),  # qkv bias
    "qwen3-gqa2": ("qwen3", {"kv_heads": 2}),  # q/k norms
    "qwen3_moe-gqa2": ("qwen3_moe", {"kv_heads": 2}),  # w13 / w2 experts
}


def expected_dim(name: str) -> int | None:
    """The dimension along which tp ranks hold different blocks, from vLLM's layer types
    (written out here, independently of the descriptors' ``tp_dim``)."""
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight")):
        return 0  # column-parallel
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0  # vocab-parallel
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1  # row-parallel
    if name.endswith("experts.routed_experts.w13_weight"):
        return 1  # [E, 2I/tp, H]
    if name.endswith("experts.routed_experts.w2_weight"):
        return 2  # [E, H, I/tp]
    return None  # norms, router, q/k norms: replicated


def _bits(array: Any) -> np.ndarray:
    a = np.ascontiguousarray(array)
    return a.reshape(-1).view(np.uint8)


def _torch_bits(tensor: Any) -> np.ndarray:
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def _span(s: slice, size: int) -> tuple[int, int]:
    start, stop, step = s.indices(size)
    assert step == 1
    return start, stop


def check_shards(arrays: dict[str, Any], states: dict[int, dict[str, Any]], mesh: Any, tp: int) -> int:
    """Every addressable shard of every array is its rank's torch tensor, bit for bit, at the
    rank-major position; shardings, global shapes and dtypes are as vLLM's layout says.
    ``states`` holds (at least) the ranks of this process's devices. Returns shards checked."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    some = states[min(states)]
    assert sorted(arrays) == sorted(some), (sorted(set(arrays) ^ set(some)))
    tp_index = mesh.axis_names.index("tp")
    checked = 0
    for name, array in arrays.items():
        dim = expected_dim(name)
        local = tuple(some[name].shape)
        want_spec = P() if dim is None else P(*([None] * dim), "tp")
        assert isinstance(array.sharding, NamedSharding), f"{name}: {array.sharding}"
        assert array.sharding.mesh == mesh, name
        assert array.sharding.spec == want_spec, f"{name}: spec {array.sharding.spec}, expected {want_spec}"
        want_shape = local if dim is None else local[:dim] + (local[dim] * tp,) + local[dim + 1 :]
        assert array.shape == want_shape, f"{name}: global shape {array.shape}, expected {want_shape}"
        assert str(array.dtype) == str(some[name].dtype).removeprefix("torch."), f"{name}: {array.dtype}"
        assert len(array.addressable_shards) == len(mesh.local_devices), name
        for shard in array.addressable_shards:
            rank = int(np.argwhere(mesh.devices == shard.device)[0][tp_index])
            tensor = states[rank][name]
            span = [_span(s, n) for s, n in zip(shard.index, array.shape)]
            want = [(0, n) for n in array.shape]
            if dim is not None:
                want[dim] = (rank * local[dim], (rank + 1) * local[dim])
            assert span == want, f"{name} on {shard.device} (rank {rank}): index {span}, expected {want}"
            data = np.asarray(shard.data)
            assert data.shape == tuple(tensor.shape), f"{name} rank {rank}: {data.shape} vs {tuple(tensor.shape)}"
            assert np.array_equal(_bits(data), _torch_bits(tensor)), f"{name} rank {rank}: shard differs from the torch rank tensor"
            checked += 1
    return checked


# -------------------------------------------------------------------------------------------
# Child-process checks (8 devices)


def check_sharding(path: str, tp: int) -> int:
    import jax
    from jax.sharding import Mesh

    import functional_load as fl

    devices = jax.devices()
    assert len(devices) >= 8, f"need 8 devices, have {len(devices)}"
    mesh = Mesh(np.array(devices[:8]).reshape(8 // tp, tp), ("dp", "tp"))
    arrays = fl.load_jax(path, mesh)
    states = {r: fl.load(path, tp_size=tp, rank=r, progress=False) for r in range(tp)}
    checked = check_shards(arrays, states, mesh, tp)
    assert checked == 8 * len(arrays)
    for alias, target in states[0].plan.aliases.items():
        assert arrays[alias] is arrays[target], f"tied {alias} is not the same array as {target}"
    return checked


@pytest.fixture(scope="module")
def sharding(tiny_checkpoint):
    calls = {}
    for cid, (arch, options) in CHECKPOINTS.items():
        path = str(tiny_checkpoint(arch, **options))
        for tp in TPS:
            calls[f"{cid}-tp{tp}"] = ("check_sharding", {"path": path, "tp": tp})
    return Cases(HERE, globals(), calls, devices=8, timeout=180)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_load_jax_shards_are_the_torch_ranks(sharding, checkpoint, tp):
    checked = sharding.check(f"{checkpoint}-tp{tp}")
    assert checked > 0


# -------------------------------------------------------------------------------------------
# Online quantization: every device holds its own rank's weights and scales


def check_quantized(path: str, tp: int, quantization: str) -> int:
    """``load_jax(quantization=...)`` equals ``load(quantization=..., rank=r)`` device by device:
    each device's shard is exactly its tensor-parallel rank's tensor (a per-tensor scale computed
    from the rank's slice of its weight differs per rank, so it is one entry per rank, never
    rank 0's scale replicated), whatever the array's placement."""
    import jax
    from jax.sharding import Mesh

    import functional_load as fl

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8 // tp, tp), ("dp", "tp"))
    arrays = fl.load_jax(path, mesh, quantization=quantization)
    states = {r: fl.load(path, tp_size=tp, rank=r, quantization=quantization, progress=False) for r in range(tp)}
    assert sorted(arrays) == sorted(states[0])
    tp_index, checked = mesh.axis_names.index("tp"), 0
    for name, array in arrays.items():
        for shard in array.addressable_shards:
            tensor = states[int(np.argwhere(mesh.devices == shard.device)[0][tp_index])][name]
            data = np.asarray(shard.data)
            if data.shape == (1, *tensor.shape) and array.shape == (tp, *tensor.shape):
                data = data[0]  # one entry per rank
            assert data.shape == tuple(tensor.shape), f"{name} on {shard.device}: {data.shape} vs {tuple(tensor.shape)}"
            assert np.array_equal(_bits(data), _torch_bits(tensor)), f"{name} on {shard.device}: not its rank's tensor"
            checked += 1
    scales = [n for n in arrays if "qkv_proj.weight_scale" in n]
    assert scales and all(arrays[n].shape[0] == tp for n in scales if quantization == "fp8"), scales
    return checked


def check_quantized_moe_refused(path: str, quantization: str) -> str:
    import jax
    from jax.sharding import Mesh

    import functional_load as fl

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("dp", "tp"))
    with pytest.raises(fl.LoadError) as torch_side:
        fl.load(path, tp_size=2, rank=1, quantization=quantization, progress=False)
    with pytest.raises(fl.LoadError) as jax_side:
        fl.load_jax(path, mesh, quantization=quantization)
    assert str(jax_side.value) == str(torch_side.value)
    return str(jax_side.value)


QUANTIZED = [(q, tp) for q in ("fp8", "fp8_block") for tp in (2, 4)]


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint):
    dense = str(tiny_checkpoint("llama", kv_heads=2, hidden_size=256, intermediate_size=512))
    moe = str(tiny_checkpoint("qwen3_moe", kv_heads=2))
    calls = {f"{q}-tp{tp}": ("check_quantized", {"path": dense, "tp": tp, "quantization": q}) for q, tp in QUANTIZED}
    calls.update({f"moe-{q}": ("check_quantized_moe_refused", {"path": moe, "quantization": q}) for q in ("fp8", "fp8_block")})
    return Cases(HERE, globals(), calls, devices=8, timeout=300)


@pytest.mark.parametrize(("quantization", "tp"), QUANTIZED)
def test_load_jax_quantized_equals_load_device_by_device(quantized, quantization, tp):
    assert quantized.check(f"{quantization}-tp{tp}") > 0


@pytest.mark.parametrize("quantization", ["fp8", "fp8_block"])
def test_load_jax_refuses_quantizing_experts_as_load_does(quantized, quantization):
    assert "quantizing MoE experts while loading" in quantized.check(f"moe-{quantization}")


# -------------------------------------------------------------------------------------------
# Two jax.distributed processes


LAYOUTS = {  # name -> (dp, tp); devices of process 0 are jax.devices()[:4]
    "tp8": (1, 8),  # process 0 holds tp ranks 0-3, process 1 ranks 4-7
    "dp2xtp4": (2, 4),  # each process holds 2 tp ranks, each on 2 dp replicas
}


def _layout_mesh(devices: list[Any], dp: int, tp: int) -> Any:
    """Process p's 4 devices cover tp ranks [p*tp/2, (p+1)*tp/2) on every dp row, so a process
    holds half the tp ranks whatever dp is."""
    from jax.sharding import Mesh

    by_process = [[d for d in devices if d.process_index == p] for p in (0, 1)]
    half = tp // 2
    grid = np.empty((dp, tp), dtype=object)
    for p in (0, 1):
        mine = np.array(by_process[p], dtype=object).reshape(dp, half)
        grid[:, p * half : (p + 1) * half] = mine
    return Mesh(grid, ("dp", "tp"))


def _param_bytes(plan: Any, name: str) -> int:
    """Bytes ``plan`` reads for parameter ``name`` (its copies and checks)."""
    p = plan.param(name)
    return sum(plan.copy_bytes(c) for c in p.copies + p.checks)


def distributed_worker(process_id: int, port: int, path: str, logits_dir: str) -> dict[str, Any]:
    import jax

    # CPU cross-process collectives (needed by the forward's psum/all_gather) go through gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=60
    )
    try:
        import functional_load as fl
        from functional_load.io import Reader, ReadOptions
        from functional_load.testing.forward import jax_tp_forward

        assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
        config = json.loads((Path(path) / "config.json").read_text())
        ids = np.random.default_rng(0).integers(0, config["vocab_size"], (2, 7))
        out: dict[str, Any] = {}
        for name, (dp, tp) in LAYOUTS.items():
            mesh = _layout_mesh(jax.devices(), dp, tp)
            tp_index = mesh.axis_names.index("tp")
            ranks = sorted({int(np.argwhere(mesh.devices == d)[0][tp_index]) for d in mesh.local_devices})
            with Reader(ReadOptions(strategy="pread")) as reader:
                arrays = fl.load_jax(path, mesh, reader=reader)
                bytes_read = reader.bytes_read
            plans = {r: fl.plan(path, tp_size=tp, rank=r) for r in ranks}
            # load_jax reads a sharded parameter once per tp rank this process holds, and a
            # replicated one once per process (all its devices get the same block).
            first = plans[ranks[0]]
            replicated = sum(_param_bytes(first, p.spec.name) for p in first.params if expected_dim(p.spec.name) is None)
            sharded = sum(_param_bytes(plans[r], p.spec.name) for p in first.params if expected_dim(p.spec.name) is not None for r in ranks)
            states = {r: fl.load(path, tp_size=tp, rank=r, progress=False) for r in ranks}
            checked = check_shards(arrays, states, mesh, tp)

            logits = jax_tp_forward(arrays, config, mesh, ids)
            local = np.asarray(logits.addressable_data(0))
            np.save(Path(logits_dir) / f"{name}-p{process_id}.npy", local)
            out[name] = {
                "ranks": ranks,
                "bytes_read": bytes_read,
                "expected": sharded + replicated,
                "plan_sum": sum(plans[r].bytes_to_read for r in ranks),
                "replicated": replicated,
                "shards_checked": checked,
                "ids": ids.tolist(),
            }
        return out
    finally:
        jax.distributed.shutdown()


def test_two_process_jax_distributed_reads_half(tmp_path):
    from functional_load.dtypes import itemsize
    from functional_load.testing.checkpoints import list_tensors
    from functional_load.testing.forward import write_unit_scale_checkpoint

    # bf16 llama with 2 KV heads (replicated over ranks at tp 4 and 8), weights scaled so the
    # logits comparison is sensitive to every block (see write_unit_scale_checkpoint)
    path = write_unit_scale_checkpoint("llama", tmp_path / "ckpt", dtype="bfloat16", kv_heads=2)
    total = sum(int(np.prod(shape)) * itemsize(dtype) for shape, dtype in list_tensors(path).values())
    port = free_port()
    procs, outs = [], []
    for pid in (0, 1):
        out = tmp_path / f"p{pid}.json"
        calls = {"w": ("distributed_worker", {"process_id": pid, "port": port, "path": str(path), "logits_dir": str(tmp_path)})}
        procs.append(spawn(HERE, calls, out, child_env(4)))
        outs.append(out)
    results = []
    failures = []
    for proc, out in zip(procs, outs):
        try:
            got = finish(proc, out, timeout=150)["w"]
        except AssertionError as e:
            failures.append(str(e))
            continue
        if not got["ok"]:
            failures.append(got["error"])
        results.append(got["result"])
    assert not failures, "\n\n".join(failures)

    reference = _transformers_logits(path, np.array(results[0]["tp8"]["ids"]))
    for name, (_dp, tp) in LAYOUTS.items():
        r0, r1 = results[0][name], results[1][name]
        assert sorted(r0["ranks"] + r1["ranks"]) == list(range(tp)), (name, r0["ranks"], r1["ranks"])
        for pid, r in enumerate((r0, r1)):
            what = f"{name} process {pid} (tp ranks {r['ranks']})"
            assert r["shards_checked"] > 0
            assert r["bytes_read"] == r["expected"], f"{what}: read {r['bytes_read']} bytes, planned {r['expected']}"
            # The per-rank plans' sum counts replicated parameters once per rank; load_jax reads
            # them once per process.
            assert r["plan_sum"] - r["expected"] == (len(r["ranks"]) - 1) * r["replicated"], what
            assert r["bytes_read"] < 0.6 * total, f"{what}: read {r['bytes_read']} of {total} checkpoint bytes"
            logits = np.load(tmp_path / f"{name}-p{pid}.npy")
            # fp32 compute on both sides from the same bf16 weights; see test_forward_equivalence
            np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max(), err_msg=what)


def _transformers_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()
