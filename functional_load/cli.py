"""``functional-load``: inspect a checkpoint, print a rank's plan, load a rank to safetensors,
verify every rank of a tp size against the checkpoint, or pre-check every rank of a multi-node layout.

Errors for bad input print as one message (no traceback) and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from .api import load, plan, resolve_model_dir, weight_dtypes
from .checkpoint.discover import checkpoint_format, discover
from .checkpoint.index import index_checkpoint
from .checkpoint.sharded import read_manifest, sharded_checkpoint
from .errors import ConfigError, LoadError, ShardingError
from .io import ReadOptions
from .model.config import model_dtype, read_config
from .model.spec import spec_for_config
from .options import LoadOptions
from .output.save import save_safetensors
from .precheck import precheck, torchrun_node
from .verify import verify_ranks
from .vllm_target import VLLM_VERSION


def _options(args: argparse.Namespace) -> LoadOptions:
    """The LoadOptions the command line asks for (the same value every entry point takes)."""
    read = ReadOptions(**{k: v for k, v in (("threads", args.threads), ("strategy", args.strategy)) if v is not None})
    return LoadOptions(
        dtype=getattr(args, "dtype", None), quantization=getattr(args, "quantization", None), load_format=args.load_format,
        allow_pickle=args.allow_pickle, revision=args.revision, spec=args.spec, text_only=args.text_only,
        expert_parallel=getattr(args, "expert_parallel", False), expert_placement=getattr(args, "expert_placement", "linear"),
        num_redundant_experts=getattr(args, "redundant_experts", 0), read=read,
        pp_size=getattr(args, "pp_size", 1), pp_rank=getattr(args, "pp_rank", 0), dp_size=getattr(args, "dp_size", 1),
        dp_rank=getattr(args, "dp_rank", 0), pp_layer_partition=getattr(args, "pp_layer_partition", None),
        cache_dir=getattr(args, "cache_dir", None),
    )


def _inspect(args: argparse.Namespace) -> None:
    options = _options(args)
    if options.dummy:
        raise ConfigError("inspect lists a checkpoint's files and tensors; --load-format dummy reads none (use plan or load)")
    directory = resolve_model_dir(args.model_dir, options.revision, options.load_format, options.allow_pickle)
    config = read_config(directory, checkpoint_format(directory, options.load_format))
    spec = options.arch_spec() or spec_for_config(config)
    manifest = read_manifest(directory)
    if manifest is not None:  # a pre-sharded save: its layout, its rank files, the original tensors it holds
        checkpoint = sharded_checkpoint(directory, manifest, 0)
        print(f"{directory}: a pre-sharded save (functional_load.save_sharded) of {spec.name}, dtype {manifest['dtype']}, "
              f"saved at {_layout_words(manifest['parallel'])}")
        for name, entry in manifest["files"].items():
            print(f"  rank {entry['rank']}: {name} ({entry['size']:,} bytes)")
        print(f"original tensors ({len(checkpoint.tensors)}, {checkpoint.total_bytes:,} bytes), held in the rank files:")
    else:
        checkpoint = index_checkpoint(discover(directory, options.load_format), allow_pickle=options.allow_pickle)
        dtype = model_dtype(None, config, weight_dtypes(directory, config))
        print(f"{checkpoint.directory}: {spec.name} ({', '.join(config.get('architectures') or [])}), "
              f"dtype {dtype}, format {checkpoint.load_format}")
        print(f"{len(checkpoint.files)} files, {len(checkpoint.tensors)} tensors, {checkpoint.total_bytes:,} bytes")
    for info in checkpoint.tensors.values():
        print(f"  {info.name:60s} {info.dtype:8s} {list(info.shape)!s:16s} {info.where()}")


def _layout_words(parallel: dict[str, object]) -> str:
    """A save's layout as words: ``tp 2`` (``pp 2 x tp 4``...), and its expert parallelism when it has any."""
    sizes = {axis: parallel.get(f"{axis}_size") for axis in ("dp", "pp")}
    words = " x ".join(f"{axis} {size}" for axis, size in sizes.items() if isinstance(size, int) and size > 1)
    words += (" x " if words else "") + f"tp {parallel.get('tp_size')}"
    if parallel.get("expert_parallel"):
        words += f", expert parallel ({parallel.get('expert_placement')} placement, {parallel.get('num_redundant_experts')} redundant)"
    return words


def _plan(args: argparse.Namespace) -> None:
    the_plan = plan(args.model_dir, tp_size=args.tp, rank=args.rank, options=_options(args))
    print(json.dumps(the_plan.to_json(), indent=1) if args.json else the_plan.table())


def _load(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    state = load(args.model_dir, tp_size=args.tp, rank=args.rank, options=_options(args).replace(progress=True))
    seconds = time.perf_counter() - start
    tensors = {name: t.contiguous() for name, t in state.unique().items()}  # safetensors refuses shared storage
    first = {id(t): name for name, t in tensors.items()}
    aliases = {name: first[id(state[name])] for name in state if name not in tensors}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"model-rank-{args.rank}-of-{args.tp}.safetensors"
    save_safetensors(tensors, path, {"tp_size": str(args.tp), "rank": str(args.rank), "aliases": json.dumps(aliases)})
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"rank {args.rank}/{args.tp}: {len(state)} tensors, {size:,} bytes in {seconds:.3f} s -> {path}")


def _verify(args: argparse.Namespace) -> None:
    if not 0 <= args.rank < args.tp:
        raise ShardingError(f"--rank {args.rank} is not a rank of --tp {args.tp}; pick a rank in 0..{args.tp - 1}")
    report = verify_ranks(args.model_dir, tp_size=args.tp, options=_options(args))
    print(report.plans[args.rank].table())
    print()
    print(report.summary())
    if not report.ok:
        raise SystemExit(1)


def _precheck(args: argparse.Namespace) -> None:
    node = args.node
    if node is None and (node := torchrun_node(os.environ)) is not None and os.environ.get("LOCAL_RANK", "0") != "0":
        return  # under torchrun: the node's first process plans the node's ranks
    result = precheck(args.model_dir, tp_size=args.tp, ranks_per_node=args.ranks_per_node, node=node, options=_options(args))
    print(json.dumps(result.to_json(), indent=1) if args.json else result.table())


def _check_spec(args: argparse.Namespace) -> None:
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("check-spec writes tiny checkpoints with transformers, which is not installed: "
                          "pip install 'functional_load[check]'")
    from .testing.checkspec import check_spec, report  # the test harness (torch, transformers): only for this command

    checks = check_spec(
        args.target, tps=[int(t) for t in args.tp.split(",")], kv_heads=args.kv_heads,
        work=Path(args.work) if args.work else None, vllm=not args.no_vllm,
    )
    print(report(checks))
    if any(c.status == "FAIL" for c in checks):
        raise SystemExit(1)


def _bench(args: argparse.Namespace) -> None:
    """Run benchmarks/bench_load.py (a source checkout's benchmarks folder) with the given options."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_load.py"
    if not script.is_file():
        raise SystemExit(f"functional-load bench needs a source checkout: {script} not found")
    spec = importlib.util.spec_from_file_location("functional_load_bench_load", script)
    if spec is None or spec.loader is None:
        raise SystemExit(f"functional-load bench: cannot import {script}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = [args.model_dir] if args.model_dir else []
    argv += ["--quick"] if args.quick else []
    for name in ("runs", "tp", "scenarios", "methods", "all_ranks", "layers", "out", "json", "nice"):
        if getattr(args, name) is not None:
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    raise SystemExit(module.main(argv))


def _rank_arguments(p: argparse.ArgumentParser) -> None:
    """The rank and how it is loaded: the parallel axes, dtype, quantization, experts."""
    _layout_arguments(p)
    p.add_argument("--rank", type=int, default=0, help="tensor-parallel rank (default 0)")
    p.add_argument("--cache-dir", default=None, help="local folder of the rank cache for s3:// models (a restart at the same "
                   "layout reads local disk; default: none)")
    p.add_argument("--pp-rank", type=int, default=0, help="pipeline stage of this rank (default 0)")
    p.add_argument("--dp-rank", type=int, default=0, help="data-parallel rank (default 0)")


def _layout_arguments(p: argparse.ArgumentParser) -> None:
    """The layout's sizes and how its ranks are loaded: dtype, quantization, experts."""
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--pp-layer-partition", default=None, help="decoder layers per stage, e.g. 4,4,3 (default: vLLM's split, "
                   "or VLLM_PP_LAYER_PARTITION)")
    p.add_argument("--dp-size", type=int, default=1, help="data-parallel replicas (default 1)")
    p.add_argument("--dtype", default=None, help="destination dtype (default: the config's)")
    p.add_argument("--quantization", default=None, help="quantize an unquantized checkpoint while loading: fp8 | fp8_block")
    p.add_argument("--expert-parallel", action="store_true", help="spread whole MoE experts over the ranks")
    p.add_argument("--expert-placement", default="linear", help="linear | round_robin (with --expert-parallel)")
    p.add_argument("--redundant-experts", type=int, default=0, help="extra physical experts (EPLB)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="functional-load", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--version", action="version", version=f"functional-load {_version()} (vLLM {VLLM_VERSION} layouts)")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str, rank: bool = True):
        p = sub.add_parser(name, help=help)
        p.add_argument("model_dir", help="checkpoint directory (config.json + weight files), or a Hugging Face Hub repo id org/name")
        p.add_argument(
            "--load-format", default="auto", help="auto | hf | safetensors | mistral | pt | dummy (config only, vLLM's dummy weights)"
        )
        p.add_argument("--revision", default=None, help="branch, tag or commit of a Hub repo id (default: main)")
        p.add_argument("--allow-pickle", action="store_true", help="permit .bin/.pt checkpoints (torch.load(weights_only=True))")
        p.add_argument("--spec", default=None, help="architecture spec: a .toml file or a spec name (default: from config.json)")
        p.add_argument("--text-only", action="store_true", help="leave a multimodal model's vision tower out")
        p.add_argument("--threads", type=int, default=None, help="reader threads (default 4)")
        p.add_argument("--strategy", default=None, help="read strategy: auto | pread | mmap | eager")
        if rank:
            _rank_arguments(p)
        return p

    add("inspect", "list the checkpoint's files and tensors (headers only)", rank=False).set_defaults(run=_inspect)
    p = add("plan", "print one rank's load plan (no tensor data is read)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=_plan)
    p = add("load", "load one rank and write its tensors as safetensors")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(run=_load)
    p = add("verify", "plan and load every rank of --tp, and check each rank's reads against its plan and the checkpoint")
    p.set_defaults(run=_verify)
    p = add("precheck", "plan every rank of a tp x pp x dp layout (headers only) and sum each node's bytes", rank=False)
    _layout_arguments(p)
    p.add_argument("--ranks-per-node", type=int, default=8, help="consecutive global ranks per node (default 8)")
    p.add_argument("--node", type=int, default=None, help="plan this node's ranks only (default: every node; under torchrun, "
                   "its GROUP_RANK)")
    p.add_argument("--json", action="store_true", help="print the ranks and node sums as JSON")
    p.set_defaults(run=_precheck)
    p = sub.add_parser(
        "check-spec", help="prove a spec: a tiny transformers checkpoint at every tp, against real vLLM and a forward",
    )
    p.add_argument("target", help="a spec .toml file, a spec name or an architecture class name (Qwen3ForCausalLM)")
    p.add_argument("--tp", default="1,2,4,8", help="tp sizes, comma-separated (default 1,2,4,8)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads of the tiny checkpoint (default 2: GQA, replicated past tp 2)")
    p.add_argument("--work", default=None, help="keep the checkpoints and vLLM's rank states here (default: a temporary directory)")
    p.add_argument("--no-vllm", action="store_true", help="skip the real-vLLM comparison even when its environment exists")
    p.set_defaults(run=_check_spec)
    p = sub.add_parser("bench", help="benchmark loading (cold/hot, tp 1/2/4) against vLLM-style, safetensors and peer loaders")
    p.add_argument("model_dir", nargs="?", help="checkpoint (default /tmp/fl-bench/llama7b-4l, generated when missing)")
    p.add_argument("--quick", action="store_true", help="1-layer checkpoint, one run, fewer variants")
    p.add_argument("--runs", type=int, help="runs per method and scenario (default 3)")
    p.add_argument("--tp", help="tp sizes, comma-separated (default 1,2,4)")
    p.add_argument("--scenarios", help="cold,hot (default both)")
    p.add_argument("--methods", help="method keys, comma-separated (default: those marked default in benchmarks/bench_load.py)")
    p.add_argument("--all-ranks", type=int, help="tp size of the all-ranks-at-once scenario (default 4; 0: skip)")
    p.add_argument("--layers", type=int, help="layers of a generated checkpoint (default 4)")
    p.add_argument("--out", help="markdown file to write the results into (default: none, printed only)")
    p.add_argument("--json", help="also write the raw per-run results as JSON")
    p.add_argument("--nice", type=int, help="niceness added to each measured worker (default 0; -10 as root disturbs them less)")
    p.set_defaults(run=_bench)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("functional_load")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: TextIO | None = None,
             line: str | None = None) -> None:
    """A library warning as one line of the CLI's own, with no source line."""
    print(f"functional-load: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning
            args.run(args)
    except LoadError as exc:
        print(f"functional-load: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`functional-load plan ... | head`): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
