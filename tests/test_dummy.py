"""``load_format="dummy"``: vLLM 0.32's ``DummyModelLoader``, from ``config.json`` alone.

* No file but ``config.json`` is opened: a directory holding only it loads, and a full checkpoint
  directory has none of its weight files (nor index, nor headers) opened; a parsed config works
  too.
* Every parameter follows vLLM's ``initialize_single_dummy_weight``: floating ones are
  ``uniform_(-1e-3, 1e-3)`` from a CPU generator seeded 1234 per parameter, drawn on the
  rank-local shape (FP8 drawn in float16, then cast); integer ones are zero (vLLM on ROCm; elsewhere
  vLLM leaves ``torch.empty``'s bytes). The golden values below were produced by vLLM's own
  function (``.venv-vllm``); the parity harness compares whole rank states with real vLLM
  (``dummy-`` cases of ``harness.parity.cases``).
* A rank's values depend only on the rank itself: loading it alone, after other ranks, or in
  another order gives the same bits, and ``load_jax``'s shards are the torch ranks.
* Names, shapes and dtypes are a real load's, for the quantized layouts of ``tests/fixtures/quant``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_state, bits, hook_opens
from safetensors.torch import load_file

import functional_load as fl
from functional_load.cli import main as cli
from functional_load.io.dummy import initialize_dummy
from functional_load.plan.dummy import VLLM_DUMMY

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny-llama"
FIXTURES = REPO / "tests" / "fixtures" / "quant"
QUANT = sorted(p.parent.name for p in FIXTURES.glob("*/config.json"))

# vLLM 0.32's initialize_single_dummy_weight(torch.empty(6, dtype=...)) on CPU, the bits of each
# element (int16/int32/uint8 views), printed from the vLLM environment.
GOLDEN = {
    torch.bfloat16: (torch.int16, [-17801, -18098, -17924, -18036, -17816, 14802]),
    torch.float16: (torch.int16, [-27720, -30098, -28705, -29601, -27843, 3731]),
    torch.float32: (torch.int32, [-1166609577, -1186087985, -1174678953, -1182017998, -1167617056, 970089514]),
    torch.float8_e4m3fn: (torch.uint8, [128, 128, 128, 128, 128, 0]),  # -0.0 x5, 0.0: |x| < 2^-10 rounds to zero
}


def config_only(source: Path, out: Path) -> Path:
    """A model directory holding only ``source``'s ``config.json``."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "config.json", out / "config.json")
    return out


class Opened:
    """Paths opened (``os.open``, ``open``, ``io.open``) while the hook is installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        hook_opens(monkeypatch, lambda f: self.paths.append(os.path.realpath(os.fsdecode(f))) if not isinstance(f, int) else None)

    def under(self, directory: Path) -> set[str]:
        root = os.path.realpath(directory)
        return {os.path.relpath(p, root) for p in self.paths if p == root or p.startswith(root + os.sep)}


def dummy_values(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """vLLM's rule, written out on a fresh tensor: one generator seeded 1234 per parameter."""
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(1234)
    draw = torch.float16 if torch.finfo(dtype).bits < 16 else dtype
    return torch.empty(shape, dtype=draw).uniform_(-1e-3, 1e-3, generator=generator).to(dtype)


def check_dummy_state(state: Any) -> None:
    """Every tensor holds vLLM's dummy values for its own shape and dtype, in range."""
    for name, tensor in state.items():
        assert_same_bits_named(tensor, dummy_values(tuple(tensor.shape), tensor.dtype), name)
        if tensor.dtype.is_floating_point and tensor.numel():
            draw = torch.float16 if torch.finfo(tensor.dtype).bits < 16 else tensor.dtype
            low, high = (torch.tensor(v, dtype=draw).to(tensor.dtype).float() for v in (-1e-3, 1e-3))
            values = tensor.float()
            assert bool(torch.isfinite(values).all()) and low <= values.min() and values.max() <= high, name
        elif tensor.numel():
            assert not bool(tensor.any()), f"{name}: integer parameters are zero"


def assert_same_bits_named(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(bits(a), bits(b)), f"{what}: values differ from vLLM's dummy rule"


def assert_same_layout(dummy: Any, real: Any, what: str) -> None:
    """The same names, shapes and dtypes, and the same tied aliases."""
    assert set(dummy) == set(real), f"{what}: {sorted(set(dummy) ^ set(real))[:5]}"
    for name, tensor in real.items():
        assert (dummy[name].dtype, dummy[name].shape) == (tensor.dtype, tensor.shape), f"{what} {name}"
    assert dict(dummy.plan.aliases) == dict(real.plan.aliases)
    for alias, target in dummy.plan.aliases.items():
        assert dummy[alias] is dummy[target]


@pytest.mark.parametrize("dtype", list(GOLDEN), ids=str)
def test_values_are_vllms(dtype: torch.dtype) -> None:
    view, expected = GOLDEN[dtype]
    tensor = torch.empty(6, dtype=dtype)
    initialize_dummy(tensor, VLLM_DUMMY)
    assert tensor.view(view).tolist() == expected
    assert (VLLM_DUMMY.low, VLLM_DUMMY.high, VLLM_DUMMY.seed) == (-1e-3, 1e-3, 1234)


def test_a_directory_with_only_config_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = config_only(TINY, tmp_path / "model")
    opened = Opened(monkeypatch)
    plan = fl.plan(model, tp_size=2, rank=1, load_format="dummy")
    state = fl.load(model, tp_size=2, rank=1, load_format="dummy")
    assert opened.under(tmp_path) == {"model/config.json"}
    assert plan.dummy and plan.bytes_to_read == 0 and not plan.tensors
    assert all(not p.copies and p.dummy == VLLM_DUMMY for p in plan.params)
    assert state.stats is not None and state.stats.bytes_read == 0
    check_dummy_state(state)
    assert_same_layout(state, fl.load(TINY, tp_size=2, rank=1), "tiny-llama tp 2 rank 1")


def test_a_checkpoint_directory_opens_only_its_config(monkeypatch: pytest.MonkeyPatch) -> None:
    opened = Opened(monkeypatch)
    fl.load(TINY, tp_size=4, rank=3, load_format="dummy")
    fl.load(FIXTURES / "ct_w4a16_asym", tp_size=2, rank=0, load_format="DUMMY")  # vLLM lowercases the format too
    assert opened.under(TINY) == {"config.json"}
    assert opened.under(FIXTURES / "ct_w4a16_asym") == {"config.json"}


def test_a_parsed_config(tmp_path: Path) -> None:
    config = json.loads((TINY / "config.json").read_text())
    state = fl.load(config, tp_size=4, rank=2, load_format="dummy")
    assert_same_state(state, fl.load(TINY, tp_size=4, rank=2, load_format="dummy"), "parsed config vs directory")
    assert state.plan.model_dir == ""
    assert [p.spec.name for p in fl.plan(config, load_format="dummy").params] == list(fl.layout(config).params)
    with pytest.raises(fl.ConfigError, match="load_format='dummy'"):
        fl.plan(config)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_has_a_real_loads_layout(tp: int) -> None:
    for rank in range(tp):
        state = fl.load(TINY, tp_size=tp, rank=rank, load_format="dummy")
        assert_same_layout(state, fl.load(TINY, tp_size=tp, rank=rank), f"tp {tp} rank {rank}")
        check_dummy_state(state)
        for name, tensor in state.unique().items():  # every parameter is seeded alone: its first values are vLLM's
            view, golden = GOLDEN[tensor.dtype]
            assert tensor.reshape(-1)[:6].view(view).tolist() == golden[: tensor.numel()], name


def test_a_rank_does_not_depend_on_other_ranks() -> None:
    alone = fl.load(TINY, tp_size=4, rank=2, load_format="dummy")
    for rank in (3, 0, 1):
        fl.load(TINY, tp_size=4, rank=rank, load_format="dummy")
    again = fl.load(TINY, tp_size=4, rank=2, load_format="dummy", read=fl.ReadOptions(threads=1))
    assert_same_state(again, alone, "rank 2 after other ranks, one thread")
    # vLLM seeds every parameter alike: ranks whose local shapes agree hold the same values
    assert_same_state(fl.load(TINY, tp_size=4, rank=0, load_format="dummy"), alone, "rank 0 vs rank 2")
    # the dtype asked for is the dtype drawn in (as vLLM creates its parameters in it)
    half = fl.load(TINY, tp_size=4, rank=2, load_format="dummy", dtype="float16")
    assert {t.dtype for t in half.values()} == {torch.float16}
    check_dummy_state(half)


def test_load_jax_shards_are_the_torch_ranks(tmp_path: Path) -> None:
    model = config_only(TINY, tmp_path / "model")
    script = f"""
import numpy as np, jax, torch, functional_load as fl
from jax.sharding import Mesh
mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("dp", "tp"))
arrays = fl.load_jax({str(model)!r}, mesh, load_format="dummy")
checked = 0
for rank in range(4):
    state = fl.load({str(model)!r}, tp_size=4, rank=rank, load_format="dummy")
    for name, array in arrays.items():
        for shard in array.addressable_shards:
            if int(np.argwhere(mesh.devices == shard.device)[0][1]) == rank:
                want = state[name].view(torch.int16).numpy()
                assert (np.asarray(shard.data).view(np.int16) == want).all(), (name, rank)
                checked += 1
print(checked)
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 0


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("fixture", QUANT)
def test_quantized_layouts(fixture: str, tp: int, tmp_path: Path) -> None:
    """Config only: each fixture's quantized parameters get values of their own dtype (FP8
    through float16, integers zero), with a real load's names, shapes and dtypes."""
    model = config_only(FIXTURES / fixture, tmp_path / fixture)
    try:
        real = fl.load(FIXTURES / fixture, tp_size=tp, rank=tp - 1, progress=False)
    except (fl.ShardingError, fl.ConfigError) as exc:  # the layout refuses it: so does a dummy load
        with pytest.raises(type(exc)):
            fl.load(model, tp_size=tp, rank=tp - 1, load_format="dummy")
        return
    state = fl.load(model, tp_size=tp, rank=tp - 1, load_format="dummy")
    assert_same_layout(state, real, f"{fixture} tp {tp}")
    check_dummy_state(state)
    assert state.plan.schemes.keys() == real.plan.schemes.keys()


def test_online_quantization_quantizes_the_dummy_weights() -> None:
    for quantization in ("fp8", "fp8_block"):
        state = fl.load(TINY, tp_size=2, rank=1, quantization=quantization, load_format="dummy")
        real = fl.load(TINY, tp_size=2, rank=1, quantization=quantization)
        assert_same_layout(state, real, quantization)
        weight = state["model.layers.0.self_attn.qkv_proj.weight"]
        assert weight.dtype == torch.float8_e4m3fn and bool(weight.float().abs().max() > 0)


def test_plan_table_and_json_say_dummy() -> None:
    plan = fl.plan(TINY, tp_size=2, rank=0, load_format="dummy")
    table = plan.table()
    assert "(dummy uniform [-0.001, 0.001), seed 1234)" in table and "0 bytes to read" in table and "dummy weights" in table
    data = json.loads(json.dumps(plan.to_json()))
    assert data["dummy"] is True and data["bytes_to_read"] == 0
    assert all(p["copies"] == [] and p["dummy"] == {"low": -1e-3, "high": 1e-3, "seed": 1234} for p in data["params"])
    assert fl.plan(TINY).to_json()["dummy"] is False
    quant = fl.plan(FIXTURES / "ct_w4a16_asym", load_format="dummy").table()
    assert "(dummy zeros)" in quant  # the packed int4 weights


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = config_only(TINY, tmp_path / "model")
    assert cli(["plan", str(model), "--tp", "2", "--rank", "1", "--load-format", "dummy", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dummy"] is True
    assert cli(["load", str(model), "--tp", "2", "--rank", "1", "--load-format", "dummy", "--out", str(tmp_path / "out")]) == 0
    saved = load_file(str(tmp_path / "out" / "model-rank-1-of-2.safetensors"))
    state = fl.load(model, tp_size=2, rank=1, load_format="dummy")
    assert_same_state(saved, {name: t for name, t in state.unique().items()}, "CLI load")
    for command in (["inspect", str(model)], ["verify", str(model), "--tp", "2"]):
        assert cli([*command, "--load-format", "dummy"]) == 2
        assert "dummy" in capsys.readouterr().err


def test_save_sharded_refuses_dummy(tmp_path: Path) -> None:
    with pytest.raises(fl.ConfigError, match="dummy"):
        fl.save_sharded(TINY, tmp_path / "out", 2, load_format="dummy")
    states = [fl.load(TINY, tp_size=2, rank=r, load_format="dummy") for r in range(2)]
    with pytest.raises(fl.ConfigError, match="dummy"):
        fl.save_sharded(states, tmp_path / "out")
    assert not (tmp_path / "out").exists()
