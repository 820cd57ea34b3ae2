"""``load_jax(model, target=tree, mapping=map)``: a JAX stack's own tree, filled from the checkpoint.

The expected value of every leaf is computed independently: the checkpoint read whole with the
safetensors library, rearranged with einops over the whole tensor (and padded, repeated, scaled
with numpy), then compared with the loaded global array bit for bit. Shardings are 2-D (and a
``PartitionSpec`` entry naming two axes), layers and experts are stacked, sources fused and
split; the bytes each process reads are counted and bounded by what its shards hold. Multi-device
checks run in child processes with 8 CPU devices (``_subprocess_runner.py``).
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

from _subprocess_runner import Cases, child_env, distributed

from harness.jaxstacks import replay

HERE = str(Path(__file__).resolve())


def checkpoint_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint, read with the safetensors library (as float32 for floats)."""
    from safetensors import safe_open

    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = t.float().numpy() if t.is_floating_point() else t.numpy()
    return out


def _sds(shape: tuple[int, ...], dtype: Any, mesh: Any, *spec: Any) -> Any:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))


def llama_target(config: dict[str, Any], mesh: Any, dtype: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A tpu-inference-like tree: head-split ``[D, N, Hpad]`` q/k/v (head_dim zero-padded to 16,
    KV heads repeated to the model axis), ``[N, Hpad, D]`` o, ``[in, out]`` MLP, the vocabulary
    sharded over ``("data", "model")`` and one norm kept in float32; with its Python map."""
    import functional_load as fl

    D, N, K = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    F, V, L = config["intermediate_size"], config["vocab_size"], config["num_hidden_layers"]
    model = mesh.shape["model"]
    KR, HP = max(K, model), 16
    tree: dict[str, Any] = {"embed": _sds((V, D), dtype, mesh, ("data", "model"), None), "layers": []}
    for _ in range(L):
        tree["layers"].append({
            "q": _sds((D, N, HP), dtype, mesh, "data", "model", None),
            "k": _sds((D, KR, HP), dtype, mesh, None, "model", None),
            "v": _sds((D, KR, HP), dtype, mesh, None, "model", None),
            "o": _sds((N, HP, D), dtype, mesh, "model", None, "data"),
            "gate": _sds((D, F), dtype, mesh, "data", "model"),
            "up": _sds((D, F), dtype, mesh, "data", "model"),
            "down": _sds((F, D), dtype, mesh, "model", "data"),
            "norm1": _sds((D,), np.float32, mesh),
            "norm2": _sds((D,), dtype, mesh),
        })
    tree["norm"] = _sds((D,), dtype, mesh)
    tree["lm_head"] = _sds((D, V), dtype, mesh, None, ("data", "model"))
    a = "model.layers.{layer}."
    rules = {
        "embed": fl.Rule("model.embed_tokens.weight", "v d -> v d"),
        "layers.{layer}.q": fl.Rule(a + "self_attn.q_proj.weight", "(n h) d -> d n h", n=N, pad=["h"]),
        "layers.{layer}.k": fl.Rule(a + "self_attn.k_proj.weight", "(k h) d -> d k h", k=K, pad=["h"], repeat=["k"]),
        "layers.{layer}.v": fl.Rule(a + "self_attn.v_proj.weight", "(k h) d -> d k h", k=K, pad=["h"], repeat=["k"]),
        "layers.{layer}.o": fl.Rule(a + "self_attn.o_proj.weight", "d (n h) -> n h d", n=N, pad=["h"]),
        "layers.{layer}.gate": fl.Rule(a + "mlp.gate_proj.weight", "f d -> d f"),
        "layers.{layer}.up": fl.Rule(a + "mlp.up_proj.weight", "f d -> d f"),
        "layers.{layer}.down": fl.Rule(a + "mlp.down_proj.weight", "d f -> f d"),
        "layers.{layer}.norm1": fl.Rule(a + "input_layernorm.weight", "d -> d"),
        "layers.{layer}.norm2": fl.Rule(a + "post_attention_layernorm.weight", "d -> d"),
        "norm": fl.Rule("model.norm.weight", "d -> d"),
        "lm_head": fl.Rule("lm_head.weight", "v d -> d v"),
    }
    return tree, rules


def llama_expected(config: dict[str, Any], tensors: dict[str, np.ndarray], model: int) -> dict[str, Any]:
    import einops

    N, K, H = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    pad = ((0, 0), (0, 0), (0, 16 - H))
    out: dict[str, Any] = {"embed": tensors["model.embed_tokens.weight"], "layers": []}
    for layer in range(config["num_hidden_layers"]):
        t = {k.split(f"model.layers.{layer}.", 1)[1]: v for k, v in tensors.items() if k.startswith(f"model.layers.{layer}.")}
        kv = {
            n: np.pad(einops.rearrange(t[f"self_attn.{n}_proj.weight"], "(k h) d -> d k h", k=K).repeat(max(1, model // K), 1), pad)
            for n in "kv"
        }
        out["layers"].append({
            "q": np.pad(einops.rearrange(t["self_attn.q_proj.weight"], "(n h) d -> d n h", n=N), pad),
            "k": kv["k"], "v": kv["v"],
            "o": np.pad(einops.rearrange(t["self_attn.o_proj.weight"], "d (n h) -> n h d", n=N), ((0, 0), (0, 16 - H), (0, 0))),
            "gate": t["mlp.gate_proj.weight"].T, "up": t["mlp.up_proj.weight"].T, "down": t["mlp.down_proj.weight"].T,
            "norm1": t["input_layernorm.weight"], "norm2": t["post_attention_layernorm.weight"],
        })
    out["norm"], out["lm_head"] = tensors["model.norm.weight"], tensors["lm_head.weight"].T
    return out


def assert_tree_equal(got: Any, want: Any, target: Any) -> int:
    """Every leaf of ``got`` has the target's shape, dtype and sharding and equals ``want`` (as
    float32, after the cast to the leaf's dtype) on every addressable shard. Returns leaves checked."""
    import jax

    got_flat = jax.tree_util.tree_flatten_with_path(got)[0]
    want_flat = jax.tree_util.tree_leaves(want)
    target_flat = jax.tree_util.tree_leaves(target)
    assert len(got_flat) == len(want_flat) == len(target_flat)
    for (path, array), expected, leaf in zip(got_flat, want_flat, target_flat):
        name = jax.tree_util.keystr(path)
        assert array.shape == leaf.shape and array.dtype == leaf.dtype, (name, array.shape, array.dtype, leaf)
        assert array.sharding.spec == leaf.sharding.spec, (name, array.sharding.spec, leaf.sharding.spec)
        exact = np.asarray(expected, dtype=np.float32).astype(leaf.dtype)
        for shard in array.addressable_shards:
            data = np.asarray(shard.data)
            want_block = exact[shard.index]
            assert data.shape == want_block.shape, (name, data.shape, want_block.shape)
            same = np.array_equal(data.view(np.uint8), np.ascontiguousarray(want_block).view(np.uint8))
            assert same, f"{name}: shard {shard.index} differs"
    return len(got_flat)


shard_bytes = replay.shard_bytes  # bytes of this process's distinct shards


# -------------------------------------------------------------------------------------------
# Child-process checks (8 devices)


def check_llama(path: str, data: int, model: int, dtype: str) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import functional_load as fl
    from functional_load.io import Reader, ReadOptions

    config = json.loads((Path(path) / "config.json").read_text())
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(data, model), ("data", "model"))
    tree, rules = llama_target(config, mesh, getattr(jnp, dtype))
    with Reader(ReadOptions(strategy="pread")) as reader:
        got = fl.load_jax(path, target=tree, mapping=rules, reader=reader)
        read = reader.bytes_read
    checked = assert_tree_equal(got, llama_expected(config, checkpoint_tensors(path), model), tree)
    return {"checked": checked, "read": read, "held": shard_bytes(got)}


def check_scanned_toml(path: str, map_file: str) -> int:
    """MaxText-like: layers stacked on axis 1, q scaled by head_dim ** -0.5 and its head_dim
    reordered to interleaved rotary pairs, on (fsdp 4 x tensor 2), from a TOML map."""
    import einops
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import functional_load as fl

    config = json.loads((Path(path) / "config.json").read_text())
    D, N, K, H, L = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers"))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
    tree = {
        "decoder": {
            "layers": {
                "query": _sds((D, L, N, H), jnp.float32, mesh, "fsdp", None, "tensor", None),
                "key": _sds((D, L, K, H), jnp.float32, mesh, "fsdp", None, "tensor", None),
                "out": _sds((N, L, H, D), jnp.float32, mesh, "tensor", None, None, "fsdp"),
                "norm": _sds((D, L), jnp.float32, mesh, "fsdp", None),
            }
        },
    }
    got = fl.load_jax(path, target=tree, mapping=map_file)
    t = checkpoint_tensors(path)

    def stack(name: str) -> np.ndarray:
        return np.stack([t[f"model.layers.{layer}.{name}"] for layer in range(L)])

    pairs = "d l n (two x) -> d l n (x two)"
    q = einops.rearrange(einops.rearrange(stack("self_attn.q_proj.weight"), "l (n h) d -> d l n h", n=N), pairs, two=2)
    k = einops.rearrange(einops.rearrange(stack("self_attn.k_proj.weight"), "l (n h) d -> d l n h", n=N // (N // K)), pairs, two=2)
    want = {
        "decoder": {
            "layers": {
                "query": (q * np.float32(H**-0.5)),
                "key": k,
                "out": einops.rearrange(stack("self_attn.o_proj.weight"), "l d (n h) -> n l h d", n=N),
                "norm": stack("input_layernorm.weight").T,
            }
        }
    }
    return assert_tree_equal(got, want, tree)


def check_experts(path: str) -> int:
    """Qwen3-MoE experts stacked ``[L, E, D, F]`` over (expert 2 x model 4), gate and up fused
    into one ``[L, E, D, 2, F]`` leaf, and a fused router ``[L, D, E]``."""
    import einops
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import functional_load as fl

    config = json.loads((Path(path) / "config.json").read_text())
    D, E, F, L = config["hidden_size"], config["num_local_experts"], config["moe_intermediate_size"], config["num_hidden_layers"]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("expert", "model"))
    tree = {
        "wi": _sds((L, E, D, 2, F), jnp.bfloat16, mesh, None, "expert", None, None, "model"),
        "wo": _sds((L, E, F, D), jnp.bfloat16, mesh, None, "expert", "model", None),
        "router": _sds((L, D, E), jnp.float32, mesh),
    }
    e = "model.layers.{layer}.mlp.experts.{expert}."
    rules = {
        "wi": fl.Rule([e + "gate_proj.weight", e + "up_proj.weight"], "part layer expert f d -> layer expert d part f", fuse="part"),
        "wo": fl.Rule(e + "down_proj.weight", "layer expert d f -> layer expert f d"),
        "router": fl.Rule("model.layers.{layer}.mlp.gate.weight", "layer e d -> layer d e"),
    }
    ignored = fl.TargetMap(rules, drops=(fl.model.targetmap.Drop(r"self_attn|layernorm|embed|norm|lm_head", "not in this test"),))
    got = fl.load_jax(path, target=tree, mapping=ignored)
    t = checkpoint_tensors(path)
    grid = {
        n: np.stack([np.stack([t[f"model.layers.{layer}.mlp.experts.{x}.{n}.weight"] for x in range(E)]) for layer in range(L)])
        for n in ("gate_proj", "up_proj", "down_proj")
    }
    want = {
        "wi": einops.rearrange(np.stack([grid["gate_proj"], grid["up_proj"]]), "part l e f d -> l e d part f"),
        "wo": einops.rearrange(grid["down_proj"], "l e d f -> l e f d"),
        "router": einops.rearrange(np.stack([t[f"model.layers.{layer}.mlp.gate.weight"] for layer in range(L)]), "l e d -> l d e"),
    }
    return assert_tree_equal(got, want, tree)


def check_nnx(path: str) -> int:
    """A user's Flax NNX module built with ``nnx.eval_shape`` under ``jax.set_mesh`` (abstract
    mesh): filled with ``mesh=``, then ``nnx.update`` and a forward pass of its own."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import functional_load as fl

    config = json.loads((Path(path) / "config.json").read_text())
    D, F = config["hidden_size"], config["intermediate_size"]
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(auto, auto))

    class Mlp(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            init = nnx.initializers.zeros
            self.gate = nnx.Param(init(rngs.params(), (D, F), jnp.float32), sharding=("fsdp", "tp"))
            self.down = nnx.Param(init(rngs.params(), (F, D), jnp.float32), sharding=("tp", "fsdp"))

        def __call__(self, x: Any) -> Any:
            return jax.nn.silu(x @ self.gate[...]) @ self.down[...]

    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(lambda: Mlp(nnx.Rngs(0)))
    state = nnx.state(abstract)
    rules = {"gate": fl.Rule("model.layers.0.mlp.gate_proj.weight", "f d -> d f"),
             "down": fl.Rule("model.layers.0.mlp.down_proj.weight", "d f -> f d")}
    drops = (fl.model.targetmap.Drop(r"^(?!model\.layers\.0\.mlp\.(gate|down)_proj)", "not in this module"),)
    loaded = fl.load_jax(path, target=state, mapping=fl.TargetMap(rules, drops=drops), mesh=mesh)
    nnx.update(abstract, loaded)
    t = checkpoint_tensors(path)
    x = np.random.default_rng(0).standard_normal((3, D)).astype(np.float32)
    with jax.set_mesh(mesh):
        y = np.asarray(abstract(jnp.asarray(x)))
    gate, down = t["model.layers.0.mlp.gate_proj.weight"], t["model.layers.0.mlp.down_proj.weight"]
    h = x @ gate.T
    want = (h / (1 + np.exp(-h))) @ down.T
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    return len(jax.tree_util.tree_leaves(loaded))


def check_vllm_tp_axes(path: str) -> int:
    """vLLM's layout with tensor parallelism over two mesh axes: shards are the torch ranks of tp 8."""
    import jax
    from jax.sharding import Mesh

    import functional_load as fl
    from functional_load.layout.placement import PerRank

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tp"))
    arrays = fl.load_jax(path, mesh, tp_axis=("fsdp", "tp"))
    states = {r: fl.load(path, tp_size=8, rank=r) for r in range(8)}
    plan = states[0].plan
    checked = 0
    for name, array in arrays.items():
        canonical = plan.aliases.get(name, name)
        placement = plan.param(canonical).spec.sharding.placement(plan.parallel)
        for shard in array.addressable_shards:
            where = np.argwhere(mesh.devices == shard.device)[0]
            rank = int(where[0]) * 4 + int(where[1])
            want = states[rank][name].float().numpy()
            got = np.asarray(shard.data).astype(np.float32)
            if isinstance(placement, PerRank):
                got = got[0]
            assert np.array_equal(got, want), f"{name} on rank {rank}"
            checked += 1
    return checked


def check_gpt_oss(path: str, tp: int) -> dict[str, Any]:
    """gpt-oss ``w2_bias``: rank 0 holds it, the others zeros (vLLM adds it once after the
    row-parallel reduction); through load_jax it is one entry per rank."""
    import jax
    from jax.sharding import Mesh

    import functional_load as fl

    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    arrays = fl.load_jax(path, mesh)
    out = {}
    for name, array in arrays.items():
        if name.endswith("w2_bias"):
            per_rank = tp > 1  # one rank holds the bias as it is
            assert array.ndim == 3 if per_rank else array.ndim == 2, (name, array.shape)
            assert not per_rank or array.shape[0] == tp, (name, array.shape)
            for shard in array.addressable_shards:
                rank = int(np.argwhere(mesh.devices == shard.device)[0][0])
                data = np.asarray(shard.data).astype(np.float32)
                data = data[0] if per_rank else data
                torch_rank = fl.load(path, tp_size=tp, rank=rank)[name].float().numpy()
                assert np.array_equal(data, torch_rank), (name, rank)
                out[f"{name}@{rank}"] = int(np.count_nonzero(data))
    return out


@pytest.fixture(scope="module")
def cases(tiny_checkpoint, tmp_path_factory):
    llama = str(tiny_checkpoint("llama", kv_heads=2))
    map_file = tmp_path_factory.mktemp("maps") / "scanned.toml"
    map_file.write_text(SCANNED_TOML)
    calls = {
        "llama-2x4-bf16": ("check_llama", {"path": llama, "data": 2, "model": 4, "dtype": "bfloat16"}),
        "llama-4x2-f32": ("check_llama", {"path": llama, "data": 4, "model": 2, "dtype": "float32"}),
        "scanned-toml": ("check_scanned_toml", {"path": llama, "map_file": str(map_file)}),
        "experts": ("check_experts", {"path": str(tiny_checkpoint("qwen3_moe", kv_heads=2))}),
        "nnx": ("check_nnx", {"path": llama}),
        "vllm-two-axes": ("check_vllm_tp_axes", {"path": llama}),
        **{f"gpt_oss-tp{tp}": ("check_gpt_oss", {"path": str(tiny_checkpoint("gpt_oss")), "tp": tp}) for tp in (1, 2, 4)},
    }
    return Cases(HERE, globals(), calls, devices=8, timeout=300)


SCANNED_TOML = """
name = "test-scanned"
[dims]
heads = "num_attention_heads"
kv_heads = "num_key_value_heads"

[[drop]]
pattern = "mlp|post_attention_layernorm|embed_tokens|lm_head|v_proj|^model\\\\.norm"
reason = "not in this target"

[leaves."decoder.layers.query"]
source = "model.layers.{layer}.self_attn.q_proj.weight"
pattern = "layer (n h) d -> d layer n h"
n = "heads"
scale = "head_dim ** -0.5"
rotary = { h = "pairs" }

[leaves."decoder.layers.key"]
source = "model.layers.{layer}.self_attn.k_proj.weight"
pattern = "layer (n h) d -> d layer n h"
n = "kv_heads"
rotary = { h = "pairs" }

[leaves."decoder.layers.out"]
source = "model.layers.{layer}.self_attn.o_proj.weight"
pattern = "layer d (n h) -> n layer h d"
n = "heads"

[leaves."decoder.layers.norm"]
source = "model.layers.{layer}.input_layernorm.weight"
pattern = "layer d -> d layer"
"""


@pytest.mark.parametrize("case", ["llama-2x4-bf16", "llama-4x2-f32"])
def test_tpu_inference_like_tree(cases, case):
    result = cases.check(case)
    assert result["checked"] > 0
    if case.endswith("bf16"):  # the shards hold the checkpoint's dtype: bytes read vs bytes held
        assert result["read"] <= 1.1 * result["held"], result


def test_scanned_layers_from_a_toml_map(cases):
    assert cases.check("scanned-toml") == 4


def test_stacked_and_fused_experts(cases):
    assert cases.check("experts") == 3


def test_flax_nnx_state_on_an_abstract_mesh(cases):
    assert cases.check("nnx") == 2


def test_vllm_layout_over_two_mesh_axes(cases):
    assert cases.check("vllm-two-axes") > 0


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt_oss_w2_bias_is_per_rank(cases, tp):
    counts = cases.check(f"gpt_oss-tp{tp}")
    assert counts, "no w2_bias"
    for key, nonzero in counts.items():
        rank = int(key.rsplit("@", 1)[1])
        assert (nonzero > 0) == (rank == 0), (key, nonzero)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt_oss_bias_through_load_and_verify(tiny_checkpoint, tp):
    """vLLM adds gpt-oss's w2_bias once, after the row-parallel reduction: rank 0 holds it, the
    other ranks zeros; ``verify`` accepts that (it is per rank, not replicated)."""
    import functional_load as fl
    from functional_load.verify import verify_ranks

    path = tiny_checkpoint("gpt_oss")
    names = [n for n in fl.plan(path).tensors if n.endswith("down_proj_bias")]
    assert names
    stored = checkpoint_tensors(str(path))
    for rank in range(tp):
        state = fl.load(path, tp_size=tp, rank=rank)
        for name in names:
            bias = state[name.replace(".experts.down_proj_bias", ".experts.routed_experts.w2_bias")].float().numpy()
            assert np.count_nonzero(stored[name]) > 0
            want = stored[name] if rank == 0 else np.zeros_like(stored[name])
            assert np.array_equal(bias, want), (name, rank)
    report = verify_ranks(path, tp_size=tp)
    assert report.ok, report.summary()


def test_one_plan_error_lists_every_problem_before_reading(tiny_checkpoint, tmp_path):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import functional_load as fl
    from functional_load.io import Reader, ReadOptions

    path = tiny_checkpoint("llama", kv_heads=2)
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    tree = {
        "q": _sds((64, 8, 8), jnp.bfloat16, mesh),
        "k": _sds((64, 3, 8), jnp.bfloat16, mesh),  # 2 KV heads
        "gone": _sds((4,), jnp.bfloat16, mesh),
        "twice": [_sds((64,), jnp.bfloat16, mesh)],
        "norm": _sds((64,), jnp.int32, mesh),
    }
    rules = {
        "q": fl.Rule("model.layers.0.self_attn.q_proj.weight", "(n h) d -> d n h", n=8),
        "k": fl.Rule("model.layers.0.self_attn.k_proj.weight", "(k h) d -> d k h", k=2),
        "twice.0": fl.Rule("model.norm.weight", "d -> d"),
        "twice.{layer}": fl.Rule("model.norm.weight", "d -> d"),
        "norm": fl.Rule("model.layers.0.input_layernorm.weight", "d -> d"),
        "absent": fl.Rule("model.layers.0.self_attn.missing.weight", "a b -> b a"),
    }
    with Reader(ReadOptions()) as reader, pytest.raises(fl.PlanError) as info:
        fl.load_jax(path, target=tree, mapping=rules, reader=reader)
    assert reader.bytes_read == 0
    text = str(info.value)
    for needle in (
        "'k'", "for the target shape [64, 3, 8]: dimension 1 is 3, but (k) gives 2",
        "'gone' has no rule",
        "'twice.0' is matched by 2 rules",
        "'norm'", "cannot be cast to the leaf's int32",
        "fill no leaf of the target",
    ):
        assert needle in text, (needle, text)
    assert "q_proj" not in text.split("fill no leaf")[1].split("\n")[0], "a planned leaf's source reported unused"


def test_load_jax_takes_every_option(tiny_checkpoint):
    import jax
    from jax.sharding import Mesh

    import functional_load as fl

    path = tiny_checkpoint("llama", kv_heads=2)
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    spec = fl.model.spec.find_spec("llama")
    options = fl.LoadOptions(spec=spec, progress=False, read=fl.ReadOptions(threads=2), quantization="fp8")
    arrays = fl.load_jax(path, mesh, options=options)
    state = fl.load(path, options=options)
    import torch

    for name, array in arrays.items():
        got = np.ascontiguousarray(np.asarray(array)).reshape(-1).view(np.uint8)
        want = state[name].contiguous().reshape(-1).view(torch.uint8).numpy()
        assert np.array_equal(got, want), name
    assert str(arrays["model.layers.0.self_attn.qkv_proj.weight"].dtype) == "float8_e4m3fn"
    with pytest.raises(fl.ConfigError, match="unknown option"):
        fl.load_jax(path, mesh, quantisation="fp8")
    with pytest.raises(fl.ConfigError, match="do not apply to load_jax"):
        fl.load_jax(path, target={}, mapping={}, dtype="float32")


def distributed_target_worker(process_id: int, port: int, path: str) -> dict[str, Any]:
    """One of two jax.distributed processes (4 CPU devices each) loading the tpu-inference-like
    tree over (data 2 x model 4), process p holding model coordinates 2p, 2p + 1 of both rows."""
    import jax
    import jax.numpy as jnp

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    try:
        from jax.sharding import Mesh

        import functional_load as fl
        from functional_load.io import Reader, ReadOptions

        grid = np.empty((2, 4), dtype=object)
        for p in (0, 1):
            mine = [d for d in jax.devices() if d.process_index == p]
            grid[:, 2 * p : 2 * p + 2] = np.array(mine, dtype=object).reshape(2, 2)
        mesh = Mesh(grid, ("data", "model"))
        config = json.loads((Path(path) / "config.json").read_text())
        tree, rules = llama_target(config, mesh, jnp.bfloat16)
        with Reader(ReadOptions(strategy="pread")) as reader:
            got = fl.load_jax(path, target=tree, mapping=rules, reader=reader)
            read = reader.bytes_read
        checked = assert_tree_equal(got, llama_expected(config, checkpoint_tensors(path), 4), tree)
        return {"read": read, "held": shard_bytes(got), "checked": checked}
    finally:
        jax.distributed.shutdown()


def test_two_processes_read_only_their_shards(tiny_checkpoint, tmp_path):
    from functional_load.dtypes import itemsize
    from functional_load.testing.checkpoints import list_tensors

    path = tiny_checkpoint("llama", kv_heads=2)
    total = sum(int(np.prod(shape)) * itemsize(dtype) for shape, dtype in list_tensors(path).values())
    results = distributed(HERE, "distributed_target_worker", path, tmp_path, timeout=150)
    for pid, r in enumerate(results):
        assert r["checked"] > 0
        assert r["read"] <= 1.1 * r["held"], (pid, r)
        assert r["read"] < 0.75 * total, (pid, r, total)  # sharded leaves: half each; only norms read by both


def check_dequantized(fixture: str) -> int:
    """FP8 weights dequantized box by box into float32 leaves sharded over (data 2 x model 4),
    whole heads and slices of head_dim alike, against the independent reference dequantizer."""
    import importlib.util

    import einops
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import functional_load as fl

    quant = Path(__file__).parent / "fixtures" / "quant"
    spec = importlib.util.spec_from_file_location("ref_dequant_targets", quant / "make" / "ref_dequant.py")
    assert spec is not None and spec.loader is not None
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    path = quant / fixture
    config = json.loads((path / "config.json").read_text())
    D, N, K = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    H = config.get("head_dim") or D // N
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    tree = {
        "q": _sds((D, N, H), jnp.float32, mesh, "data", "model", None),  # whole heads
        "k": _sds((D, K, H), jnp.float32, mesh, "data", None, "model"),  # slices of head_dim: rows off the blocks
        "down": _sds((config["intermediate_size"], D), jnp.float32, mesh, "model", "data"),
        "mid": _sds((2 * H, D), jnp.float32, mesh, None, "data"),  # heads 1-2: rows that start inside a block and cross it
    }
    a = "model.layers.0."
    rules = {
        "q": fl.Rule(a + "self_attn.q_proj.weight", "(n h) d -> d n h", n=N, dequantize=True),
        "k": fl.Rule(a + "self_attn.k_proj.weight", "(n h) d -> d n h", n=K, dequantize=True),
        "down": fl.Rule(a + "mlp.down_proj.weight", "d f -> f d", dequantize=True),
        "mid": fl.Rule(a + "self_attn.q_proj.weight", "(n h) d -> (n h) d", n=N, take={"n": (1, 3)}, dequantize=True),
    }
    drops = (fl.model.targetmap.Drop(r".", "not in this test"),)
    got = fl.load_jax(path, target=tree, mapping=fl.TargetMap(rules, drops=drops))
    dense = {p: w for p, (w, _) in ref.dequantize(str(path)).items()}
    want = {
        "q": einops.rearrange(dense[a + "self_attn.q_proj"].numpy(), "(n h) d -> d n h", n=N),
        "k": einops.rearrange(dense[a + "self_attn.k_proj"].numpy(), "(n h) d -> d n h", n=K),
        "down": dense[a + "mlp.down_proj"].numpy().T,
        "mid": dense[a + "self_attn.q_proj"].numpy()[H : 3 * H],
    }
    return assert_tree_equal(got, want, tree)


@pytest.fixture(scope="module")
def dequantized():
    names = ("hf_fp8_block", "ct_fp8_channel", "ct_fp8_tensor", "ct_fp8_block_hd64", "hf_fp8_block_ue8m0")
    return Cases(HERE, globals(), {n: ("check_dequantized", {"fixture": n}) for n in names}, devices=8, timeout=300)


@pytest.mark.parametrize("fixture", ["hf_fp8_block", "ct_fp8_channel", "ct_fp8_tensor", "ct_fp8_block_hd64", "hf_fp8_block_ue8m0"])
def test_fp8_weights_dequantized_box_by_box(dequantized, fixture):
    assert dequantized.check(fixture) == 4


def test_dequantize_names_what_it_cannot(tiny_checkpoint):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import functional_load as fl

    quant = Path(__file__).parent / "fixtures" / "quant"
    mesh = Mesh(np.array(jax.devices()[:1]), ("m",))
    rule = {"w": fl.Rule("model.layers.0.self_attn.q_proj.qweight", "i o -> i o", dequantize=True)}
    with pytest.raises(fl.PlanError, match="no weight of a module"):
        fl.load_jax(quant / "gptq_v1", target={"w": _sds((16, 128), jnp.float32, mesh)}, mapping=rule)
    rule = {"w": fl.Rule("model.layers.0.self_attn.q_proj.weight", "o i -> o i", dequantize=True)}
    with pytest.raises(fl.PlanError, match=r"mxfp8 weights .* do not dequantize box by box yet"):
        fl.load_jax(quant / "llmc_mxfp8", target={"w": _sds((512, 256), jnp.float32, mesh)}, mapping=rule)
    plain = tiny_checkpoint("llama", kv_heads=2)
    with pytest.raises(fl.PlanError, match="no quantization_config"):
        fl.load_jax(plain, target={"w": _sds((64, 64), jnp.float32, mesh)}, mapping=rule)


def test_a_target_dimension_sizes_a_source_group(tiny_checkpoint):
    """``(n h) d -> d n h`` into a ``[64, 8, 8]`` leaf: the target gives n and h, so the rule
    needs neither (it said "(n h) has 2 axes of unknown size")."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import functional_load as fl

    path = tiny_checkpoint("llama", kv_heads=2)
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    rest = (fl.Drop(r"^(?!model\.layers\.0\.self_attn\.q_proj\.weight$)", "only q is a leaf here"),)
    rule = fl.Rule("model.layers.0.self_attn.q_proj.weight", "(n h) d -> d n h")
    got = fl.load_jax(path, target={"q": _sds((64, 8, 8), jnp.bfloat16, mesh)}, mapping=fl.TargetMap({"q": rule}, drops=rest))
    weight = fl.load(path)["model.layers.0.self_attn.qkv_proj.weight"][:64].float().numpy()
    assert np.array_equal(np.asarray(got["q"], np.float32), weight.reshape(8, 8, 64).transpose(2, 0, 1))
    with pytest.raises(fl.PlanError, match=r"\(n h\) has 2 axes of unknown size"):  # a target that sizes neither
        rule = fl.Rule("model.layers.0.self_attn.q_proj.weight", "(n h) d -> d (n h)")
        fl.load_jax(path, target={"q": _sds((64, 64), jnp.bfloat16, mesh)}, mapping=fl.TargetMap({"q": rule}, drops=rest))


def test_a_rule_that_matches_no_leaf_is_named(tiny_checkpoint):
    """A mistyped rule key is an error naming the rule and the closest leaves, not ignored; a rule
    for another form of the tree (its sources taken by the rule that matched) stays quiet."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import functional_load as fl

    path = tiny_checkpoint("llama", kv_heads=2)
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    target = {"norm": _sds((64,), jnp.bfloat16, mesh), "layers": [{"ln": _sds((64,), jnp.bfloat16, mesh)}]}
    keep = r"^(?!model\.norm\.weight$|model\.layers\.0\.input_layernorm\.weight$)"
    rules = {
        "norm": fl.Rule("model.norm.weight", "d -> d"),
        "layers.{layer}.ln": fl.Rule("model.layers.{layer}.input_layernorm.weight", "d -> d"),
        "layers_{layer}.ln": fl.Rule("model.layers.{layer}.input_layernorm.weight", "d -> d"),  # the unscanned form: quiet
        "lyers.{layer}.ln2": fl.Rule("model.layers.{layer}.post_attention_layernorm.weight", "d -> d"),  # a typo
    }
    with pytest.raises(fl.PlanError) as info:
        fl.load_jax(path, target=target, mapping=fl.TargetMap(rules, drops=(fl.Drop(keep, "not in this tree"),)))
    assert "rule 'lyers.{layer}.ln2' of <map> matches no target leaf; closest leaves: ['layers.0.ln']" in str(info.value)
    assert "layers_{layer}.ln" not in str(info.value) and len(info.value.problems) == 1


def test_a_tied_head_the_checkpoint_stores_is_dropped_by_the_specs_tie(tiny_checkpoint, tmp_path):
    """A tied checkpoint that also stores ``lm_head.weight`` (some exporters write both): the
    spec's ``[tie]`` says it is the embedding, so a target without a head need not take it; an
    untied model's head is a tensor no leaf takes."""
    import json
    import shutil

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from safetensors.torch import load_file, save_file

    import functional_load as fl

    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    source = tiny_checkpoint("llama", kv_heads=2, tie_word_embeddings=True)
    tied = tmp_path / "tied"
    shutil.copytree(source, tied)
    files = sorted(tied.glob("*.safetensors"))
    tensors = load_file(files[0])
    embed = next(f for f in files if "model.embed_tokens.weight" in load_file(f))
    tensors["lm_head.weight"] = load_file(embed)["model.embed_tokens.weight"].clone()
    save_file(tensors, files[0], metadata={"format": "pt"})
    index = tied / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"]["lm_head.weight"] = files[0].name
        index.write_text(json.dumps(data))
    rule = {"norm": fl.Rule("model.norm.weight", "d -> d")}
    keep = (fl.Drop(r"^model\.(?!norm\.weight$)", "not in this tree"),)
    target = {"norm": _sds((64,), jnp.bfloat16, mesh)}
    fl.load_jax(tied, target=target, mapping=fl.TargetMap(rule, drops=keep))  # the head: the spec's tie
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(fl.PlanError, match=r"'lm_head\.weight'"):
        fl.load_jax(tied, target=target, mapping=fl.TargetMap(rule, drops=keep))


NO_TORCH = r"""
import json, os, sys
sys.modules["torch"] = None  # import torch raises: MaxText's environment has no torch
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, sys.argv[1])
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh
import functional_load as fl
from test_jax_targets import llama_target
path, out = sys.argv[2], sys.argv[3]
config = json.load(open(os.path.join(path, "config.json")))
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
tree, rules = llama_target(config, mesh, jnp.bfloat16)
got = fl.load_jax(path, target=tree, mapping=rules, options=fl.LoadOptions(progress=False))
flat = jax.tree_util.tree_flatten_with_path(got)[0]
np.savez(out, **{jax.tree_util.keystr(p): np.asarray(a).astype(np.float32) for p, a in flat})
"""


def test_a_target_tree_loads_without_torch(tiny_checkpoint, tmp_path):
    """JAX stacks load without torch (MaxText's environment has none): the executor runs a target
    leaf's copies on numpy blocks, so a target tree with transposes, padding, repeated KV heads and
    a cast loads with ``import torch`` failing, and equals the whole-tensor rearrangement."""
    import subprocess

    import jax

    path = tiny_checkpoint("llama", kv_heads=2)
    out = tmp_path / "got.npz"
    done = subprocess.run([sys.executable, "-c", NO_TORCH, str(Path(HERE).parent), str(path), str(out)], capture_output=True, text=True,
                          timeout=300, env=child_env(8))
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((path / "config.json").read_text())
    want = llama_expected(config, checkpoint_tensors(str(path)), 4)
    got = np.load(out)
    flat = jax.tree_util.tree_flatten_with_path(want)[0]
    assert len(got.files) == len(flat) > 10
    for keys, expected in flat:
        key = jax.tree_util.keystr(keys)
        assert np.array_equal(got[key], np.asarray(expected).astype(jnp_bf16()).astype(np.float32)), key


def jnp_bf16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16
