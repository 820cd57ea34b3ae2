"""A tensor-parallel forward over every rank's loaded state, simulated in one process (torch,
float32), for ``functional-load check-spec``.

Each rank computes with its own blocks exactly as vLLM's parallel layers do; an all-reduce is the
sum of the ranks' partial outputs and a gather the concatenation of their slices:

* ``embed_tokens`` vocab-parallel (rows of the padded vocabulary; a token off a rank's rows gives
  zeros there); ``lm_head`` (or the tied embedding) vocab-parallel, gathered, padding dropped;
* ``qkv_proj`` rows ``[q_r; k_r; v_r]`` of the rank's ``heads / tp`` query heads and
  ``max(kv / tp, 1)`` KV heads (the local query heads share the local KV heads in order), with
  biases when the state has them, ``q_norm`` / ``k_norm`` per head (Qwen 3), default RoPE;
* ``o_proj`` / ``down_proj`` row-parallel (partials summed; a bias added once);
* ``gate_up_proj`` rows ``[gate_r; up_r]``;
* MoE: the replicated router; ``w13_weight [E_local, 2 I_r, H]`` (``[w1_r; w3_r]`` per expert) and
  ``w2_weight [E_local, H, I_r]``, over the experts the rank holds (all of them, sliced, without
  expert parallelism; whole ones of :meth:`Parallel.expert_slots` with it); softmax routing,
  top-k, renormalised as the family does.

The families whose math this is are :data:`FAMILIES` (by the transformers model class whose
logits are compared); for any other check-spec compares with real vLLM only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..layout.parallel import Parallel

# transformers model class -> (q/k norm per head, MoE renormalises its top-k weights: True, False or the config key)
FAMILIES: Mapping[str, tuple[bool, bool | str]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (False, False),
    "Qwen3ForCausalLM": (True, False),
    "Qwen3MoeForCausalLM": (True, "norm_topk_prob"),
    "MixtralForCausalLM": (False, True),
}


def _cfg(config: Mapping[str, Any]) -> dict[str, Any]:
    c = dict(config.get("text_config") or config)
    heads = c["num_attention_heads"]
    c.setdefault("head_dim", None)
    c["head_dim"] = c["head_dim"] or c["hidden_size"] // heads
    c["num_key_value_heads"] = c.get("num_key_value_heads") or heads
    rope = c.get("rope_parameters") or {}
    c["rope_theta"] = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    return c


def _rms(x: Any, weight: Any, eps: float) -> Any:
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _rope(x: Any, theta: float) -> Any:
    """Default (non-scaled) RoPE, halves rotated, over ``x [S, heads, D]``."""
    import torch

    seq, _, dim = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(seq, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None, :], torch.cat([angles.sin()] * 2, -1)[:, None, :]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _linear(x: Any, state: Mapping[str, Any], prefix: str) -> Any:
    out = x @ state[prefix + ".weight"].float().T
    bias = state.get(prefix + ".bias")
    return out if bias is None else out + bias.float()


def _attention(x: Any, state: Mapping[str, Any], p: str, c: Mapping[str, Any], tp: int, qk_norm: bool) -> Any:
    import torch

    heads, kv, dim = c["num_attention_heads"] // tp, max(c["num_key_value_heads"] // tp, 1), c["head_dim"]
    qkv = _linear(x, state, p + ".qkv_proj")
    q, k, v = qkv.split([heads * dim, kv * dim, kv * dim], -1)
    seq = x.shape[0]
    q, k, v = q.view(seq, heads, dim), k.view(seq, kv, dim), v.view(seq, kv, dim)
    if qk_norm:
        q = _rms(q, state[p + ".q_norm.weight"], c["rms_norm_eps"])
        k = _rms(k, state[p + ".k_norm.weight"], c["rms_norm_eps"])
    q, k = _rope(q, c["rope_theta"]), _rope(k, c["rope_theta"])
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(seq, heads * dim)
    return out @ state[p + ".o_proj.weight"].float().T


def _mlp(x: Any, state: Mapping[str, Any], p: str) -> Any:
    import torch

    gate, up = _linear(x, state, p + ".gate_up_proj").chunk(2, -1)
    return (torch.nn.functional.silu(gate) * up) @ state[p + ".down_proj.weight"].float().T


def _moe(x: Any, state: Mapping[str, Any], p: str, c: Mapping[str, Any], parallel: Parallel, renormalise: bool) -> Any:
    import torch

    w13 = state[p + ".experts.routed_experts.w13_weight"].float()
    w2 = state[p + ".experts.routed_experts.w2_weight"].float()
    experts = state[p + ".gate.weight"].shape[0]
    held = parallel.expert_slots(experts) if parallel.expert_parallel else tuple(range(experts))
    probs = (x @ state[p + ".gate.weight"].float().T).softmax(-1)
    weights, chosen = probs.topk(c["num_experts_per_tok"], -1)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for slot, expert in enumerate(held):
        rows, which = (chosen == expert).nonzero(as_tuple=True)
        if len(rows):
            gate, up = (x[rows] @ w13[slot].T).chunk(2, -1)
            out.index_add_(0, rows, ((torch.nn.functional.silu(gate) * up) @ w2[slot].T) * weights[rows, which, None])
    return out


def _is_moe(state: Mapping[str, Any], p: str) -> bool:
    return p + ".experts.routed_experts.w13_weight" in state


def tp_logits(
    family: str, states: Sequence[Mapping[str, Any]], parallels: Sequence[Parallel], config: Mapping[str, Any], input_ids: Any
) -> Any:
    """Logits ``[S, vocab]`` of the token ids ``input_ids [S]`` from every rank's state."""
    import torch

    qk_norm, renorm = FAMILIES[family]
    c = _cfg(config)
    renormalise = bool(c.get(renorm, False)) if isinstance(renorm, str) else renorm
    tp = len(states)
    vocab = c["vocab_size"]
    embed = []
    for state, parallel in zip(states, parallels):
        rows = state["model.embed_tokens.weight"]
        first = parallel.rank * rows.shape[0]
        local = input_ids - first
        inside = (local >= 0) & (local < rows.shape[0])
        embed.append(rows.float()[local.clamp(0, rows.shape[0] - 1)] * inside[:, None])
    h = torch.stack(embed).sum(0)
    eps = c["rms_norm_eps"]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        x = _rms(h, states[0][p + ".input_layernorm.weight"], eps)
        h = h + sum(_attention(x, s, p + ".self_attn", c, tp, qk_norm) for s in states)
        x = _rms(h, states[0][p + ".post_attention_layernorm.weight"], eps)
        if _is_moe(states[0], p + ".mlp"):
            h = h + sum(_moe(x, s, p + ".mlp", c, par, renormalise) for s, par in zip(states, parallels))
        else:
            h = h + sum(_mlp(x, s, p + ".mlp") for s in states)
    x = _rms(h, states[0]["model.norm.weight"], eps)
    head = "lm_head.weight" if "lm_head.weight" in states[0] else "model.embed_tokens.weight"
    return torch.cat([x @ s[head].float().T for s in states], -1)[:, :vocab]
