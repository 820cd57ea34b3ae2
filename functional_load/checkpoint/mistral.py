"""Mistral's own weight files (``consolidated*.safetensors``): their tensor names, mapped to HF's
as vLLM 0.32 does (``MistralForCausalLM.maybe_remap_mistral``), before any table of the layout.

vLLM also permutes ``wq``/``wk`` rows (and per-row ``qscale_weight``) from Meta's interleaved
rotary pairs to halves: the table marks those names ``interleaved``.
"""

from __future__ import annotations

from ..model.mapping import MappingTable

# Mistral-native names -> HF names, applied before any other table (vLLM renames first, too).
MISTRAL_NAMES = MappingTable.from_dicts(
    interleaved={r"\.attention\.w[qk]\.(weight|qscale_weight)$": True},
    regex={
        r"^tok_embeddings\.": "model.embed_tokens.",
        r"^norm\.": "model.norm.",
        r"^output\.": "lm_head.",
        r"^layers\.": "model.layers.",
        r"\.attention\.w([qkvo])\.": r".self_attn.\1_proj.",
        r"\.attention\.kv_fake_quantizer\.qscale_act$": ".self_attn.kv_scale",
        r"\.attention\.q_fake_quantizer\.qscale_act$": ".self_attn.attn.q_scale",
        r"\.attention\.([kv])_fake_quantizer\.qscale_act$": r".self_attn.\1_scale",
        r"\.attention_norm\.": ".input_layernorm.",
        r"\.ffn_norm\.": ".post_attention_layernorm.",
        r"\.feed_forward\.w1\.": ".mlp.gate_proj.",
        r"\.feed_forward\.w2\.": ".mlp.down_proj.",
        r"\.feed_forward\.w3\.": ".mlp.up_proj.",
        r"\.qscale_weight$": ".weight_scale",
        r"\.qscale_act$": ".input_scale",
    }
)
