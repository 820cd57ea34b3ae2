"""Orbax v1's safetensors loading (orbax-checkpoint 0.12.8,
``orbax/checkpoint/experimental/v1/_src/layout/safetensors_layout.py``): HF safetensors files read
straight into a flat tree of sharded ``jax.Array``, each process reading only the byte ranges its
devices need. The benchmark's read-pattern anchor; runs in ``.venv-maxtext``.

The call::

    import orbax.checkpoint.experimental.v1 as ocp
    ctx = ocp.Context()
    ctx.checkpoint_layout = "safetensors"        # or ocp.options.CheckpointLayout.SAFETENSORS
    with ctx:
        arrays = ocp.load(checkpoint_dir, target)  # dict: tensor name -> jax.Array

``checkpoint_dir`` is a ``.safetensors`` file or a directory of them (every ``*.safetensors`` in
it; the index json is not read). ``target`` must be a FLAT dict keyed by the checkpoint's own
tensor names (``model.layers.0.self_attn.q_proj.weight``), each leaf a ``jax.ShapeDtypeStruct``
whose shape equals the stored one (no renaming, transposing or relayout: a shape mismatch raises);
its sharding (``NamedSharding``) decides which byte ranges each device gets, and a dtype other
than the stored one is converted on the host with numpy ``astype`` after the read. Names not in
``target`` are not read. Knobs: ``ctx.safetensors_options.max_over_read_ratio`` (None: chosen
per file; 1.0: never read a byte not needed), ``ctx.safetensors_options.read_chunk_bytes``
(default 128 MiB) and ``ctx.memory_options.read_concurrent_bytes`` (in-flight budget, default
2 GiB). Bytes read are reported through ``jax.monitoring`` scalars
``/jax/orbax/read/safetensors/{bytes_read,num_reads,storage_reads}``, which :func:`load` collects.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .common import make_mesh, parse_mesh, setup_cpu_devices

setup_cpu_devices(require=False)  # 8 host devices for the CLI, when jax is not imported yet

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint.experimental.v1 as ocp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": jax.numpy.bfloat16, "I64": np.int64, "I32": np.int32}


def headers(checkpoint_dir: str | Path) -> dict[str, tuple[tuple[int, ...], Any]]:
    """``{tensor name: (shape, dtype)}`` of every ``*.safetensors`` file, from the headers alone."""
    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for path in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (tuple(info["shape"]), DTYPES[info["dtype"]])
    return out


def row_sharded_target(checkpoint_dir: str | Path, mesh: jax.sharding.Mesh, axis: str | tuple[str, ...]) -> dict[str, jax.ShapeDtypeStruct]:
    """An example target: every tensor whose first dimension divides over ``axis`` split along it,
    the others replicated, stored dtype kept."""
    size = int(np.prod([mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis)]))
    target = {}
    for name, (shape, dtype) in headers(checkpoint_dir).items():
        spec = PartitionSpec(axis) if shape and shape[0] % size == 0 else PartitionSpec()
        target[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    return target


def load(checkpoint_dir: str | Path, target: Mapping[str, jax.ShapeDtypeStruct],
         max_over_read_ratio: float | None = None) -> tuple[dict[str, jax.Array], dict[str, float]]:
    """Orbax's safetensors load of ``target`` (see the module docstring); returns the arrays and
    the read counters it reported (``bytes_read``, ``num_reads``, ``storage_reads``)."""
    stats: dict[str, float] = {}
    prefix = "/jax/orbax/read/safetensors/"

    def listener(event: str, value: float, **_: Any) -> None:
        if event.startswith(prefix):
            stats[event[len(prefix):]] = stats.get(event[len(prefix):], 0.0) + value

    callback: Callable[..., None] = listener
    jax.monitoring.register_scalar_listener(callback)
    try:
        ctx = ocp.Context()
        ctx.checkpoint_layout = "safetensors"
        ctx.safetensors_options.max_over_read_ratio = max_over_read_ratio
        with ctx:
            arrays = ocp.load(str(checkpoint_dir), dict(target))
    finally:
        jax.monitoring.unregister_scalar_listener(callback)
    return dict(arrays), stats


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.jaxstacks.orbax_safetensors CKPT [--mesh data=2,model=4 --axis model]``:
    loads every tensor row-sharded, checks it against the file, prints the read counters."""
    import argparse

    from safetensors.numpy import load_file

    parser = argparse.ArgumentParser(prog="python -m harness.jaxstacks.orbax_safetensors")
    parser.add_argument("checkpoint")
    parser.add_argument("--mesh", type=parse_mesh, default={"data": 2, "model": 4})
    parser.add_argument("--axis", default="model")
    parser.add_argument("--max-over-read-ratio", type=float)
    args = parser.parse_args(argv)
    mesh = make_mesh(args.mesh)
    target = row_sharded_target(args.checkpoint, mesh, args.axis)
    arrays, stats = load(args.checkpoint, target, args.max_over_read_ratio)
    stored: dict[str, np.ndarray] = {}
    for path in sorted(Path(args.checkpoint).glob("*.safetensors")):
        stored.update(load_file(path))
    for name, array in arrays.items():
        if not np.array_equal(np.asarray(array), stored[name]) or array.sharding != target[name].sharding:
            raise AssertionError(f"{name}: not the stored tensor on the target sharding")
    print(f"{len(arrays)} tensors equal to the files, on the target shardings; reads: {stats}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
