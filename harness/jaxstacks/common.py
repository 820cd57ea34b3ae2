"""Helpers shared by the JAX-stack workers: device set-up, meshes, key paths, tables, npz files.

Only jax and numpy are imported here, so the module loads in every stack's environment.

Key paths. A leaf's name is ``".".join`` of its ``jax.tree_util`` keys, each key stringified as:
``DictKey`` -> ``str(key.key)``, ``GetAttrKey`` -> ``key.name``, ``SequenceKey`` -> ``str(key.idx)``,
``FlattenedIndexKey`` -> ``str(key.key)``. So ``{"model": {"layers": {0: {"w": x}}}}`` names ``x``
``model.layers.0.w``, as does ``{"model": {"layers": [{"w": x}]}}``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

DEVICES = 8


def setup_cpu_devices(count: int = DEVICES, require: bool = True) -> None:
    """Ask XLA for ``count`` host devices. Must run before jax is first imported; afterwards it
    only checks (with ``require``) that jax has that many devices."""
    if "jax" in sys.modules:
        import jax

        if require and jax.device_count() < count:
            raise RuntimeError(f"jax was imported with {jax.device_count()} devices; set XLA_FLAGS before importing it")
        return
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}`` (order kept: it is the mesh's axis order)."""
    shape: dict[str, int] = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if not name or not size.isdigit():
            raise ValueError(f"mesh axis {item!r}: expected NAME=SIZE")
        shape[name.strip()] = int(size)
    return shape


def make_mesh(mesh_shape: Mapping[str, int]) -> Any:
    """A plain ``jax.sharding.Mesh`` over the first ``prod(sizes)`` devices, axes in the given order."""
    import jax
    import numpy as np

    sizes = tuple(mesh_shape.values())
    count = int(np.prod(sizes))
    devices = jax.devices()
    if len(devices) < count:
        raise RuntimeError(f"mesh {dict(mesh_shape)} needs {count} devices, jax has {len(devices)}")
    return jax.sharding.Mesh(np.array(devices[:count]).reshape(sizes), tuple(mesh_shape))


def key_str(key: Any) -> str:
    """One ``jax.tree_util`` key as a name part (see the module docstring)."""
    import jax

    tu = jax.tree_util
    if isinstance(key, tu.DictKey):
        return str(key.key)
    if isinstance(key, tu.GetAttrKey):
        return key.name
    if isinstance(key, tu.SequenceKey):
        return str(key.idx)
    if isinstance(key, tu.FlattenedIndexKey):
        return str(key.key)
    raise TypeError(f"unknown key type {type(key).__name__}: {key!r}")


def path_str(path: Iterable[Any]) -> str:
    return ".".join(key_str(k) for k in path)


def flatten(tree: Any) -> dict[str, Any]:
    """``{key path: leaf}`` in ``jax.tree_util`` order."""
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out: dict[str, Any] = {}
    for path, leaf in flat:
        name = path_str(path)
        if name in out:
            raise ValueError(f"two leaves named {name!r}")
        out[name] = leaf
    return out


def describe_rows(tree: Any) -> list[tuple[str, tuple[int, ...], str, str]]:
    """(key path, shape, dtype, PartitionSpec) per leaf of a tree of ShapeDtypeStruct or jax.Array."""
    rows = []
    for name, leaf in flatten(tree).items():
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", None)
        rows.append((name, tuple(leaf.shape), str(leaf.dtype), str(spec)))
    return rows


def spec_json(spec: Any) -> list[Any]:
    """A ``PartitionSpec`` as JSON: one entry per dimension, ``None``, an axis name or a list of names."""
    return [list(entry) if isinstance(entry, tuple) else entry for entry in spec]


def placement(sharding: Any, shape: Any) -> str:
    """The SHA-256 of where a sharding puts an array of ``shape``: per device id, the box it holds
    (``[start, stop]`` per dimension). Two shardings place alike exactly when
    ``is_equivalent_to`` holds (memory kinds aside), whatever their meshes or specs."""
    import hashlib
    import json

    shape = tuple(int(n) for n in shape)
    rows = []
    for device, index in sharding.devices_indices_map(shape).items():
        box = [[s.start or 0, n if s.stop is None else s.stop] for s, n in zip(index, shape)]
        rows.append([device.id, box])
    return hashlib.sha256(json.dumps(sorted(rows), separators=(",", ":")).encode()).hexdigest()


def describe_target(tree: Any, mesh: Any) -> dict[str, Any]:
    """An abstract target tree as JSON: the mesh (axes in order with their sizes, device ids in
    mesh order, axis types) and per leaf its key path (dict keys as they are: ``int`` layer keys
    stay ``int``), shape, dtype, ``PartitionSpec`` and :func:`placement`. Only trees of nested
    dicts of ``ShapeDtypeStruct`` with a ``NamedSharding`` over ``mesh`` are described."""
    import jax

    leaves: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not all(isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, (str, int)) for k in path):
            raise TypeError(f"{path_str(path)}: only nested dicts keyed by str or int are described")
        if leaf.sharding.mesh.shape_tuple != mesh.shape_tuple:
            raise ValueError(f"{path_str(path)}: sharded over {leaf.sharding.mesh}, not the target's mesh")
        leaves[path_str(path)] = {
            "path": [k.key for k in path],
            "shape": list(leaf.shape),
            "dtype": str(leaf.dtype),
            "spec": spec_json(leaf.sharding.spec),
            "placement": placement(leaf.sharding, leaf.shape),
        }
    types = [getattr(t, "name", str(t)) for t in getattr(mesh, "axis_types", ())]
    return {
        "mesh": {
            "axes": [[name, int(size)] for name, size in mesh.shape.items()],
            "devices": [int(d.id) for d in mesh.devices.flat],
            "axis_types": types,
        },
        "leaves": leaves,
    }


def print_table(rows: list[tuple[str, tuple[int, ...], str, str]], out: Any = None) -> None:
    out = out or sys.stdout
    width = max((len(r[0]) for r in rows), default=10)
    for name, shape, dtype, spec in rows:
        print(f"{name:<{width}}  {list(shape)!s:<18} {dtype:<9} {spec}", file=out)


def save_npz(tree: Any, path: str | Path) -> None:
    """Gather every leaf to the host and write ``{key path: array}``. Dtypes numpy cannot store
    (bfloat16, float8: ml_dtypes) are written as same-width unsigned integers and named in the
    ``__dtypes__`` entry (JSON), which :func:`load_npz_into` reads back."""
    import json

    import numpy as np

    arrays: dict[str, Any] = {}
    dtypes: dict[str, str] = {}
    for name, leaf in flatten(tree).items():
        value = np.asarray(leaf)
        if value.dtype.kind == "V" or type(value.dtype).__module__.startswith("ml_dtypes"):
            dtypes[name] = str(value.dtype)
            value = value.view(f"uint{8 * value.dtype.itemsize}")
        arrays[name] = value
    arrays["__dtypes__"] = np.array(json.dumps(dtypes))
    np.savez(path, **arrays)


def read_npz(path: str | Path) -> dict[str, Any]:
    """The arrays of an npz written by :func:`save_npz`, with their dtypes restored."""
    import json

    import ml_dtypes
    import numpy as np

    data = np.load(path)
    dtypes = json.loads(str(data["__dtypes__"])) if "__dtypes__" in data else {}
    return {
        name: data[name].view(getattr(ml_dtypes, dtypes[name])) if name in dtypes else data[name]
        for name in data.files
        if name != "__dtypes__"
    }


def load_npz_into(target: Any, path: str | Path) -> Any:
    """The arrays of an npz written by :func:`save_npz`, put on ``target``'s shardings (a tree of
    ShapeDtypeStruct with NamedSharding); every leaf must be present with the target's shape."""
    import jax

    data = read_npz(path)
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = []
    for key_path, leaf in flat:
        name = path_str(key_path)
        if name not in data:
            raise KeyError(f"{path}: no array {name!r}")
        value = data[name]
        if value.shape != tuple(leaf.shape):
            raise ValueError(f"{name}: {value.shape} in {path}, target {tuple(leaf.shape)}")
        leaves.append(jax.device_put(value.astype(leaf.dtype), leaf.sharding))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def run_cli(
    name: str, abstract: Callable[..., Any], own: Callable[..., Any], forward: Callable[..., Any], argv: list[str] | None = None
) -> int:
    """``describe CKPT --mesh ... [--scan]``, ``own CKPT OUT.npz --mesh ...``,
    ``forward CKPT PARAMS.npz --mesh ... --ids 1,2,3 [--out LOGITS.npy]`` for a worker."""
    import argparse

    import numpy as np

    parser = argparse.ArgumentParser(prog=f"python -m harness.jaxstacks.{name}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("describe", "own", "forward"):
        p = sub.add_parser(command)
        p.add_argument("checkpoint")
        if command == "own":
            p.add_argument("out")
        if command == "forward":
            p.add_argument("params")
            p.add_argument("--ids", default="1,5,9,17,33,65,129,255")
            p.add_argument("--out")
        p.add_argument("--mesh", required=True, type=parse_mesh)
        p.add_argument("--option", action="append", default=[], help="model option NAME=VALUE (repeatable)")
        p.add_argument("--scan", action="store_true", help="MaxText: scanned layers")
    args = parser.parse_args(argv)
    options: dict[str, Any] = dict(o.split("=", 1) for o in args.option)
    if args.scan:
        options["scan_layers"] = True
    if args.command == "describe":
        tree, _, _ = abstract(args.checkpoint, args.mesh, **options)
        print_table(describe_rows(tree))
    elif args.command == "own":
        save_npz(own(args.checkpoint, args.mesh, **options), args.out)
    else:
        tree, _, handle = abstract(args.checkpoint, args.mesh, **options)
        logits = forward(load_npz_into(tree, args.params), handle, [int(i) for i in args.ids.split(",")])
        if args.out:
            np.save(args.out, logits)
        print(np.array2string(logits[:, :8], precision=5))
    return 0
