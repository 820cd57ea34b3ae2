"""Record, check or sample the JAX stacks' answers (``tests/oracle/jaxstacks/<stack>.json``).

    python -m harness.jaxstacks.record --check                  # list stale or missing answers, exit 1 if any
    python -m harness.jaxstacks.record --refresh [--all]        # recompute the stale ones (or all), rewrite
    python -m harness.jaxstacks.record --sample 0.2 --seed SHA  # recompute a sample, fail if one differs

``--check`` needs no stack environment (seconds); ``--refresh`` and ``--sample`` run the real stacks
(about 2 minutes for every case on 2 cores) and write nothing else than the record files
(``--sample`` not even those).

Run it with the repository's ``.venv``: it writes the tiny checkpoints (:func:`.replay.write_checkpoints`)
and keys them; the stacks answer in their own environments (:mod:`.oracle`, built first when
missing: ``env.ensure``). An answer is stale when its key changed or, for a case answered over
functional_load's arrays, when ``load_jax`` no longer gives those arrays (:func:`.replay.stale_inputs`).
Only what a real stack printed is stored.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import date
from pathlib import Path
from typing import Any

from functional_load.testing import records

from . import env, replay
from .cases import CASES, all_cases


def stale(workdir: Path, store: Path) -> list[str]:
    """Case ids whose answer is missing, keyed otherwise, or answered over other arrays."""
    entries = replay.load_store(store)
    ids = replay.stale_keys(replay.keys(workdir), entries)
    over_ours = [name for name, (_, case) in all_cases().items() if not case.own and name not in ids]
    if over_ours:
        answers = {name: entries[name]["answer"] for name in over_ours}
        ids += replay.stale_inputs(answers, replay.run_observe(workdir, store, over_ours))
    return [name for name in all_cases() if name in ids]


def ask(ids: Sequence[str], workdir: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """The real stacks' answers for ``ids`` (``{id: answer}``), each stack's versions and the keys
    the answers go under; raises when a case fails, when a stack wrote into a checkpoint, or when
    a key changed while the stacks ran (the oracle's code was edited meanwhile)."""
    before = replay.keys(workdir)
    checkpoints = {p.name: records.tree_digest(p) for p in sorted(workdir.iterdir()) if p.is_dir()}
    answers: dict[str, Any] = {}
    versions: dict[str, Any] = {}
    failed: list[dict[str, Any]] = []
    for stack in CASES:
        wanted = [name for name in ids if all_cases()[name][0] == stack]
        if wanted:
            rows = ask_stack(stack, wanted, workdir)
            versions[stack] = next(r["versions"] for r in rows if "versions" in r)
            answers.update({r["case"]: r["answer"] for r in rows if "answer" in r})
            failed += [r for r in rows if "error" in r]
    if {p.name: records.tree_digest(p) for p in sorted(workdir.iterdir()) if p.is_dir()} != checkpoints:
        raise RuntimeError("a stack changed the tiny checkpoints while answering: the answers are not keyed by what it read")
    if replay.keys(workdir) != before:
        raise RuntimeError("the oracle's code or the requirement lists changed while the stacks answered: run it again")
    if failed:
        raise RuntimeError("the oracle failed:\n" + "\n".join(json.dumps(r)[:3000] for r in failed))
    return answers, versions, before


def ask_stack(stack: str, ids: Sequence[str], workdir: Path) -> list[dict[str, Any]]:
    """The oracle's lines for ``ids`` of one stack (its environment built first if missing); a
    case it printed nothing for is a failed one."""
    python = env.ensure(stack)
    start = time.perf_counter()
    args = [str(python), "-m", "harness.jaxstacks.oracle", stack, "--workdir", str(workdir)]
    done = subprocess.run(args + [a for name in ids for a in ("--case", name)], capture_output=True, text=True, cwd=env.ROOT)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not any("versions" in r for r in rows):
        rows.append({"versions": {}})
    printed = {r.get("case") for r in rows}
    rows += [{"case": n, "error": f"no answer (exit {done.returncode})", "stderr": done.stderr[-3000:]} for n in ids if n not in printed]
    print(f"{stack}: {len(ids)} cases answered in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return rows


def store_answers(answers: Mapping[str, Any], versions: Mapping[str, Any], current: Mapping[str, str], store: Path, command: str) -> None:
    """Write each stack's new answers under their keys; the stack's other answers stay, answers of
    cases that no longer exist go."""
    for stack in CASES:
        new = {name: answer for name, answer in answers.items() if all_cases()[name][0] == stack}
        if not new:
            continue
        path = store / f"{stack}.json"
        entries = {k: v for k, v in records.read(path).get("cases", {}).items() if k in all_cases()}
        entries.update({name: {"key": current[name], "answer": answer} for name, answer in new.items()})
        produced = {"command": command, "stack": versions[stack], "date": date.today().isoformat()}
        records.write(path, {"produced_by": produced, "cases": entries})


def differences(recorded: Any, fresh: Any, where: str = "") -> list[str]:
    """Where two answers differ (paths into them)."""
    if isinstance(recorded, Mapping) and isinstance(fresh, Mapping):
        out = [f"{where}{k}: only in one" for k in sorted(set(recorded) ^ set(fresh))]
        for k in sorted(set(recorded) & set(fresh)):
            out += differences(recorded[k], fresh[k], f"{where}{k}.")
        return out
    return [] if recorded == fresh else [where.rstrip(".") or "the answer"]


def sample(fraction: float, seed: str, workdir: Path, store: Path) -> int:
    """Recompute a sample (at least one case of each stack) and compare it with the record."""
    ids = [name for stack in CASES for name in records.sample([n for n, (s, _) in all_cases().items() if s == stack], fraction, seed)]
    print(f"sample of {len(ids)}: {', '.join(ids)}", file=sys.stderr)
    old = stale(workdir, store)
    if any(name in old for name in ids):
        print(records.stale_error("JAX-stack", [n for n in ids if n in old], replay.COMMAND), file=sys.stderr)
        return 1
    entries = replay.load_store(store)
    answers, _, _ = ask(ids, workdir)
    bad = {name: differences(entries[name]["answer"], json.loads(json.dumps(answers[name]))) for name in ids}
    for name, where in bad.items():
        print(f"{'DIFFERS' if where else 'same   '} {name}" + (f": {', '.join(where[:10])}" if where else ""))
    return 1 if any(bad.values()) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.jaxstacks.record")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="list stale or missing answers; exit 1 when there are any")
    mode.add_argument("--refresh", action="store_true", help="recompute the stale answers with the real stacks")
    mode.add_argument("--sample", type=float, metavar="FRACTION", help="recompute a sample; fail when one differs")
    parser.add_argument("--all", action="store_true", help="with --refresh: every answer, stale or not")
    parser.add_argument("--seed", help="with --sample (required): the commit whose hash picks the sample")
    parser.add_argument("--store", default=str(replay.STORE))
    parser.add_argument("--workdir", help="where the tiny checkpoints go (default: a temporary directory)")
    args = parser.parse_args(argv)
    if (args.sample is not None) != (args.seed is not None) or (args.all and not args.refresh):
        parser.error("--sample needs --seed (and --seed --sample); --all goes with --refresh")
    store = Path(args.store)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        replay.write_checkpoints(workdir)
        if args.sample is not None:
            return sample(args.sample, args.seed, workdir, store)
        ids = list(all_cases()) if args.refresh and args.all else stale(workdir, store)
        if args.check or not ids:
            print("\n".join(ids) if ids else "every JAX-stack answer is current")
            return 1 if args.check and ids else 0
        answers, versions, current = ask(ids, workdir)
        command = "python -m harness.jaxstacks.record --refresh" + (" --all" if args.all else "")
        store_answers(answers, versions, current, store, command)
        print(f"recorded {len(answers)} answers in {store}")
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
