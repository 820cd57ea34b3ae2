"""A Llama checkpoint into real JAX stacks' own parameter trees: functional_load vs each stack's
own loader vs Orbax v1's safetensors layout (issue 20, item 7).

Stacks and targets (8 CPU devices, ``XLA_FLAGS=--xla_force_host_platform_device_count=8``, one
process, the meshes of ``tests/test_jax_stacks.py``):

* ``tpu-inference`` 0.32, its JAX ``llama3`` model (``LlamaForCausalLM``), mesh data 2 x model 4,
  shipped map ``tpu-inference.llama3``; runs in ``.venv-tpu-inference``.
* ``maxtext`` 0.2.5, its llama3.1 decoder with scanned layers, mesh fsdp 4 x tensor 2, shipped map
  ``maxtext.llama3.1``; runs in ``.venv-maxtext``.

Methods (each measurement a fresh process of that stack's environment):

* ``functional_load``: the stack builds its abstract tree (``abstract_target``), then
  ``fl.load_jax(ckpt, target=tree, mapping=<shipped map>)``.
* ``own``: the stack's own loader from the HF checkpoint. tpu-inference: ``_get_nnx_model`` (builds
  the model, ``model.load_weights``, ``create_jit_model``). MaxText: its ``to_maxtext`` conversion
  (lazy safetensors reads, writes an Orbax checkpoint) then ``load_params_from_path`` (Orbax
  restore into the abstract tree): what a MaxText user runs to serve an HF checkpoint.
* ``own_restore`` (MaxText): the restore alone, from an Orbax checkpoint converted once beforehand
  (not timed): MaxText's steady state.
* ``orbax_v1``: Orbax v1 (``orbax-checkpoint`` 0.12.8, ``.venv-maxtext``) safetensors layout
  loading safetensors files that already hold the target's leaves in its names (key paths) and
  layout, written once beforehand from functional_load's result; the target is the stack's
  abstract tree flattened (MaxText: built by MaxText in the same process; tpu-inference: its
  shapes, dtypes and shardings rebuilt from a JSON description, since Orbax is not installed in
  tpu-inference's environment, so its "target s" is not the stack's own build time).

Scenarios: ``cold`` (every file the method reads dropped from the page cache first, ``measure.prepare``)
and ``hot`` (all of them read into the page cache first). Rounds interleave stacks, scenarios and
methods (method order rotated each round).

Columns (per stack, scenario, method; seconds median (min) over rounds, the rest median):

* ``wall s``: time from after the imports (stack, jax with its 8 devices, functional_load,
  Orbax) until every output array is ready (``jax.block_until_ready``), including building the
  target tree (``target s``) where the method needs one and, for MaxText ``own``, the conversion.
* ``target s``: the part of ``wall`` spent building the abstract target ("-" where the stack's
  own loader builds its model inside its own call).
* ``storage read``: ``read_bytes`` of ``/proc/self/io`` over the timed span: bytes this process
  (all its threads) made the kernel fetch from the block device (mmap faults included; page-cache
  hits are not, so hot runs read about 0).
* ``logical read``: the loader's own count of tensor bytes it took out of files: functional_load's
  ``Reader.bytes_read``; tpu-inference: ``ReadCounter`` (``get_tensor`` bytes of every
  ``safe_open``); MaxText ``own``: ``get_tensor`` bytes of the conversion's ``safe_open`` (the
  restore of the Orbax files it wrote is not counted; see ``storage read``); Orbax:
  ``/jax/orbax/read/safetensors/bytes_read``; "-" where there is no counter.
* ``shards hold``: bytes of this process's distinct shards (a box held by several devices once):
  what the process must read at least. With one process holding all 8 devices that is the whole
  model, so every method must read every byte once; over-read shows as a ratio above 1.
* ``peak RSS``: ``VmHWM`` of ``/proc/self/status`` at the end (includes file pages mapped by
  mmap readers, and the imports: ``RSS before`` is ``VmRSS`` just before the timed span).
* ``own / this``: the stack's ``own`` median wall divided by this method's (above 1: faster than
  the stack's own loader from the HF checkpoint).
* ``arrays``: whether every output leaf equals functional_load's bit for bit in that round
  (blake2b of each leaf, computed after the measurement; ``--no-check`` skips it). Expected
  exception: MaxText's ``query.kernel`` (its conversion scales q by 1/sqrt(head_dim) in XLA on CPU,
  which flushes subnormal results to zero; functional_load keeps them; the random bf16 data of
  ``make_checkpoint.py`` has about 3 % of q values whose scaled value is subnormal: smoke run,
  72,366 of 2,097,152 values, all ``0`` there and ``|x| < 1.2e-38`` here).

The checkpoint is Llama-3-8B-shaped (``make_checkpoint.py`` with other dimensions, see
:func:`llama3_checkpoint`): hidden 4096, intermediate 14336, 32 heads, 8 KV heads, head_dim 128,
RoPE theta 500000 in ``rope_parameters`` (transformers 5 spelling, default rope type), untied
``lm_head``, bf16, but vocab 32000 (Llama-3's 128256 alone would put 2.1 GB in the embeddings) and
3 layers: 1.83 GB, in ``/tmp/fl-bench/llama3-8b-3l``. ``--small`` writes a scaled-down one (hidden
1024, 8 heads, 4 KV heads) for a smoke run. Both stacks build from this config as it is:
tpu-inference reads it through vLLM's ``ModelConfig``; MaxText through the overrides of
``maxtext_stack.overrides`` (``rope_use_scale=false`` for the default rope type).

Run on a quiet machine, from the repository root, in the main environment (torch writes the
checkpoint; the stack environments are built by ``python -m harness.jaxstacks.env``)::

    nice -n 10 .venv/bin/python benchmarks/bench_jax_targets.py [--rounds 7] [--stacks tpu-inference,maxtext]
        [--methods functional_load,own,own_restore,orbax_v1] [--scenarios cold,hot] [--json OUT.json] [--small]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

RESULT_TAG = "@@JAXBENCH-RESULT "
ROOT = Path("/tmp/fl-bench")
DEVICES = 8


class Stack:
    def __init__(self, name: str, venv: str, mesh: dict[str, int], mapping: str, options: dict[str, Any],
                 methods: tuple[str, ...]) -> None:
        self.name, self.venv, self.mesh, self.mapping, self.options, self.methods = name, venv, mesh, mapping, options, methods

    @property
    def mesh_text(self) -> str:
        return " x ".join(f"{k} {v}" for k, v in self.mesh.items())

    @property
    def tag(self) -> str:
        return self.name + "-" + "x".join(f"{k}{v}" for k, v in self.mesh.items()) + ("-scan" if self.options.get("scan_layers") else "")


STACKS = {
    "tpu-inference": Stack("tpu-inference", ".venv-tpu-inference", {"data": 2, "model": 4}, "tpu-inference.llama3", {},
                           ("functional_load", "own", "orbax_v1")),
    "maxtext": Stack("maxtext", ".venv-maxtext", {"fsdp": 4, "tensor": 2}, "maxtext.llama3.1", {"scan_layers": True},
                     ("functional_load", "own", "own_restore", "orbax_v1")),
}
WORKER_MODULES = {"tpu-inference": "harness.jaxstacks.tpu_inference_stack",
                  "maxtext": "harness.jaxstacks.maxtext_stack"}
ORBAX_VENV = ".venv-maxtext"  # orbax-checkpoint's v1 safetensors layout is installed there only
COUNTERS = {
    ("tpu-inference", "functional_load"): "Reader.bytes_read",
    ("maxtext", "functional_load"): "Reader.bytes_read",
    ("tpu-inference", "own"): "ReadCounter (safe_open get_tensor)",
    ("maxtext", "own"): "conversion's safe_open get_tensor (restore not counted)",
    ("maxtext", "own_restore"): None,
    ("tpu-inference", "orbax_v1"): "orbax bytes_read",
    ("maxtext", "orbax_v1"): "orbax bytes_read",
}

# ------------------------------------------------------------------------------------------------
# The checkpoint: make_checkpoint.py's writer with Llama-3 dimensions and config


PRESETS = {
    # name: (hidden, intermediate, heads, kv heads, vocab, layers)
    "llama3-8b": (4096, 14336, 32, 8, 32000, 3),
    "llama3-small": (1024, 3584, 8, 4, 32000, 2),
}
HEAD_DIM = 128
ROPE_THETA = 500000.0


def llama3_config(hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int, layers: int) -> dict[str, Any]:
    """Llama-3's config.json fields (rope theta 500000 in ``rope_parameters``, explicit ``head_dim``,
    GQA) at the given sizes; bos/eos 1/2 (Llama-3's 128000/128001 exceed vocab 32000)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
        "intermediate_size": intermediate, "max_position_embeddings": 8192, "mlp_bias": False,
        "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": kv_heads, "head_dim": HEAD_DIM,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "tie_word_embeddings": False, "dtype": "bfloat16", "use_cache": True, "vocab_size": vocab,
    }


def llama3_checkpoint(preset: str, layers: int | None = None, out: Path | None = None) -> Path:
    """Write (once) a Llama-3-shaped bf16 checkpoint with ``make_checkpoint.write_checkpoint``, its
    dimension constants set to the preset's for the call, then its config.json replaced by
    :func:`llama3_config`. Needs torch (the main ``.venv``)."""
    import make_checkpoint as mc

    hidden, inter, heads, kv, vocab, default_layers = PRESETS[preset]
    layers = layers or default_layers
    out = out or ROOT / f"{preset}-{layers}l"
    names = ("HIDDEN", "INTERMEDIATE", "HEADS", "KV_HEADS", "VOCAB", "HEAD_DIM")
    saved = {n: getattr(mc, n) for n in names}
    for n, v in zip(names, (hidden, inter, heads, kv, vocab, HEAD_DIM)):
        setattr(mc, n, v)
    try:
        assert hidden == heads * HEAD_DIM, "make_checkpoint's shapes use hidden = heads * head_dim"
        mc.write_checkpoint(out, layers=layers)
    finally:
        for n, v in saved.items():
            setattr(mc, n, v)
    config = json.dumps(llama3_config(hidden, inter, heads, kv, vocab, layers), indent=2) + "\n"
    if (out / "config.json").read_text() != config:
        (out / "config.json").write_text(config)
    return out


def safetensors_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def all_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.stat().st_size > 0)


# ------------------------------------------------------------------------------------------------
# Worker side (runs in a stack environment)


def _proc_io(field: str = "read_bytes") -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class SafeOpenCounter:
    """Tensor bytes of every ``get_tensor`` through the ``safe_open`` attribute of ``module``."""

    def __init__(self) -> None:
        self.bytes = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def patch(self, module: Any) -> Any:
        original, counter = module.safe_open, self

        class Handle:
            def __init__(self, handle: Any) -> None:
                self._handle = handle

            def get_tensor(self, name: str) -> Any:
                tensor = self._handle.get_tensor(name)
                nbytes = tensor.nbytes if hasattr(tensor, "nbytes") else tensor.numel() * tensor.element_size()
                with counter._lock:
                    counter.bytes += int(nbytes)
                return tensor

            def __getattr__(self, name: str) -> Any:
                return getattr(self._handle, name)

        @contextlib.contextmanager
        def counted(*args: Any, **kwargs: Any) -> Any:
            with original(*args, **kwargs) as handle:
                yield Handle(handle)

        module.safe_open = counted
        try:
            yield self
        finally:
            module.safe_open = original


def _spec_json(spec: Any) -> list[Any]:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def describe_target(target: Any) -> dict[str, Any]:
    """Shapes, dtypes and shardings of a flat target, with its mesh (axis names, shape, device ids)."""
    from harness.jaxstacks.common import flatten

    leaves, mesh = {}, None
    for name, leaf in flatten(target).items():
        mesh = leaf.sharding.mesh
        leaves[name] = {"shape": list(leaf.shape), "dtype": str(leaf.dtype), "spec": _spec_json(leaf.sharding.spec)}
    return {"mesh": {"axes": list(mesh.axis_names), "shape": list(mesh.devices.shape),
                     "devices": [int(d.id) for d in mesh.devices.flat]}, "leaves": leaves}


def target_from_description(description: dict[str, Any]) -> dict[str, Any]:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    by_id = {d.id: d for d in jax.devices()}
    m = description["mesh"]
    mesh = Mesh(np.array([by_id[i] for i in m["devices"]]).reshape(m["shape"]), tuple(m["axes"]))
    return {name: jax.ShapeDtypeStruct(tuple(info["shape"]), jax.numpy.dtype(info["dtype"]),
                                       sharding=NamedSharding(mesh, PartitionSpec(*[tuple(e) if isinstance(e, list) else e
                                                                                   for e in info["spec"]])))
            for name, info in description["leaves"].items()}


ST_DTYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}


def write_layout(arrays: dict[str, Any], out: Path, shard_bytes: int = 600_000_000) -> None:
    """Each array gathered to the host, one at a time, into safetensors files named by key path
    (headers written first from the shapes, data streamed): the target's own names and layout."""
    import numpy as np

    groups: list[list[str]] = [[]]
    size = 0
    for name, array in arrays.items():
        if groups[-1] and size + array.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += array.nbytes
    for i, names in enumerate(groups):
        header: dict[str, Any] = {"__metadata__": {"format": "jax", "written_by": "benchmarks/bench_jax_targets.py"}}
        offset = 0
        for name in names:
            a = arrays[name]
            header[name] = {"dtype": ST_DTYPES[str(a.dtype)], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
            offset += a.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        path = out / f"layout-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name in names:
                value = np.ascontiguousarray(np.asarray(arrays[name]))
                f.write(value.view(np.uint8).reshape(-1).data)
                del value
            f.flush()
            os.fsync(f.fileno())


def digests(tree: Any) -> dict[str, str]:
    import numpy as np

    from harness.jaxstacks.common import flatten

    out = {}
    for name, leaf in flatten(tree).items():
        value = np.ascontiguousarray(np.asarray(leaf))
        digest = hashlib.blake2b(value.view(np.uint8).reshape(-1).data, digest_size=12).hexdigest()
        out[name] = f"{value.dtype}{list(value.shape)}:{digest}"
    return out


def _stack_target(worker: Any, job: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The stack's abstract tree, mesh and handle (``abstract_target``)."""
    return worker.abstract_target(job["checkpoint"], job["mesh"], **dict(job["options"], dtype=job["dtype"]))


def _maxtext_restore(built: tuple[Any, Any, Any], items: str) -> Any:
    """MaxText's restore into the abstract tree, as ``maxtext_stack.own_load`` does it."""
    from flax.linen import partitioning as nn_partitioning
    from maxtext.common import checkpointing

    target, mesh, handle = built
    config = handle.config
    with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
        return checkpointing.load_params_from_path(items, target, config.checkpoint_storage_concurrent_gb,
                                                   config.checkpoint_storage_use_ocdbt, config.checkpoint_storage_use_zarr3)


def run_method(worker: Any, job: dict[str, Any], marks: dict[str, float]) -> tuple[Any, int | None]:
    """The timed work of one method; returns (output tree, logical bytes or None). ``marks``
    gets ``target`` (seconds building the abstract target) and sub-spans."""
    stack, method, ckpt = job["stack"], job["method"], job["checkpoint"]
    t0 = time.perf_counter()
    if method == "functional_load":
        from functional_load.api_jax import load_jax
        from functional_load.io import Reader, ReadOptions

        target, _, _ = _stack_target(worker, job)
        marks["target"] = time.perf_counter() - t0
        with Reader(ReadOptions()) as reader:
            tree = load_jax(ckpt, target=target, mapping=job["mapping"], reader=reader)
            return tree, reader.bytes_read
    if method == "orbax_v1":
        from harness.jaxstacks import orbax_safetensors
        from harness.jaxstacks.common import flatten

        if stack == "maxtext":
            target = flatten(_stack_target(worker, job)[0])
        else:
            target = target_from_description(json.loads(Path(job["layout"], "target.json").read_text()))
        marks["target"] = time.perf_counter() - t0
        arrays, stats = orbax_safetensors.load(job["layout"], target, job.get("max_over_read_ratio"))
        marks["orbax_num_reads"] = stats.get("num_reads", 0)
        return arrays, int(stats["bytes_read"]) if "bytes_read" in stats else None
    if stack == "tpu-inference" and method == "own":
        counter = worker.ReadCounter()
        tree = worker.own_load(ckpt, job["mesh"], dtype=job["dtype"], counter=counter, **job["options"])
        return tree, counter.bytes
    if stack == "maxtext" and method == "own":
        from maxtext.checkpoint_conversion import to_maxtext

        built = _stack_target(worker, job)
        marks["target"] = time.perf_counter() - t0
        counter = SafeOpenCounter()
        t1 = time.perf_counter()
        with counter.patch(to_maxtext):
            items = worker.convert(ckpt, job["mesh"], job["workdir"], dtype=job["dtype"], **job["options"])
        marks["convert"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        tree = _maxtext_restore(built, str(items))
        marks["restore"] = time.perf_counter() - t2
        return tree, counter.bytes
    if stack == "maxtext" and method == "own_restore":
        built = _stack_target(worker, job)
        marks["target"] = time.perf_counter() - t0
        return _maxtext_restore(built, job["converted"]), None
    raise ValueError(f"no method {method!r} for {stack}")


def worker_main(job: dict[str, Any]) -> int:
    import importlib

    from harness.jaxstacks.common import setup_cpu_devices

    setup_cpu_devices(DEVICES)
    # Orbax runs in MaxText's environment: there the tpu-inference target comes from its JSON description.
    foreign = job["method"] == "orbax_v1" and job["stack"] != "maxtext"
    worker = None if foreign else importlib.import_module(WORKER_MODULES[job["stack"]])
    import jax

    from functional_load.api_jax import load_jax  # noqa: F401  (imported before the timer)
    if job["method"] == "orbax_v1":
        from harness.jaxstacks import orbax_safetensors  # noqa: F401
    if job["kind"] == "convert":  # MaxText's conversion, once, for own_restore
        worker.convert(job["checkpoint"], job["mesh"], job["converted_root"], dtype=job["dtype"], **job["options"])
        print(RESULT_TAG + json.dumps({"ok": True}), flush=True)
        return 0
    assert len(jax.devices()) >= DEVICES, jax.devices()
    if job["kind"] == "layout":  # the target's leaves as safetensors, once, for orbax_v1
        from functional_load.api_jax import load_jax as _load
        from harness.jaxstacks.common import flatten

        target, _, _ = _stack_target(worker, job)
        out = Path(job["layout"])
        flat = flatten(_load(job["checkpoint"], target=target, mapping=job["mapping"]))
        write_layout(flat, out)
        (out / "target.json").write_text(json.dumps(describe_target(flatten(target)), indent=1) + "\n")
        print(RESULT_TAG + json.dumps({"ok": True, "leaves": len(flat)}), flush=True)
        return 0
    marks: dict[str, float] = {}
    baseline = _status_bytes("VmRSS")
    io0 = _proc_io("read_bytes")
    start = time.perf_counter()
    tree, logical = run_method(worker, job, marks)
    jax.block_until_ready(tree)
    seconds = time.perf_counter() - start
    storage = _proc_io("read_bytes") - io0
    peak = _status_bytes("VmHWM")
    from harness.jaxstacks.common import flatten
    from harness.jaxstacks.replay import shard_bytes

    report = {"seconds": seconds, "marks": marks, "storage_read": storage, "logical_read": logical, "peak_rss": peak,
              "baseline_rss": baseline, "shard_bytes": shard_bytes(tree), "leaves": len(flatten(tree)),
              "out_bytes": sum(int(x.nbytes) for x in jax.tree.leaves(tree))}
    if job.get("check", True):
        report["digests"] = digests(tree)
    print(RESULT_TAG + json.dumps(report), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# Parent side


def venv_python(venv: str) -> Path:
    return REPO / venv / "bin" / "python"


def spawn(job: dict[str, Any], venv: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    env.update({"JAX_PLATFORMS": "cpu", "TQDM_DISABLE": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    cmd = [str(venv_python(venv)), str(Path(__file__).resolve()), "--worker", json.dumps(job)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    lines = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
    last = next((line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1] if lines else "no output")
    return {"error": f"exit {done.returncode}: {last.strip()[:400]}", "log_tail": (done.stdout + done.stderr)[-6000:]}


def workdir_for(ckpt: Path) -> Path:
    return ROOT / "jaxbench" / ckpt.name


def prepare_layout(stack: Stack, ckpt: Path, dtype: str, timeout: float) -> tuple[Path | None, str | None]:
    """Safetensors files holding functional_load's output for the stack's target (key-path names,
    target shapes), written once; (directory, error)."""
    out = workdir_for(ckpt) / f"orbax-layout-{stack.tag}-{dtype}"
    marker = out / ".complete"
    if marker.exists():
        return out, None
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    print(f"writing the Orbax layout files for {stack.name} into {out} ...", flush=True)
    job = {"kind": "layout", "stack": stack.name, "method": "layout", "checkpoint": str(ckpt), "mesh": stack.mesh,
           "options": stack.options, "dtype": dtype, "mapping": stack.mapping, "layout": str(out)}
    r = spawn(job, stack.venv, timeout)
    if "error" in r:
        print(r.get("log_tail", ""), file=sys.stderr)
        return None, r["error"]
    marker.write_text(json.dumps({"checkpoint": str(ckpt), "leaves": r["leaves"]}) + "\n")
    return out, None


def prepare_converted(stack: Stack, ckpt: Path, dtype: str, timeout: float) -> tuple[Path | None, str | None]:
    """MaxText's own conversion of the checkpoint, once (for ``own_restore``); (items dir, error)."""
    root = workdir_for(ckpt) / f"maxtext-converted-{stack.tag}-{dtype}"
    items = root / "0" / "items"
    if (root / ".complete").exists():
        return items, None
    shutil.rmtree(root, ignore_errors=True)
    print(f"converting the checkpoint with MaxText's to_maxtext into {root} ...", flush=True)
    job = {"kind": "convert", "stack": stack.name, "method": "convert", "checkpoint": str(ckpt), "mesh": stack.mesh,
           "options": stack.options, "dtype": dtype, "converted_root": str(root)}
    r = spawn(job, stack.venv, timeout)
    if "error" in r:
        print(r.get("log_tail", ""), file=sys.stderr)
        return None, r["error"]
    (root / ".complete").write_text("{}\n")
    return items, None


def fmt_s(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f})" if values else "-"


def fmt_gb(values: list[float | None]) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values) / 1e9:.3f}" if values else "-"


def table(results: dict[str, list[dict[str, Any]]], stacks: list[Stack], scenarios: list[str], methods: list[str]) -> str:
    lines = ["| stack (mesh) | scenario | method | wall s | target s | storage read GB | logical read GB (counter) | "
             "shards hold GB | peak RSS GB (before) | own / this | arrays |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for stack in stacks:
        for scenario in scenarios:
            own = [r["seconds"] for r in results.get(f"{stack.name}|{scenario}|own", []) if "error" not in r]
            for method in [m for m in methods if m in stack.methods]:
                runs = results.get(f"{stack.name}|{scenario}|{method}", [])
                good = [r for r in runs if "error" not in r]
                head = f"| {stack.name} ({stack.mesh_text}) | {scenario} | {method} |"
                failed = [r for r in runs if "error" in r]
                if not good:
                    why = failed[0]["error"] if failed else "not run"
                    lines.append(head + f" **failed: {why[:160]}** | | | | | | | |")
                    continue
                if failed:
                    notes.append(f"{stack.name} {scenario} {method}: {len(failed)} of {len(runs)} runs failed: {failed[0]['error'][:300]}")
                wall = [r["seconds"] for r in good]
                target = [r["marks"]["target"] for r in good if "target" in r["marks"]]
                counter = COUNTERS.get((stack.name, method))
                logical = fmt_gb([r["logical_read"] for r in good]) + (f" ({counter})" if counter else "")
                rss = f"{fmt_gb([r['peak_rss'] for r in good])} ({fmt_gb([r['baseline_rss'] for r in good])})"
                ratio = f"{statistics.median(own) / statistics.median(wall):.2f}x" if own else "-"
                same = [r.get("same_as_fl") for r in good if r.get("same_as_fl") is not None]
                if method == "functional_load":
                    arrays = "reference"
                elif not same:
                    arrays = "-"
                else:
                    arrays = "equal" if all(s is True for s in same) else next(s for s in same if s is not True)
                lines.append(head + f" {fmt_s(wall)} | {fmt_s(target)} | {fmt_gb([r['storage_read'] for r in good])} | {logical} | "
                             f"{fmt_gb([r['shard_bytes'] for r in good])} | {rss} | {ratio} | {arrays} |")
                extra = {k: fmt_s([r["marks"][k] for r in good if k in r["marks"]]) for k in ("convert", "restore")
                         if any(k in r["marks"] for r in good)}
                if extra:
                    notes.append(f"{stack.name} {scenario} {method}: " + ", ".join(f"{k} {v} s" for k, v in extra.items()))
    return "\n".join(lines + ([""] + [f"* {n}" for n in notes] if notes else []))


def compare(digest: dict[str, str] | None, reference: dict[str, str] | None) -> bool | str | None:
    if digest is None or reference is None:
        return None
    if digest.keys() != reference.keys():
        return f"leaves differ: {sorted(digest.keys() ^ reference.keys())[:3]}"
    bad = [k for k in digest if digest[k] != reference[k]]
    return True if not bad else f"{len(bad)} leaves differ ({bad[0]})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--stacks", default=",".join(STACKS))
    ap.add_argument("--methods", default="functional_load,own,own_restore,orbax_v1")
    ap.add_argument("--scenarios", default="cold,hot")
    ap.add_argument("--dtype", default="bfloat16", help="the targets' parameter dtype (default bfloat16, the checkpoint's)")
    ap.add_argument("--small", action="store_true", help="a scaled-down checkpoint (hidden 1024, 2 layers, ~0.2 GB): smoke runs")
    ap.add_argument("--layers", type=int, help="decoder layers (default 3; --small: 2)")
    ap.add_argument("--checkpoint", type=Path, help="use this Llama checkpoint instead of writing one")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    ap.add_argument("--max-over-read-ratio", type=float, help="Orbax's safetensors_options.max_over_read_ratio (default None: per file)")
    ap.add_argument("--no-check", action="store_true", help="do not compare the output arrays with functional_load's")
    ap.add_argument("--json", type=Path, help="write every run's numbers here")
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(json.loads(args.worker))

    from measure import prepare

    stacks = [STACKS[s] for s in args.stacks.split(",")]
    methods = args.methods.split(",")
    scenarios = args.scenarios.split(",")
    for stack in stacks:
        for venv in {stack.venv, ORBAX_VENV}:
            if not venv_python(venv).exists():
                raise SystemExit(f"{venv} is missing: build it with `python -m harness.jaxstacks.env`")
    ckpt = args.checkpoint or llama3_checkpoint("llama3-small" if args.small else "llama3-8b", args.layers)
    ckpt_files = safetensors_files(ckpt)
    size = sum(p.stat().st_size for p in ckpt_files)
    config = json.loads((ckpt / "config.json").read_text())
    print(f"checkpoint {ckpt}: {size / 1e9:.2f} GB in {len(ckpt_files)} files; hidden {config['hidden_size']}, "
          f"{config['num_hidden_layers']} layers, {config['num_attention_heads']} heads, {config['num_key_value_heads']} KV heads, "
          f"vocab {config['vocab_size']}; dtype {args.dtype}; cpu count {os.cpu_count()}; niceness {os.nice(0)}", flush=True)

    unavailable: dict[tuple[str, str], str] = {}
    layouts: dict[str, Path] = {}
    converted: dict[str, Path] = {}
    for stack in stacks:
        if "orbax_v1" in methods and "orbax_v1" in stack.methods:
            path, error = prepare_layout(stack, ckpt, args.dtype, args.timeout)
            if error:
                unavailable[(stack.name, "orbax_v1")] = f"layout files could not be written: {error}"
            else:
                layouts[stack.name] = path
        if "own_restore" in methods and "own_restore" in stack.methods:
            path, error = prepare_converted(stack, ckpt, args.dtype, args.timeout)
            if error:
                unavailable[(stack.name, "own_restore")] = f"MaxText's own conversion failed: {error}"
            else:
                converted[stack.name] = path

    results: dict[str, list[dict[str, Any]]] = {}
    scratch = workdir_for(ckpt) / "scratch"
    started = time.perf_counter()
    for round_ in range(args.rounds):
        for stack in stacks:
            order = [m for m in methods if m in stack.methods]
            order = order[round_ % len(order):] + order[: round_ % len(order)]
            for scenario in scenarios:
                reference: dict[str, str] | None = None
                round_results: dict[str, dict[str, Any]] = {}
                for method in order:
                    key = f"{stack.name}|{scenario}|{method}"
                    if (stack.name, method) in unavailable:
                        results.setdefault(key, []).append({"error": unavailable[(stack.name, method)]})
                        continue
                    job: dict[str, Any] = {"kind": "measure", "stack": stack.name, "method": method, "checkpoint": str(ckpt),
                                           "mesh": stack.mesh, "options": stack.options, "dtype": args.dtype,
                                           "mapping": stack.mapping, "check": not args.no_check,
                                           "max_over_read_ratio": args.max_over_read_ratio}
                    files = ckpt_files
                    venv = stack.venv
                    if method == "orbax_v1":
                        job["layout"] = str(layouts[stack.name])
                        files = safetensors_files(layouts[stack.name])
                        venv = ORBAX_VENV
                    if method == "own_restore":
                        job["converted"] = str(converted[stack.name])
                        files = all_files(converted[stack.name])
                    if method == "own" and stack.name == "maxtext":
                        job["workdir"] = str(scratch / uuid.uuid4().hex)
                    prepare(scenario, files)
                    t = time.perf_counter()
                    r = spawn(job, venv, args.timeout)
                    if "workdir" in job:
                        shutil.rmtree(job["workdir"], ignore_errors=True)
                    r["process_s"] = time.perf_counter() - t
                    round_results[method] = r
                    results.setdefault(key, []).append(r)
                    shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                             if k not in ("digests", "log_tail", "marks")}
                    print(f"round {round_} {stack.name} {scenario} {method}: {shown} marks {r.get('marks')}", flush=True)
                    if "error" in r and r.get("log_tail"):
                        print(r["log_tail"][-3000:], file=sys.stderr, flush=True)
                reference = round_results.get("functional_load", {}).get("digests")
                for method, r in round_results.items():
                    if method != "functional_load" and "error" not in r:
                        r["same_as_fl"] = compare(r.get("digests"), reference)
                    r.pop("digests", None)
        print(f"round {round_} done, {time.perf_counter() - started:.0f} s since the first run", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({"checkpoint": str(ckpt), "bytes": size, "config": config, "results": results}, indent=1))
    print(f"\n{args.rounds} rounds; checkpoint {ckpt.name} ({size / 1e9:.2f} GB); wall s median (min); bytes and RSS median\n")
    print(table(results, stacks, scenarios, methods))
    return 0


if __name__ == "__main__":
    sys.exit(main())
