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
from typing import TYPE_CHECKING, Any, TypeVar

from .checkpoints import write_unit_scale_checkpoint

if TYPE_CHECKING:
    import jax
    import numpy as np
    import torch

__all__ = ["Dims", "jax_tp_forward", "torch_tp_decoder_layer", "write_unit_scale_checkpoint"]

_MISSING = object()
_Array = TypeVar("_Array", "torch.Tensor", "jax.Array")


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
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    shard_map: Any = getattr(jax, "shard_map", None)
    if shard_map is None:  # older jax
        from jax.experimental.shard_map import shard_map

    dims = Dims.from_config(config)
    heads = dims.local_heads(mesh.shape[tp_axis])
    names = sorted(params)
    moe = {i: _moe_prefix(names, i) for i in range(dims.layers)}

    ids = np.asarray(input_ids, dtype=np.int32)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {ids.shape}")
    ids_global = jax.make_array_from_callback(ids.shape, NamedSharding(mesh, P()), lambda index: ids[index])
    cos_sin = _jax_rope_tables(dims, ids.shape[1])

    def kernel(p: dict[str, jax.Array], tokens: jax.Array) -> jax.Array:
        return _jax_rank_logits(p, tokens, dims, heads, moe, cos_sin, tp_axis)

    specs = {name: params[name].sharding.spec for name in names}
    # all_gather's result is the same on every rank, but shard_map's replication check cannot
    # infer that (it types the result as varying over tp_axis), so the check is off.
    try:
        fn = shard_map(kernel, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False)
    except TypeError:  # older jax spells it check_rep
        fn = shard_map(kernel, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_rep=False)
    return jax.jit(fn)({name: params[name] for name in names}, ids_global)


def _jax_rope_tables(dims: Dims, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)`` ``[S, head_dim]`` of transformers' default RoPE, float32: inv_freq = 1 / theta^(2i/d), emb = [freqs, freqs]."""
    import numpy as np

    hd = dims.head_dim
    inv_freq = 1.0 / (dims.rope_theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd))
    freqs = np.arange(seq, dtype=np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def _jax_rank_logits(
    p: dict[str, jax.Array], tokens: jax.Array, dims: Dims, heads: tuple[int, int], moe: dict[int, str | None],
    cos_sin: tuple[np.ndarray, np.ndarray], tp_axis: str,
) -> jax.Array:
    """The logits, inside ``shard_map`` over one rank's blocks: the vocab-parallel embedding, every
    decoder layer (partial products summed over ``tp_axis``), the final norm and the gathered lm_head."""
    import jax
    import jax.numpy as jnp

    rank = jax.lax.axis_index(tp_axis)
    cos, sin = jnp.asarray(cos_sin[0]), jnp.asarray(cos_sin[1])

    # vocab-parallel embedding
    table = p["model.embed_tokens.weight"].astype(jnp.float32)
    rows = table.shape[0]
    local = tokens - rank * rows
    inside = (local >= 0) & (local < rows)
    h = jnp.where(inside[..., None], table[jnp.clip(local, 0, rows - 1)], 0.0)
    h = jax.lax.psum(h, tp_axis)

    for i in range(dims.layers):
        pre = f"model.layers.{i}."
        x = _jax_rms(h, p[pre + "input_layernorm.weight"].astype(jnp.float32), dims.eps)
        attn = jax.lax.psum(_jax_attention(p, x, pre + "self_attn.", dims, heads, cos, sin), tp_axis)
        if pre + "self_attn.o_proj.bias" in p:
            attn = attn + p[pre + "self_attn.o_proj.bias"].astype(jnp.float32)
        h = h + attn
        x = _jax_rms(h, p[pre + "post_attention_layernorm.weight"].astype(jnp.float32), dims.eps)
        h = h + jax.lax.psum(_jax_mlp(p, x, pre, moe[i], dims), tp_axis)

    h = _jax_rms(h, p["model.norm.weight"].astype(jnp.float32), dims.eps)
    logits = _jax_mm("bsh,vh->bsv", h, p["lm_head.weight"].astype(jnp.float32))
    logits = jax.lax.all_gather(logits, tp_axis, axis=2, tiled=True)
    return logits[..., : dims.vocab]


def _split_qkv(qkv: _Array, batch: int, seq: int, nq: int, nkv: int, hd: int) -> tuple[_Array, _Array, _Array]:
    """A fused QKV projection's ``[batch, seq, (nq + 2 nkv) hd]`` as q, k and v heads (torch or JAX)."""
    q = qkv[..., : nq * hd].reshape(batch, seq, nq, hd)
    k = qkv[..., nq * hd : (nq + nkv) * hd].reshape(batch, seq, nkv, hd)
    v = qkv[..., (nq + nkv) * hd :].reshape(batch, seq, nkv, hd)
    return q, k, v


def _jax_attention(
    p: dict[str, jax.Array], x: jax.Array, att: str, dims: Dims, heads: tuple[int, int], cos: jax.Array, sin: jax.Array
) -> jax.Array:
    """A rank's partial ``o_proj`` product (before the sum over ranks) of causal attention over its local heads."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    (nq, nkv), hd = heads, dims.head_dim
    batch, seq = x.shape[0], x.shape[1]
    qkv_w = p[att + "qkv_proj.weight"].astype(jnp.float32)
    if qkv_w.shape[0] != (nq + 2 * nkv) * hd:
        raise ValueError(f"{att}qkv_proj.weight has {qkv_w.shape[0]} rows on a rank, expected {(nq + 2 * nkv) * hd}")
    qkv = _jax_mm("bsh,oh->bso", x, qkv_w)
    if att + "qkv_proj.bias" in p:
        qkv = qkv + p[att + "qkv_proj.bias"].astype(jnp.float32)
    q, k, v = _split_qkv(qkv, batch, seq, nq, nkv, hd)
    if att + "q_norm.weight" in p:
        q = _jax_rms(q, p[att + "q_norm.weight"].astype(jnp.float32), dims.eps)
        k = _jax_rms(k, p[att + "k_norm.weight"].astype(jnp.float32), dims.eps)
    q, k = _jax_rope(q, cos, sin), _jax_rope(k, cos, sin)
    k = jnp.repeat(k, nq // nkv, axis=2)  # local query head j uses local KV head j // group
    v = jnp.repeat(v, nq // nkv, axis=2)
    scores = _jax_mm("bqnd,bknd->bnqk", q, k) * (hd**-0.5)
    causal = np.tril(np.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = _jax_mm("bnqk,bknd->bqnd", probs, v).reshape(batch, seq, nq * hd)
    return _jax_mm("bsi,hi->bsh", out, p[att + "o_proj.weight"].astype(jnp.float32))


def _jax_mlp(p: dict[str, jax.Array], x: jax.Array, pre: str, module: str | None, dims: Dims) -> jax.Array:
    """A rank's partial MLP output (before the sum over ranks): its ``gate_up_proj`` / ``down_proj``
    rows, or in a MoE layer (``module``) its slice of every expert, weighted by the replicated router."""
    import jax
    import jax.numpy as jnp

    if module is None:
        gate_up = _jax_mm("bsh,oh->bso", x, p[pre + "mlp.gate_up_proj.weight"].astype(jnp.float32))
        inter = gate_up.shape[-1] // 2
        act = jax.nn.silu(gate_up[..., :inter]) * gate_up[..., inter:]
        return _jax_mm("bsi,hi->bsh", act, p[pre + "mlp.down_proj.weight"].astype(jnp.float32))
    router = _jax_mm("bsh,eh->bse", x, p[module + "gate.weight"].astype(jnp.float32))
    experts = router.shape[-1]
    probs = jax.nn.softmax(router, axis=-1)
    top_p, top_i = jax.lax.top_k(probs, dims.top_k)
    if dims.norm_topk_prob:
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    weights = jnp.sum(jax.nn.one_hot(top_i, experts, dtype=jnp.float32) * top_p[..., None], axis=-2)
    w13 = p[module + "experts.routed_experts.w13_weight"].astype(jnp.float32)  # [E, 2I/tp, H]
    inter = w13.shape[1] // 2
    gate_up = _jax_mm("bsh,eih->bsei", x, w13)
    act = jax.nn.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    per_expert = _jax_mm("bsei,ehi->bseh", act, p[module + "experts.routed_experts.w2_weight"].astype(jnp.float32))
    return jnp.sum(per_expert * weights[..., None], axis=-2)


def _jax_mm(spec: str, *xs: jax.Array) -> jax.Array:
    """``einsum`` at the highest precision (float32 products on every backend)."""
    import jax
    import jax.numpy as jnp

    return jnp.einsum(spec, *xs, precision=jax.lax.Precision.HIGHEST)


def _jax_rms(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMS norm of ``x`` over its last dimension, scaled by ``w``."""
    import jax
    import jax.numpy as jnp

    return w * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def _jax_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x`` ``[B, S, heads, hd]`` rotated by RoPE (transformers' rotate-half layout)."""
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


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

    dims = Dims.from_config(config)
    heads = dims.local_heads(dist.get_world_size(group))
    pre = f"model.layers.{layer}."
    att = pre + "self_attn."

    h = hidden.to(torch.float32)
    x = _torch_rms(h, state[pre + "input_layernorm.weight"].to(torch.float32), dims.eps)
    attn = _torch_attention(state, x, att, dims, heads)
    dist.all_reduce(attn, group=group)
    if att + "o_proj.bias" in state:
        attn = attn + state[att + "o_proj.bias"].to(torch.float32)
    h = h + attn

    x = _torch_rms(h, state[pre + "post_attention_layernorm.weight"].to(torch.float32), dims.eps)
    partial = _torch_mlp(state, x, pre, _moe_prefix(list(state), layer), dims)
    dist.all_reduce(partial, group=group)
    return h + partial


def _torch_attention(state: Mapping[str, torch.Tensor], x: torch.Tensor, att: str, dims: Dims, heads: tuple[int, int]) -> torch.Tensor:
    """This rank's partial ``o_proj`` product (before the all-reduce) of causal attention over its local heads."""
    import torch
    import torch.nn.functional as F

    (nq, nkv), hd = heads, dims.head_dim
    batch, seq, _ = x.shape
    inv_freq = 1.0 / (dims.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]

    def rope(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    qkv_w = state[att + "qkv_proj.weight"].to(torch.float32)
    if qkv_w.shape[0] != (nq + 2 * nkv) * hd:
        raise ValueError(f"{att}qkv_proj.weight has {qkv_w.shape[0]} rows on this rank, expected {(nq + 2 * nkv) * hd}")
    qkv = F.linear(x, qkv_w, state[att + "qkv_proj.bias"].to(torch.float32) if att + "qkv_proj.bias" in state else None)
    q, k, v = _split_qkv(qkv, batch, seq, nq, nkv, hd)
    if att + "q_norm.weight" in state:
        q = _torch_rms(q, state[att + "q_norm.weight"].to(torch.float32), dims.eps)
        k = _torch_rms(k, state[att + "k_norm.weight"].to(torch.float32), dims.eps)
    q, k = rope(q), rope(k)
    k = k.repeat_interleave(nq // nkv, dim=2)
    v = v.repeat_interleave(nq // nkv, dim=2)
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) * (hd**-0.5)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.einsum("bnqk,bknd->bqnd", scores.softmax(-1), v).reshape(batch, seq, nq * hd)
    return F.linear(out, state[att + "o_proj.weight"].to(torch.float32))


def _torch_mlp(state: Mapping[str, torch.Tensor], x: torch.Tensor, pre: str, module: str | None, dims: Dims) -> torch.Tensor:
    """This rank's partial MLP output (before the all-reduce): its ``gate_up_proj`` / ``down_proj``
    rows, or in a MoE layer (``module``) its slice of every expert, weighted by the replicated router."""
    import torch
    import torch.nn.functional as F

    if module is None:
        gate, up = F.linear(x, state[pre + "mlp.gate_up_proj.weight"].to(torch.float32)).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, state[pre + "mlp.down_proj.weight"].to(torch.float32))
    probs = F.linear(x, state[module + "gate.weight"].to(torch.float32)).softmax(-1)
    top_p, top_i = probs.topk(dims.top_k, dim=-1)
    if dims.norm_topk_prob:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(-1, top_i, top_p)
    gate_up = torch.einsum("bsh,eih->bsei", x, state[module + "experts.routed_experts.w13_weight"].to(torch.float32))
    gate, up = gate_up.chunk(2, dim=-1)
    per_expert = torch.einsum("bsei,ehi->bseh", F.silu(gate) * up, state[module + "experts.routed_experts.w2_weight"].to(torch.float32))
    return (per_expert * weights[..., None]).sum(-2)


def _torch_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of ``x`` over its last dimension, scaled by ``weight``."""
    import torch

    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
