"""Pickle checkpoints never run code (reliability.md §2, inputs 38-42).

Each payload's ``__reduce__`` would create a marker file (through ``os.system``, ``exec`` or
``subprocess``) if anything unpickled it with a full unpickler. Without ``allow_pickle`` the file
is never even opened; with ``allow_pickle=True`` only ``torch.load(weights_only=True)`` sees it and
refuses it (SecurityError); in both cases the marker never appears. A legitimate ``torch.save``
of a state dict loads with ``allow_pickle=True`` bit for bit as the safetensors checkpoint does.
"""

from __future__ import annotations

import builtins
import os
import pickle
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_state, hook_opens

from functional_load import load
from functional_load.checkpoint import pickles
from functional_load.errors import FormatError, LoadError, SecurityError
from functional_load.testing.checkpoints import read_checkpoint_tensors

BIN = "pytorch_model.bin"


# --- payloads ------------------------------------------------------------------------------------


class SystemPayload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class ExecPayload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.exec, (f"open({self.marker!r}, 'w').write('ran')",))


class SubprocessPayload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (subprocess.call, (["touch", self.marker],))


PAYLOADS = {"os.system": SystemPayload, "exec": ExecPayload, "subprocess": SubprocessPayload}


def test_the_payloads_really_run_when_unpickled(tmp_path):
    """Control: a plain ``pickle.loads`` of each payload does create its marker, so the marker's
    absence below means no code ran, not that the payload was a dud."""
    for name, payload in PAYLOADS.items():
        marker = tmp_path / f"control-{name.replace('.', '-')}"
        pickle.loads(pickle.dumps(payload(marker)))
        assert marker.exists(), name


def _torch_archive(path: Path, marker: Path, payload: type) -> None:
    """A torch zip archive whose data.pkl holds a real tensor next to the payload."""
    torch.save({"model.norm.weight": torch.ones(64, dtype=torch.bfloat16), "evil": payload(marker)}, path)


def _top_level(path: Path, marker: Path, payload: type) -> None:
    """The whole archive's object is the payload."""
    torch.save(payload(marker), path)


def _spliced_data_pkl(path: Path, marker: Path, payload: type) -> None:
    """A legitimate torch archive whose ``data.pkl`` was swapped for a plain ``pickle.dumps`` of
    the payload (what a hand-made malicious checkpoint looks like); entries stay uncompressed."""
    torch.save({"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}, path)
    with zipfile.ZipFile(path) as src:
        members = [(info.filename, src.read(info.filename)) for info in src.infolist()]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as dst:
        for name, data in members:
            dst.writestr(name, pickle.dumps(payload(marker), protocol=2) if name.endswith("/data.pkl") else data)


def _raw_pickle(path: Path, marker: Path, payload: type) -> None:
    """Not a zip at all: a bare pickle stream (the legacy format)."""
    path.write_bytes(pickle.dumps({"model.norm.weight": payload(marker)}))


BUILDERS = {"torch-archive": _torch_archive, "top-level": _top_level, "spliced-data-pkl": _spliced_data_pkl, "raw-pickle": _raw_pickle}


# --- spies ---------------------------------------------------------------------------------------


class Spy:
    """Records opens of ``watch`` and every ``torch.load`` call (with its ``weights_only``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, watch: Path):
        self.opened: list[str] = []
        self.loads: list[Any] = []
        watch_real = os.path.realpath(watch)
        real_load = torch.load

        def note(file: Any) -> None:
            if not isinstance(file, int):
                try:
                    if os.path.realpath(os.fsdecode(os.fspath(file))) == watch_real:
                        self.opened.append(str(file))
                except TypeError:
                    pass

        hook_opens(monkeypatch, note)

        def t_load(f: Any, *args: Any, **kwargs: Any) -> Any:
            self.loads.append(kwargs.get("weights_only"))
            return real_load(f, *args, **kwargs)

        monkeypatch.setattr(torch, "load", t_load)

        def forbidden(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("a full (code-running) unpickler was used on a checkpoint")

        monkeypatch.setattr(pickle, "load", forbidden)
        monkeypatch.setattr(pickle, "loads", forbidden)


@pytest.fixture(scope="module")
def config_source(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", kv_heads=2, max_shard_size="10MB")


def _payload_dir(tmp_path: Path, config_source: Path, builder: str, payload: str) -> tuple[Path, Path]:
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(config_source / "config.json", d / "config.json")
    marker = tmp_path / "elsewhere" / "PWNED"
    marker.parent.mkdir()
    BUILDERS[builder](d / BIN, marker, PAYLOADS[payload])
    return d, marker


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_without_allow_pickle_the_file_is_never_opened(tmp_path, monkeypatch, config_source, builder, payload):
    d, marker = _payload_dir(tmp_path, config_source, builder, payload)
    spy = Spy(monkeypatch, d / BIN)
    with pytest.raises(LoadError) as info:
        load(d, progress=False)
    assert type(info.value) is SecurityError
    assert BIN in str(info.value) and "allow_pickle=True" in str(info.value)
    assert spy.opened == [] and spy.loads == []
    assert not marker.exists()


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_with_allow_pickle_weights_only_refuses(tmp_path, monkeypatch, config_source, builder, payload):
    d, marker = _payload_dir(tmp_path, config_source, builder, payload)
    spy = Spy(monkeypatch, d / BIN)
    with pytest.raises(LoadError) as info:
        load(d, allow_pickle=True, progress=False)
    message = str(info.value)
    assert str(d / BIN) in message
    if builder == "raw-pickle":  # refused by the archive check: never handed to any unpickler
        assert type(info.value) is FormatError and "not a zip" in message
        assert spy.loads == []
    else:
        assert type(info.value) is SecurityError
        assert "weights_only" in message and "no code from it ran" in message
        assert "will likely succeed" not in message  # torch's advice to retry with weights_only=False
        assert spy.loads and all(w is True for w in spy.loads), spy.loads  # never a fallback
        # the refusal names the blocked callable
        blocked = {"os.system": "system", "exec": "exec", "subprocess": "call"}[payload]
        assert blocked in message
    assert not marker.exists()


def test_safetensors_win_even_with_allow_pickle(tmp_path, monkeypatch, config_source):
    """A malicious .bin next to model.safetensors is never touched, pickles allowed or not."""
    d = tmp_path / "model"
    shutil.copytree(config_source, d)
    marker = tmp_path / "PWNED"
    _torch_archive(d / BIN, marker, SystemPayload)
    reference = load(config_source, progress=False)
    spy = Spy(monkeypatch, d / BIN)
    for allow in (False, True):
        state = load(d, allow_pickle=allow, progress=False)
        assert_same_state(state, reference)
    assert spy.opened == [] and spy.loads == []
    assert not marker.exists()


def test_old_torch_is_refused(tmp_path, monkeypatch, config_source):
    """torch versions with known weights_only escapes never unpickle anything."""
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(config_source / "config.json", d / "config.json")
    torch.save(read_checkpoint_tensors(config_source), d / BIN)
    monkeypatch.setattr(pickles, "_torch_version", lambda: (2, 5))
    spy = Spy(monkeypatch, d / BIN)
    with pytest.raises(LoadError) as info:
        load(d, allow_pickle=True, progress=False)
    assert type(info.value) is SecurityError and "torch >= 2.10" in str(info.value) and str(d / BIN) in str(info.value)
    assert spy.loads == []


# --- a legitimate pickle loads exactly like the safetensors ----------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("tp", [1, 2])
def test_torch_save_state_dict_equals_safetensors(tmp_path, tiny_checkpoint, arch, tp):
    """``torch.save(state_dict)`` as transformers writes it (tied weights sharing storage, a
    non-contiguous tensor) loads bit for bit like the safetensors checkpoint on every rank."""
    source = tiny_checkpoint(arch, kv_heads=2) if arch == "llama" else tiny_checkpoint(arch)
    tensors = read_checkpoint_tensors(source)
    if arch == "gpt2":  # the tied head, saved as the very same storage as wte (dropped as tied)
        tensors["lm_head.weight"] = tensors["transformer.wte.weight"]
    else:  # same values, transposed strides
        name = "model.layers.0.self_attn.k_proj.weight"
        tensors[name] = tensors[name].t().contiguous().t()
        assert not tensors[name].is_contiguous()
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(source / "config.json", d / "config.json")
    torch.save(tensors, d / BIN)
    for rank in range(tp):
        got = load(d, tp_size=tp, rank=rank, allow_pickle=True, progress=False)
        want = load(source, tp_size=tp, rank=rank, progress=False)
        assert_same_state(got, want)
        assert got.stats.bytes_read > 0
