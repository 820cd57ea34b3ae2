"""Load and greedy generation in real vLLM with a given load format (run with the vLLM environment's python).

``python -m harness.vllm_generate MODEL OUT.json --tp 2 [--pp 2] [--dp 2] [--expert-parallel]
--load-formats auto,functional_load --report-dir DIR`` starts ``vllm.LLM`` (float32, eager, no
tokenizer) with each load format in turn and writes, per format, a digest of every parameter and
buffer of every worker's model right after the load (SHA-256 of its bytes, and its shape), and the
greedy generation of a few tokens for fixed prompt token ids with their top logprobs, or the error
vLLM raised instead (its CPU build loads pipeline and data-parallel layouts but cannot run them,
see docs/multinode.md). Data parallelism runs one engine per replica, in its own process, as
vLLM's offline data-parallel example does (``VLLM_DP_RANK``...). ``tests/test_vllm_plugin.py`` and
``harness.plugin_record`` compare the ``functional_load`` load format with vLLM's default loader
this way. The ``__main__`` guard is needed: vLLM spawns its workers.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import multiprocessing
import os
import socket
from pathlib import Path
from typing import Any

PROMPTS = ([1, 17, 42, 99, 5, 63], [7, 7, 120, 3], [200, 11, 64, 19, 88, 2, 150, 31])
MAX_TOKENS = 8
LOGPROBS = 5


def digests(worker: Any) -> dict[str, str]:
    """Run in every vLLM worker (``collective_rpc``): each parameter's and buffer's bytes, digested."""
    import torch

    model = worker.model_runner.model
    out = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = f"{hashlib.sha256(data).hexdigest()[:20]} {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"
    return out


def engine(model: str, load_format: str, extra: dict[str, Any], tp: int, pp: int, expert_parallel: bool) -> dict[str, Any]:
    """One engine: every worker's weight digests after the load, then the generation (or vLLM's error)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of a function
    llm = LLM(
        model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype="float32", load_format=load_format,
        model_loader_extra_config=extra, skip_tokenizer_init=True, enforce_eager=True, max_model_len=64, max_num_seqs=4, seed=0,
        gpu_memory_utilization=0.05, distributed_executor_backend="mp" if tp * pp > 1 else None, enable_expert_parallel=expert_parallel,
    )
    result: dict[str, Any] = {"digests": llm.collective_rpc(digests), "generations": None, "error": None}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS, detokenize=False)
    try:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in PROMPTS], params, use_tqdm=False)
    except Exception as exc:  # vLLM's CPU build cannot run this layout: its error is the answer
        result["error"] = f"{type(exc).__name__}: {exc}"
        outputs = []
    finally:
        llm.llm_engine.engine_core.shutdown()  # the next engine of this process starts clean
    if outputs:
        result["generations"] = [
            {"prompt": list(out.prompt_token_ids or []), "tokens": list(out.outputs[0].token_ids),
             "logprobs": [{str(tok): lp.logprob for tok, lp in step.items()} for step in out.outputs[0].logprobs or []]}
            for out in outputs
        ]
    return result


def _replica(queue: Any, dp: int, dp_rank: int, port: int, args: tuple[Any, ...]) -> None:
    """One data-parallel replica's engine, in its own process (vLLM's offline data-parallel form)."""
    os.environ.update(VLLM_DP_RANK=str(dp_rank), VLLM_DP_RANK_LOCAL=str(dp_rank), VLLM_DP_SIZE=str(dp),
                      VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port))
    queue.put((dp_rank, engine(*args)))


def run(model: str, load_format: str, extra: dict[str, Any], tp: int, pp: int, dp: int, expert_parallel: bool) -> dict[str, Any]:
    """Every engine of the layout (one per data-parallel replica): ``{"digests": [every worker's,
    in vLLM's global rank order], "engines": [each replica's generations and error]}``."""
    args = (model, load_format, extra, tp, pp, expert_parallel)
    if dp == 1:
        engines = [engine(*args)]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        procs = [context.Process(target=_replica, args=(queue, dp, r, port, args)) for r in range(dp)]
        for p in procs:
            p.start()
        done = dict(queue.get(timeout=900) for _ in procs)
        for p in procs:
            p.join(60)
        engines = [done[r] for r in range(dp)]
    answers = [{"generations": e["generations"], "error": e["error"]} for e in engines]
    return {"digests": [d for e in engines for d in e["digests"]], "engines": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--load-formats", default="auto,functional_load", help="comma-separated; one engine each, in turn")
    parser.add_argument("--report-dir", default=None)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--saved", default=None, help="also load this pre-sharded save (fl.save_sharded) with the functional_load format")
    args = parser.parse_args()
    world = args.tp * args.pp * args.dp
    if world > 1:  # vLLM's CPU backend binds one OpenMP thread group per worker, over every replica's workers
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(world)))
    layout = (args.tp, args.pp, args.dp, args.expert_parallel)
    results = {}
    for load_format in args.load_formats.split(","):
        extra = {"report_dir": args.report_dir} if args.report_dir and load_format == "functional_load" else {}
        results[load_format] = run(args.model, load_format, extra, *layout)
        gc.collect()
    if args.saved:
        results["saved"] = run(args.saved, "functional_load", {}, *layout)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
