"""Pre-sharded save / reload (``save_sharded``; reliability.md §5 "What our pre-sharded save/reload
should promise").

* Equivalence: a save at tp=4 reloads at tp=4 (each rank opening and reading only its own rank
  file) and reshards to tp=2 and tp=8 (tp=1 where 8 does not divide), bit for bit equal to loading
  the original checkpoint at that tp: llama GQA, gpt2 (tied head, Conv1D transposes), qwen3_moe
  with and without expert parallelism, and two real quantized fixtures (GPTQ act-order, FP8 block).
* Crash consistency: ``sharded_state._step`` is made to raise at every step of the save in turn,
  into a fresh ``out_dir`` and over an older save (of another checkpoint, or of the same one at
  another tp). After each crash the directory holds the old save or the new one, complete and
  loading bit for bit, or (fresh) nothing at all; never a mix that loads, never a temp dir.
* Bit flips: with ``verify_hashes=True`` a flipped byte is an IntegrityError naming the file;
  without it the size check passes and the flipped value loads. That is why ``verify_hashes``
  exists.
* Layout mismatches are ConfigErrors that say what was saved and what was asked.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_state

from functional_load import ReadOptions, load, save_sharded
from functional_load.checkpoint.sharded import MANIFEST, read_manifest
from functional_load.errors import ConfigError, FormatError, IntegrityError, LoadError, MissingFileError
from functional_load.output import save as sharded_state

QUANT = Path(__file__).parent / "fixtures" / "quant"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class Opens:
    """Paths passed to ``os.open`` / ``open`` / ``io.open`` while recording."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.paths: list[str] = []
        real_os_open, real_open, real_io_open = os.open, builtins.open, io.open

        def note(file: Any) -> None:
            if not isinstance(file, int):
                try:
                    self.paths.append(os.path.realpath(os.fsdecode(os.fspath(file))))
                except TypeError:
                    pass

        def os_open(path: Any, *a: Any, **k: Any) -> int:
            note(path)
            return real_os_open(path, *a, **k)

        def b_open(file: Any, *a: Any, **k: Any) -> Any:
            note(file)
            return real_open(file, *a, **k)

        def i_open(file: Any, *a: Any, **k: Any) -> Any:
            note(file)
            return real_io_open(file, *a, **k)

        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(builtins, "open", b_open)
        monkeypatch.setattr(io, "open", i_open)


def data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file (everything after the header)."""
    blob = path.read_bytes()
    return len(blob) - 8 - int.from_bytes(blob[:8], "little")


# --- equivalence ---------------------------------------------------------------------------------

SOURCES: dict[str, tuple[Callable[[Any], Path], dict[str, Any], tuple[int, ...]]] = {
    # name: (source directory, load options, tp sizes to reload at besides the saved 4)
    "llama-gqa": (lambda tc: tc("llama", kv_heads=2), {}, (2, 8)),
    "gpt2": (lambda tc: tc("gpt2"), {}, (2, 8)),
    "qwen3_moe": (lambda tc: tc("qwen3_moe"), {}, (2, 8)),
    "qwen3_moe-ep": (lambda tc: tc("qwen3_moe"), {"expert_parallel": True}, (2, 8)),
    "gptq_actorder": (lambda tc: QUANT / "gptq_actorder", {}, (2, 1)),  # 4 heads: tp 8 does not divide
    "hf_fp8_block": (lambda tc: QUANT / "hf_fp8_block", {}, (1,)),  # saved at 2: o_proj's 256 inputs / 4 < a 128 block
}
SAVED_TP = 4


def saved_tp(name: str) -> int:
    return 2 if name == "hf_fp8_block" else SAVED_TP

_REFS: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}


def reference(source: Path, options: dict[str, Any], tp: int, rank: int) -> dict[str, torch.Tensor]:
    key = (str(source), json.dumps(options, sort_keys=True), tp, rank)
    if key not in _REFS:
        _REFS[key] = dict(load(source, tp_size=tp, rank=rank, progress=False, **options))
    return _REFS[key]


@pytest.fixture(scope="module")
def saves(tiny_checkpoint, tmp_path_factory) -> dict[str, tuple[Path, Path, dict[str, Any]]]:
    out = {}
    for name, (source_of, options, _) in SOURCES.items():
        source = source_of(tiny_checkpoint)
        saved = save_sharded(source, tmp_path_factory.mktemp(name) / "save", tp_size=saved_tp(name), **options)
        out[name] = (source, saved, options)
    return out


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_reload_at_saved_tp_reads_only_own_file(saves, name, monkeypatch):
    source, saved, options = saves[name]
    manifest = read_manifest(saved)
    tp = saved_tp(name)
    assert manifest["parallel"]["tp_size"] == tp and len(manifest["files"]) == tp
    rank_files = {str((saved / f).resolve()) for f in manifest["files"]}
    for rank in range(tp):
        own = (saved / manifest["ranks"][str(rank)]["file"]).resolve()
        opens = Opens(monkeypatch)
        state = load(saved, tp_size=tp, rank=rank, progress=False, **options)
        monkeypatch.undo()
        assert_same_state(state, reference(source, options, tp, rank), f"{name} rank {rank}")
        touched = {p for p in opens.paths if p in rank_files}
        assert touched == {str(own)}, f"rank {rank} opened {sorted(touched)}"
        # every tensor byte read comes from the own file (vocabulary padding is zero-filled, not
        # read; act-order g_idx is read once more per part, to check that the parts agree)
        checks = sum(state.plan.copy_bytes(c) for p in state.plan.params for c in p.checks)
        assert state.stats.bytes_read == state.plan.bytes_to_read <= data_bytes(own) + checks


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_reshard_equals_loading_the_original(saves, name):
    source, saved, options = saves[name]
    for tp in SOURCES[name][2]:
        for rank in range(tp):
            state = load(saved, tp_size=tp, rank=rank, progress=False, **options)
            assert_same_state(state, reference(source, options, tp, rank), f"{name} tp {tp} rank {rank}")


def test_expert_parallel_save_reshards_to_tensor_parallel_experts(saves):
    """An EP save holds whole experts per rank; a plain TP load needs every expert sliced."""
    source, saved, _ = saves["qwen3_moe-ep"]
    for rank in range(2):
        state = load(saved, tp_size=2, rank=rank, progress=False)
        assert_same_state(state, reference(source, {}, 2, rank), f"tp 2 rank {rank}")


# --- kill at every step --------------------------------------------------------------------------


class CrashError(Exception):
    """Stands in for the process dying at a step of the save."""


def record_steps(monkeypatch: pytest.MonkeyPatch, source: Path, out: Path, tp: int) -> list[str]:
    steps: list[str] = []
    monkeypatch.setattr(sharded_state, "_step", steps.append)
    save_sharded(source, out, tp_size=tp)
    monkeypatch.undo()
    return steps


def crash_at(monkeypatch: pytest.MonkeyPatch, k: int) -> list[str]:
    seen: list[str] = []

    def step(name: str) -> None:
        seen.append(name)
        if len(seen) == k + 1:
            raise CrashError(name)

    monkeypatch.setattr(sharded_state, "_step", step)
    return seen


def stray_temps(parent: Path) -> list[str]:
    """Temporary directories or files of a save, anywhere under ``parent``."""
    return sorted(str(p.relative_to(parent)) for p in parent.rglob("*") if ".tmp-" in p.name or p.name.startswith(f".{MANIFEST}"))


def assert_complete(out: Path, source: Path, tp: int) -> set[str]:
    """``out`` is one whole save of ``source`` at ``tp``: every rank loads bit for bit, and no
    file of a half-written save lies beside it."""
    manifest = read_manifest(out)
    assert manifest is not None and manifest["parallel"]["tp_size"] == tp
    listed = set(manifest["files"]) | {MANIFEST, "config.json"}
    assert json.loads((out / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    for rank in range(tp):
        assert_same_state(load(out, tp_size=tp, rank=rank, progress=False), reference(source, {}, tp, rank), f"rank {rank}")
    return listed


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint) -> dict[str, Path]:
    return {"llama": tiny_checkpoint("llama", kv_heads=2), "gpt2": tiny_checkpoint("gpt2")}


NEW_TP = 4


def test_crash_at_every_step_into_a_fresh_directory(checkpoints, tmp_path, monkeypatch):
    source = checkpoints["llama"]
    steps = record_steps(monkeypatch, source, tmp_path / "probe" / "save", NEW_TP)
    assert steps[:2] == ["write rank 0", "fsync rank 0"] and steps[-2:] == ["commit", "cleanup"]
    assert len(steps) == 2 * NEW_TP + 4 and len(set(steps)) == len(steps)
    outcomes = {}
    for k, name in enumerate(steps):
        parent = tmp_path / f"crash-{k}"
        parent.mkdir()
        out = parent / "save"
        crash_at(monkeypatch, k)
        with pytest.raises(CrashError, match=name):
            save_sharded(source, out, tp_size=NEW_TP)
        monkeypatch.undo()
        assert stray_temps(parent) == [], f"crash at {name!r} left {stray_temps(parent)}"
        if out.exists():  # only once the rename committed it
            listed = assert_complete(out, source, NEW_TP)
            assert {p.name for p in out.iterdir()} == listed
            outcomes[name] = "new"
        else:
            assert sorted(os.listdir(parent)) == []
            with pytest.raises(MissingFileError):
                load(out, tp_size=NEW_TP, rank=0, progress=False)
            outcomes[name] = "none"
    # the commit point is the rename of the temporary directory, after the "commit" step
    assert [outcomes[s] for s in steps] == ["none"] * (len(steps) - 1) + ["new"]


OLD_SAVES = {
    "other-checkpoint": ("gpt2", 2),  # gpt2 at tp 2 under the llama tp 4 save
    "same-checkpoint-other-tp": ("llama", 2),
}


@pytest.mark.parametrize("old", sorted(OLD_SAVES))
def test_crash_at_every_step_over_an_older_save(checkpoints, tmp_path, monkeypatch, old):
    old_arch, old_tp = OLD_SAVES[old]
    old_source, new_source = checkpoints[old_arch], checkpoints["llama"]
    pristine = save_sharded(old_source, tmp_path / "pristine" / "save", tp_size=old_tp)
    old_files = set(read_manifest(pristine)["files"])
    steps = record_steps(monkeypatch, new_source, tmp_path / "probe" / "save", NEW_TP)
    outcomes = {}
    for k, name in enumerate(steps):
        parent = tmp_path / f"crash-{k}"
        out = parent / "save"
        shutil.copytree(pristine, out)
        crash_at(monkeypatch, k)
        with pytest.raises(CrashError, match=name):
            save_sharded(new_source, out, tp_size=NEW_TP)
        monkeypatch.undo()
        assert stray_temps(parent) == [], f"crash at {name!r} left {stray_temps(parent)}"
        files = set(read_manifest(out)["files"])
        present = {p.name for p in out.iterdir()}
        if files == old_files:
            listed = assert_complete(out, old_source, old_tp)
            assert present == listed, f"crash at {name!r}: files of the unfinished save left: {sorted(present - listed)}"
            outcomes[name] = "old"
        else:
            assert files.isdisjoint(old_files)
            listed = assert_complete(out, new_source, NEW_TP)
            # a crash between the commit and the cleanup may leave the old rank files (never loaded)
            assert present - listed <= old_files, sorted(present - listed)
            outcomes[name] = "new"
    # the commit point is the manifest's replacement, just before the "commit" step
    assert [outcomes[s] for s in steps] == ["old"] * (len(steps) - 2) + ["new", "new"]


def test_crash_between_manifest_and_config_is_refused(checkpoints, tmp_path, monkeypatch):
    """Over an old save, the manifest and config.json are two renames. A crash between them
    leaves the new manifest with the old config: that mix must not load."""
    out = save_sharded(checkpoints["gpt2"], tmp_path / "save", tp_size=2)
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).name == "config.json":
            raise CrashError("between the renames")
        real_replace(src, dst)

    monkeypatch.setattr(sharded_state.os, "replace", replace)
    with pytest.raises(CrashError):
        save_sharded(checkpoints["llama"], out, tp_size=NEW_TP)
    monkeypatch.undo()
    assert read_manifest(out)["arch"] == "llama"
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    for tp, rank in ((NEW_TP, 0), (2, 1)):
        with pytest.raises(LoadError) as info:
            load(out, tp_size=tp, rank=rank, progress=False)
        assert type(info.value) is IntegrityError and str(out / "config.json") in str(info.value)
    assert stray_temps(tmp_path) == []
    save_sharded(checkpoints["llama"], out, tp_size=NEW_TP)  # a re-save repairs it
    assert_complete(out, checkpoints["llama"], NEW_TP)


def test_edited_config_of_a_save_is_refused(saves, tmp_path):
    _, pristine, _ = saves["llama-gqa"]
    saved = tmp_path / "save"
    shutil.copytree(pristine, saved)
    config = json.loads((saved / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3  # no shape changes: only the hash can tell
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError) as info:
        load(saved, tp_size=SAVED_TP, rank=0, progress=False)
    assert type(info.value) is IntegrityError and "SHA-256" in str(info.value)


def test_resave_over_an_older_save_cleans_up(checkpoints, tmp_path):
    """The happy path over an old save: only the new save's files remain."""
    out = save_sharded(checkpoints["gpt2"], tmp_path / "save", tp_size=2)
    save_sharded(checkpoints["llama"], out, tp_size=NEW_TP)
    listed = assert_complete(out, checkpoints["llama"], NEW_TP)
    assert {p.name for p in out.iterdir()} == listed
    assert stray_temps(tmp_path) == []


# --- bit flips -----------------------------------------------------------------------------------


def test_bit_flip_is_caught_only_with_verify_hashes(saves, tmp_path):
    source, pristine, _ = saves["llama-gqa"]
    saved = tmp_path / "save"
    shutil.copytree(pristine, saved)
    manifest = read_manifest(saved)
    victim = saved / manifest["ranks"]["1"]["file"]
    blob = bytearray(victim.read_bytes())
    at = len(blob) - data_bytes(victim) + data_bytes(victim) // 2  # a byte in the middle of the data
    blob[at] ^= 0x04
    victim.write_bytes(bytes(blob))

    for tp, rank in ((SAVED_TP, 1), (2, 0), (1, 0)):  # own file, and reshards that read it
        with pytest.raises(LoadError) as info:
            load(saved, tp_size=tp, rank=rank, read=ReadOptions(verify_hashes=True), progress=False)
        assert type(info.value) is IntegrityError
        assert str(victim) in str(info.value) and "SHA-256" in str(info.value)
    for rank in (0, 2, 3):  # the other ranks' files are intact and verify
        assert_same_state(
            load(saved, tp_size=SAVED_TP, rank=rank, read=ReadOptions(verify_hashes=True), progress=False),
            reference(source, {}, SAVED_TP, rank),
        )

    # Without hashes only sizes are checked: the flipped byte loads silently. This is the case
    # verify_hashes exists for (after a copy, a download, or on suspect storage).
    state = load(saved, tp_size=SAVED_TP, rank=1, progress=False)
    want = reference(source, {}, SAVED_TP, 1)
    differing = [n for n in want if not torch.equal(state[n].view(torch.uint8), want[n].view(torch.uint8))]
    assert len(differing) == 1
    diff = (state[differing[0]].contiguous().view(torch.uint8) != want[differing[0]].contiguous().view(torch.uint8)).sum()
    assert int(diff) == 1


def test_truncated_rank_file_is_caught_by_the_size_check(saves, tmp_path):
    _, pristine, _ = saves["llama-gqa"]
    saved = tmp_path / "save"
    shutil.copytree(pristine, saved)
    victim = saved / read_manifest(saved)["ranks"]["2"]["file"]
    size = victim.stat().st_size
    os.truncate(victim, size - 1)
    with pytest.raises(LoadError) as info:
        load(saved, tp_size=SAVED_TP, rank=2, progress=False)
    assert type(info.value) is IntegrityError
    assert str(victim) in str(info.value) and f"{size - 1} bytes, the manifest says {size}" in str(info.value)


# --- layout mismatches ---------------------------------------------------------------------------


def test_another_dtype_casts_like_any_checkpoint(saves):
    """A save plans like any checkpoint, so another dtype casts its (virtual original) tensors."""
    source, saved, _ = saves["llama-gqa"]
    for tp, rank in ((SAVED_TP, 0), (2, 1)):
        state = load(saved, tp_size=tp, rank=rank, dtype="float32", progress=False)
        assert_same_state(state, load(source, tp_size=tp, rank=rank, dtype="float32", progress=False), f"tp {tp}")
    with pytest.raises(ConfigError, match="the dtype argument: unsupported model dtype 'int4'"):
        load(saved, tp_size=SAVED_TP, rank=0, dtype="int4", progress=False)


def test_online_quantized_save_reloads_only_as_saved(checkpoints, tmp_path):
    saved = save_sharded(checkpoints["llama"], tmp_path / "save", tp_size=2, quantization="fp8")
    state = load(saved, tp_size=2, rank=1, progress=False)
    want = load(checkpoints["llama"], tp_size=2, rank=1, quantization="fp8", progress=False)
    assert_same_state(state, want)
    with pytest.raises(LoadError) as info:
        load(saved, tp_size=4, rank=0, progress=False)
    assert type(info.value) is ConfigError
    assert str(saved) in str(info.value) and "quantized while loading" in str(info.value)


def test_a_rank_file_without_a_listed_tensor_is_refused(saves, tmp_path):
    """A rank file that lacks a tensor its manifest lists is refused, naming the file and the
    tensor, before anything is read."""
    from safetensors.torch import load_file, save_file

    _, pristine, _ = saves["llama-gqa"]
    saved = tmp_path / "save"
    shutil.copytree(pristine, saved)
    manifest = read_manifest(saved)
    entry = manifest["ranks"]["3"]
    path = saved / entry["file"]
    tensors = load_file(str(path))
    del tensors["model.norm.weight"]
    save_file(tensors, str(path), metadata={"format": "pt", "rank": "3"})
    manifest["files"][entry["file"]]["size"] = path.stat().st_size
    (saved / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FormatError) as info:
        load(saved, tp_size=SAVED_TP, rank=3, progress=False)
    message = str(info.value)
    assert str(path) in message and "'model.norm.weight'" in message and "the manifest lists" in message
