"""Mutation fuzzing of safetensors headers, the index and config.json (reliability.md §1.4, §4).

Hypothesis mutates a valid tiny checkpoint (llama, 1 layer, GQA) and runs ``plan`` + ``load`` in
process. The only acceptable outcomes are a :class:`LoadError` subclass or a correct load:

* header bytes (bit flips, insertions and deletions inside the header, header-length changes,
  structured edits of the header JSON): a load that succeeds must read a file the reference
  safetensors library also accepts (our rules are a superset of its rules, so no parser
  differential), and must equal loading that library's reading of the file written out afresh
  (so a mutation that is a no-op on meaning loads exactly the original);
* index JSON (text edits, structured edits of keys and values): the index only selects shards,
  so a load that succeeds must equal the original load bit for bit;
* config.json values: a load that succeeds must equal the original, except for the keys that
  legitimately change the output (dtype, tied embeddings).

Any other exception fails the example. Each example runs under a watchdog (an example that takes
over ``EXAMPLE_SECONDS`` is a hang) and an address-space cap (unbounded allocation is a failure,
not a dead machine); pytest-timeout bounds each test. Examples are derandomized, so a run is
reproducible and CI-stable.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_state
from hypothesis import HealthCheck, given, settings
from hypothesis import event as _event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from safetensors.torch import load_file, save_file

from functional_load import load
from functional_load.checkpoint.index import MAX_HEADER_BYTES
from functional_load.errors import LoadError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
EXAMPLE_SECONDS = 10
# CI: a fixed, bounded set of examples. For a longer hunt: FL_FUZZ_EXAMPLES=5000 FL_FUZZ_RANDOM=1.
FUZZ = settings(
    max_examples=int(os.environ.get("FL_FUZZ_EXAMPLES", "400")),
    deadline=None,
    derandomize=not os.environ.get("FL_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- guards --------------------------------------------------------------------------------------


class ExampleHang(BaseException):
    """An example ran past its deadline (raised in the main thread by the watchdog)."""


@contextmanager
def guarded(seconds: float = EXAMPLE_SECONDS, extra_memory: int = 1 << 30) -> Iterator[None]:
    """Watchdog (SIGUSR1 to the main thread after ``seconds``; SIGALRM stays pytest-timeout's) and
    an address-space cap of the current size + ``extra_memory``."""

    def on_timeout(signum: int, frame: Any) -> None:
        raise ExampleHang(f"example ran over {seconds} s: a hang")

    previous = signal.signal(signal.SIGUSR1, on_timeout)
    main = threading.main_thread().ident
    timer = threading.Timer(seconds, lambda: signal.pthread_kill(main, signal.SIGUSR1))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    cap = vm + extra_memory if hard == resource.RLIM_INFINITY else min(vm + extra_memory, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGUSR1, previous)


def event(text: str) -> None:
    """Count outcomes (``--hypothesis-show-statistics``); a no-op outside a Hypothesis example."""
    try:
        _event(text)
    except InvalidArgument:
        pass


def run_load(d: Path, **options: Any) -> tuple[dict[str, torch.Tensor] | None, LoadError | None]:
    """``load`` under the guards: the state, or the LoadError. Anything else propagates (a bug)."""
    with guarded():
        try:
            state = dict(load(d, progress=False, **options))
            event("outcome: loaded")
            return state, None
        except LoadError as exc:
            assert str(exc), "a LoadError must say what is wrong"
            event(f"outcome: {type(exc).__name__}")
            return None, exc


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@contextmanager
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fl-fuzz-") as d:
        yield Path(d)


# --- bases ---------------------------------------------------------------------------------------


class Bases(dict):  # type: ignore[type-arg]
    """The fuzzing bases; a short repr keeps Hypothesis' failure reports readable."""

    def __repr__(self) -> str:
        return f"Bases(single={self['single']}, sharded={self['sharded']})"


@pytest.fixture(scope="module")
def bases(tiny_checkpoint) -> Bases:
    single = tiny_checkpoint("llama", kv_heads=2, num_layers=1, max_shard_size="10MB")
    sharded = tiny_checkpoint("llama", kv_heads=2, num_layers=1)
    assert (single / SINGLE).is_file() and (sharded / INDEX).is_file()
    blob = (single / SINGLE).read_bytes()
    return Bases({
        "single": single,
        "sharded": sharded,
        "blob": blob,
        "header_len": int.from_bytes(blob[:8], "little"),
        "index": json.loads((sharded / INDEX).read_text()),
        "config": json.loads((sharded / "config.json").read_text()),
        "single_state": dict(load(single, progress=False)),
        "sharded_state": dict(load(sharded, progress=False)),
        "sharded_tp2": dict(load(sharded, tp_size=2, rank=1, progress=False)),
    })


def copy_base(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- the harness itself can fail --------------------------------------------------------------------


def test_watchdog_turns_a_hang_into_a_failure():
    started = time.monotonic()
    with pytest.raises(ExampleHang), guarded(seconds=0.5):
        time.sleep(30)
    assert time.monotonic() - started < 5


def test_memory_cap_turns_unbounded_allocation_into_a_failure():
    with pytest.raises(MemoryError), guarded(extra_memory=256 << 20):
        bytearray(4 << 30)


def test_reference_oracle_catches_a_wrong_load(bases, tmp_path):
    """``check_against_reference`` passes for a correct load and fails for one wrong byte."""
    good = bases["single_state"]
    check_against_reference(good, bases["single"] / SINGLE, bases["single"] / "config.json", tmp_path / "a")
    bad = dict(good)
    name = "model.norm.weight"
    bad[name] = good[name].clone()
    bad[name].view(torch.uint8)[0] ^= 1
    with pytest.raises(AssertionError, match=name):
        check_against_reference(bad, bases["single"] / SINGLE, bases["single"] / "config.json", tmp_path / "b")


# --- header mutations ----------------------------------------------------------------------------

INTERESTING_BYTES = [
    b" ", b"\n", b"\t", b"{", b"}", b"[", b"]", b'"', b",", b":", b"0", b"1", b"-", b"9" * 20, b"\x00", b"\xff", b"\\", b"e", b"NaN",
]
DTYPES = ["BF16", "F16", "F32", "F64", "I8", "U8", "I32", "I64", "BOOL", "F8_E4M3", "F8_E5M2", "bf16", "F31", "", None, 3]


def _header_json(blob: bytes, n: int) -> dict:
    return json.loads(blob[8 : 8 + n])


def _struct_edit(data: st.DataObject, header: dict) -> dict:
    """A structured edit of the header JSON (keeps it valid JSON; meaning may change)."""
    names = [k for k in header if k != "__metadata__"]
    name = data.draw(st.sampled_from(names), label="tensor")
    entry = header[name]
    op = data.draw(
        st.sampled_from(
            [
                "dtype", "shape-dim", "shape-swap", "shape-append", "offset",
                "rename", "delete", "duplicate-extent", "extra-field", "metadata",
            ]
        ),
        label="op",
    )
    if op == "dtype":
        entry["dtype"] = data.draw(st.sampled_from(DTYPES), label="dtype")
    elif op == "shape-dim" and entry["shape"]:
        i = data.draw(st.integers(0, len(entry["shape"]) - 1), label="dim")
        sizes = [0, 1, entry["shape"][i] * 2, entry["shape"][i] // 2, -1, 2**63, 2**64]
        entry["shape"][i] = data.draw(st.sampled_from(sizes), label="size")
    elif op == "shape-swap":
        entry["shape"] = list(reversed(entry["shape"]))
    elif op == "shape-append":
        entry["shape"] = entry["shape"] + [1]
    elif op == "offset":
        i = data.draw(st.integers(0, 1), label="which")
        entry["data_offsets"][i] += data.draw(st.sampled_from([-2, -1, 1, 2, 2**32, -(2**40)]), label="delta")
    elif op == "rename":
        new = data.draw(
            st.sampled_from(["", "x", "model.norm.weight", "lm_head.weight", "a\x00b", "../../etc/passwd", "y" * 2000]), label="new name"
        )
        header[new] = header.pop(name)
    elif op == "delete":
        del header[name]
    elif op == "duplicate-extent":
        header[name + ".copy"] = dict(entry)
    elif op == "extra-field":
        entry[data.draw(st.sampled_from(["evil", "dtype2", ""]), label="field")] = 1
    elif op == "metadata":
        header["__metadata__"] = data.draw(
            st.sampled_from([{"format": "pt"}, {"format": 1}, None, [], "pt", {"a": {"b": "c"}}]), label="meta"
        )
    return header


def mutate_header(data: st.DataObject, blob: bytes, n: int) -> bytes:
    kind = data.draw(st.sampled_from(["flip", "insert", "delete", "length", "struct", "struct-padded"]), label="kind")
    head, body = bytearray(blob[: 8 + n]), blob[8 + n :]
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            pos = data.draw(st.integers(0, len(head) - 1), label="pos")
            head[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        return bytes(head) + body
    if kind in ("insert", "delete"):
        pos = data.draw(st.integers(8, 8 + n), label="pos")
        if kind == "insert":
            chunk = data.draw(st.sampled_from(INTERESTING_BYTES) | st.binary(min_size=1, max_size=8), label="bytes")
            head[pos:pos] = chunk
            delta = len(chunk)
        else:
            count = data.draw(st.integers(1, 16), label="count")
            del head[pos : pos + count]
            delta = -min(count, 8 + n - pos)
        if data.draw(st.booleans(), label="fix length"):
            head[:8] = struct.pack("<Q", n + delta)
        return bytes(head) + body
    if kind == "length":
        new = data.draw(
            st.sampled_from([0, 1, 2, n - 1, n + 1, n + 8, MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1, 2**63, 2**64 - 1])
            | st.integers(0, 2**64 - 1),
            label="length",
        )
        head[:8] = struct.pack("<Q", new)
        return bytes(head) + body
    header = _struct_edit(data, _header_json(blob, n))
    text = json.dumps(header).encode()
    if kind == "struct-padded" and len(text) <= n:  # keep the data where it was: pad with spaces
        text = text + b" " * (n - len(text))
    return struct.pack("<Q", len(text)) + text + body


def check_against_reference(state: dict[str, torch.Tensor], mutated: Path, config: Path, work: Path) -> None:
    """A file we loaded must be one the safetensors library reads too, and our load must equal
    the load of what that library read, written out afresh."""
    try:
        tensors = load_file(str(mutated))
    except Exception as exc:
        pytest.fail(f"the loader accepted a file the reference safetensors library rejects ({exc})")
    ref = work / "reference"
    ref.mkdir(parents=True)
    shutil.copy(config, ref / "config.json")
    save_file(tensors, str(ref / SINGLE), metadata={"format": "pt"})
    want, error = run_load(ref)
    assert error is None, f"the mutated file loaded, but its fresh rewrite does not: {error}"
    assert_same_state(state, want, "mutated file vs its reference reading")


@pytest.mark.timeout(120)
@FUZZ
@given(data=st.data())
def test_header_mutations(bases, data):
    blob, n = bases["blob"], bases["header_len"]
    mutated_blob = mutate_header(data, blob, n)
    with scratch() as work:
        d = copy_base(bases["single"], work / "model")
        (d / SINGLE).write_bytes(mutated_blob)
        state, error = run_load(d)
        if error is None:
            check_against_reference(state, d / SINGLE, d / "config.json", work)
            if mutated_blob == blob:
                assert_same_state(state, bases["single_state"], "unmutated")


@pytest.mark.parametrize(
    "header, data",
    [
        pytest.param(b'{"w": {"dtype": "U8", "shape": [2], "data_offsets": [-0, 2]}}', b"ab", id="negative-zero-offset"),
        pytest.param(b'{"w": {"dtype": "U8", "shape": [-0, 2], "data_offsets": [0, 0]}}', b"", id="negative-zero-dim"),
        pytest.param(b'{"w": {"dtype": "U8", "shape": [0, 18446744073709551616], "data_offsets": [0, 0]}}', b"", id="dim-beyond-u64"),
        pytest.param(
            b'{"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "__metadata__": {"a": "b", "a": "c"}}',
            b"ab",
            id="duplicate-metadata-key",
        ),
        pytest.param(b'{"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2.0]}}', b"ab", id="float-offset"),
        pytest.param(b'{"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}\x00\x00', b"ab", id="nul-padding"),
    ],
)
def test_no_parser_differential_on_known_edge_cases(tmp_path, header, data):
    """Everything the reference library rejects, the loader's header parser rejects too
    (``read_header`` directly: these files are not a model)."""
    from functional_load.checkpoint.index import read_header

    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    try:
        load_file(str(path))
        reference_accepts = True
    except Exception:
        reference_accepts = False
    try:
        read_header(path)
        ours_accepts = True
    except LoadError as exc:
        ours_accepts = False
        assert str(path) in str(exc)
    assert not ours_accepts or reference_accepts, "accepted a header the reference safetensors library rejects"


# --- index mutations -----------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
SHARD_VALUES = [
    "model.safetensors", "../model-00001-of-00002.safetensors", "/etc/passwd", "", "a/b", ".", "..",
    "model-00001-of-00002.safetensors\x00", "config.json", INDEX,
]


def mutate_index(data: st.DataObject, index: dict, text: str) -> str:
    kind = data.draw(st.sampled_from(["text", "set", "delete", "rename", "top", "weight_map-type", "duplicate"]), label="kind")
    if kind == "text":
        chars = list(text)
        for _ in range(data.draw(st.integers(1, 4), label="edits")):
            pos = data.draw(st.integers(0, len(chars)), label="pos")
            op = data.draw(st.sampled_from(["insert", "delete", "replace"]), label="op")
            ch = data.draw(st.sampled_from(list('{}[]",:0-.\\ naN') + ["\x00", "é", "\ud800"]), label="char")
            if op == "insert":
                chars.insert(pos, ch)
            elif chars:
                pos = min(pos, len(chars) - 1)
                if op == "delete":
                    del chars[pos]
                else:
                    chars[pos] = ch
        return "".join(chars)
    index = json.loads(text)
    wm = index["weight_map"]
    names, shards = sorted(wm), sorted(set(wm.values()))
    if kind == "set":
        key = data.draw(st.sampled_from(names) | st.text(max_size=10), label="key")
        wm[key] = data.draw(st.sampled_from(shards + SHARD_VALUES) | JSON_VALUES, label="value")
    elif kind == "delete":
        del wm[data.draw(st.sampled_from(names), label="key")]
    elif kind == "rename":
        key = data.draw(st.sampled_from(names), label="key")
        wm[data.draw(st.sampled_from([key + "x", key.upper(), "", " " + key]), label="new")] = wm.pop(key)
    elif kind == "top":
        index[data.draw(st.sampled_from(["metadata", "extra", "weight_map2"]), label="top key")] = data.draw(JSON_VALUES, label="value")
    elif kind == "weight_map-type":
        index["weight_map"] = data.draw(JSON_VALUES, label="weight_map")
    elif kind == "duplicate":  # a raw duplicate key: plain json would keep the last one silently
        key = data.draw(st.sampled_from(names), label="key")
        other = data.draw(st.sampled_from(shards), label="shard")
        body = json.dumps(index)
        return body.replace('"weight_map": {', f'"weight_map": {{{json.dumps(key)}: {json.dumps(other)}, ', 1)
    return json.dumps(index)


@pytest.mark.timeout(120)
@FUZZ
@given(data=st.data())
def test_index_mutations(bases, data):
    text = (bases["sharded"] / INDEX).read_text()
    mutated = mutate_index(data, bases["index"], text)
    tp = data.draw(st.sampled_from([1, 2]), label="tp")
    with scratch() as work:
        d = copy_base(bases["sharded"], work / "model")
        (d / INDEX).write_bytes(mutated.encode("utf-8", "surrogatepass"))
        state, error = run_load(d, tp_size=tp, rank=tp - 1)
        if error is None:  # the index only selects: a load that works is the original load
            assert_same_state(state, bases["sharded_state" if tp == 1 else "sharded_tp2"], "index mutation")


# --- config mutations ----------------------------------------------------------------------------

CONFIG_VALUES = (
    st.sampled_from(
        [
            0, 1, 2, 3, 4, 7, 8, 16, 63, 64, 65, 1000, 10**6, 10**12, -1, 1.5, "8", "", None, True, False, [], {},
            ["LlamaForCausalLM"], ["MistralForCausalLM"], ["Qwen2ForCausalLM"], "llama", "bfloat16", "float16", "float32", "int8",
        ]
    )
    | JSON_VALUES
)
OUTPUT_CHANGING = {"dtype", "torch_dtype", "tie_word_embeddings"}


@pytest.mark.timeout(120)
@FUZZ
@given(data=st.data())
def test_config_mutations(bases, data):
    config = dict(bases["config"])
    keys = sorted(config) + ["quantization_config", "head_dim", "num_key_value_heads", "model_type", "new_key"]
    changed = set()
    for _ in range(data.draw(st.integers(1, 2), label="edits")):
        key = data.draw(st.sampled_from(keys), label="key")
        changed.add(key)
        if data.draw(st.integers(0, 5), label="delete?") == 0:
            config.pop(key, None)
        else:
            config[key] = data.draw(CONFIG_VALUES, label="value")
    with scratch() as work:
        d = copy_base(bases["single"], work / "model")
        (d / "config.json").write_text(json.dumps(config))
        state, error = run_load(d)
        if error is None and not changed & OUTPUT_CHANGING:
            assert_same_state(state, bases["single_state"], f"config edit of {sorted(changed)}")
