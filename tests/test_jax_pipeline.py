"""Pipeline stages and data-parallel replicas in JAX.

* A target tree (MaxText's scanned layers, the shipped ``maxtext.llama3.1`` map, and a
  layers-first tree of ``fl.Rule``s) whose stacked layer dimension is sharded over a ``stage``
  mesh axis: on 8 CPU devices (stage 2 x tp 4) every leaf equals the unsharded load and the
  checkpoint tensors rearranged with numpy/einops; in a ``jax.distributed`` job of 2 processes
  (4 CPU devices each, one stage per process) the ``preadv`` calls of each process, mapped to
  tensors through the safetensors headers, cover every byte of its stage's layers once and no
  byte of the other stage's, and its shards are the expected slices.
* vLLM's layout with ``pp_axis``/``dp_axis``: each stage's arrays live on that stage's
  sub-mesh and every device's shard is the torch rank tensor ``fl.load`` gives its worker
  ``(pp_rank, dp_rank, tp_rank)``; fused MoE experts run over ``("dp", "tp")``. In the
  2-process job each process loads its own stage only and reads no byte of the other's layers.

Multi-device checks run in child processes (``_subprocess_runner.py``).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if str(Path(__file__).resolve().parent) not in sys.path:  # --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _subprocess_runner import Cases, distributed

HERE = str(Path(__file__).resolve())
LAYERS = 4  # two per stage


def _sds(shape: tuple[int, ...], dtype: Any, mesh: Any, *spec: Any) -> Any:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))


def checkpoint_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint as float32, read with the safetensors library."""
    from safetensors import safe_open

    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name).float().numpy()
    return out


def header_spans(path: str) -> dict[tuple[int, int], list[tuple[int, int, str]]]:
    """Per file identity (device, inode): each tensor's ``(start, end, name)`` byte span, from the
    safetensors headers parsed here (8-byte length, JSON, data)."""
    spans: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        raw = file.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        st = os.stat(file)
        spans[(st.st_dev, st.st_ino)] = [
            (8 + n + entry["data_offsets"][0], 8 + n + entry["data_offsets"][1], name)
            for name, entry in header.items() if name != "__metadata__"
        ]
    return spans


class PreadvLog:
    """Wraps ``os.preadv`` in this process and records every data read (file, offset, bytes
    returned); the one-byte page-cache probes (a flags argument) are not data reads."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, int], int, int]] = []
        self.real = os.preadv

        def preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
            got = self.real(fd, buffers, offset, *args)
            if not args:
                st = os.fstat(fd)
                self.calls.append(((st.st_dev, st.st_ino), offset, got))
            return got

        os.preadv = preadv  # type: ignore[assignment]

    def close(self) -> None:
        os.preadv = self.real  # type: ignore[assignment]

    def per_tensor(self, path: str) -> dict[str, list[int]]:
        """``{tensor: [bytes read once, bytes read more than once, bytes not read, bytes read in all]}``;
        the key ``""`` counts bytes read outside every tensor."""
        spans = header_spans(path)
        counts = {fid: np.zeros(max(e for _, e, _ in s), dtype=np.int64) for fid, s in spans.items()}
        for fid, offset, got in self.calls:
            assert fid in counts, "a preadv on a file that is not a checkpoint shard"
            counts[fid][offset : offset + got] += 1
        out: dict[str, list[int]] = {"": [0, 0, 0, 0]}
        for fid, entries in spans.items():
            covered = np.zeros(len(counts[fid]), dtype=bool)
            for start, end, name in entries:
                c = counts[fid][start:end]
                out[name] = [int((c == 1).sum()), int((c > 1).sum()), int((c == 0).sum()), int(c.sum())]
                covered[start:end] = True
            out[""][3] += int(counts[fid][~covered].sum())
        return out


# -------------------------------------------------------------------------------------------
# Target trees: stacked layers sharded over a stage axis


def maxtext_tree(config: dict[str, Any], mesh: Any, staged: bool) -> dict[str, Any]:
    """MaxText's scanned llama tree (layers on axis 1), the layer axis over ``stage`` and heads,
    MLP and vocabulary over ``tp``; ``staged=False``: every leaf unsharded."""
    import jax.numpy as jnp

    D, N, K, H = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    F, V, L = config["intermediate_size"], config["vocab_size"], config["num_hidden_layers"]
    f32 = jnp.float32

    def leaf(shape: tuple[int, ...], *spec: Any) -> Any:
        return _sds(shape, f32, mesh, *(spec if staged else ()))

    def kernel(shape: tuple[int, ...], *spec: Any) -> dict[str, Any]:
        return {"kernel": leaf(shape, *spec)}

    layers = {
        "self_attention": {
            "query": kernel((D, L, N, H), None, "stage", "tp", None),
            "key": kernel((D, L, K, H), "tp", "stage", None, None),  # 2 KV heads: D over tp
            "value": kernel((D, L, K, H), "tp", "stage", None, None),
            "out": kernel((N, L, H, D), "tp", "stage", None, None),
        },
        "mlp": {
            "wi_0": kernel((D, L, F), None, "stage", "tp"),
            "wi_1": kernel((D, L, F), None, "stage", "tp"),
            "wo": kernel((F, L, D), "tp", "stage", None),
        },
        "pre_self_attention_layer_norm": {"scale": leaf((D, L), None, "stage")},
        "post_self_attention_layer_norm": {"scale": leaf((D, L), None, "stage")},
    }
    decoder = {"layers": layers, "decoder_norm": {"scale": leaf((D,))}, "logits_dense": kernel((D, V), None, "tp")}
    return {"params": {"decoder": decoder, "token_embedder": {"embedding": leaf((V, D), "tp", None)}}}


def maxtext_expected(config: dict[str, Any], t: dict[str, np.ndarray]) -> dict[str, Any]:
    """The maxtext.llama3.1 map's scanned leaves, computed with einops over whole tensors: q scaled
    by head_dim ** -0.5, q and k from rotary halves to interleaved pairs."""
    import einops

    N, K, H, L = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"], config["num_hidden_layers"]

    def stack(name: str) -> np.ndarray:
        return np.stack([t[f"model.layers.{layer}.{name}"] for layer in range(L)])

    pairs = "d l n (two x) -> d l n (x two)"
    q = einops.rearrange(einops.rearrange(stack("self_attn.q_proj.weight"), "l (n h) d -> d l n h", n=N), pairs, two=2)
    k = einops.rearrange(einops.rearrange(stack("self_attn.k_proj.weight"), "l (n h) d -> d l n h", n=K), pairs, two=2)
    layers = {
        "self_attention": {
            "query": {"kernel": q * np.float32(H**-0.5)},
            "key": {"kernel": k},
            "value": {"kernel": einops.rearrange(stack("self_attn.v_proj.weight"), "l (n h) d -> d l n h", n=K)},
            "out": {"kernel": einops.rearrange(stack("self_attn.o_proj.weight"), "l d (n h) -> n l h d", n=N)},
        },
        "mlp": {
            "wi_0": {"kernel": einops.rearrange(stack("mlp.gate_proj.weight"), "l f d -> d l f")},
            "wi_1": {"kernel": einops.rearrange(stack("mlp.up_proj.weight"), "l f d -> d l f")},
            "wo": {"kernel": einops.rearrange(stack("mlp.down_proj.weight"), "l d f -> f l d")},
        },
        "pre_self_attention_layer_norm": {"scale": stack("input_layernorm.weight").T},
        "post_self_attention_layer_norm": {"scale": stack("post_attention_layernorm.weight").T},
    }
    decoder = {"layers": layers, "decoder_norm": {"scale": t["model.norm.weight"]}, "logits_dense": {"kernel": t["lm_head.weight"].T}}
    return {"params": {"decoder": decoder, "token_embedder": {"embedding": t["model.embed_tokens.weight"]}}}


def layers_first(config: dict[str, Any], mesh: Any, staged: bool) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """A tree of ``[layers, ...]`` leaves with ``P("stage", ...)``, its rules, and its expected values (given the tensors)."""
    import jax.numpy as jnp

    import functional_load as fl

    D, N, H, F, L = (config[k] for k in ("hidden_size", "num_attention_heads", "head_dim", "intermediate_size", "num_hidden_layers"))

    def leaf(shape: tuple[int, ...], *spec: Any) -> Any:
        return _sds(shape, jnp.float32, mesh, *(spec if staged else ()))

    tree = {"gate": leaf((L, D, F), "stage", None, "tp"), "q": leaf((L, D, N, H), "stage", None, "tp", None), "norm": leaf((L, D), "stage")}
    a = "model.layers.{layer}."
    rules = {
        "gate": fl.Rule(a + "mlp.gate_proj.weight", "layer f d -> layer d f"),
        "q": fl.Rule(a + "self_attn.q_proj.weight", "layer (n h) d -> layer d n h", n=N),
        "norm": fl.Rule(a + "input_layernorm.weight", "layer d -> layer d"),
    }
    drop = fl.model.targetmap.Drop(r"^(?!model\.layers\.\d+\.(mlp\.gate_proj|self_attn\.q_proj|input_layernorm)\.)", "not in this tree")
    return tree, fl.TargetMap(rules, drops=(drop,)), {"L": L, "N": N}


def layers_first_expected(t: dict[str, np.ndarray], L: int, N: int) -> dict[str, np.ndarray]:
    def stack(name: str) -> np.ndarray:
        return np.stack([t[f"model.layers.{layer}.{name}"] for layer in range(L)])

    q = stack("self_attn.q_proj.weight")
    return {
        "gate": stack("mlp.gate_proj.weight").transpose(0, 2, 1),
        "q": q.reshape(L, N, -1, q.shape[-1]).transpose(0, 3, 1, 2),
        "norm": stack("input_layernorm.weight"),
    }


def shards_equal(got: Any, want: Any, target: Any) -> int:
    """Every addressable shard of every leaf of ``got`` is the matching slice of ``want`` (numpy,
    whole), with the target's shape, dtype and sharding. Returns the shards compared."""
    import jax

    got_flat = jax.tree_util.tree_flatten_with_path(got)[0]
    want_flat, target_flat = jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(target)
    assert len(got_flat) == len(want_flat) == len(target_flat)
    checked = 0
    for (path, array), expected, leaf in zip(got_flat, want_flat, target_flat):
        name = jax.tree_util.keystr(path)
        assert array.shape == leaf.shape and array.dtype == leaf.dtype, (name, array.shape, leaf)
        assert array.sharding.spec == leaf.sharding.spec, (name, array.sharding.spec, leaf.sharding.spec)
        whole = np.asarray(expected, dtype=np.float32).astype(leaf.dtype)
        assert whole.shape == array.shape, (name, whole.shape, array.shape)
        for shard in array.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), whole[shard.index]), f"{name}: shard {shard.index} differs"
            checked += 1
    return checked


def check_stage_target(path: str, form: str) -> dict[str, int]:
    """8 devices, (stage 2 x tp 4): the staged load equals the unsharded load and the numpy reference."""
    import jax
    from jax.sharding import Mesh

    import functional_load as fl

    config = json.loads((Path(path) / "config.json").read_text())
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("stage", "tp"))
    tensors = checkpoint_tensors(path)
    if form == "maxtext":
        staged, whole, mapping = maxtext_tree(config, mesh, True), maxtext_tree(config, mesh, False), "maxtext.llama3.1"
        want = maxtext_expected(config, tensors)
    else:
        staged, mapping, dims = layers_first(config, mesh, True)
        whole = layers_first(config, mesh, False)[0]
        want = layers_first_expected(tensors, **dims)
    got = fl.load_jax(path, target=staged, mapping=mapping)
    full = fl.load_jax(path, target=whole, mapping=mapping)
    staged_leaves = jax.tree_util.tree_leaves(staged)
    assert any("stage" in leaf.sharding.spec for leaf in staged_leaves)
    vs_full = shards_equal(got, jax.tree_util.tree_map(np.asarray, full), staged)
    vs_numpy = shards_equal(got, want, staged)
    return {"vs_full": vs_full, "vs_numpy": vs_numpy, "leaves": len(staged_leaves)}


# -------------------------------------------------------------------------------------------
# vLLM's layout: pp_axis and dp_axis


def is_expert(name: str) -> bool:
    """Fused MoE expert parameters, split or spread over vLLM's dp x tp ranks (by name, here)."""
    return ".experts." in name


def check_worker_shards(arrays: dict[str, Any], mesh: Any, states: dict[tuple[int, int], Any]) -> int:
    """Every addressable shard of ``arrays`` (over ``mesh``, axes ``tp`` and maybe ``dp``) is the
    torch tensor of its worker ``states[(dp_rank, tp_rank)]``, bit for bit, at the rank-major
    position: tp rank for most parameters, ``dp_rank * tp + tp_rank`` for experts. Returns shards checked."""
    import torch
    from jax.sharding import PartitionSpec as P

    from functional_load.layout.placement import Along, PerRank

    names = mesh.axis_names
    tp = mesh.shape["tp"]
    some = states[min(states)]
    plan = some.plan
    assert sorted(arrays) == sorted(some), sorted(set(arrays) ^ set(some))
    checked = 0
    for name, array in arrays.items():
        assert array.sharding.mesh == mesh, name
        placement = plan.param(plan.aliases.get(name, name)).spec.placement(plan.parallel)
        over = ("dp", "tp") if is_expert(name) and "dp" in names else ("tp",)
        entry = over if len(over) > 1 else over[0]
        if isinstance(placement, Along):
            assert array.sharding.spec == P(*([None] * placement.dim), entry), (name, array.sharding.spec)
        elif isinstance(placement, PerRank):
            assert array.sharding.spec == P(entry), (name, array.sharding.spec)
        else:
            assert array.sharding.spec == P(), (name, array.sharding.spec)
        for shard in array.addressable_shards:
            where = np.argwhere(mesh.devices == shard.device)[0]
            dp = int(where[names.index("dp")]) if "dp" in names else 0
            t = int(where[names.index("tp")])
            tensor = states[(dp, t)][name]
            index = dp * tp + t if len(over) > 1 else t
            data = np.ascontiguousarray(np.asarray(shard.data))
            if isinstance(placement, PerRank):
                assert shard.index[0] == slice(index, index + 1), (name, shard.index)
                data = data[0]
            elif isinstance(placement, Along):
                n = tensor.shape[placement.dim]
                assert shard.index[placement.dim].indices(array.shape[placement.dim])[:2] == (index * n, (index + 1) * n), (name, index)
            want = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            assert data.shape == tuple(tensor.shape), (name, data.shape, tuple(tensor.shape))
            assert np.array_equal(data.reshape(-1).view(np.uint8), want), f"{name} on worker (dp {dp}, tp {t}): not its rank's tensor"
            checked += 1
    return checked


def check_vllm_stages(path: str, dp: int, tp: int) -> dict[str, Any]:
    """Mesh (pp 2 x [dp] x tp) over 8 devices: one dict per stage, each on its sub-mesh, each
    device's shard its worker's torch tensor."""
    import jax
    from jax.sharding import Mesh

    import functional_load as fl

    names = ("pp", "dp", "tp") if dp > 1 else ("pp", "tp")
    shape = (2, dp, tp) if dp > 1 else (2, tp)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names)
    extra = {"dp_axis": "dp"} if dp > 1 else {}
    out = fl.load_jax(path, mesh, pp_axis="pp", progress=False, **extra)
    assert sorted(out) == [0, 1], sorted(out)
    checked, sizes = 0, {}
    for s in (0, 1):
        sub = Mesh(mesh.devices[s], names[1:])
        states = {(d, t): fl.load(path, tp_size=tp, rank=t, pp_size=2, pp_rank=s, dp_size=dp, dp_rank=d, progress=False)
                  for d in range(dp) for t in range(tp)}
        checked += check_worker_shards(out[s], sub, states)
        sizes[s] = len(out[s])
    return {"checked": checked, "params": sizes}


def check_vllm_dp(path: str, dp: int, tp: int, expert_parallel: bool) -> int:
    """Mesh (dp x tp): experts over ("dp", "tp"), everything else over tp and replicated over dp."""
    import jax
    from jax.sharding import Mesh

    import functional_load as fl

    mesh = Mesh(np.array(jax.devices()[: dp * tp]).reshape(dp, tp), ("dp", "tp"))
    arrays = fl.load_jax(path, mesh, dp_axis="dp", expert_parallel=expert_parallel, progress=False)
    states = {(d, t): fl.load(path, tp_size=tp, rank=t, dp_size=dp, dp_rank=d, expert_parallel=expert_parallel, progress=False)
              for d in range(dp) for t in range(tp)}
    config = json.loads((Path(path) / "config.json").read_text())
    assert any(is_expert(n) for n in arrays) == ("num_experts" in config or "num_local_experts" in config)
    return check_worker_shards(arrays, mesh, states)


@pytest.fixture(scope="module")
def cases(tiny_checkpoint):
    def make(arch: str, **options: Any) -> str:
        return str(tiny_checkpoint(arch, kv_heads=2, num_layers=LAYERS, **options))

    llama, moe = make("llama"), make("qwen3_moe")
    calls = {
        "target-maxtext": ("check_stage_target", {"path": llama, "form": "maxtext"}),
        "target-layers-first": ("check_stage_target", {"path": llama, "form": "layers-first"}),
        "vllm-pp2-tp4": ("check_vllm_stages", {"path": llama, "dp": 1, "tp": 4}),
        "vllm-pp2-tp4-tied": ("check_vllm_stages", {"path": make("llama", tie_word_embeddings=True), "dp": 1, "tp": 4}),
        "vllm-pp2-dp2-tp2-moe": ("check_vllm_stages", {"path": moe, "dp": 2, "tp": 2}),
        "vllm-dp2-tp2-moe": ("check_vllm_dp", {"path": moe, "dp": 2, "tp": 2, "expert_parallel": False}),
        "vllm-dp4-tp1-moe-ep": ("check_vllm_dp", {"path": moe, "dp": 4, "tp": 1, "expert_parallel": True}),
        "vllm-dp4-tp2-llama": ("check_vllm_dp", {"path": llama, "dp": 4, "tp": 2, "expert_parallel": False}),
    }
    return Cases(HERE, globals(), calls, devices=8, timeout=300)


@pytest.mark.parametrize("form", ["maxtext", "layers-first"])
def test_stacked_layers_sharded_over_a_stage_axis(cases, form):
    got = cases.check(f"target-{form}")
    assert got["vs_full"] == got["vs_numpy"] == 8 * got["leaves"], got  # every shard of every leaf on 8 devices


@pytest.mark.parametrize("case", ["vllm-pp2-tp4", "vllm-pp2-tp4-tied", "vllm-pp2-dp2-tp2-moe"])
def test_vllm_layout_one_dict_per_stage(cases, case):
    got = cases.check(case)
    assert got["checked"] > 0 and {str(s) for s in got["params"]} == {"0", "1"}, got


@pytest.mark.parametrize("case", ["vllm-dp2-tp2-moe", "vllm-dp4-tp1-moe-ep", "vllm-dp4-tp2-llama"])
def test_vllm_layout_data_parallel_axis(cases, case):
    assert cases.check(case) > 0


def test_stages_and_replicas_are_mesh_axes_not_options(tmp_path):
    """The options that pick one stage or replica are refused where a mesh axis says them, with the fix."""
    import jax
    from jax.sharding import Mesh

    import functional_load as fl
    from functional_load.testing.checkpoints import write_checkpoint

    path = write_checkpoint("llama", tmp_path / "ckpt", kv_heads=2, num_layers=2)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("pp", "dp", "tp"))
    tree = {"norm": _sds((64,), np.float32, mesh)}
    rules = {"norm": fl.Rule("model.norm.weight", "d -> d")}
    for kwargs, needles in (
        ({"pp_size": 2, "pp_rank": 1}, ("['pp_size', 'pp_rank']", "stacked layer dimension", "shard that dimension over your stage axis")),
        ({"pp_axis": "pp"}, ("['pp_axis'] do not apply", "stacked layer dimension")),
        ({"dp_size": 2}, ("['dp_size']", "replicate or shard them over your data axis")),
        ({"dp_axis": "dp"}, ("['dp_axis'] do not apply", "replicate or shard them over your data axis")),
    ):
        with pytest.raises(fl.ConfigError) as info:
            fl.load_jax(path, target=tree, mapping=rules, **kwargs)
        assert all(n in str(info.value) for n in needles), (kwargs, str(info.value))
    for kwargs, needle in (
        ({"pp_axis": "pp", "pp_size": 2, "pp_rank": 1}, "option(s) ['pp_size', 'pp_rank'] with pp_axis='pp'"),
        ({"dp_axis": "dp", "dp_rank": 0, "dp_size": 2}, "option(s) ['dp_size'] with dp_axis='dp'"),
        ({"pp_axis": "stage"}, "have no pipeline axis 'stage'"),
        ({"pp_axis": "tp"}, "mesh axis ['tp'] is given to more than one"),
        ({"dp_axis": ("dp", "pp"), "pp_axis": "pp"}, "mesh axis ['pp'] is given to more than one"),
        ({"dp_axis": "data"}, "have no data-parallel axis ['data']; pass dp_axis="),
    ):
        with pytest.raises(fl.ConfigError) as info:
            fl.load_jax(path, mesh, **kwargs)
        assert needle in str(info.value), (kwargs, str(info.value))
    # one stage of one: the dict form, on the sub-mesh without the pipeline axis
    staged = fl.load_jax(path, mesh, pp_axis="pp", dp_axis="dp", progress=False)
    plain = fl.load_jax(path, mesh, progress=False)
    assert list(staged) == [0] and sorted(staged[0]) == sorted(plain)
    assert staged[0]["model.norm.weight"].sharding.mesh.axis_names == ("dp", "tp")


# -------------------------------------------------------------------------------------------
# Two jax.distributed processes, one stage each


def _stage_mesh(names: tuple[str, str]) -> Any:
    """(stage 2 x tp 4): row p is process p's 4 devices."""
    import jax
    from jax.sharding import Mesh

    rows = [[d for d in jax.devices() if d.process_index == p] for p in (0, 1)]
    return Mesh(np.array(rows, dtype=object), names)


def distributed_stage_worker(process_id: int, port: int, path: str) -> dict[str, Any]:
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    try:
        from jax.sharding import Mesh

        import functional_load as fl
        from functional_load.io import Reader, ReadOptions

        assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
        config = json.loads((Path(path) / "config.json").read_text())
        out: dict[str, Any] = {}
        mesh = _stage_mesh(("stage", "tp"))
        tree = maxtext_tree(config, mesh, True)
        log = PreadvLog()
        try:
            with Reader(ReadOptions(strategy="pread", prefetch=False)) as reader:
                got = fl.load_jax(path, target=tree, mapping="maxtext.llama3.1", reader=reader)
                out["target"] = {"reader": reader.bytes_read, "tensors": log.per_tensor(path)}
            log.calls.clear()
            with Reader(ReadOptions(strategy="pread", prefetch=False)) as reader:
                stages = fl.load_jax(path, _stage_mesh(("pp", "tp")), pp_axis="pp", reader=reader, progress=False)
                out["vllm"] = {"reader": reader.bytes_read, "tensors": log.per_tensor(path), "stages": sorted(stages)}
        finally:
            log.close()
        out["target"]["shards"] = shards_equal(got, maxtext_expected(config, checkpoint_tensors(path)), tree)
        sub = Mesh(_stage_mesh(("pp", "tp")).devices[process_id], ("tp",))
        states = {(0, t): fl.load(path, tp_size=4, rank=t, pp_size=2, pp_rank=process_id, progress=False) for t in range(4)}
        out["vllm"]["shards"] = check_worker_shards(stages[process_id], sub, states) if list(stages) == [process_id] else 0
        return out
    finally:
        jax.distributed.shutdown()


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def test_two_processes_each_read_only_their_stage(tmp_path):
    from functional_load.testing.checkpoints import write_checkpoint

    path = write_checkpoint("llama", tmp_path / "ckpt", kv_heads=2, num_layers=LAYERS)
    spans = {name: end - start for entries in header_spans(str(path)).values() for start, end, name in entries}
    results = distributed(HERE, "distributed_stage_worker", path, tmp_path, timeout=120)

    layer_bytes = {s: sum(n for name, n in spans.items() if _layer(name) is not None and _layer(name) // 2 == s) for s in (0, 1)}
    outer = sum(n for name, n in spans.items() if _layer(name) is None)
    first_only, last_only = {"model.embed_tokens.weight"}, {"model.norm.weight", "lm_head.weight"}
    for pid, r in enumerate(results):
        # the target tree: every byte of this stage's layers once, none of the other stage's;
        # the outer leaves (sharded over tp only) once per process
        target = r["target"]["tensors"]
        assert target.pop("") == [0, 0, 0, 0], "bytes read outside the tensors"
        for name, (once, more, unread, _) in target.items():
            mine = _layer(name) is None or _layer(name) // 2 == pid
            want = [spans[name], 0, 0] if mine else [0, 0, spans[name]]
            assert [once, more, unread] == want, (pid, name, [once, more, unread], want)
        assert r["target"]["reader"] == layer_bytes[pid] + outer, (pid, r["target"]["reader"], layer_bytes, outer)
        assert r["target"]["shards"] == 4 * 12, r["target"]["shards"]
        # vLLM's layout with pp_axis: this process's stage only, every byte of it, none of the
        # other stage's (its layers; the embedding on the first stage, norm and head on the last)
        vllm = r["vllm"]
        assert vllm["stages"] == [pid] and vllm["shards"] > 0, vllm["stages"]
        assert vllm["tensors"].pop("")[3] == 0, "bytes read outside the tensors"
        expected = 0
        for name, (once, more, unread, total) in vllm["tensors"].items():
            layer = _layer(name)
            mine = (layer // 2 == pid) if layer is not None else name not in (last_only if pid == 0 else first_only)
            # 2 KV heads over 4 tp ranks: vLLM's ranks 0, 1 hold KV head 0 and 2, 3 head 1, so each
            # k/v byte is read by two ranks' qkv_proj; every other byte once
            twice = mine and name.endswith(("k_proj.weight", "v_proj.weight"))
            want = [0, spans[name], 0, 2 * spans[name]] if twice else [spans[name], 0, 0, spans[name]] if mine else [0, 0, spans[name], 0]
            assert [once, more, unread, total] == want, (pid, name, [once, more, unread, total], want)
            expected += want[3]
        assert vllm["reader"] == expected, (pid, vllm["reader"], expected)
