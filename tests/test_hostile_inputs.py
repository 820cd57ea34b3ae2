"""Hostile inputs (shared/reference/reliability.md §1-§4, the ~50 adversarial inputs): every
malformed checkpoint, index, config, pickle, manifest or file swap raises the most specific
:class:`LoadError` subclass with a message naming the file / tensor and the numbers involved, or,
where the reference says the input must be tolerated, loads bit for bit what the intact
checkpoint loads.

Every case also records every ``open`` / ``os.open`` / ``io.open`` the loader makes while it runs
and checks that each one resolves inside the model directory (Python's own files and the few
``/proc`` and cgroup files the reader consults excepted): a symlinked shard, index, config or
rank file that points elsewhere must be refused *before* it is opened, never opened and then
rejected for its contents.

Each case is a small function that breaks a fresh copy of a real tiny transformers checkpoint
(llama, GQA with 2 KV heads): ``sharded`` (4 shards + index), ``single`` (one
``model.safetensors``), ``pickle`` (config + ``pytorch_model.bin``) or ``presharded`` (a
``save_sharded`` directory at tp=4). Every case runs under an address-space cap (1 GiB over the
current size), so an input that makes the loader allocate without bound fails instead of
exhausting the machine.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import sys
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_state, hook_opens
from safetensors.torch import load_file, save_file

import functional_load
from functional_load import ReadOptions, load, plan, save_sharded
from functional_load.checkpoint import index as index_module
from functional_load.checkpoint.sharded import MANIFEST
from functional_load.errors import (
    CheckpointError,
    ConfigError,
    FormatError,
    IntegrityError,
    LoadError,
    MissingFileError,
    PlanError,
    SecurityError,
)
from functional_load.io import execute
from functional_load.paths import allowed_root
from functional_load.testing.checkpoints import read_checkpoint_tensors

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
EMBED = "model.embed_tokens.weight"
K_PROJ = "model.layers.0.self_attn.k_proj.weight"

# --- recording every open ------------------------------------------------------------------------

# Files the loader may read outside the model directory: the mount table (filesystem type, for the
# prefetch decision) and memory figures (prefetch budget). Nothing else.
SYSTEM_READS = {"/proc/mounts", "/proc/meminfo", "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"}
# Python's own files, the package and its architecture specs (packaged from the repo's specs/).
PYTHON_ROOTS = tuple(
    {
        os.path.realpath(str(p))
        for p in (
            sys.prefix, sys.base_prefix, sys.exec_prefix, Path(functional_load.__file__).parent,
            resources.files("functional_load.specs"),
        )
    }
)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


class OpenLog:
    """Paths handed to ``os.open``, ``builtins.open`` and ``io.open`` while active (any thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.paths: list[str] = []
        self.active = False

        def note(file: Any) -> None:
            if self.active and not isinstance(file, int):
                try:
                    self.paths.append(os.path.abspath(os.fsdecode(os.fspath(file))))
                except TypeError:
                    pass

        hook_opens(monkeypatch, note, skip_dir_fd=True)

    def __enter__(self) -> OpenLog:
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False

    def outside(self, model_dir: Path) -> list[str]:
        """Opened paths that resolve outside ``model_dir``'s allowed root."""
        root = str(allowed_root(model_dir))
        bad = []
        for path in self.paths:
            real = os.path.realpath(path)
            if _inside(real, root) or path in SYSTEM_READS or real in SYSTEM_READS:
                continue
            if any(_inside(real, r) for r in PYTHON_ROOTS):
                continue
            bad.append(f"{path} -> {real}" if real != path else path)
        return bad


@contextmanager
def memory_cap(extra: int = 1 << 30) -> Iterator[None]:
    """Address space capped at the current size + ``extra``: a hostile input that makes the loader
    allocate without bound fails with MemoryError instead of exhausting the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + extra if hard == resource.RLIM_INFINITY else min(vm + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture
def opens(monkeypatch) -> OpenLog:
    return OpenLog(monkeypatch)


def test_the_open_log_sees_an_outside_read(tmp_path, opens):
    """The containment check can fail: a read of a file elsewhere is reported."""
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    (other / "secret").write_text("x")
    os.symlink(other / "secret", model / "link")
    with opens:
        (model / "link").read_text()
        with open(model / "link", "rb"):
            pass
        os.close(os.open(model / "link", os.O_RDONLY))
    assert len(opens.outside(model)) == 3 and all(str(other / "secret") in p for p in opens.outside(model))


# --- bases ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bases(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    sharded = tiny_checkpoint("llama", kv_heads=2)
    single = tiny_checkpoint("llama", kv_heads=2, max_shard_size="10MB")
    assert (single / SINGLE).is_file() and not (single / INDEX).exists()
    assert (sharded / INDEX).is_file() and len(list(sharded.glob("model-*.safetensors"))) >= 3
    pickle_dir = tmp_path_factory.mktemp("pickle")
    shutil.copy(single / "config.json", pickle_dir / "config.json")
    torch.save(read_checkpoint_tensors(single), pickle_dir / "pytorch_model.bin")
    presharded = save_sharded(sharded, tmp_path_factory.mktemp("presharded") / "save", tp_size=4)
    return {"sharded": sharded, "single": single, "pickle": pickle_dir, "presharded": presharded}


_REFERENCE: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}


def reference(bases: dict[str, Path], base: str, tp: int, rank: int) -> dict[str, torch.Tensor]:
    source = "sharded" if base == "presharded" else base
    key = (source, tp, rank)
    if key not in _REFERENCE:
        _REFERENCE[key] = dict(load(bases[source], tp_size=tp, rank=rank, progress=False))
    return _REFERENCE[key]


# --- helpers that break a copy -------------------------------------------------------------------


def st_bytes(header: dict | bytes | str, data: bytes = b"", length: int | None = None) -> bytes:
    """A hand-made safetensors file: u64 LE header length, header, data."""
    if isinstance(header, dict):
        header = json.dumps(header)
    body = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(body) if length is None else length) + body + data


def only_file(d: Path, content: bytes, name: str = SINGLE) -> Path:
    """Replace every weight file of ``d`` with one file of ``content``."""
    for p in list(d.glob("*.safetensors")) + list(d.glob(INDEX)):
        p.unlink()
    (d / name).write_bytes(content)
    return d / name


def T(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def index_of(d: Path) -> dict:
    return json.loads((d / INDEX).read_text())


def write_index(d: Path, index: dict) -> None:
    (d / INDEX).write_text(json.dumps(index, indent=1))


def shard_of(d: Path, tensor: str) -> str:
    return index_of(d)["weight_map"][tensor]


def set_weight_map(d: Path, tensor: str, value: Any) -> None:
    index = index_of(d)
    index["weight_map"][tensor] = value
    write_index(d, index)


def _drop_config_key(d: Path, key: str) -> None:
    config = json.loads((d / "config.json").read_text())
    del config[key]
    (d / "config.json").write_text(json.dumps(config, indent=1))


def edit_config(d: Path, **changes: Any) -> None:
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config, indent=1))


def rewrite_shard(d: Path, shard: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(d / shard))
    edit(tensors)
    save_file(tensors, str(d / shard), metadata={"format": "pt"})


def outside_copy(outside: Path, source: Path, name: str) -> Path:
    outside.mkdir(exist_ok=True)
    shutil.copy(source, outside / name)
    return outside / name


def hostname_copy(outside: Path) -> Path:
    """A stand-in for /etc/hostname, in another temporary directory."""
    outside.mkdir(exist_ok=True)
    target = outside / "hostname"
    target.write_text("build-host-42\n")
    return target


def relink(path: Path, target: Path) -> None:
    path.unlink(missing_ok=True)
    os.symlink(target, path)


def torch_zip(path: Path, obj: Any) -> Path:
    torch.save(obj, path)
    return path


def zip_set_declared_size(path: Path, member_suffix: str, size: int) -> None:
    """Rewrite the central-directory uncompressed size of the member ending in ``member_suffix``."""
    blob = bytearray(path.read_bytes())
    pos = blob.find(b"PK\x01\x02")
    while pos != -1:
        name_len = struct.unpack_from("<H", blob, pos + 28)[0]
        name = bytes(blob[pos + 46 : pos + 46 + name_len]).decode()
        if name.endswith(member_suffix):
            struct.pack_into("<I", blob, pos + 24, size)
            path.write_bytes(bytes(blob))
            return
        pos = blob.find(b"PK\x01\x02", pos + 4)
    raise AssertionError(f"no member {member_suffix} in {path}")


class Payload:
    """Unpickling this would run ``os.system`` (it never may)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# --- the cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """``build(d, outside)`` breaks the copy ``d`` (``outside``: a sibling directory for files the
    loader must never open) and may return extra message substrings. ``after_plan(d)`` runs between
    ``plan`` and ``execute`` instead (files changing under the load). ``expect=None``: the load must
    succeed and equal the intact checkpoint's. ``needles`` are formatted with ``d``."""

    id: str
    category: str
    base: str
    build: Callable[[Path, Path], Any]
    expect: type[LoadError] | None
    needles: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    after_plan: Callable[[Path], Any] | None = None
    never_open: tuple[str, ...] = ()  # file names in the model directory that must not be opened
    timeout: int = 60


F32x2 = T("F32", [2], 0, 8)
DATA8 = b"\x00" * 8
CASES: list[Case] = []


def case(*args: Any, **kwargs: Any) -> None:
    CASES.append(Case(*args, **kwargs))


def header_case(
    id: str, content: bytes | Callable[[], bytes], expect: type[LoadError], *needles: str, category: str = "header format", **kw: Any
) -> None:
    """A case that replaces the weights of the ``single`` base with one crafted file."""
    make = content if callable(content) else (lambda: content)
    case(id, category, "single", lambda d, o: only_file(d, make()) and None, expect, ("{d}/model.safetensors", *needles), **kw)


def offsets_case(*args: Any, **kw: Any) -> None:
    header_case(*args, category="offsets/sizes", **kw)


# 1. header format --------------------------------------------------------------------------------
header_case("header-length-beyond-file", st_bytes(b'{"w": 1}', length=1000), FormatError, "header length 1000", "1008", "file has 16")
header_case("header-over-cap", st_bytes(b"{}", length=index_module.MAX_HEADER_BYTES + 1), FormatError, str(index_module.MAX_HEADER_BYTES + 1), f"cap of {index_module.MAX_HEADER_BYTES}")
header_case("header-length-u64-max", struct.pack("<Q", 2**64 - 1) + b"{}", FormatError, str(2**64 - 1))
header_case("seven-byte-file", b"\x02\x00\x00\x00\x00\x00\x00", FormatError, "8-byte header length", "7 bytes")
header_case("empty-file", b"", FormatError, "0 bytes")
header_case("non-utf8-header", st_bytes(b'{"w\xff\xfe": 1}'), FormatError, "UTF-8")
header_case("not-json", st_bytes(b"{not json"), FormatError, "invalid JSON")
header_case("nul-padded-header", st_bytes(b"{}" + b"\x00" * 6), FormatError, "invalid JSON")
header_case("json-array-header", st_bytes(b"[1, 2]"), FormatError, "JSON object", "list")
header_case("json-string-header", st_bytes(b'"weights"'), FormatError, "JSON object", "str")
header_case(
    "duplicate-tensor-name",  # safetensors itself keeps the last one (U8[4] vs F32[1] on the same bytes)
    st_bytes('{"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', b"\x00\x00\x80\x3f"),
    FormatError, "duplicate JSON key 'w'",
)
header_case("duplicate-metadata", st_bytes('{"__metadata__": {"a": "b"}, "__metadata__": {"a": "c"}}'), FormatError, "duplicate JSON key '__metadata__'")
header_case(
    "duplicate-entry-field",
    st_bytes('{"w": {"dtype": "F32", "dtype": "U8", "shape": [2], "data_offsets": [0, 8]}}', DATA8),
    FormatError, "duplicate JSON key 'dtype'",
)
header_case("nan-in-header", st_bytes('{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}', DATA8), FormatError, "NaN")
header_case("deeply-nested-header", st_bytes(("[" * 200_000 + "]" * 200_000).encode()), FormatError, "nested too deeply")
header_case("unknown-dtype", st_bytes({"w": T("F31", [2], 0, 8)}, DATA8), FormatError, "tensor 'w'", "'F31'")
header_case("dtype-a-list", st_bytes({"w": T([64, 128], [2], 0, 8)}, DATA8), FormatError, "tensor 'w'", "dtype [64, 128]")
header_case("lowercase-dtype", st_bytes({"w": T("f32", [2], 0, 8)}, DATA8), FormatError, "tensor 'w'", "'f32'")
header_case("negative-shape", st_bytes({"w": T("F32", [-1, 2], 0, 8)}, DATA8), FormatError, "tensor 'w'", "[-1, 2]")
header_case("float-shape", st_bytes({"w": T("F32", [2.0], 0, 8)}, DATA8), FormatError, "tensor 'w'", "[2.0]")
header_case("bool-shape", st_bytes({"w": T("F32", [True, 2], 0, 8)}, DATA8), FormatError, "tensor 'w'", "[True, 2]")
header_case("shape-not-a-list", st_bytes({"w": T("F32", "2", 0, 8)}, DATA8), FormatError, "tensor 'w'", "'2'")
header_case("entry-not-an-object", st_bytes({"w": [0, 8]}), FormatError, "tensor 'w'", "[0, 8]")
header_case("missing-data-offsets", st_bytes({"w": {"dtype": "F32", "shape": [2]}}, DATA8), FormatError, "tensor 'w'", "data_offsets")
header_case(
    "unknown-entry-field",  # the safetensors library ignores it; the schema forbids it
    st_bytes({"w": {**F32x2, "evil": 1}}, DATA8), FormatError, "tensor 'w'", "['evil']",
)
header_case("metadata-non-string", st_bytes({"__metadata__": {"format": 1}, "w": F32x2}, DATA8), FormatError, "__metadata__", "'format': 1")
header_case("metadata-a-list", st_bytes({"__metadata__": ["pt"], "w": F32x2}, DATA8), FormatError, "__metadata__", "['pt']")
header_case("name-empty", st_bytes({"": F32x2}, DATA8), FormatError, "tensor name ''")
header_case("name-nul", st_bytes({"a\x00b": F32x2}, DATA8), FormatError, "'a\\x00b'", "control characters")
header_case("name-newline", st_bytes({"model.norm.weight\nINFO forged log line": F32x2}, DATA8), FormatError, "'model.norm.weight\\nINFO forged log line'")
header_case("name-10k-chars", st_bytes({"x" * 10_000: F32x2}, DATA8), FormatError, "'" + "x" * 80 + "'...", "1024 characters")


def _too_many_tensors() -> bytes:
    header = {f"t{i}": T("U8", [1], i, i + 1) for i in range(5)}
    return st_bytes(header, b"\x00" * 5)


header_case("tensor-count-over-cap", _too_many_tensors, FormatError, "declares 5 tensors", "cap of 4")

# 2. offsets and sizes ----------------------------------------------------------------------------
offsets_case("offsets-begin-after-end", st_bytes({"w": T("F32", [2], 8, 0)}, DATA8), FormatError, "tensor 'w'", "[8, 0]")
offsets_case("offsets-negative", st_bytes({"w": T("F32", [2], -8, 0)}, DATA8), FormatError, "tensor 'w'", "[-8, 0]")
offsets_case("offsets-one-number", st_bytes({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8]}}, DATA8), FormatError, "tensor 'w'", "[8]")
offsets_case("offsets-float", st_bytes({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}, DATA8), FormatError, "tensor 'w'", "[0, 8.0]")
offsets_case("span-differs-from-shape", st_bytes({"w": T("F32", [2], 0, 4)}, b"\x00" * 4), FormatError, "tensor 'w'", "span 4 bytes", "needs 8 bytes")
offsets_case("negative-zero-offset", st_bytes('{"w": {"dtype": "F32", "shape": [2], "data_offsets": [-0, 8]}}', DATA8), FormatError, "tensor 'w'", "[-0.0, 8]")
offsets_case("dim-beyond-u64-with-zero", st_bytes('{"w": {"dtype": "F32", "shape": [0, 18446744073709551616], "data_offsets": [0, 0]}}'), FormatError, "tensor 'w'", "[0, 1.8446744073709552e+19]")
offsets_case("integer-of-5000-digits", st_bytes('{"w": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 8]}}', DATA8), FormatError, "invalid JSON", "5000 digits")
offsets_case(
    "shape-product-overflows-u64",  # safetensors: checked_mul (TOB-SFTN-2); here exact big-int maths
    st_bytes({"w": T("F32", [2, 2**63 - 1], 0, 8)}, DATA8), FormatError, "tensor 'w'", str(2 * (2**63 - 1) * 4),
)
_BEYOND = json.dumps({"w": T("U8", [2**40], 0, 2**40)})
offsets_case(
    "offsets-beyond-the-file",
    st_bytes(_BEYOND, DATA8), IntegrityError, "tensor 'w'", f"ends at byte {8 + len(_BEYOND) + 2**40}",
    f"has only {8 + len(_BEYOND) + 8} bytes", "truncated",
)
offsets_case(
    "overlapping-tensors",
    st_bytes({"a": T("F32", [2], 0, 8), "b": T("F32", [2], 4, 12)}, b"\x00" * 12), FormatError, "'b'", "'a'", "[4, 12]", "[0, 8]", "overlaps",
)
offsets_case(
    "same-extent-twice",  # the safetensors json_attack: many tensors on the same bytes
    st_bytes({"a": T("F32", [2], 0, 8), "b": T("F32", [2], 0, 8)}, DATA8), FormatError, "overlaps",
)
offsets_case("hole-at-start", st_bytes({"w": T("F32", [2], 4, 12)}, b"\x00" * 12), FormatError, "tensor 'w'", "starts at 4", "after byte 0")
offsets_case(
    "hole-between-tensors",
    st_bytes({"a": T("F32", [1], 0, 4), "b": T("F32", [1], 8, 12)}, b"\x00" * 12), FormatError, "'b'", "starts at 8", "after byte 4",
)


def _last_shard(d: Path) -> Path:
    return sorted(d.glob("model-*.safetensors"))[-1]


def _append(d: Path, o: Path) -> tuple[str, ...]:
    shard = _last_shard(d)
    size = shard.stat().st_size
    with open(shard, "ab") as f:  # a zip end-of-central-directory record: a safetensors+zip polyglot
        f.write(b"PK\x05\x06" + b"\x00" * 18)
    return (str(shard), f"ends at byte {size}", f"has {size + 22} bytes", "not fully covered")


def _truncate(d: Path, o: Path) -> tuple[str, ...]:
    shard = _last_shard(d)
    size = shard.stat().st_size
    os.truncate(shard, size - 3)
    return (str(shard), f"only {size - 3} bytes", "truncated")


case("trailing-bytes-polyglot", "offsets/sizes", "sharded", _append, FormatError)
case("truncated-data", "offsets/sizes", "sharded", _truncate, IntegrityError)

# 3. JSON / index ---------------------------------------------------------------------------------


def _index_text(d: Path, text: str) -> None:
    (d / INDEX).write_text(text)


def _dup_weight_map(d: Path, o: Path) -> None:
    wm = index_of(d)["weight_map"]
    entries = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in wm.items()]
    entries.append(f'"{EMBED}": {json.dumps(wm[K_PROJ])}')  # a second, conflicting entry
    _index_text(d, '{"weight_map": {' + ", ".join(entries) + "}}")


def _index_edit(edit: Callable[[dict], Any]) -> Callable[[Path, Path], None]:
    def build(d: Path, o: Path) -> None:
        index = index_of(d)
        edit(index)
        write_index(d, index)

    return build


def _missing_shard(d: Path, o: Path) -> tuple[str, ...]:
    index = index_of(d)
    index["weight_map"][EMBED] = "model-00099-of-00099.safetensors"
    write_index(d, index)
    return ("model-00099-of-00099.safetensors",)


def _absent_from_shard(d: Path, o: Path) -> tuple[str, ...]:
    shard = shard_of(d, K_PROJ)
    other = next(s for s in sorted(set(index_of(d)["weight_map"].values())) if s != shard)
    set_weight_map(d, K_PROJ, other)
    return (repr(other),)


case("index-duplicate-keys", "JSON/index", "sharded", _dup_weight_map, FormatError, ("{d}/" + INDEX, f"duplicate JSON key '{EMBED}'"))
case("index-nan", "JSON/index", "sharded", _index_edit(lambda i: i.setdefault("metadata", {}).__setitem__("total_size", float("nan"))), FormatError, ("{d}/" + INDEX, "NaN"))
case("index-infinity", "JSON/index", "sharded", _index_edit(lambda i: i.__setitem__("x", float("inf"))), FormatError, ("{d}/" + INDEX, "Infinity"))
case("index-deep-nesting", "JSON/index", "sharded", lambda d, o: _index_text(d, '{"weight_map": {"a": "b"}, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"), FormatError, ("{d}/" + INDEX, "nested too deeply"))
case("index-not-utf8", "JSON/index", "sharded", lambda d, o: (d / INDEX).write_bytes(b'{"weight_map": {"\xff": "a"}}'), FormatError, ("{d}/" + INDEX, "invalid JSON"))
def _index_huge_integer(d: Path, o: Path) -> None:
    index = json.dumps(index_of(d))
    _index_text(d, index.replace('"weight_map": ', '"total_size": ' + "9" * 5000 + ', "weight_map": ', 1))


case("index-integer-of-5000-digits", "JSON/index", "sharded", _index_huge_integer, FormatError, ("{d}/" + INDEX, "5000 digits"))
case("index-truncated-json", "JSON/index", "sharded", lambda d, o: _index_text(d, (d / INDEX).read_text()[:-40]), FormatError, ("{d}/" + INDEX, "invalid JSON"))
case("index-top-level-list", "JSON/index", "sharded", lambda d, o: _index_text(d, "[]"), FormatError, ("{d}/" + INDEX, "weight_map"))
case("index-weight-map-list", "JSON/index", "sharded", _index_edit(lambda i: i.__setitem__("weight_map", list(i["weight_map"].items()))), FormatError, ("{d}/" + INDEX, "weight_map"))
case("index-weight-map-empty", "JSON/index", "sharded", _index_edit(lambda i: i.__setitem__("weight_map", {})), FormatError, ("{d}/" + INDEX, "non-empty 'weight_map'"))
case("index-value-not-string", "JSON/index", "sharded", lambda d, o: set_weight_map(d, EMBED, 7), FormatError, ("{d}/" + INDEX, f"weight_map['{EMBED}']", "found 7"))
case("index-missing-shard-file", "JSON/index", "sharded", _missing_shard, MissingFileError, ("{d}/" + INDEX,))
case("index-entry-absent-from-shard", "JSON/index", "sharded", _absent_from_shard, CheckpointError, ("{d}/" + INDEX, f"'{K_PROJ}'", "has no such tensor"))
for _value in ("../model-00001-of-00004.safetensors", "/etc/hostname", "sub/model.safetensors", "a\\b.safetensors", ""):
    case(
        f"index-path-{_value or 'empty'}", "JSON/index", "sharded",
        (lambda v: lambda d, o: set_weight_map(d, EMBED, v))(_value), SecurityError, ("{d}/" + INDEX, repr(_value), "plain file name"),
    )


def _extra_unindexed_tensor(d: Path, o: Path) -> None:
    """A tensor in a shard that the index does not list (e.g. an optimizer leftover) is ignored."""
    rewrite_shard(d, shard_of(d, EMBED), lambda t: t.__setitem__("model.layers.0.self_attn.evil.weight", torch.ones(3)))


def _tensor_in_two_shards(d: Path, o: Path) -> None:
    """Another shard also holds the embedding (zeros): the index decides, never "last file wins"."""
    owner = shard_of(d, EMBED)
    for other in sorted({s for s in index_of(d)["weight_map"].values() if s != owner}):
        rewrite_shard(d, other, lambda t: t.__setitem__(EMBED, torch.zeros(1000, 64, dtype=torch.bfloat16)))


def _stray_file(d: Path, o: Path) -> None:
    save_file({EMBED: torch.zeros(1000, 64, dtype=torch.bfloat16)}, str(d / "zz-extra.safetensors"))


case("unindexed-tensor-in-shard", "JSON/index", "sharded", _extra_unindexed_tensor, None)
case("same-tensor-in-two-shards", "JSON/index", "sharded", _tensor_in_two_shards, None)
case("stray-unindexed-file", "JSON/index", "sharded", _stray_file, None, never_open=("zz-extra.safetensors",))

# 4. paths, symlinks, special files ---------------------------------------------------------------


def _shard_to_hostname(d: Path, o: Path) -> tuple[str, ...]:
    target = hostname_copy(o)
    relink(d / SINGLE, target)
    return (str(d / SINGLE), str(target), "outside the model directory")


def _shard_to_valid_outside(d: Path, o: Path) -> tuple[str, ...]:
    """The target is a perfectly valid shard; it is still elsewhere, so it is refused unread."""
    target = outside_copy(o, d / SINGLE, "model.safetensors")
    relink(d / SINGLE, target)
    return (str(target), "outside the model directory")


def _index_to_outside(d: Path, o: Path) -> tuple[str, ...]:
    target = outside_copy(o, d / INDEX, "index.json")
    relink(d / INDEX, target)
    return (str(d / INDEX), str(target), "outside the model directory")


def _config_to_outside(d: Path, o: Path) -> tuple[str, ...]:
    target = outside_copy(o, d / "config.json", "config.json")
    relink(d / "config.json", target)
    return (str(d / "config.json"), str(target), "outside the model directory")


def _loop(d: Path, o: Path) -> None:
    (d / SINGLE).unlink()
    os.symlink(d / "b.safetensors", d / SINGLE)
    os.symlink(d / SINGLE, d / "b.safetensors")


def _fifo_at(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _fifo(d: Path, o: Path) -> None:
    _fifo_at(d / SINGLE)


def _dir_named_like_weights(d: Path, o: Path) -> None:
    (d / "extra.safetensors").mkdir()
    (d / "extra.safetensors" / "model.safetensors").write_bytes(b"garbage")


case("shard-symlink-outside", "paths/symlinks", "single", _shard_to_hostname, SecurityError)
case("shard-symlink-outside-valid", "paths/symlinks", "single", _shard_to_valid_outside, SecurityError)
case("shard-symlink-etc-passwd", "paths/symlinks", "single", lambda d, o: relink(d / SINGLE, Path("/etc/passwd")), SecurityError, ("{d}/model.safetensors", "/etc/passwd"))
case("index-symlink-outside", "paths/symlinks", "sharded", _index_to_outside, SecurityError)
case("config-symlink-outside", "paths/symlinks", "sharded", _config_to_outside, SecurityError)
case("symlink-loop", "paths/symlinks", "single", _loop, SecurityError, ("{d}/", "cannot be resolved"), timeout=10)
case("broken-symlink", "paths/symlinks", "single", lambda d, o: relink(d / SINGLE, d / "gone.safetensors"), MissingFileError, ("{d}/model.safetensors", "broken symlink"))
case("fifo-shard", "paths/symlinks", "single", _fifo, SecurityError, ("{d}/model.safetensors", "not a regular file"), timeout=10)
case("device-shard", "paths/symlinks", "single", lambda d, o: relink(d / SINGLE, Path("/dev/zero")), SecurityError, ("{d}/model.safetensors", "not a regular file"), timeout=10)
case("directory-named-safetensors", "paths/symlinks", "single", _dir_named_like_weights, None)
case("config-fifo", "paths/symlinks", "single", lambda d, o: _fifo_at(d / "config.json"), ConfigError, ("{d}/config.json",), timeout=10)

# 5. config inconsistencies -----------------------------------------------------------------------


def _int_weight(d: Path, o: Path) -> tuple[str, ...]:
    shard = shard_of(d, K_PROJ)
    rewrite_shard(d, shard, lambda t: t.__setitem__(K_PROJ, torch.zeros(16, 64, dtype=torch.int32)))
    return (shard,)


def _config_text(text: str) -> Callable[[Path, Path], None]:
    return lambda d, o: (d / "config.json").write_text(text)


def _config_dup(d: Path, o: Path) -> None:
    text = (d / "config.json").read_text().rstrip().rstrip("}")
    (d / "config.json").write_text(text + ', "num_key_value_heads": 8}')


def _config_edit_naming(tensor: str, **changes: Any) -> Callable[[Path, Path], tuple[str, ...]]:
    """Edit config.json; the message must name the shard that holds ``tensor``."""

    def build(d: Path, o: Path) -> tuple[str, ...]:
        edit_config(d, **changes)
        return (f"in {shard_of(d, tensor)}",)

    return build


case("config-kv-heads-vs-shapes", "config", "sharded", _config_edit_naming(K_PROJ, num_key_value_heads=4), PlanError, (f"'{K_PROJ}'", "[16, 64]", "expected [32, 64]"))
case("config-vocab-vs-shapes", "config", "sharded", _config_edit_naming(EMBED, vocab_size=1024), PlanError, (f"'{EMBED}'", "[1000, 64]", "expected [1024, 64]"))
case("config-hidden-vs-shapes", "config", "sharded", _config_edit_naming(EMBED, hidden_size=128), PlanError, (f"'{EMBED}'", "[1000, 64]", "[1000, 128]"))
case("config-more-layers", "config", "sharded", lambda d, o: edit_config(d, num_hidden_layers=3), PlanError, ("model.layers.2.", "not initialized"))
case("int-tensor-where-float-expected", "config", "sharded", _int_weight, PlanError, (f"'{K_PROJ}'", "dtype I32", "bfloat16"))
case("config-absurd-layers", "config", "sharded", lambda d, o: edit_config(d, num_hidden_layers=10**12), ConfigError, (str(10**12), "config.json"), timeout=20)
case("config-negative-vocab", "config", "sharded", lambda d, o: edit_config(d, vocab_size=-1), ConfigError, ("vocab", "-1", "config.json"))
case("config-heads-a-string", "config", "sharded", lambda d, o: edit_config(d, num_attention_heads="8"), ConfigError, ("'8'", "config.json"))
def _heads_without_head_dim(heads: int) -> Callable[[Path, Path], None]:
    """head_dim is then derived as hidden_size // num_attention_heads."""

    def build(d: Path, o: Path) -> None:
        edit_config(d, num_attention_heads=heads)
        _drop_config_key(d, "head_dim")

    return build


case("config-heads-zero-no-head-dim", "config", "sharded", _heads_without_head_dim(0), ConfigError, ("division", "config.json"))
case("config-heads-beyond-hidden", "config", "sharded", _heads_without_head_dim(65), ConfigError, ("'q'", "65, 0", "config.json"))
case("config-architectures-an-int", "config", "sharded", lambda d, o: edit_config(d, architectures=1), ConfigError, ("'architectures'", "config.json"))
case("config-model-type-a-list", "config", "sharded", lambda d, o: edit_config(d, architectures=[], model_type=["llama"]), ConfigError, ("'model_type'", "['llama']"))
case("config-dtype-int", "config", "sharded", lambda d, o: edit_config(d, dtype="int8"), ConfigError, ("{d}/config.json", "'int8'"))
case("config-duplicate-keys", "config", "sharded", _config_dup, ConfigError, ("{d}/config.json", "duplicate JSON key 'num_key_value_heads'"))
case("config-nan", "config", "sharded", lambda d, o: edit_config(d, rms_norm_eps=float("nan")), ConfigError, ("{d}/config.json", "NaN"))
case("config-deep-nesting", "config", "sharded", _config_text('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"), ConfigError, ("{d}/config.json", "nested too deeply"))
case("config-integer-of-5000-digits", "config", "sharded", _config_text('{"vocab_size": ' + "9" * 5000 + "}"), ConfigError, ("{d}/config.json", "5000 digits"))
case("config-not-an-object", "config", "sharded", _config_text("[1, 2]"), ConfigError, ("{d}/config.json", "list"))
case("config-not-utf8", "config", "sharded", lambda d, o: (d / "config.json").write_bytes(b'{"\xff": 1}'), ConfigError, ("{d}/config.json",))
case("config-missing", "config", "sharded", lambda d, o: (d / "config.json").unlink(), ConfigError, ("{d}/config.json", "no config.json"))
case("config-unknown-arch", "config", "sharded", lambda d, o: edit_config(d, architectures=["EvilForCausalLM"], model_type="evil"), ConfigError, ("EvilForCausalLM",))

# 6. pickles --------------------------------------------------------------------------------------
BIN = "pytorch_model.bin"


def _huge_entry(d: Path, o: Path) -> tuple[str, ...]:
    zip_set_declared_size(d / BIN, "data.pkl", 2**31)
    return (str(2**31), f"file's {(d / BIN).stat().st_size}")


def _compressed(d: Path, o: Path) -> None:
    with zipfile.ZipFile(d / BIN) as src:
        members = [(info, src.read(info.filename)) for info in src.infolist()]
    with zipfile.ZipFile(d / BIN, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for info, data in members:
            dst.writestr(info.filename, data)


def _escaping_member(d: Path, o: Path) -> None:
    with zipfile.ZipFile(d / BIN, "a") as z:
        z.writestr("../../escape.txt", b"x")


def _payload(d: Path, o: Path) -> tuple[str, ...]:
    marker = o / "PWNED"
    o.mkdir(exist_ok=True)
    torch.save({EMBED: torch.zeros(2), "x": Payload(marker)}, d / BIN)
    return ("weights_only", "no code from it ran")


def _both_formats(d: Path, o: Path) -> None:
    o.mkdir(exist_ok=True)
    torch.save({"x": Payload(o / "PWNED")}, d / BIN)


case("bin-without-allow-pickle", "pickles", "pickle", lambda d, o: None, SecurityError, ("{d}", BIN, "allow_pickle=True"), never_open=(BIN,))
case("bin-entry-larger-than-file", "pickles", "pickle", _huge_entry, SecurityError, ("{d}/" + BIN, "data.pkl", "zip bomb"), options={"allow_pickle": True})
case("bin-compressed-entries", "pickles", "pickle", _compressed, SecurityError, ("{d}/" + BIN, "compressed"), options={"allow_pickle": True})
case("bin-member-escapes", "pickles", "pickle", _escaping_member, SecurityError, ("{d}/" + BIN, "'../../escape.txt'"), options={"allow_pickle": True})
case("bin-top-object-a-list", "pickles", "pickle", lambda d, o: torch.save([torch.zeros(2)], d / BIN), FormatError, ("{d}/" + BIN, "found list"), options={"allow_pickle": True})
case("bin-values-not-tensors", "pickles", "pickle", lambda d, o: torch.save({"w": "str", "n": {"nested": [1, 2]}}, d / BIN), FormatError, ("{d}/" + BIN, "tensor names to tensors"), options={"allow_pickle": True})
case("bin-raw-pickle", "pickles", "pickle", lambda d, o: (d / BIN).write_bytes(__import__("pickle").dumps({"w": [1.0]})), FormatError, ("{d}/" + BIN, "not a zip"), options={"allow_pickle": True})
case("bin-truncated-archive", "pickles", "pickle", lambda d, o: os.truncate(d / BIN, (d / BIN).stat().st_size // 2), FormatError, ("{d}/" + BIN,), options={"allow_pickle": True})
case("bin-reduce-payload", "pickles", "pickle", _payload, SecurityError, ("{d}/" + BIN,), options={"allow_pickle": True})
case("both-safetensors-and-bin", "pickles", "single", _both_formats, None, never_open=(BIN,))

# 7. files changing under the load ----------------------------------------------------------------


def _victim(d: Path) -> Path:
    return d / shard_of(d, EMBED)


def _truncate_after_plan(d: Path) -> tuple[str, ...]:
    path = _victim(d)
    size = path.stat().st_size
    os.truncate(path, size - 100)
    return (str(path), f"'{EMBED}'", f"now has {size - 100}", "truncated")


def _rewrite_same_size(d: Path) -> tuple[str, ...]:
    """New bytes, same size, same inode; only the mtime tells (it is pushed 1 s on, as any real
    rewrite later than the plan would move it; a rewrite within the clock tick is undetectable
    by stat, which is what verify_hashes-style checks are for)."""
    path = _victim(d)
    before = path.stat()
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(blob)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    assert path.stat().st_ino == before.st_ino and path.stat().st_size == before.st_size
    return (str(path), "changed after it was indexed", f"mtime_ns {before.st_mtime_ns} -> {before.st_mtime_ns + 1_000_000_000}")


def _replace_by_rename(d: Path) -> tuple[str, ...]:
    """Same bytes and times, new inode (an atomic ``mv`` of a re-download)."""
    path = _victim(d)
    before = path.stat()
    shutil.copy2(path, path.with_name("new.tmp"))
    os.replace(path.with_name("new.tmp"), path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    return (str(path), f"inode {before.st_ino} -> {path.stat().st_ino}")


def _grow(d: Path) -> tuple[str, ...]:
    path = _victim(d)
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x00" * 16)
    return (str(path), f"size {size} -> {size + 16}")


def _delete(d: Path) -> tuple[str, ...]:
    path = _victim(d)
    path.unlink()
    return (str(path),)


for _id, _change, _expect in [
    ("truncated-after-plan", _truncate_after_plan, IntegrityError),
    ("rewritten-in-place-after-plan", _rewrite_same_size, IntegrityError),
    ("replaced-by-rename-after-plan", _replace_by_rename, IntegrityError),
    ("grown-after-plan", _grow, IntegrityError),
    ("deleted-after-plan", _delete, IntegrityError),
]:
    case(_id, "changing files", "sharded", lambda d, o: None, _expect, after_plan=_change)


def _delete_pickle(d: Path) -> tuple[str, ...]:
    (d / BIN).unlink()
    return (str(d / BIN), "disappeared")


def _rewrite_pickle(d: Path) -> tuple[str, ...]:
    before = (d / BIN).stat()
    state = torch.load(d / BIN, weights_only=True)
    state[EMBED] = torch.zeros_like(state[EMBED])
    torch.save(state, d / BIN)
    os.utime(d / BIN, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    return (str(d / BIN), "changed after it was indexed")


case("pickle-deleted-after-plan", "changing files", "pickle", lambda d, o: None, IntegrityError, options={"allow_pickle": True}, after_plan=_delete_pickle)
case("pickle-rewritten-after-plan", "changing files", "pickle", lambda d, o: None, IntegrityError, options={"allow_pickle": True}, after_plan=_rewrite_pickle)

# 8. pre-sharded manifests ------------------------------------------------------------------------


def _manifest(d: Path) -> dict:
    return json.loads((d / MANIFEST).read_text())


def _edit_manifest(edit: Callable[[dict], Any]) -> Callable[[Path, Path], None]:
    def build(d: Path, o: Path) -> None:
        m = _manifest(d)
        edit(m)
        (d / MANIFEST).write_text(json.dumps(m))

    return build


def _rank_file(d: Path, rank: int) -> Path:
    return d / _manifest(d)["ranks"][str(rank)]["file"]


def _rename_file_key(new: str) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        old = m["ranks"]["1"]["file"]
        m["files"][new] = m["files"].pop(old)
        m["ranks"]["1"]["file"] = new

    return edit


def _size_mismatch(d: Path, o: Path) -> tuple[str, ...]:
    path = _rank_file(d, 1)
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x00")
    return (str(path), f"{size + 1} bytes, the manifest says {size}")


def _bit_flip(d: Path, o: Path) -> tuple[str, ...]:
    path = _rank_file(d, 1)
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0x01
    path.write_bytes(bytes(blob))
    return (str(path), "SHA-256")


def _delete_rank(rank: int) -> Callable[[Path, Path], tuple[str, ...]]:
    def build(d: Path, o: Path) -> tuple[str, ...]:
        path = _rank_file(d, rank)
        path.unlink()
        return (str(path), "missing")

    return build


def _rank_file_outside(d: Path, o: Path) -> tuple[str, ...]:
    path = _rank_file(d, 1)
    target = outside_copy(o, path, path.name)
    relink(path, target)
    return (str(path), str(target), "outside")


def _manifest_outside(d: Path, o: Path) -> tuple[str, ...]:
    target = outside_copy(o, d / MANIFEST, MANIFEST)
    relink(d / MANIFEST, target)
    return (str(d / MANIFEST), str(target), "outside")


def _dup_manifest(d: Path, o: Path) -> None:
    text = (d / MANIFEST).read_text().rstrip().rstrip("}")
    (d / MANIFEST).write_text(text + ', "version": 1}')


PRE = {"tp_size": 4, "rank": 1}
case("manifest-bad-version", "manifests", "presharded", _edit_manifest(lambda m: m.__setitem__("version", 3)), FormatError, ("{d}/" + MANIFEST, "version 3"), PRE)
case("manifest-bad-format", "manifests", "presharded", _edit_manifest(lambda m: m.__setitem__("format", "evil")), FormatError, ("{d}/" + MANIFEST,), PRE)
case("manifest-duplicate-keys", "manifests", "presharded", _dup_manifest, FormatError, ("{d}/" + MANIFEST, "duplicate JSON key 'version'"), PRE)
case("manifest-nan", "manifests", "presharded", _edit_manifest(lambda m: m.__setitem__("x", float("nan"))), FormatError, ("{d}/" + MANIFEST, "NaN"), PRE)
case("manifest-not-json", "manifests", "presharded", lambda d, o: (d / MANIFEST).write_text("{"), FormatError, ("{d}/" + MANIFEST, "invalid JSON"), PRE)
case("manifest-files-not-object", "manifests", "presharded", _edit_manifest(lambda m: m.__setitem__("files", [])), FormatError, ("{d}/" + MANIFEST, "'files'"), PRE)
for _name in ("../model-rank-1.safetensors", "sub/model-rank-1.safetensors", "/tmp/model-rank-1.safetensors", ".hidden.safetensors"):
    case(f"manifest-file-name-{_name}", "manifests", "presharded", _edit_manifest(_rename_file_key(_name)), FormatError, ("{d}/" + MANIFEST, repr(_name), "plain file name"), PRE)
case("manifest-size-mismatch", "manifests", "presharded", _size_mismatch, IntegrityError, (), PRE)
case("manifest-sha-mismatch-verify-hashes", "manifests", "presharded", _bit_flip, IntegrityError, (), {**PRE, "read": ReadOptions(verify_hashes=True)})
case("manifest-rank-file-deleted", "manifests", "presharded", _delete_rank(1), IntegrityError, (), PRE)
case("manifest-rank-file-deleted-reshard", "manifests", "presharded", _delete_rank(2), IntegrityError, (), {"tp_size": 2, "rank": 1})
case("manifest-rank-not-in-files", "manifests", "presharded", _edit_manifest(lambda m: m["ranks"]["1"].__setitem__("file", "model-rank-9.safetensors")), FormatError, ("{d}/" + MANIFEST, "'model-rank-9.safetensors'"), PRE)
case("manifest-rank-missing", "manifests", "presharded", _edit_manifest(lambda m: m["ranks"].pop("1")), FormatError, ("{d}/" + MANIFEST, "rank"), PRE)
# Deeper manifest fields: read_manifest's schema check names them.
for _id, _edit, _opts in [
    ("manifest-no-expert-parallel", lambda m: m["parallel"].pop("expert_parallel"), PRE),
    ("manifest-no-dtype", lambda m: m.pop("dtype"), PRE),
    ("manifest-params-no-sources", lambda m: [p.pop("sources") for p in m["ranks"]["0"]["params"].values()], {"tp_size": 2, "rank": 0}),
    ("manifest-tensor-shape-a-string", lambda m: [t.__setitem__("shape", "x") for t in m["tensors"].values()], {"tp_size": 2, "rank": 0}),
]:
    CASES.append(Case(_id, "manifests", "presharded", _edit_manifest(_edit), FormatError, ("{d}/" + MANIFEST, "manifest field"), _opts))
case("manifest-rank-file-symlink-outside", "manifests", "presharded", _rank_file_outside, SecurityError, (), PRE)
case("manifest-symlink-outside", "manifests", "presharded", _manifest_outside, SecurityError, (), PRE)


# --- the test ------------------------------------------------------------------------------------


def _params() -> list[Any]:
    return [
        pytest.param(c, id=f"{c.category}:{c.id}", marks=[pytest.mark.timeout(c.timeout)])
        for c in CASES
    ]


def test_case_list_covers_every_category():
    categories = {c.category for c in CASES}
    assert categories == {
        "header format", "offsets/sizes", "JSON/index", "paths/symlinks", "config", "pickles", "changing files", "manifests",
    }
    assert len({c.id for c in CASES}) == len(CASES) and len(CASES) >= 40


@pytest.mark.parametrize("c", _params())
def test_hostile_input(c: Case, bases, tmp_path, opens, monkeypatch):
    if c.id == "tensor-count-over-cap":
        monkeypatch.setattr(index_module, "MAX_TENSORS", 4)
    d, outside = tmp_path / "model", tmp_path / "outside"
    shutil.copytree(bases[c.base], d, symlinks=True)
    extra = c.build(d, outside)
    extra = extra if isinstance(extra, tuple) else ()
    options = {"tp_size": 1, "rank": 0, "progress": False, **c.options}

    error: LoadError | None = None
    state = None
    with memory_cap(), opens:
        try:
            if c.after_plan is None:
                state = load(d, **options)
            else:
                the_plan = plan(d, **{k: v for k, v in options.items() if k != "progress"})
                opens.active = False
                extra = c.after_plan(d)
                opens.active = True
                state = execute(the_plan, progress=False)
        except LoadError as exc:
            error = exc

    if c.expect is None:
        assert error is None, f"expected a clean load, got {type(error).__name__}: {error}"
        assert_same_state(state, reference(bases, c.base, options["tp_size"], options["rank"]))
    else:
        assert error is not None, f"expected {c.expect.__name__}, but the load succeeded"
        assert type(error) is c.expect, f"expected {c.expect.__name__}, got {type(error).__name__}: {error}"
        message = str(error)
        for needle in (*c.needles, *extra):
            assert needle.format(d=d) in message, f"{needle.format(d=d)!r} not in message:\n{message}"
    assert opens.outside(d) == [], f"opened outside the model directory: {opens.outside(d)}"
    forbidden = [p for p in opens.paths if Path(p).name in c.never_open]
    assert forbidden == [], f"opened {forbidden}"
    if outside.exists():
        assert not (outside / "PWNED").exists()


def test_hf_cache_snapshot_symlinks_load(bases, tmp_path, opens):
    """Containment allows the Hugging Face cache layout: snapshot files that link into ``blobs``."""
    repo = tmp_path / "models--tiny--llama"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted(bases["sharded"].iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copy(path, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / path.name)
    with opens:
        state = load(snapshot, progress=False)
    assert_same_state(state, reference(bases, "sharded", 1, 0))
    assert opens.outside(snapshot) == []
    assert any("/blobs/" in os.path.realpath(p) for p in opens.paths)


def test_file_gone_before_the_final_check(bases, tmp_path):
    """verify_unchanged (run after every read) reports a vanished shard as an IntegrityError."""
    from functional_load.io import verify_unchanged

    d = tmp_path / "model"
    shutil.copytree(bases["sharded"], d)
    the_plan = plan(d)
    victim = d / shard_of(d, EMBED)
    victim.unlink()
    with pytest.raises(LoadError) as info:
        verify_unchanged(the_plan)
    assert type(info.value) is IntegrityError
    assert str(victim) in str(info.value) and "disappeared" in str(info.value)
