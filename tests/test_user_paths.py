"""The library tried as a new user would, and the escapes found that way: each now a clear
LoadError (or a clean CLI message), checked before anything is read.

Also: pre-sharded saves through every consumer (load, load_jax, verify, the CLI), one dtype
rule for layout/plan/load, quiet library calls, and the plan's JSON names.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from helpers import assert_same_state

import functional_load as fl
from functional_load.checkpoint import pickles
from functional_load.cli import main as cli_main
from functional_load.io import options as io_options
from functional_load.testing.checkpoints import write_checkpoint

REPO = Path(__file__).resolve().parents[1]
QUANT = REPO / "tests" / "fixtures" / "quant"
sys.path.insert(0, str(Path(__file__).parent))
from _subprocess_runner import child_env  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return write_checkpoint("llama", tmp_path_factory.mktemp("llama") / "ckpt", kv_heads=2)


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory) -> Path:
    return fl.save_sharded(llama, tmp_path_factory.mktemp("save") / "out", tp_size=2)


# --- pre-sharded saves through every consumer -------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_presharded_save_loads_as_the_original_at_any_tp(llama, saved, tp):
    for rank in range(tp):
        assert_same_state(fl.load(saved, tp_size=tp, rank=rank, progress=False), fl.load(llama, tp_size=tp, rank=rank, progress=False))


def test_presharded_save_through_load_jax_at_another_tp(llama, saved):
    """Saved at tp 2, loaded by load_jax on a tp-4 mesh (it used to fail with OSError 22)."""
    script = textwrap.dedent(
        f"""
        import jax, numpy as np
        from jax.sharding import Mesh
        import functional_load as fl
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
        got, want = fl.load_jax({str(saved)!r}, mesh), fl.load_jax({str(llama)!r}, mesh)
        assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
        for name in want:
            a, b = np.asarray(got[name]), np.asarray(want[name])
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
            assert got[name].sharding.spec == want[name].sharding.spec, name
        print("OK", len(want))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], env=child_env(8), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("OK"), done.stderr[-3000:]


@pytest.mark.parametrize("tp", [2, 4])
def test_presharded_save_verifies_clean(saved, tp, capsys):
    """``functional-load verify`` on a save compares against the original tensors reassembled from
    the rank files with the safetensors library (it used to report false mismatches)."""
    assert cli_main(["verify", str(saved), "--tp", str(tp), "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "verified against the plan: every rank equals the checkpoint slices its plan names, bit for bit" in out


def test_inspect_names_a_whole_layouts_axes(llama, tmp_path, capsys):
    saved = fl.save_sharded(llama, tmp_path / "pp", tp_size=2, pp_size=2)
    assert cli_main(["inspect", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "saved at pp 2 x tp 2" in out and "rank 3:" in out


def test_inspect_describes_a_save(saved, capsys):
    assert cli_main(["inspect", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "pre-sharded save" in out and "rank 1:" in out and "duplicate" not in out
    assert "model.layers.0.self_attn.q_proj.weight" in out  # the original tensors it holds
    assert "saved at tp 2" in out and "{" not in out.splitlines()[0]  # words, not a Python dict
    assert "functional_load.sharded.json" not in out  # each tensor names the rank files holding it
    assert re.search(r"model\.embed_tokens\.weight .* model-rank-0-of-2-\w+\.safetensors, model-rank-1-of-2", out)


def test_plan_of_a_save_names_the_rank_file_each_copy_reads(saved, capsys):
    assert cli_main(["plan", str(saved), "--tp", "4", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "functional_load.sharded.json" not in out
    assert re.search(r"model\.embed_tokens\.weight \(model-rank-0-of-2-\w+\.safetensors\)\s+\[256:512", out), out


def test_plan_reads_no_tensor_bytes_even_to_verify_hashes(saved, monkeypatch):
    """Hashing is the reader's job (ReadOptions(verify_hashes=True)): planning a save stats its
    rank files and reads its own file's header, never tensor data, and hashes nothing."""
    import hashlib

    from functional_load.checkpoint.sharded import read_manifest

    hashed: list[int] = []
    preads: list[int] = []
    real_sha, real_preadv = hashlib.sha256, os.preadv
    monkeypatch.setattr(hashlib, "sha256", lambda data=b"": hashed.append(len(data)) or real_sha(data))
    monkeypatch.setattr(os, "preadv", lambda *a: preads.append(1) or real_preadv(*a))
    plan = fl.plan(saved, tp_size=2, rank=0)
    monkeypatch.undo()
    assert preads == []  # tensor data is read with preadv; headers are not
    assert sum(hashed) <= (saved / "config.json").stat().st_size  # only config.json, checked against the manifest
    assert plan.checksums and set(plan.checksums.values()) == {f["sha256"] for f in read_manifest(saved)["files"].values()}
    state = fl.load(saved, tp_size=2, rank=0, read=fl.ReadOptions(verify_hashes=True), progress=False)
    assert state.stats.bytes_read == plan.bytes_to_read


# --- escapes that are now clear errors ----------------------------------------------------------


def test_cuda_without_cuda_is_refused_before_reading(llama, monkeypatch):
    if torch.cuda.is_available():
        pytest.fail("this check needs a machine without CUDA; the GPU tests cover CUDA loads")
    monkeypatch.setattr("functional_load.api.execute", lambda *a, **k: pytest.fail("read before the device was checked"))
    with pytest.raises(fl.ConfigError, match="no CUDA device"):
        fl.load(llama, device="cuda")


def test_a_file_instead_of_the_model_directory(llama):
    shard = next(llama.glob("*.safetensors"))
    with pytest.raises(fl.ConfigError) as info:
        fl.plan(shard)
    assert "is a file, not a model directory" in str(info.value) and str(llama) in str(info.value)
    with pytest.raises(fl.MissingFileError, match="not found"):
        fl.plan(llama / "nowhere")


def test_layout_from_a_config_json_path(llama):
    by_dir, by_file = fl.layout(llama, tp_size=2, rank=1), fl.layout(llama / "config.json", tp_size=2, rank=1)
    assert by_dir == by_file
    assert set(by_dir.params) == {p["name"] for p in fl.plan(llama, tp_size=2, rank=1).to_json()["params"]}


def test_plan_json_names_local_and_global_shapes(llama):
    entry = next(p for p in fl.plan(llama, tp_size=2, rank=1).to_json()["params"] if p["name"].endswith("qkv_proj.weight"))
    assert "shape" not in entry
    assert entry["global_shape"] == [64 + 2 * 2 * 8, 64] and entry["local_shape"] == [(64 + 2 * 2 * 8) // 2, 64]


def test_verify_with_a_rank_outside_the_tp_size(llama, capsys):
    assert cli_main(["verify", str(llama), "--tp", "2", "--rank", "3"]) == 2
    err = capsys.readouterr().err
    assert "--rank 3 is not a rank of --tp 2" in err and "Traceback" not in err


def test_cli_output_into_a_closed_pipe(llama):
    """``functional-load plan ... | head -1`` ends quietly."""
    command = f"{shutil.which('functional-load') or sys.executable + ' -m functional_load.cli'} plan {llama} --tp 2 | head -1"
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_fp8_weights_are_never_cast_without_their_scales(tmp_path):
    """A float8 checkpoint whose config lost its quantization_config must not load as bf16 values."""
    d = tmp_path / "fp8"
    shutil.copytree(QUANT / "ct_fp8_tensor", d)
    config = json.loads((d / "config.json").read_text())
    del config["quantization_config"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(fl.PlanError) as info:
        fl.plan(d)
    message = str(info.value)
    assert "model.layers.0.self_attn.q_proj.weight" in message and "float8_e4m3fn, a quantized weight" in message


def test_an_os_error_reading_a_pickle_is_not_called_a_refusal(tmp_path, monkeypatch):
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.zeros(2)}, path)

    def fail(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(torch, "load", fail)
    with pytest.raises(fl.LoadError) as info:
        pickles.safe_torch_load(path)
    assert type(info.value).__name__ == "IntegrityError" and "Input/output error" in str(info.value)
    assert "refused" not in str(info.value)


def test_memory_probe_closes_its_files():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        io_options.available_memory()
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


@pytest.mark.parametrize("threads", [1, 4])
def test_bytes_are_counted_once_from_many_threads(llama, saved, tmp_path, threads):
    """Pickles and pre-sharded saves count through the same lock as files."""
    pt = tmp_path / f"pickle-{threads}"
    shutil.copytree(llama, pt, ignore=shutil.ignore_patterns("*.safetensors", "*.json"))
    shutil.copy(llama / "config.json", pt / "config.json")
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(llama.glob("*.safetensors")):
        tensors.update(load_file(shard))
    torch.save(tensors, pt / "pytorch_model.bin")
    read = fl.ReadOptions(threads=threads)
    for source, options in ((pt, {"allow_pickle": True}), (saved, {})):
        state = fl.load(source, tp_size=4, rank=1, read=read, progress=False, **options)
        assert state.stats.bytes_read == state.plan.bytes_to_read


# --- one dtype rule -----------------------------------------------------------------------------


def test_one_dtype_rule_for_layout_plan_and_load(tmp_path):
    """A float16 checkpoint whose config names no dtype: every entry point says float16."""
    d = write_checkpoint("llama", tmp_path / "fp16", kv_heads=2, dtype="float16")
    config = json.loads((d / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (d / "config.json").write_text(json.dumps(config))
    assert fl.layout(d).dtype == fl.plan(d).dtype == "float16"
    assert fl.load(d, progress=False)["model.norm.weight"].dtype == torch.float16
    assert fl.layout(config).dtype == "bfloat16"  # no weights at hand: vLLM's float32 default, served in bfloat16
    with pytest.raises(fl.ConfigError, match="the dtype argument"):
        fl.layout(d, dtype="int4")


# --- quiet by default ---------------------------------------------------------------------------


def test_library_calls_are_quiet(llama, capfd, monkeypatch):
    fl.load(llama, tp_size=2)
    assert capfd.readouterr().err == ""
    fl.load(llama, tp_size=2, progress=True)
    assert "rank 0 load" in capfd.readouterr().err
    monkeypatch.setenv("TQDM_DISABLE", "1")
    fl.load(llama, tp_size=2, progress=True)
    assert capfd.readouterr().err == ""


def test_written_weight_files_follow_the_umask(llama, tmp_path):
    """save_sharded and ``load --out`` write files a plain open would: 0o666 less the umask
    (safetensors makes its files owner-only; config.json already followed the umask)."""
    old = os.umask(0o022)
    try:
        saved = fl.save_sharded(llama, tmp_path / "save", tp_size=2)
        assert cli_main(["load", str(llama), "--tp", "2", "--rank", "1", "--out", str(tmp_path / "rank")]) == 0
    finally:
        os.umask(old)
    files = sorted(saved.glob("*.safetensors")) + sorted((tmp_path / "rank").glob("*.safetensors")) + [saved / "config.json"]
    assert len(files) == 4
    for path in files:
        assert path.stat().st_mode & 0o777 == 0o644, (path, oct(path.stat().st_mode & 0o777))


@pytest.mark.parametrize(("keyword", "meant"), [("tp", "tp_size"), ("tensor_parallel_size", "tp_size"), ("tp_rank", "rank"),
                                                 ("dtyp", "dtype"), ("expert_paralel", "expert_parallel")])
def test_a_mistyped_keyword_names_what_it_meant(llama, keyword, meant):
    with pytest.raises(fl.ConfigError, match=f"{keyword}: did you mean {meant}\\?"):
        fl.load(llama, **{keyword: 1})


def test_a_mistyped_local_path_is_called_one(tmp_path, monkeypatch):
    """``models/tiny-lama`` has the shape of a Hub repo id; when ``models/`` is a local directory
    the error says the path is mistyped and names the closest directories, not only the Hub."""
    (tmp_path / "models" / "tiny-llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(fl.MissingFileError) as info:
        fl.plan("models/tiny-lama", tp_size=2)
    assert "looks like a mistyped path" in str(info.value) and "did you mean models/tiny-llama?" in str(info.value)
    assert "Hugging Face Hub repo id" in str(info.value)


def test_the_names_the_docs_use_are_exported():
    """``fl.verify`` and ``fl.Drop`` are named in the README and docs/jax.md."""
    report = fl.verify(Path(__file__).resolve().parents[1] / "examples" / "tiny-llama", tp_size=2)
    assert report.ok and not report.problems and report.tp_size == 2
    assert fl.Drop("mtp\\..*", "multi-token prediction is not served").reason
    assert {"verify", "Drop"} <= set(fl.__all__)


def test_cli_version_help_defaults_and_one_line_warnings(capsys, tiny_checkpoint):
    from functional_load.cli import main

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith(f"functional-load {importlib.metadata.version('functional_load')} (vLLM ")
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "tensor-parallel size (default 1)" in out and "``" not in out
    moe = tiny_checkpoint("qwen3_moe", kv_heads=2)
    assert main(["plan", str(moe), "--tp", "2", "--expert-parallel", "--expert-placement", "round_robin"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("functional-load: warning: expert_placement='round_robin' falls back to 'linear'"), err
    assert "UserWarning" not in err and "warnings.warn" not in err and len(err.splitlines()) == 1


def test_the_first_loads_read_seconds_do_not_count_importing_torch():
    """A fresh process: the first load's read time is the reading, not torch's import (seconds)."""
    code = (
        "import sys, time, functional_load as fl; assert 'torch' not in sys.modules, 'torch imported early';"
        "start = time.perf_counter(); s = fl.load(sys.argv[1], tp_size=4, rank=1); total = time.perf_counter() - start;"
        "print(s.stats.read_seconds, total)"
    )
    model = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"
    done = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    read, total = map(float, done.stdout.split())
    assert read < 0.25 * total, (read, total)  # 103 KB; importing torch takes most of the total


def test_cli_help_and_plan_import_neither_torch_nor_the_test_harness():
    """``functional-load --help`` and ``plan`` start in about 0.3 s here: torch, transformers and
    the test harness are imported only by the commands that need them (load, verify, check-spec)."""
    model = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"
    code = (
        "import sys, contextlib, io; from functional_load.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['plan', sys.argv[1], '--tp', '4', '--rank', '1']) == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'functional_load.testing') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
