"""functional_load's side of the JAX-stack cases, replayed against the stacks' recorded answers.

The answers (:mod:`.oracle`, real stacks in their own environments) are in
``tests/oracle/jaxstacks/<stack>.json``, each under a key made of everything that decides it
(:func:`case_key`): the case's definition, the tiny checkpoint's bytes (``records.tree_digest``),
the stack's pinned requirement list and the oracle-side code (the stack's worker module,
``common.py``, ``oracle.py``). A missing or stale answer raises ``records.StaleRecordError`` naming
:data:`COMMAND`. Replaying needs no stack environment: each case's target tree is rebuilt from
the record (``ShapeDtypeStruct`` leaves with ``NamedSharding`` over a mesh of the recorded axes and
device order), ``load_jax`` fills it with the shipped map, counting bytes (:func:`observe`, in a
subprocess asking XLA for 8 host devices: :func:`run_observe`), and :func:`compare` judges it:
every leaf equal to the own loader's (dtype, shape, placement, bytes), the recorded logits within
``TOLERANCE`` of transformers' (computed here, now), the bytes read at most 1.1 x the shards'.

    python -m harness.jaxstacks.replay --workdir DIR [--store DIR] [--case ID ...]   # observations, one JSON line each
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from functional_load.api_jax import load_jax
from functional_load.io import Reader, ReadOptions
from functional_load.testing import records

from . import tiny
from .cases import MAPS, READ_BOUND, TOLERANCE, WORKERS, Case, all_cases, definition
from .common import DEVICES, flatten, placement, setup_cpu_devices
from .env import HERE, STACKS

STORE = records.RECORDS / "jaxstacks"
COMMAND = "python -m harness.jaxstacks.record --refresh"
Entries = dict[str, dict[str, Any]]


def oracle_code(stack: str) -> list[Path]:
    return [HERE / f"{WORKERS[stack]}.py", HERE / "common.py", HERE / "oracle.py"]


def case_key(stack: str, case: Case, directory: Path) -> str:
    return records.key_of(
        {
            "format": records.FORMAT,
            "case": definition(stack, case),
            "checkpoint": records.tree_digest(directory),
            "requirements": records.file_digest(HERE / STACKS[stack].requirements),
            "oracle": records.code_digest(oracle_code(stack)),
        }
    )


def write_checkpoints(workdir: Path) -> None:
    """Every case's tiny checkpoint under ``workdir`` (``<arch>-hd<head_dim>``), with its reference
    logits; one already complete is kept."""
    for _, case in all_cases().values():
        directory = workdir / case.checkpoint
        done = [directory / "config.json", directory / "model.safetensors", directory / "tiny.json", tiny.reference_path(directory)]
        if not all(p.exists() for p in done):
            tiny.write(case.arch, directory, case.head_dim)


def keys(workdir: Path) -> dict[str, str]:
    """``{case id: key}`` over the checkpoints in ``workdir``."""
    return {name: case_key(stack, case, workdir / case.checkpoint) for name, (stack, case) in all_cases().items()}


def load_store(store: Path = STORE) -> Entries:
    """``{case id: {"key": ..., "answer": ...}}`` over every stack's record file."""
    entries: Entries = {}
    for stack in STACKS:
        entries.update(records.read(store / f"{stack}.json").get("cases", {}))
    return entries


def stale_keys(current: Mapping[str, str], entries: Entries) -> list[str]:
    return [name for name, key in current.items() if entries.get(name, {}).get("key") != key]


def expected(workdir: Path, store: Path = STORE) -> dict[str, Any]:
    """``{case id: answer}``, the checkpoints written to ``workdir`` first; raises
    ``records.StaleRecordError`` when an answer is missing or its key is not the current one."""
    write_checkpoints(workdir)
    entries = load_store(store)
    stale = stale_keys(keys(workdir), entries)
    if stale:
        raise records.stale_error("JAX-stack", stale, COMMAND)
    return {name: entries[name]["answer"] for name in all_cases()}


def stale_inputs(answers: Mapping[str, Any], observations: Sequence[Mapping[str, Any]]) -> list[str]:
    """Cases whose logits were computed over functional_load's arrays (``inputs``) that are not the
    arrays ``load_jax`` gives now: their answer does not apply, it is stale."""
    stale = []
    for seen in observations:
        inputs = answers.get(seen["case"], {}).get("inputs")
        if inputs is not None and inputs != {name: leaf["digest"] for name, leaf in seen["leaves"].items()}:
            stale.append(seen["case"])
    return stale


# ---- the jax side (run_observe's subprocess) ----------------------------------------------------------


def rebuild(target: Mapping[str, Any]) -> Any:
    """The recorded abstract target as nested dicts of ``ShapeDtypeStruct`` with ``NamedSharding``
    over a mesh of the recorded axes, sizes, device order and axis types."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    shape = target["mesh"]
    by_id = {d.id: d for d in jax.devices()}
    devices = np.array([by_id[i] for i in shape["devices"]], dtype=object).reshape([size for _, size in shape["axes"]])
    types = tuple(getattr(jax.sharding.AxisType, t) for t in shape["axis_types"]) or None
    mesh = Mesh(devices, tuple(name for name, _ in shape["axes"]), axis_types=types)
    tree: dict[Any, Any] = {}
    for leaf in target["leaves"].values():
        spec = PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in leaf["spec"]])
        node = tree
        for key in leaf["path"][:-1]:
            node = node.setdefault(key, {})
        node[leaf["path"][-1]] = jax.ShapeDtypeStruct(tuple(leaf["shape"]), jnp.dtype(leaf["dtype"]), sharding=NamedSharding(mesh, spec))
    return tree


def shard_bytes(tree: Any) -> int:
    """Bytes of the distinct shards of this process (a box held by several devices once)."""
    total = 0
    for array in flatten(tree).values():
        seen = set()
        for shard in array.addressable_shards:
            box = tuple((s.start, s.stop) for s in shard.index)
            if box not in seen:
                seen.add(box)
                total += shard.data.nbytes
    return total


def observe(stack: str, case: Case, directory: Path, answer: Mapping[str, Any]) -> dict[str, Any]:
    """``load_jax`` into the rebuilt target of one case: the bytes read and the shards' bytes, the
    rebuilt target's placements and each array's digest and placement."""
    tree = rebuild(answer["target"])
    start = time.perf_counter()
    with Reader(ReadOptions()) as reader:
        ours = load_jax(directory, target=tree, mapping=MAPS[(stack, case.arch)], reader=reader)
        read = reader.bytes_read
    seconds = round(time.perf_counter() - start, 3)
    return {
        "bytes_read": read,
        "shard_bytes": shard_bytes(ours),
        "seconds": seconds,
        "target": {name: placement(leaf.sharding, leaf.shape) for name, leaf in flatten(tree).items()},
        "leaves": {
            name: {"digest": records.array_digest(a), "placement": placement(a.sharding, a.shape)} for name, a in flatten(ours).items()
        },
    }


def run_observe(workdir: Path, store: Path = STORE, cases: Sequence[str] = ()) -> list[dict[str, Any]]:
    """:func:`observe` for every case (or ``cases``) in a subprocess of this interpreter with 8
    host devices (this process may have started jax with one)."""
    args = [sys.executable, "-m", "harness.jaxstacks.replay", "--workdir", str(workdir), "--store", str(store)]
    args += [a for name in cases for a in ("--case", name)]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=records.ROOT, timeout=900)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in rows if "error" in r]
    if done.returncode or failed or not rows:
        raise RuntimeError(f"the replay failed (exit {done.returncode}): {json.dumps(failed)[:4000]}\n{done.stderr[-4000:]}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.jaxstacks.replay")
    parser.add_argument("--workdir", required=True, help="where the tiny checkpoints are (written by the caller)")
    parser.add_argument("--store", default=str(STORE))
    parser.add_argument("--case", action="append", default=[], help="a case id (repeatable; default: every case)")
    args = parser.parse_args(argv)
    setup_cpu_devices()
    entries = load_store(Path(args.store))
    failed = 0
    for name, (stack, case) in all_cases().items():
        if args.case and name not in args.case:
            continue
        try:
            row = {"case": name, **observe(stack, case, Path(args.workdir) / case.checkpoint, entries[name]["answer"])}
        except Exception as error:  # reported; run_observe raises
            failed += 1
            row = {"case": name, "error": f"{type(error).__name__}: {error}"}
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


# ---- judging ----------------------------------------------------------------------------------------


def compare(case: Case, answer: Mapping[str, Any], seen: Mapping[str, Any], reference: Any) -> dict[str, Any]:
    """What differs between the stack's recorded answer and what ``load_jax`` gave now, by kind:
    ``target`` (the rebuilt tree places a leaf otherwise), ``own`` (a leaf's dtype, shape,
    placement or bytes differ from the own loader's), ``logits`` (digest, or over ``TOLERANCE``
    from ``reference``), ``bytes`` (read more than 1.1 x the shards); and ``max_logit_diff``."""
    import numpy as np

    recorded = {name: leaf["placement"] for name, leaf in answer["target"]["leaves"].items()}
    out: dict[str, Any] = {"target": [f"{n}: rebuilt otherwise" for n in sorted(recorded) if seen["target"].get(n) != recorded[n]]}
    out["target"] += [f"{n}: not in the record" for n in sorted(seen["target"].keys() - recorded.keys())]
    out["own"] = own_differences(seen["leaves"], answer["own"]) if case.own else []
    logits = np.asarray(answer["logits"], dtype=np.float32)
    out["logits"] = [] if records.array_digest(logits) == answer["logits_digest"] else ["the logits are not the recorded ones"]
    out["max_logit_diff"] = float(np.max(np.abs(logits - np.asarray(reference)))) if logits.shape == np.shape(reference) else float("inf")
    if case.reference and not out["max_logit_diff"] <= TOLERANCE:
        out["logits"].append(f"max |logits - transformers| {out['max_logit_diff']:.3g} > {TOLERANCE}")
    if not 0 < seen["bytes_read"] <= READ_BOUND * seen["shard_bytes"]:
        out["bytes"] = [f"read {seen['bytes_read']} bytes, the shards hold {seen['shard_bytes']}"]
    else:
        out["bytes"] = []
    return out


def own_differences(ours: Mapping[str, Any], own: Mapping[str, Any]) -> list[str]:
    problems = [f"only ours: {k}" for k in sorted(ours.keys() - own.keys())]
    problems += [f"only theirs: {k}" for k in sorted(own.keys() - ours.keys())]
    for name in sorted(ours.keys() & own.keys()):
        (dtype, shape, data), (their_dtype, their_shape, their_data) = ours[name]["digest"], own[name]["digest"]
        if (dtype, shape) != (their_dtype, their_shape):
            problems.append(f"{name}: ours {shape} {dtype}, theirs {their_shape} {their_dtype}")
        elif ours[name]["placement"] != own[name]["placement"]:
            problems.append(f"{name}: placed otherwise than the own loader's")
        elif data != their_data:
            problems.append(f"{name}: values differ from the own loader's")
    return problems


if __name__ == "__main__":
    raise SystemExit(main())
