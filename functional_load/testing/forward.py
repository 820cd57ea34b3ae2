"""Reference tensor-parallel forwards over loaded shards, for tests (not part of the loader).

These run a Llama-family decoder the way vLLM's tensor-parallel layers do, over exactly the
rank-local blocks the loader produces, so comparing their output with transformers' own model
checks that the blocks are the right ones *and* in the right layout:

* vocab-parallel embedding: rank ``r`` holds rows ``[r*Vp/tp, (r+1)*Vp/tp)`` of the vocabulary
  padded to ``Vp``; a token outside the rank's range contributes zeros, the ranks' partial
  embeddings are summed (all-reduce);
* ``qkv_proj`` rows ``[q_r; k_r; v_r]`` of the rank's ``heads/tp`` query heads and
  ``max(kv/tp, 1)`` KV heads (a replicated KV head when ``tp > kv``); attention over local heads;
* ``o_proj`` and ``down_proj`` row-parallel: each rank's partial product is all-reduced;
* ``gate_up_proj`` rows ``[gate_r; up_r]``;
* MoE: ``experts.routed_experts.w13_weight [E, 2I/tp, H]`` (``[w1_r; w3_r]`` per expert) and
  ``experts.routed_experts.w2_weight [E, H, I/tp]``; the router ``gate.weight`` is replicated, every rank
  routes identically and computes its ``I/tp`` slice of every expert, partial outputs are summed;
* ``lm_head`` vocab-parallel: each rank's logits over its vocabulary rows are gathered and the
  padding columns dropped.

All math is float32 (weights are cast up from whatever dtype they were loaded in); attention is
causal over positions ``0..S-1``; RoPE is transformers' default (non-scaled) Llama RoPE.

``jax_tp_forward`` works on the global arrays of :func:`functional_load.load_jax` with
``jax.shard_map``; ``torch_tp_decoder_layer`` runs one decoder layer on one torch rank's state
with ``torch.distributed.all_reduce``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .checkpoints import quiet_transformers, write_checkpoint

__all__ = ["Dims", "jax_tp_forward", "torch_tp_decoder_layer"]

_MISSING = object()


def _get(config: Any, key: str, default: Any = _MISSING) -> Any:
    if isinstance(config, Mapping):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    if value is _MISSING:
        raise KeyError(f"config has no {key!r}")
    return value


@dataclass(frozen=True)
class Dims:
    """The model sizes the reference forwards need, from a ``config.json`` dict or a
    transformers config."""

    model_type: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    eps: float
    rope_theta: float
    top_k: int
    norm_topk_prob: bool

    @classmethod
    def from_config(cls, config: Any) -> Dims:
        model_type = _get(config, "model_type", "")
        hidden = int(_get(config, "hidden_size"))
        heads = int(_get(config, "num_attention_heads"))
        head_dim = _get(config, "head_dim", None) or hidden // heads
        rope = _get(config, "rope_parameters", None) or _get(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"reference forward implements the default RoPE only, not {rope_type!r}")
        theta = rope.get("rope_theta", None) or _get(config, "rope_theta", 10000.0)
        if _get(config, "use_sliding_window", False) and _get(config, "sliding_window", None):
            raise NotImplementedError("reference forward has no sliding-window attention")
        return cls(
            model_type=model_type,
            hidden=hidden,
            heads=heads,
            kv_heads=int(_get(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab=int(_get(config, "vocab_size")),
            layers=int(_get(config, "num_hidden_layers")),
            eps=float(_get(config, "rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            top_k=int(_get(config, "num_experts_per_tok", 0) or 0),
            # transformers: Qwen3-MoE renormalises the top-k probabilities only when asked
            # (config default False); Mixtral always does.
            norm_topk_prob=bool(_get(config, "norm_topk_prob", model_type == "mixtral")),
        )

    def local_heads(self, tp: int) -> tuple[int, int]:
        """(query heads, KV heads) a rank holds: vLLM replicates a KV head when tp > kv_heads."""
        if self.heads % tp:
            raise ValueError(f"{self.heads} attention heads do not divide over tp={tp}")
        if self.kv_heads >= tp:
            if self.kv_heads % tp:
                raise ValueError(f"{self.kv_heads} KV heads do not divide over tp={tp}")
            return self.heads // tp, self.kv_heads // tp
        if tp % self.kv_heads:
            raise ValueError(f"tp={tp} is not a multiple of the {self.kv_heads} KV heads")
        return self.heads // tp, 1


def _moe_prefix(names: Any, layer: int) -> str | None:
    """``model.layers.N.<moe module>.`` of a layer with routed experts, else None."""
    pre = f"model.layers.{layer}."
    for name in names:
        if name.startswith(pre) and name.endswith(".experts.routed_experts.w13_weight"):
            module = name[: -len("experts.routed_experts.w13_weight")]
            if any(n.startswith(module + "shared_expert") for n in names):
                raise NotImplementedError(f"{module}: shared experts are not implemented by the reference forward")
            return module
    return None


# --------------------------------------------------------------------------------------------
# JAX


def jax_tp_forward(params: Mapping[str, Any], config: Any, mesh: Any, input_ids: Any, tp_axis: str = "tp") -> Any:
    """Logits ``[B, S, vocab]`` (float32, padding columns dropped) of a Llama-family causal LM
    (llama / mistral / qwen2 / qwen3, with optional q/k/v bias and q/k norms; MoE layers as
    qwen3_moe / mixtral) from the global arrays of ``load_jax``, computed with ``jax.shard_map``
    over ``mesh``: each device sees its tensor-parallel rank's blocks. ``input_ids`` ``[B, S]``
    is replicated. The result is a global array replicated over the mesh (in a multi-process
    run, read it with ``.addressable_data(0)``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    shard_map: Any = getattr(jax, "shard_map", None)
    if shard_map is None:  # older jax
        from jax.experimental.shard_map import shard_map

    dims = Dims.from_config(config)
    tp = mesh.shape[tp_axis]
    nq, nkv = dims.local_heads(tp)
    hd = dims.head_dim
    hi = jax.lax.Precision.HIGHEST
    names = sorted(params)
    moe = {i: _moe_prefix(names, i) for i in range(dims.layers)}

    ids = np.asarray(input_ids, dtype=np.int32)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {ids.shape}")
    batch, seq = ids.shape
    ids_global = jax.make_array_from_callback(ids.shape, NamedSharding(mesh, P()), lambda index: ids[index])

    def mm(spec: str, *xs: Any) -> Any:
        return jnp.einsum(spec, *xs, precision=hi)

    def rms(x: Any, w: Any) -> Any:
        return w * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + dims.eps))

    # transformers' default RoPE, float32: inv_freq = 1 / theta^(2i/d), emb = [freqs, freqs]
    inv_freq = 1.0 / (dims.rope_theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd))
    freqs = np.arange(seq, dtype=np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos_np, sin_np = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)

    def rope(x: Any, cos: Any, sin: Any) -> Any:  # x [B, S, heads, hd]
        half = x.shape[-1] // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]

    def kernel(p: dict[str, Any], tokens: Any) -> Any:
        rank = jax.lax.axis_index(tp_axis)

        def w(name: str) -> Any:
            return p[name].astype(jnp.float32)

        def has(name: str) -> bool:
            return name in p

        cos, sin = jnp.asarray(cos_np), jnp.asarray(sin_np)

        # vocab-parallel embedding
        table = w("model.embed_tokens.weight")
        rows = table.shape[0]
        local = tokens - rank * rows
        inside = (local >= 0) & (local < rows)
        h = jnp.where(inside[..., None], table[jnp.clip(local, 0, rows - 1)], 0.0)
        h = jax.lax.psum(h, tp_axis)

        causal = np.tril(np.ones((seq, seq), dtype=bool))
        for i in range(dims.layers):
            pre = f"model.layers.{i}."
            att = pre + "self_attn."
            x = rms(h, w(pre + "input_layernorm.weight"))
            qkv_w = w(att + "qkv_proj.weight")
            if qkv_w.shape[0] != (nq + 2 * nkv) * hd:
                raise ValueError(f"{att}qkv_proj.weight has {qkv_w.shape[0]} rows on a rank, expected {(nq + 2 * nkv) * hd}")
            qkv = mm("bsh,oh->bso", x, qkv_w)
            if has(att + "qkv_proj.bias"):
                qkv = qkv + w(att + "qkv_proj.bias")
            q = qkv[..., : nq * hd].reshape(batch, seq, nq, hd)
            k = qkv[..., nq * hd : (nq + nkv) * hd].reshape(batch, seq, nkv, hd)
            v = qkv[..., (nq + nkv) * hd :].reshape(batch, seq, nkv, hd)
            if has(att + "q_norm.weight"):
                q = rms(q, w(att + "q_norm.weight"))
                k = rms(k, w(att + "k_norm.weight"))
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            k = jnp.repeat(k, nq // nkv, axis=2)  # local query head j uses local KV head j // group
            v = jnp.repeat(v, nq // nkv, axis=2)
            scores = mm("bqnd,bknd->bnqk", q, k) * (hd**-0.5)
            scores = jnp.where(causal[None, None], scores, -jnp.inf)
            probs = jax.nn.softmax(scores, axis=-1)
            out = mm("bnqk,bknd->bqnd", probs, v).reshape(batch, seq, nq * hd)
            partial = mm("bsi,hi->bsh", out, w(att + "o_proj.weight"))
            attn = jax.lax.psum(partial, tp_axis)
            if has(att + "o_proj.bias"):
                attn = attn + w(att + "o_proj.bias")
            h = h + attn

            x = rms(h, w(pre + "post_attention_layernorm.weight"))
            module = moe[i]
            if module is None:
                gate_up = mm("bsh,oh->bso", x, w(pre + "mlp.gate_up_proj.weight"))
                inter = gate_up.shape[-1] // 2
                act = jax.nn.silu(gate_up[..., :inter]) * gate_up[..., inter:]
                partial = mm("bsi,hi->bsh", act, w(pre + "mlp.down_proj.weight"))
            else:
                router = mm("bsh,eh->bse", x, w(module + "gate.weight"))
                experts = router.shape[-1]
                probs = jax.nn.softmax(router, axis=-1)
                top_p, top_i = jax.lax.top_k(probs, dims.top_k)
                if dims.norm_topk_prob:
                    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
                weights = jnp.sum(jax.nn.one_hot(top_i, experts, dtype=jnp.float32) * top_p[..., None], axis=-2)
                w13 = w(module + "experts.routed_experts.w13_weight")  # [E, 2I/tp, H]
                inter = w13.shape[1] // 2
                gate_up = mm("bsh,eih->bsei", x, w13)
                act = jax.nn.silu(gate_up[..., :inter]) * gate_up[..., inter:]
                per_expert = mm("bsei,ehi->bseh", act, w(module + "experts.routed_experts.w2_weight"))
                partial = jnp.sum(per_expert * weights[..., None], axis=-2)
            h = h + jax.lax.psum(partial, tp_axis)

        h = rms(h, w("model.norm.weight"))
        logits = mm("bsh,vh->bsv", h, w("lm_head.weight"))
        logits = jax.lax.all_gather(logits, tp_axis, axis=2, tiled=True)
        return logits[..., : dims.vocab]

    specs = {name: params[name].sharding.spec for name in names}
    # all_gather's result is the same on every rank, but shard_map's replication check cannot
    # infer that (it types the result as varying over tp_axis), so the check is off.
    try:
        fn = shard_map(kernel, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False)
    except TypeError:  # older jax spells it check_rep
        fn = shard_map(kernel, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_rep=False)
    return jax.jit(fn)({name: params[name] for name in names}, ids_global)


# --------------------------------------------------------------------------------------------
# torch


def torch_tp_decoder_layer(state: Mapping[str, Any], config: Any, layer: int, hidden: Any, group: Any = None) -> Any:
    """One decoder layer of one tensor-parallel rank, float32: ``hidden`` ``[B, S, H]`` (the same
    on every rank) -> the layer's output ``[B, S, H]`` (the same on every rank). ``state`` is the
    rank's :func:`functional_load.load` output; the tp size and rank are those of ``group``
    (default: the world). Partial products after ``o_proj`` and ``down_proj`` (or the experts)
    are summed with ``torch.distributed.all_reduce``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    dims = Dims.from_config(config)
    tp = dist.get_world_size(group)
    nq, nkv = dims.local_heads(tp)
    hd = dims.head_dim
    pre = f"model.layers.{layer}."
    att = pre + "self_attn."

    def w(name: str) -> Any:
        return state[name].to(torch.float32)

    def rms(x: Any, weight: Any) -> Any:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + dims.eps))

    h = hidden.to(torch.float32)
    batch, seq, _ = h.shape
    inv_freq = 1.0 / (dims.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]

    def rope(x: Any) -> Any:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    x = rms(h, w(pre + "input_layernorm.weight"))
    qkv_w = w(att + "qkv_proj.weight")
    if qkv_w.shape[0] != (nq + 2 * nkv) * hd:
        raise ValueError(f"{att}qkv_proj.weight has {qkv_w.shape[0]} rows on this rank, expected {(nq + 2 * nkv) * hd}")
    qkv = F.linear(x, qkv_w, w(att + "qkv_proj.bias") if att + "qkv_proj.bias" in state else None)
    q = qkv[..., : nq * hd].reshape(batch, seq, nq, hd)
    k = qkv[..., nq * hd : (nq + nkv) * hd].reshape(batch, seq, nkv, hd)
    v = qkv[..., (nq + nkv) * hd :].reshape(batch, seq, nkv, hd)
    if att + "q_norm.weight" in state:
        q = rms(q, w(att + "q_norm.weight"))
        k = rms(k, w(att + "k_norm.weight"))
    q, k = rope(q), rope(k)
    k = k.repeat_interleave(nq // nkv, dim=2)
    v = v.repeat_interleave(nq // nkv, dim=2)
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) * (hd**-0.5)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.einsum("bnqk,bknd->bqnd", scores.softmax(-1), v).reshape(batch, seq, nq * hd)
    attn = F.linear(out, w(att + "o_proj.weight"))
    dist.all_reduce(attn, group=group)
    if att + "o_proj.bias" in state:
        attn = attn + w(att + "o_proj.bias")
    h = h + attn

    x = rms(h, w(pre + "post_attention_layernorm.weight"))
    module = _moe_prefix(list(state), layer)
    if module is None:
        gate_up = F.linear(x, w(pre + "mlp.gate_up_proj.weight"))
        gate, up = gate_up.chunk(2, dim=-1)
        partial = F.linear(F.silu(gate) * up, w(pre + "mlp.down_proj.weight"))
    else:
        probs = F.linear(x, w(module + "gate.weight")).softmax(-1)
        top_p, top_i = probs.topk(dims.top_k, dim=-1)
        if dims.norm_topk_prob:
            top_p = top_p / top_p.sum(-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(-1, top_i, top_p)
        gate_up = torch.einsum("bsh,eih->bsei", x, w(module + "experts.routed_experts.w13_weight"))
        gate, up = gate_up.chunk(2, dim=-1)
        per_expert = torch.einsum("bsei,ehi->bseh", F.silu(gate) * up, w(module + "experts.routed_experts.w2_weight"))
        partial = (per_expert * weights[..., None]).sum(-2)
    dist.all_reduce(partial, group=group)
    return h + partial


# --------------------------------------------------------------------------------------------
# Checkpoints whose activations are O(1)


def write_unit_scale_checkpoint(arch: str, out_dir: Any, *, dtype: str = "bfloat16", **options: Any) -> Any:
    """A tiny ``write_checkpoint`` model with its weights rescaled so every activation is O(1),
    saved by transformers' ``save_pretrained`` (several shards) in ``dtype``; returns the directory.

    ``write_checkpoint`` fills every tensor, norm weights included, with ``0.02 * randn``, so
    each layer adds a tiny fraction to the residual stream and a wrong block in one layer
    changes the logits only by ~1e-5 relative: too close to float32 rounding for a comparison
    to tell. Here linear weights (and experts, router, lm_head) become ``N(0, 1/fan_in)``, the
    embedding ``N(0, 1)``, norm weights ``1 + N(0, 0.4^2)`` and biases ``N(0, 0.5^2)`` (the same
    random draws, scaled), so every block matters at O(1). ``options`` go to ``write_checkpoint``.
    """
    import math
    import tempfile
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")):
        raise FileExistsError(f"{out} already holds a checkpoint")
    with tempfile.TemporaryDirectory() as tmp:
        source = write_checkpoint(arch, tmp, dtype="float32", **options)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.mul_(20.0).add_(1.0)
            elif name.endswith(".bias"):
                p.mul_(25.0)
            elif "embed_tokens" in name:
                p.mul_(50.0)
            else:
                p.mul_(1.0 / (0.02 * math.sqrt(p.shape[-1])))
    torch_dtype = getattr(torch, dtype)
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    with quiet_transformers():
        model.save_pretrained(out, max_shard_size="100KB")
    return out
