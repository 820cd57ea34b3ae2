"""The loaders vLLM users pick instead of the default one, as optional peers of the load benchmark
(``pip install -e ".[bench]"``; a peer that is not installed is skipped with a note):

* Run:ai model streamer (``runai-model-streamer``): ``SafetensorsStreamer().stream_files(files)``
  + ``get_tensors()``, as vLLM's ``runai_safetensors_weights_iterator``; concurrency 16.
* fastsafetensors: per file a ``SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)``,
  ``copy_files_to_device()``, ``get_tensor`` per key, as vLLM's ``fastsafetensors_weights_iterator``.
* tensorizer: the whole checkpoint in tensorizer's format (checkpoint names), and one rank's
  vLLM-layout state in its own file, as vLLM's tensorizer path writes one file per rank;
  ``TensorDeserializer(path, device="cpu")``. Both are serialized once, untimed.
* functional_load's pre-sharded reload: ``save_sharded(dir, out, tp)`` once, untimed, then
  ``load(out, tp_size=tp, rank=r)`` (a ``kind="fl"`` run with ``source=out``).

Streaming peers are measured twice: *layout* feeds every tensor to ``loaders.VllmLayout`` (vLLM's
narrow + ``copy_`` into the rank's parameters), *raw* only collects what the peer hands out.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
from pathlib import Path

from loaders import VllmLayout, checkpoint_get, run_vllm

# peer -> (import name, distribution, pin of the "bench" extra)
PEERS = {
    "runai": ("runai_model_streamer", "runai-model-streamer", "0.17.*"),
    "fastsafetensors": ("fastsafetensors", "fastsafetensors", "0.5.*"),
    "tensorizer": ("tensorizer", "tensorizer", "2.12.*"),
}
# Environment per scenario (None unsets). Both read with O_DIRECT by default; cold runs keep that,
# hot runs read buffered (from the page cache), as a user who knows the files are cached would.
ENV = {
    "runai": {
        "cold": {"RUNAI_STREAMER_CONCURRENCY": "16", "RUNAI_STREAMER_FS_STRATEGY": None},  # io_uring_direct,libaio_direct,sync_buffered
        "hot": {"RUNAI_STREAMER_CONCURRENCY": "16", "RUNAI_STREAMER_FS_STRATEGY": "io_uring_buffered,sync_buffered"},
    },
    "fastsafetensors": {"cold": {"FASTSAFETENSORS_ODIRECT": None}, "hot": {"FASTSAFETENSORS_ODIRECT": "0"}},
}


def peer_status(peer: str) -> str | None:
    """The installed version of ``peer``, or None when it is not importable."""
    module, dist, _ = PEERS[peer]
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _collect(pairs, job: dict) -> dict:
    """Feed ``(name, tensor)`` pairs to vLLM's layout, or (raw) keep them as they come."""
    if job["options"].get("raw"):
        out = {name: t for name, t in pairs}
        out_bytes = sum(t.numel() * t.element_size() for t in out.values())
        return {"state": out, "out_bytes": out_bytes, "get": checkpoint_get(out, job, sliced=False)}
    layout = VllmLayout(job)
    for name, t in pairs:
        layout.feed(name, t)
    return layout.result()


def run_runai(job: dict) -> dict:
    from runai_model_streamer import SafetensorsStreamer

    def pairs():
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(list(job["files"]), device="cpu")
            yield from streamer.get_tensors()

    return _collect(pairs(), job)


def run_fastsafetensors(job: dict) -> dict:
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    def pairs():
        for path in job["files"]:  # one file per loader, as vLLM does with a single-process group
            loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
            try:
                loader.add_filenames({0: [path]})
                fb = loader.copy_files_to_device()
                try:
                    for key in list(fb.key_to_rank_lidx.keys()):
                        yield key, fb.get_tensor(key)  # tensors share ownership of the buffer
                finally:
                    fb.close()
            finally:
                loader.close()

    return _collect(pairs(), job)


def run_tensorizer(job: dict) -> dict:
    from tensorizer import TensorDeserializer

    path = job["source"]
    if job["options"].get("rank_file"):
        # A rank's file already holds vLLM's layout; vLLM's load_into_module registers the
        # deserialized tensors as the module's parameters, without a copy.
        with TensorDeserializer(path, device="cpu") as d:
            state = {k: d[k] for k in d.keys()}
        out_bytes = sum(t.numel() * t.element_size() for t in state.values())
        return {"state": state, "out_bytes": out_bytes, "get": state.__getitem__}
    d = TensorDeserializer(path, device="cpu")
    try:
        return _collect(((k, d[k]) for k in d.keys()), job)
    finally:
        d.close()


KINDS = {
    "runai": (("runai_model_streamer",), run_runai),
    "fastsafetensors": (("fastsafetensors",), run_fastsafetensors),
    "tensorizer": (("tensorizer",), run_tensorizer),
}


# --------------------------------------------------------------------------------------------
# Derived files, written once (untimed) next to the generated checkpoints


def derived_root(model_dir: Path, files: list[Path]) -> Path:
    """/tmp/fl-bench/derived/<name>-<stamp of the shards' names, sizes and mtimes>; stale
    siblings of an older checkpoint of the same name are removed."""
    stamp = json.dumps([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files])
    digest = hashlib.sha256((str(model_dir.resolve()) + stamp).encode()).hexdigest()[:10]
    base = Path(os.environ.get("FL_BENCH_DERIVED", "/tmp/fl-bench/derived"))
    root = base / f"{model_dir.name}-{digest}"
    if base.is_dir():
        for old in base.glob(f"{model_dir.name}-*"):
            if old != root and len(old.name) == len(root.name):
                shutil.rmtree(old, ignore_errors=True)
    return root


def tensorizer_whole(root: Path, files: list[Path]) -> Path:
    """The whole checkpoint (checkpoint names) as one tensorizer file."""
    path = root / "tensorizer" / "model.tensors"
    if not path.exists():
        from safetensors.torch import load_file
        from tensorizer import TensorSerializer

        path.parent.mkdir(parents=True, exist_ok=True)
        state = {}
        for f in files:
            state.update(load_file(f))
        _serialize(state, path, TensorSerializer)
    return path


def tensorizer_rank(root: Path, job: dict) -> Path:
    """One rank's vLLM-layout state (built by the vLLM-style loader, so the guard compares it with
    functional_load's) as its own file, as vLLM's tensorizer path writes one file per rank."""
    path = root / "tensorizer" / f"model-rank-{job['rank']}-of-{job['tp']}.tensors"
    if not path.exists():
        from tensorizer import TensorSerializer

        path.parent.mkdir(parents=True, exist_ok=True)
        _serialize(run_vllm(job)["state"], path, TensorSerializer)
    return path


def _serialize(state: dict, path: Path, serializer_cls) -> None:
    tmp = path.with_suffix(".tmp")
    s = serializer_cls(str(tmp))
    s.write_state_dict(state)
    s.close()
    os.replace(tmp, path)


def presharded(root: Path, model_dir: Path, tp: int) -> Path:
    """``functional_load.save_sharded(model_dir, out, tp)`` (every rank of the layout)."""
    out = root / f"sharded-tp{tp}"
    if not any(out.glob("*.json")):
        import functional_load

        functional_load.save_sharded(model_dir, out, tp)
    return out


def presharded_files(out: Path, tp: int, rank: int) -> list[Path]:
    """The files a rank's reload opens: its own shard, the manifest and config.json."""
    return sorted(out.glob(f"model-rank-{rank}-of-{tp}-*.safetensors")) + sorted(out.glob("*.json"))
