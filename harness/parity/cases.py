"""The parity cases: tiny checkpoints, tensor-parallel sizes and loader options.

Every architecture spec of ``specs/`` has tiny transformers-written checkpoints (several GQA/MQA
shapes, odd sizes), MoE models run with and without expert parallelism and with both placements,
DeepSeek with and without ``q_lora_rank``, and the quantized fixtures of ``tests/fixtures/quant``
(written by the real tools) run at tp 1, 2 and 4; ``dummy-`` cases compare ``load_format="dummy"``.
A case may say why vLLM cannot load it while functional_load can (``vllm_cannot``), or why
functional_load refuses a state vLLM "loads" (``we_refuse``); every other difference fails the
harness.
"""

from __future__ import annotations

from functional_load.testing.parity.case import DENSE, MOE, Case, Options, check_case

__all__ = ["CASES", "CHECK_SPEC", "RECORDED", "Case", "Options", "select"]


# Formats vLLM no longer reads, or crashes on, that functional_load loads (its dequantization
# tests against an independent reference are the judge there).
_VLLM_CANNOT = {
    "gptq_actorder": "vLLM no longer supports GPTQ act-order (desc_act=True)",
    "gptq_v1_zero0": "vLLM supports symmetric GPTQ only",
    "gptq_v2": "vLLM supports symmetric GPTQ only",
    "hf_fp8_block": "vLLM crashes when a rank's k/v rows share a scale block (tp 2: head_dim 64 < block 128)",
    "hf_fp8_block_ue8m0": "vLLM crashes when a rank's k/v rows share a scale block (tp 2: head_dim 64 < block 128)",
    # vLLM 0.32's CPU build cannot build these layers even with its Emulation kernels (VLLM_2026.md)
    "llmc_nvfp4a16": "vLLM forces the Marlin NVFP4 kernel for weight-only NVFP4 (Marlin FP4 not available on CPU)",
    "modelopt_w4a16_nvfp4": "vLLM forces the Marlin NVFP4 kernel for weight-only NVFP4 (Marlin FP4 not available on CPU)",
    **{name: "vLLM has no NVFP4 MoE backend on CPU (its emulation experts are Triton kernels)" for name in (
        "llmc_qwen3moe_nvfp4", "llmc_qwen3moe_nvfp4a16", "modelopt_qwen3moe_nvfp4", "modelopt_qwen3moe_w4a16_nvfp4")},
}

# Loaded in the model dtype the config gives and in another (scales follow the model dtype).
_QUANT_OPTIONS = {
    name: (Options(), Options(dtype=other))
    for name, other in (("awq_gemm", "bfloat16"), ("gptq_v1", "bfloat16"), ("ct_w4a16_asym", "float16"), ("ct_fp8_tensor", "float16"))
}

_DUMMY = (Options(load_format="dummy"),)
_MULTIMODAL = (Options(), Options(text_only=True))
_ODD = {"vocab_size": 100, "intermediate_size": 96}  # vocab pads to 128: at tp 8 rank 7 is all padding

CORE: tuple[Case, ...] = (
    # Dense, every spec; MHA, GQA, MQA; tied and untied embeddings.
    Case("llama-mha", "llama"),
    Case("llama-gqa", "llama", {"kv_heads": 2}),
    Case("llama-mqa-tied", "llama", {"kv_heads": 1, "tie_word_embeddings": True}),
    Case("llama-odd", "llama", {"kv_heads": 2, **_ODD}, note="vocab 100 (last shards partly/wholly padding), intermediate 96"),
    Case("llama-tp16", "llama", tps=(16,), note="8 heads do not divide over 16 ranks"),
    Case("llama-tp3", "llama", {"hidden_size": 48, "num_attention_heads": 6, "head_dim": 8, "num_key_value_heads": 3}, tps=(3,),
         note="heads divide over 3 ranks, the vocabulary padded to 1024 does not"),
    Case("mistral-gqa", "mistral", {"kv_heads": 2}),
    Case("mistral-both-formats", "mistral", {"kv_heads": 2}, tps=(1, 2, 4), mistral_copy=True,
         options=(Options(), Options(load_format="mistral"), Options(load_format="hf")),
         note="HF files and Mistral's consolidated copy: auto picks Mistral's (wq/wk permuted to rotary halves)"),
    Case("qwen2-gqa", "qwen2", {"kv_heads": 2}),
    Case("qwen2-odd", "qwen2", {"kv_heads": 1, **_ODD}),
    Case("qwen3-gqa", "qwen3", {"kv_heads": 2}),
    Case("phi3", "phi3", {"kv_heads": 2}),
    Case("gpt2", "gpt2"),
    # Gemma 2 / Gemma 3 text: tied by default; vLLM's Gemma 2 has no lm_head, so an untied one is refused.
    Case("gemma2-mha", "gemma2"),
    Case("gemma2-gqa", "gemma2", {"kv_heads": 2}),
    Case("gemma2-untied", "gemma2", {"kv_heads": 2, "tie_word_embeddings": False}, tps=(1, 2),
         note="lm_head.weight stored: vLLM's Gemma 2 has no lm_head; both refuse"),
    Case("gemma3_text-gqa", "gemma3_text", {"kv_heads": 2}),
    Case("gemma3_text-mqa-untied", "gemma3_text", {"kv_heads": 1, "tie_word_embeddings": False}),
    # Phi-4 is Phi3ForCausalLM: Phi-4's 40 heads and 10 KV heads (intermediate 3.5 x hidden);
    # Phi-4-mini's 3:1 GQA, tied embeddings and partial rotary.
    Case("phi4-gqa", "phi3", {"hidden_size": 160, "num_attention_heads": 40, "num_key_value_heads": 10, "intermediate_size": 560},
         note="Phi-4's heads: 10 KV heads neither divide over 4 or 8 ranks nor are divided by them; both refuse tp 4 and 8"),
    Case("phi4-mini-tied", "phi3", {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 4,
                                    "intermediate_size": 256, "tie_word_embeddings": True, "partial_rotary_factor": 0.75},
         tps=(1, 2, 4), note="12 heads, 4 KV heads: tp 8 does not divide"),
    # GLM-4 dense: q/k/v biases, fused gate_up_proj on disk, post_self_attn/post_mlp norms.
    Case("glm4-mha", "glm4"),
    Case("glm4-gqa", "glm4", {"kv_heads": 2}),
    Case("glm4-mqa-tied", "glm4", {"kv_heads": 1, "tie_word_embeddings": True}),
    # MoE: without and with expert parallelism, both placements.
    Case("mixtral", "mixtral", {"kv_heads": 2}, options=MOE),
    Case("mixtral-4experts", "mixtral", {"kv_heads": 2, "num_local_experts": 4}, tps=(8,), options=MOE,
         note="8 ranks, 4 experts: refused without EP; with EP, ranks 4..7 hold no expert"),
    Case("qwen3_moe", "qwen3_moe", {"kv_heads": 2}, options=MOE),
    Case("qwen3_moe-fused", "qwen3_moe", {"kv_heads": 2, "fused_experts": True}, tps=(1, 2), options=MOE,
         note="transformers 5 3-D expert tensors"),
    Case("deepseek_v3", "deepseek_v3", {}, options=MOE, note="q_lora_rank 32, 2 expert groups"),
    Case("deepseek_v2_lite", "deepseek_v3", {"q_lora_rank": None}, options=MOE, note="q_lora_rank null"),
    Case("gpt_oss", "gpt_oss", {}, tps=(1, 2, 4), options=MOE[:2], note="fused input-major experts, gate/up interleaved, biases"),
    Case("llama4_text", "llama4_text", {"kv_heads": 2}, tps=(1, 2, 4), options=MOE[:2],
         note="MoE every 2nd layer, shared expert, fused input-major experts, q/k rows permuted to rotary halves"),
    Case("glm4_moe", "glm4_moe", {"kv_heads": 2}, tps=(1, 2, 4), options=MOE[:2], note="float32 router, qk-norm, shared expert"),
    # Multimodal: the language model under language_model., the vision tower with vLLM's sharding
    # (4 vision heads: tp 8 refused by both); text_only=True compared with vLLM's language model.
    Case("qwen2_5_vl", "qwen2_5_vl", {"kv_heads": 2}, options=_MULTIMODAL, multimodal=True,
         note="vision qkv fused on disk, gate/up merged, merger column/row; releases' names"),
    Case("qwen2_5_vl-tf452-tied", "qwen2_5_vl", {"kv_heads": 1, "tie_word_embeddings": True}, tps=(1, 2, 4),
         options=_MULTIMODAL, multimodal=True, names="transformers_4_52",
         note="transformers 4.52-4.57 names: model.language_model.*, model.visual.*"),
    Case("gemma3-mm", "gemma3", {"kv_heads": 2}, options=_MULTIMODAL, multimodal=True,
         note="SigLIP q/k/v stacked into qkv_proj, fc1 column, fc2 row, projector replicated; releases' names"),
    Case("gemma3-mm-tf452", "gemma3", {"kv_heads": 1}, tps=(1, 2, 4), options=_MULTIMODAL, multimodal=True,
         names="transformers_4_52", note="transformers 4.52-4.57 names: model.language_model.*, model.vision_tower.*"),
    # Quantized dense checkpoints written by the real tools.
    *(
        Case(f"quant-{name}", fixture=name, tps=(1, 2, 4), options=_QUANT_OPTIONS.get(name, DENSE),
             vllm_cannot=_VLLM_CANNOT.get(name, ""))
        for name in (
            "awq_gemm", "awq_gemm_sym", "ct_fp8_block", "ct_fp8_channel", "ct_fp8_tensor", "ct_w4a16_asym",
            "ct_w4a16_sym", "ct_w8a8", "gptq_actorder", "gptq_v1", "gptq_v1_zero0", "gptq_v2", "hf_fp8_block",
            "hf_fp8_block_ue8m0", "llmc_fp8_kv", "quark_fp8", "quark_native_kv",
            # the 2026 formats (ModelOpt's mxfp4: refused by both, vLLM 0.32's ModelOpt has no MXFP4)
            "llmc_nvfp4", "llmc_nvfp4a16", "llmc_mxfp4", "llmc_mxfp4a16", "llmc_mxfp8", "llmc_mxfp8a16", "modelopt_fp8",
            "modelopt_nvfp4", "modelopt_w4a16_nvfp4", "modelopt_mxfp8", "modelopt_mxfp4", "quark_mxfp4",
        )
    ),
    # Quantized MoE checkpoints: every expert scheme, with and without expert parallelism.
    *(
        Case(f"quant-{name}", fixture=name, tps=(1, 2, 4), options=(Options(), Options(True)),
             vllm_cannot=_VLLM_CANNOT.get(name, ""))
        for name in (
            "llmc_qwen3moe_fp8", "llmc_qwen3moe_fp8_block", "llmc_qwen3moe_w4a16_experts", "llmc_mixtral_fp8_block",
            "llmc_dsv3_fp8_block", "llmc_dsv3_w4a16_experts", "hf_fp8_dsv3", "hf_fp8_dsv3_mtp", "hf_fp8_qwen3moe",
            "ar_mixtral_gptq", "ar_qwen3moe_gptq", "ar_mixtral_awq",
            "llmc_qwen3moe_fp8_dynamic", "llmc_qwen3moe_nvfp4", "llmc_qwen3moe_nvfp4a16", "llmc_qwen3moe_mxfp4",
            "llmc_qwen3moe_mxfp4a16", "llmc_qwen3moe_mxfp8", "llmc_qwen3moe_mxfp8a16", "modelopt_qwen3moe_fp8",
            "modelopt_qwen3moe_nvfp4", "modelopt_qwen3moe_w4a16_nvfp4", "modelopt_qwen3moe_mxfp8", "modelopt_qwen3moe_mxfp4",
            "quark_qwen3moe_mxfp4",
        )
    ),
    Case("quant-gptoss_mxfp4", fixture="gptoss_mxfp4", tps=(1, 2, 4), options=(Options(), Options(True)),
         note="2 KV heads: tp 4 is refused (vLLM replicates no gpt-oss KV head)"),
    # load_format="dummy": vLLM's DummyModelLoader, integer parameters zeroed (its ROCm branch), against ours.
    Case("dummy-llama-odd", "llama", {"kv_heads": 2, **_ODD}, tps=(1, 2, 8), options=_DUMMY, note="rank 7 of tp 8: all padding"),
    Case("dummy-llama-mqa-tied", "llama", {"kv_heads": 1, "tie_word_embeddings": True}, tps=(1, 4), options=_DUMMY),
    Case("dummy-gpt2", "gpt2", tps=(1, 2), options=_DUMMY),
    *(
        Case(f"dummy-{arch}", arch, build, tps=(1, 2), options=(*_DUMMY, Options(True, load_format="dummy")))
        for arch, build in (("mixtral", {"kv_heads": 2}), ("deepseek_v3", {}), ("gpt_oss", {}))
    ),
    *(
        Case(f"dummy-{name}", fixture=name, tps=(1, 2), options=_DUMMY)
        for name in (
            "ct_fp8_tensor", "ct_w4a16_asym", "ct_w8a8", "gptq_v1", "awq_gemm", "quark_fp8", "llmc_fp8_kv", "gptoss_mxfp4",
            "llmc_qwen3moe_w4a16_experts", "hf_fp8_dsv3",
        )
    ),
)


def _groups() -> tuple[Case, ...]:
    """The cases of the ``cases_*`` modules (one per group of families), in module order."""
    import importlib
    import pkgutil
    from pathlib import Path

    out: list[Case] = []
    for module in sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.name.startswith("cases_")):
        out += importlib.import_module(f"{__package__}.{module}").CASES
    return tuple(out)


CASES: tuple[Case, ...] = CORE + _groups()
_names = [c.name for c in CASES]
if len(set(_names)) != len(_names):
    raise ValueError(f"parity cases named twice: {sorted({n for n in _names if _names.count(n) > 1})}")


def select(cases: tuple[Case, ...], patterns: list[str]) -> tuple[Case, ...]:
    """The cases whose name contains any of ``patterns`` (all when none are given)."""
    if not patterns:
        return cases
    return tuple(c for c in cases if any(p in c.name for p in patterns))


# vLLM's side of the check-spec runs the test suite replays (tests/test_check_spec.py):
# ``functional-load check-spec gpt2 --tp 1,2``, and a Llama spec at tp 2.
CHECK_SPEC: tuple[Case, ...] = (check_case("gpt2", (1, 2)), check_case("llama", (2,)))
RECORDED: tuple[Case, ...] = CASES + CHECK_SPEC  # every case whose vLLM answers tests/oracle/vllm/ holds


def _pipeline(cases: tuple[Case, ...]) -> tuple[Case, ...]:
    """Each architecture's first case again over pipeline stages (2 stages at tp 1 and 2, 3
    stages: the tiny checkpoints' 2 layers leave the first stage none), and each MoE family's over
    data parallelism (dp 2 x tp 2, with and without expert parallelism); Llama with 5 layers
    over uneven splits and a custom partition, and tied embeddings (the last stage holds the
    embedding as its head)."""
    from functional_load.testing.archs import ARCHS
    from functional_load.testing.parity.case import Grid

    out, seen = [], set()
    cannot = {  # vLLM 0.32 fails to build or load a stage (the tiny checkpoints' first layers are dense, 2 layers)
        "glm4_moe": "vLLM's model needs an MoE layer on every stage (RuntimeError: No Glm4MoE layer found)",
        "glm4_moe_lite": "vLLM's model needs an MoE layer on every stage (RuntimeError: No Glm4MoE layer found)",
        "afmoe": "vLLM's model needs an MoE layer on every stage (RuntimeError: No AfmoeMoE layer found)",
        "hy_v3": "vLLM's model needs an MoE layer on every stage (RuntimeError: No MoE layer found)",
        "lfm2_moe": "vLLM's model needs an MoE layer on every stage (RuntimeError: No Lfm2MoeSparseMoeBlock layer found)",
        "qwen3vlmoe": "vLLM's model needs an MoE layer on every stage (a third stage of 2 layers holds none)",
        **{arch: "vLLM's MoE model needs an MoE layer on every stage; a third stage of 2 layers holds none (No ... layer found)"
           for arch in ("mixtral", "qwen3_moe", "qwen3_5_moe", "qwen3_next", "qwen3_5_moe_vl")},
        "granitemoehybrid": "vLLM's loader fails on a stage without the layer (KeyError: 'layers.1.block_sparse_moe.gate.weight')",
        "ernie4_5_moe": "vLLM fails to tie the head on a stage without it (AttributeError: 'PPMissingLayer' ... 'tie_weights')",
    }
    refuse = {"gemma4_text": "Gemma 4 stages are not planned (vLLM refuses every stage but the first: KV sharing across stages)",
              "gemma4": "Gemma 4 stages are not planned (vLLM refuses every stage but the first: KV sharing across stages)"}
    for c in cases:
        if c.arch is None or c.arch in seen or c.mistral_copy or c.names or c.arch not in ARCHS:
            continue
        seen.add(c.arch)
        grids = (Grid(1, 2), Grid(2, 2), Grid(1, 3))
        why = next((w for key, w in cannot.items() if c.arch == key or c.name.startswith(key)), c.vllm_cannot)
        out.append(Case(f"{c.name}-pp", c.arch, c.build, tps=(), grids=grids, options=(c.options[0],), multimodal=c.multimodal,
                        vllm_cannot=why, we_refuse=refuse.get(c.arch, c.we_refuse)))
        served = tuple(o for o in c.options if not o.text_only)
        if any(o.expert_parallel for o in served):  # each MoE family: wide EP (dp 4 x tp 1), and dp 2 x tp 2
            out.append(Case(f"{c.name}-dp", c.arch, c.build, tps=(), grids=(Grid(1, dp=4), Grid(2, dp=2)), options=served,
                            multimodal=c.multimodal, vllm_cannot=c.vllm_cannot, we_refuse=c.we_refuse))
    splits = (Grid(1, 2), Grid(1, 3), Grid(2, 2), Grid(1, 4), Grid(1, 3, partition="1,1,3"), Grid(2, 2, partition="4,1"))
    out.append(Case("llama-pp-splits", "llama", {"kv_heads": 2, "num_hidden_layers": 5}, tps=(), grids=splits,
                    note="5 layers: vLLM's uneven splits [3, 2], [2, 2, 1], [1, 1, 2, 1] and custom partitions"))
    out.append(Case("llama-mqa-tied-pp", "llama", {"kv_heads": 1, "tie_word_embeddings": True}, tps=(), grids=(Grid(1, 2), Grid(1, 3))))
    return tuple(out)


PIPELINE: tuple[Case, ...] = _pipeline(CASES)
CASES = CASES + PIPELINE
RECORDED = RECORDED + PIPELINE
