"""Every oracle's recorded answers at once (CI's oracle stage; docs/parity.md).

    python -m harness.oracles --check                  # no oracle runs: exit 1 when any answer is stale
    python -m harness.oracles --sample 0.05 --seed SHA # real oracles recompute a sample; must equal the record
    python -m harness.oracles --refresh [--all]        # real oracles recompute the stale answers (every one)

The kinds: real vLLM's rank states (parity and check-spec, ``functional_load.testing.parity``),
the functional_load load format's generation in real vLLM against the default loader's recorded
one (``harness.plugin_record``), and the JAX stacks' own loaders and forwards
(``harness.jaxstacks.record``). A sample takes at least the fraction of each
kind's cases, and at least one case of each kind.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from . import plugin_record
from .jaxstacks import record as jaxstacks_record
from .parity import __main__ as parity

KINDS: dict[str, Callable[[list[str] | None], int]] = {
    "vLLM parity": parity.main, "vLLM generation": plugin_record.main, "JAX stacks": jaxstacks_record.main,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.oracles", description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--sample", type=float, metavar="F")
    mode.add_argument("--refresh", action="store_true")
    parser.add_argument("--all", action="store_true", help="with --refresh: every answer, stale or not")
    parser.add_argument("--seed", default="", help="with --sample: what picks the sample (CI: the commit hash)")
    args = parser.parse_args(argv)
    if args.check:
        flags = ["--check"]
    elif args.refresh:
        flags = ["--refresh"] + (["--all"] if args.all else [])
    else:
        flags = ["--sample", str(args.sample), "--seed", args.seed]
    failed = []
    for kind, run in KINDS.items():
        start = time.perf_counter()
        print(f"== {kind}: {' '.join(flags)}", flush=True)
        code = run(flags)
        print(f"== {kind}: {'ok' if code == 0 else 'FAILED'} ({time.perf_counter() - start:.0f} s)", flush=True)
        if code:
            failed.append(kind)
    if failed:
        print(f"oracle checks failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
