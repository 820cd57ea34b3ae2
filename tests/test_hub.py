"""Hugging Face Hub repo ids and cache folders (functional_load.checkpoint.hub), offline.

Each test lays out a Hugging Face cache the way huggingface_hub does (``models--org--name`` with
``blobs/``, ``snapshots/<commit>/`` entries symlinked into the blobs, ``refs/<branch>``), holding
tiny transformers checkpoints, and points ``HF_HUB_CACHE`` at it with ``HF_HUB_OFFLINE=1``. The
lookups run through huggingface_hub's own code; nothing of it is mocked.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same_state

import functional_load as fl
from functional_load.checkpoint.hub import files_to_fetch, is_repo_id
from functional_load.cli import main as cli_main
from functional_load.errors import SecurityError

REPO = "tiny-org/tiny-llama"
MAIN, OTHER = "a" * 40, "b" * 40


def add_snapshot(cache: Path, repo_id: str, source: Path, commit: str, refs: Iterable[str] = ("main",), skip: Iterable[str] = ()) -> Path:
    """Put the files of ``source`` into ``cache`` as huggingface_hub stores a download of
    ``repo_id`` at ``commit``, with ``refs`` pointing at it; returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        if file.name in set(skip):
            continue
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def llama(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", kv_heads=2)


@pytest.fixture
def other(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", kv_heads=2, seed=1)


@pytest.fixture
def cache(tmp_path, monkeypatch, llama, other) -> Path:
    """An offline cache holding REPO at MAIN (refs main) and at OTHER (refs "v2", seed 1)."""
    root = tmp_path / "hf-cache"
    add_snapshot(root, REPO, llama, MAIN)
    add_snapshot(root, REPO, other, OTHER, refs=("v2",))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no relative path named like the repo
    return root


def test_a_repo_id_loads_its_cached_snapshot(cache, llama):
    for tp, rank in ((1, 0), (2, 1)):
        state = fl.load(REPO, tp_size=tp, rank=rank)
        assert_same_state(state, fl.load(llama, tp_size=tp, rank=rank), f"tp {tp} rank {rank}")
        assert Path(state.plan.model_dir) == cache / "models--tiny-org--tiny-llama" / "snapshots" / MAIN
    assert fl.plan(REPO, tp_size=2, rank=1).table() == fl.plan(llama, tp_size=2, rank=1).table()


def test_revision_picks_a_branch_or_a_commit(cache, llama, other):
    want = fl.load(other, tp_size=2, rank=0)
    assert_same_state(fl.load(REPO, tp_size=2, rank=0, revision="v2"), want, "branch v2")
    assert_same_state(fl.load(REPO, tp_size=2, rank=0, revision=OTHER), want, "commit")
    assert_same_state(fl.load(REPO, revision="main"), fl.load(llama), "main")


def test_a_cache_repo_folder_is_the_snapshot_its_ref_names(cache, llama, other):
    folder = cache / "models--tiny-org--tiny-llama"
    assert_same_state(fl.load(folder, tp_size=2, rank=1), fl.load(llama, tp_size=2, rank=1), "refs/main")
    assert_same_state(fl.load(str(folder), revision="v2"), fl.load(other), "refs/v2")
    with pytest.raises(fl.MissingFileError, match=r"no complete snapshot for revision 'v9' \(refs: \['main', 'v2'\]\)"):
        fl.plan(folder, revision="v9")


def test_every_entry_point_takes_a_repo_id(cache, llama, other, tmp_path):
    assert fl.layout(REPO, tp_size=2, rank=1) == fl.layout(llama, tp_size=2, rank=1)
    saved = fl.save_sharded(REPO, tmp_path / "saved", tp_size=2, revision="v2")
    assert_same_state(fl.load(saved, tp_size=2, rank=1), fl.load(other, tp_size=2, rank=1), "save of v2")

    from functional_load.verify import verify_ranks

    report = verify_ranks(REPO, tp_size=2, revision="v2")
    assert report.ok and report.checkpoint_bytes == verify_ranks(other, tp_size=2).checkpoint_bytes

    import jax
    from jax.sharding import Mesh

    params = fl.load_jax(REPO, Mesh(np.array(jax.devices()[:1]), ("tp",)), revision="v2")
    want = fl.load(other)
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "lm_head.weight"):
        got = np.asarray(params[name]).view(np.uint16)
        np.testing.assert_array_equal(got, want[name].view(torch.int16).numpy().view(np.uint16), err_msg=name)


def test_a_missing_repo_offline_says_how_to_download_it(cache):
    with pytest.raises(fl.MissingFileError) as info:
        fl.load("tiny-org/absent")
    message = str(info.value)
    assert "hf download tiny-org/absent" in message and "huggingface-cli download tiny-org/absent" in message
    assert "HF_HUB_OFFLINE=0" in message and str(cache) in message
    assert type(info.value).__module__ == "functional_load.errors"
    with pytest.raises(fl.MissingFileError, match=r"at revision 'nope'.*hf download tiny-org/tiny-llama --revision nope"):
        fl.plan(REPO, revision="nope")


def test_a_partial_snapshot_names_the_missing_shard(tmp_path, monkeypatch, llama):
    root = tmp_path / "hf-cache"
    add_snapshot(root, REPO, llama, MAIN, skip=["model-00003-of-00004.safetensors"])
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(fl.MissingFileError, match=r"model-00003-of-00004\.safetensors"):
        fl.load(REPO)


def test_paths_stay_paths(cache, tmp_path, llama):
    # an existing directory shaped like a repo id is a directory, and revision= does not apply to it
    local = tmp_path / "tiny-org" / "tiny-llama"
    local.parent.mkdir()
    local.symlink_to(llama, target_is_directory=True)
    assert fl.plan("tiny-org/tiny-llama").model_dir == "tiny-org/tiny-llama"
    with pytest.raises(fl.ConfigError, match=r"revision='v2'.*is a local path"):
        fl.plan("tiny-org/tiny-llama", revision="v2")
    # a missing path that is no repo id keeps its old error
    with pytest.raises(fl.LoadError, match="model directory not found"):
        fl.plan(tmp_path / "a" / "b" / "c")
    assert not is_repo_id("./org/name") and not is_repo_id("/org/name") and not is_repo_id("org--x/name")
    assert is_repo_id("Qwen/Qwen3-8B") and not is_repo_id(Path("Qwen/Qwen3-8B"))


def test_the_cli_takes_a_repo_id_and_revision(cache, capsys):
    assert cli_main(["plan", REPO, "--tp", "2", "--rank", "1", "--revision", "v2"]) == 0
    assert "rank 1/2" in capsys.readouterr().out
    assert cli_main(["inspect", REPO]) == 0
    assert f"snapshots/{MAIN}" in capsys.readouterr().out
    assert cli_main(["verify", REPO, "--tp", "2", "--revision", OTHER]) == 0
    assert "verified" in capsys.readouterr().out
    assert cli_main(["plan", "tiny-org/absent"]) == 2
    assert "hf download tiny-org/absent" in capsys.readouterr().err


def test_an_unreachable_hub_falls_back_to_the_cache(cache, llama):
    """Online mode with the Hub unreachable (a closed local port): the cached snapshot is used, and
    a repo that is not cached is a LoadError, not a huggingface_hub exception."""
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    code = (
        "import functional_load as fl\n"
        f"print(fl.plan({REPO!r}, tp_size=2, rank=1).bytes_to_read)\n"
        "try:\n    fl.plan('tiny-org/absent')\nexcept fl.MissingFileError as e:\n    print('missing:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.splitlines()[0] == str(fl.plan(llama, tp_size=2, rank=1).bytes_to_read)
    assert "missing: tiny-org/absent: not in the Hugging Face cache" in out and "could not be downloaded" in out


# --- which files a download fetches (pure: a repo's file list) -----------------------------------

HF_SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def write_index(folder: Path, name: str, shards: list[str]) -> None:
    folder.mkdir(exist_ok=True)
    entries = ", ".join(f'"t{i}": "{shard}"' for i, shard in enumerate(shards))
    (folder / name).write_text(f'{{"weight_map": {{{entries}}}}}')


def test_fetch_only_the_weights_of_the_chosen_format(tmp_path):
    names = ["config.json", "params.json", "consolidated.safetensors", *HF_SHARDS, "model.safetensors.index.json",
             "original/consolidated.00.pth", "pytorch_model.bin", "README.md"]
    write_index(tmp_path, "model.safetensors.index.json", HF_SHARDS)
    assert files_to_fetch(names, "auto", tmp_path) == ("consolidated.safetensors",)  # vLLM: any consolidated -> Mistral
    assert files_to_fetch(names, "mistral", tmp_path) == ("consolidated.safetensors",)
    assert files_to_fetch(names, "hf", tmp_path) == tuple(HF_SHARDS)
    assert files_to_fetch(names, "safetensors", tmp_path) == tuple(HF_SHARDS)
    no_mistral = [n for n in names if not n.startswith("consolidated")]
    assert files_to_fetch(no_mistral, "auto", tmp_path) == tuple(HF_SHARDS)
    # the index keeps the shards it names (a stray copy stays on the Hub)
    write_index(tmp_path, "model.safetensors.index.json", HF_SHARDS[:1])
    assert files_to_fetch(no_mistral, "auto", tmp_path) == tuple(HF_SHARDS[:1])


def test_fetch_pickles_only_without_safetensors_and_only_when_allowed(tmp_path):
    names = ["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "training_args.bin", "extra.pt"]
    assert files_to_fetch(names, "auto", tmp_path, allow_pickle=True) == tuple(names[1:3])
    assert files_to_fetch(names, "pt", tmp_path, allow_pickle=True) == ("extra.pt",)
    with pytest.raises(SecurityError, match="nothing was downloaded"):
        files_to_fetch(names, "auto", tmp_path, where="org/pickles")
    assert files_to_fetch(["config.json"], "auto", tmp_path) == ()
    assert files_to_fetch(names, "unknown", tmp_path) == ()  # the load itself reports the format


def test_fetch_a_saved_layout_by_its_manifest(tmp_path, llama):
    saved = fl.save_sharded(llama, tmp_path / "saved", tp_size=2)
    names = sorted(p.name for p in saved.iterdir())
    fetched = files_to_fetch(names, "auto", saved)
    assert fetched and all(name.endswith(".safetensors") for name in fetched)
    assert set(fetched) == {n for n in names if n.endswith(".safetensors")}
