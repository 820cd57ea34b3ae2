"""Load time inside real vLLM (the CPU build of the parity environment), by load format.

Methods: vLLM's default loader (``auto``), ``functional_load``, ``runai_streamer`` and
functional_load's pre-sharded save (``save_sharded`` once, then ``load_format="functional_load"``);
``sharded_state`` (vLLM's own pre-sharded files, saved once per tp) and ``fastsafetensors`` on
request (``--methods``: both fail in vLLM's CPU build, see ``METHODS``).
Models: a Llama-2-7B-shaped checkpoint (3 layers, 1.74 GB, ``make_checkpoint.py``) and a
Qwen3-30B-A3B-shaped one (2 layers of 48 experts, 2.1 GB), bf16; tp 1 and 2; cold (the files
dropped from the page cache) and hot.

Each measurement is a fresh engine, ``LLM(model, load_format=..., tensor_parallel_size=tp,
enforce_eager=True, skip_tokenizer_init=True)``, in a fresh process. Reported per run:

* ``model`` - the seconds of vLLM's ``get_model`` in each worker (building the model and loading its
  weights, the same span for every loader; the slowest worker at tp 2), timed by a
  ``sitecustomize`` the child gets on ``PYTHONPATH``;
* ``weights`` - vLLM's own "Loading weights took" line where the loader logs it (default,
  sharded_state), functional_load's "loaded in" line for its format;
* ``engine`` - the wall time of ``LLM(...)``: the start-up a user waits for.

Rounds interleave the methods (``--rounds``, default 7); the table gives median (min) and every
ratio is against vLLM's default loader in the same run. Run on a quiet machine:

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--rounds 7] [--models llama,qwen3moe] [--tp 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from measure import prepare  # noqa: E402

ROOT = Path("/tmp/fl-bench")
# Not run by default, because vLLM 0.32's CPU build cannot (measured here): fastsafetensors, whose
# weights iterator builds torch.device(f"cuda:{current_device()}"), "cuda:cpu" on CPU ("Invalid
# device string"; bench_load.py runs it outside vLLM); sharded_state, whose save_sharded_state
# writes model.state_dict() after the CPU backend has repacked the linear weights out of it (a
# 3-layer Llama saved 524 MB: the embedding and lm_head) and whose load then fails with "Missing
# keys ('model.layers.0.self_attn.qkv_proj.weight', ...)". --methods still takes both.
METHODS = ("auto", "functional_load", "runai_streamer", "fl_presharded")
PEERS = ("runai-model-streamer==0.17.*",)

SITECUSTOMIZE = '''
import time, sys
import vllm.model_executor.model_loader as _ml
_get = _ml.get_model
def get_model(*args, **kwargs):
    start = time.perf_counter()
    model = _get(*args, **kwargs)
    print(f"BENCH get_model {time.perf_counter() - start:.4f}", file=sys.stderr, flush=True)
    return model
_ml.get_model = get_model
'''

CHILD = r'''
import json, sys, time
from vllm import LLM

def main():
    model, fmt, tp, dtype, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
    start = time.perf_counter()
    llm = LLM(model=model, load_format=fmt, tensor_parallel_size=tp, dtype=dtype, enforce_eager=True,
              skip_tokenizer_init=True, max_model_len=256, max_num_seqs=4, model_loader_extra_config=extra)
    engine = time.perf_counter() - start
    if len(sys.argv) > 6:  # save vLLM's sharded state
        llm.llm_engine.engine_core.save_sharded_state(path=sys.argv[6])
    print("BENCH engine %.4f" % engine, flush=True)

if __name__ == "__main__":
    main()
'''


def qwen3moe_checkpoint(out: Path, layers: int = 2, experts: int = 48) -> Path:
    """A Qwen3-30B-A3B-shaped checkpoint (its hidden, heads, expert and vocabulary sizes) with
    ``layers`` layers of ``experts`` experts, random bf16, in ~600 MB shards."""
    if (out / "model.safetensors.index.json").exists():
        return out
    import torch
    from safetensors.torch import save_file

    hidden, inter, vocab, heads, kv, dim = 2048, 768, 151936, 32, 4, 128
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden, "intermediate_size": 6144,
        "moe_intermediate_size": inter, "num_experts": experts, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": dim,
        "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": [],
        "bos_token_id": 151643, "eos_token_id": 151645,
    }
    gen = torch.Generator().manual_seed(0)
    tensors: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for n in range(layers):
        p = f"model.layers.{n}"
        tensors += [(f"{p}.input_layernorm.weight", (hidden,)), (f"{p}.post_attention_layernorm.weight", (hidden,))]
        tensors += [(f"{p}.self_attn.q_proj.weight", (heads * dim, hidden)), (f"{p}.self_attn.k_proj.weight", (kv * dim, hidden)),
                    (f"{p}.self_attn.v_proj.weight", (kv * dim, hidden)), (f"{p}.self_attn.o_proj.weight", (hidden, heads * dim)),
                    (f"{p}.self_attn.q_norm.weight", (dim,)), (f"{p}.self_attn.k_norm.weight", (dim,)),
                    (f"{p}.mlp.gate.weight", (experts, hidden))]
        for e in range(experts):
            q = f"{p}.mlp.experts.{e}"
            tensors += [(f"{q}.gate_proj.weight", (inter, hidden)), (f"{q}.up_proj.weight", (inter, hidden))]
            tensors += [(f"{q}.down_proj.weight", (hidden, inter))]
    tensors += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    weight_map, size, n = {}, 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        n += 1
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, shape in tensors:
        shard[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        size += shard[name].numel() * 2
        if size >= 600_000_000:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def llama_checkpoint(out: Path) -> Path:
    from make_checkpoint import write_checkpoint

    return write_checkpoint(out, layers=3)


# functional_load with one read option changed (model_loader_extra_config), by method name
VARIANTS = {"fl_mmap": {"strategy": "mmap"}, "fl_pread": {"strategy": "pread"}}


def run_child(
    model: Path, fmt: str, tp: int, dtype: str, site: Path, save: Path | None = None, extra: dict | None = None
) -> dict[str, float]:
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "TQDM_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(CHILD)
    cmd = [sys.executable, f.name, str(model), fmt, str(tp), dtype, json.dumps(extra or {})] + ([str(save)] if save else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    os.unlink(f.name)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{fmt} tp {tp} failed:\n{log[-3000:]}")
    weights = [float(x) for x in re.findall(r"Loading weights took ([\d.]+) seconds", log)]
    weights += [float(x) for x in re.findall(r"functional_load: rank \d+ of \d+ loaded in ([\d.]+) s", log)]
    return {
        "engine": float(re.findall(r"BENCH engine ([\d.]+)", log)[-1]),
        "model": max(float(x) for x in re.findall(r"BENCH get_model ([\d.]+)", log)),
        "weights": max(weights) if weights else float("nan"),
    }


def _median_min(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f})"


def ensure_peers() -> None:
    try:
        import runai_model_streamer  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *PEERS], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--models", default="llama,qwen3moe")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--scenarios", default="cold,hot")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    ensure_peers()
    site = Path(tempfile.mkdtemp(prefix="fl-bench-site-"))
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    models = {"llama": llama_checkpoint(ROOT / "llama7b-3l"), "qwen3moe": qwen3moe_checkpoint(ROOT / "qwen3moe-2l")}
    models = {k: v for k, v in models.items() if k in args.models.split(",")}
    tps = [int(t) for t in args.tp.split(",")]
    methods = args.methods.split(",")
    saved: dict[tuple[str, int, str], Path] = {}
    for key, model in models.items():  # the pre-sharded saves, once
        for tp in tps:
            if "sharded_state" in methods:
                out = ROOT / f"{key}-vllm-sharded-tp{tp}"
                if not any(out.glob("*.safetensors")):
                    out.mkdir(parents=True, exist_ok=True)
                    run_child(model, "auto", tp, args.dtype, site, save=out)
                    for extra in ("config.json",):
                        (out / extra).write_bytes((model / extra).read_bytes())
                saved[(key, tp, "sharded_state")] = out
            if "fl_presharded" in methods:
                out = ROOT / f"{key}-fl-sharded-tp{tp}"
                if not (out / "functional_load.sharded.json").exists():
                    import functional_load as fl

                    fl.save_sharded([fl.load(model, tp_size=tp, rank=r, dtype=args.dtype) for r in range(tp)], out)
                saved[(key, tp, "fl_presharded")] = out
    results: dict[str, list[dict[str, float]]] = {}
    print(f"{args.rounds} rounds, methods interleaved; cpu count {os.cpu_count()}; dtype {args.dtype}", flush=True)
    for round_ in range(args.rounds):
        for key, model in models.items():
            for tp in tps:
                for scenario in args.scenarios.split(","):
                    for method in methods[round_ % len(methods):] + methods[: round_ % len(methods)]:
                        path = saved.get((key, tp, method), model)
                        fmt = "functional_load" if method == "fl_presharded" or method in VARIANTS else method
                        prepare(scenario, sorted(p for p in path.iterdir() if p.suffix == ".safetensors"))
                        r = run_child(path, fmt, tp, args.dtype, site, extra=VARIANTS.get(method))
                        results.setdefault(f"{key}|{tp}|{scenario}|{method}", []).append(r)
                        print(f"round {round_} {key} tp {tp} {scenario} {method}: {r}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print("\n| model | tp | scenario | method | model s | weights s | engine s | model vs default (median) |")
    print("|---|---|---|---|---|---|---|---|")
    for cell, runs in results.items():
        key, tp, scenario, method = cell.split("|")
        base = statistics.median(r["model"] for r in results[f"{key}|{tp}|{scenario}|auto"])
        ratio = base / statistics.median(r["model"] for r in runs)
        cells = " | ".join(_median_min([r[f] for r in runs]) for f in ("model", "weights", "engine"))
        print(f"| {key} | {tp} | {scenario} | {method} | {cells} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
