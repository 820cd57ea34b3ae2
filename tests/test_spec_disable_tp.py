"""``disable_tp`` as an expression, on every linear kind (the row kind included): a layer some
configurations keep whole on every rank (GPTBigCode's multi-head attention, which vLLM's
Transformers backend leaves as ReplicatedLinear)."""

from __future__ import annotations

import pytest

from functional_load.layout.build import build_layout
from functional_load.layout.parallel import Parallel
from functional_load.model.spec import parse_spec

_SPEC = {
    "name": "tiny",
    "layers": "1",
    "dims": {"whole": "not multi_query"},
    "modules": {
        "attn.qkv": {"kind": "qkv", "in": "16", "heads": "4", "kv_heads": "1 if multi_query else 4", "head_dim": "4",
                     "bias": "True", "disable_tp": "whole"},
        "attn.out": {"kind": "row", "in": "16", "out": "16", "bias": "True", "disable_tp": "whole"},
        "mlp.up": {"kind": "column", "in": "16", "out": "32", "disable_tp": False},
    },
}


@pytest.mark.parametrize("multi_query", [True, False])
def test_disable_tp_expression(multi_query: bool) -> None:
    layout = build_layout({"multi_query": multi_query}, parse_spec(_SPEC), Parallel(2, 1), "bfloat16")
    qkv, out, up = (layout.params[n] for n in ("attn.qkv.weight", "attn.out.weight", "mlp.up.weight"))
    if multi_query:  # split: q by head, the one KV head replicated; the row layer by input columns
        assert qkv.shape == (24, 16) and qkv.local_shape == (16, 16)
        assert out.local_shape == (16, 8)
    else:  # whole on every rank, as stored
        assert qkv.shape == qkv.local_shape == (48, 16)
        assert out.local_shape == (16, 16)
        assert layout.params["attn.qkv.bias"].local_shape == (48,)
    assert up.local_shape == (16, 16)
    assert out.sharding.disable_tp is not multi_query  # type: ignore[attr-defined]
