"""Greedy generation in real vLLM with a given load format (run with the vLLM environment's python).

``python -m harness.vllm_generate MODEL OUT.json --tp 2 --load-format functional_load
--report-dir DIR`` starts ``vllm.LLM`` (float32, eager, no tokenizer), generates a few tokens
greedily for fixed prompt token ids with their top logprobs, and writes them to ``OUT.json``.
``tests/test_vllm_plugin.py`` compares the ``functional_load`` load format with vLLM's default
loader this way. The ``__main__`` guard is needed: vLLM spawns its workers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path
from typing import Any

PROMPTS = ([1, 17, 42, 99, 5, 63], [7, 7, 120, 3], [200, 11, 64, 19, 88, 2, 150, 31])
MAX_TOKENS = 8
LOGPROBS = 5


def generate(model: str, tp: int, load_format: str, extra: dict[str, Any], expert_parallel: bool = False) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model, tensor_parallel_size=tp, dtype="float32", load_format=load_format, model_loader_extra_config=extra,
        skip_tokenizer_init=True, enforce_eager=True, max_model_len=64, max_num_seqs=4, seed=0, gpu_memory_utilization=0.05,
        distributed_executor_backend="mp" if tp > 1 else None, enable_expert_parallel=expert_parallel,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in PROMPTS], params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()  # the next engine of this process starts clean
    results = []
    for out in outputs:
        completion = out.outputs[0]
        steps = [{str(tok): lp.logprob for tok, lp in step.items()} for step in completion.logprobs or []]
        results.append({"prompt": list(out.prompt_token_ids or []), "tokens": list(completion.token_ids), "logprobs": steps})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--load-formats", default="auto,functional_load", help="comma-separated; one engine each, in turn")
    parser.add_argument("--report-dir", default=None)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--saved", default=None, help="also load this pre-sharded save (fl.save_sharded) with the functional_load format")
    args = parser.parse_args()
    if args.tp > 1:  # vLLM's CPU backend binds one OpenMP thread group per worker
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp)))
    results = {}
    for load_format in args.load_formats.split(","):
        extra = {"report_dir": args.report_dir} if args.report_dir and load_format == "functional_load" else {}
        results[load_format] = generate(args.model, args.tp, load_format, extra, args.expert_parallel)
        gc.collect()
    if args.saved:
        results["saved"] = generate(args.saved, args.tp, "functional_load", {}, args.expert_parallel)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
