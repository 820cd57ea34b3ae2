"""MoE expert tensors of the tiny checkpoints: per-expert 2-D weights and fused 3-D ones.

transformers 5 holds routed experts in memory as 3-D tensors but writes most architectures back
per expert; :func:`fuse` and :func:`unfuse` convert between the two layouts (and are inverse).
Some architectures (gpt_oss, llama4) exist only fused, in an input-major layout of their own
(``MoeLayout.per_expert_prefix`` None); :func:`linear_experts` reads any of the layouts as
per-expert ``nn.Linear`` weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoeLayout:
    """Names of an architecture's routed experts on disk.

    Per-expert: ``{layer}.{per_expert_prefix}.{e}.{gate|up|down}.weight``, each a 2-D
    ``nn.Linear`` weight (gate/up ``[I, H]``, down ``[H, I]``).
    Fused: ``{layer}.{fused_prefix}.gate_up_proj`` ``[E, 2I, H]`` (gate rows first, then up) and
    ``{layer}.{fused_prefix}.down_proj`` ``[E, H, I]``; ``fused_renames`` are substring renames
    applied to every other name of the checkpoint in the fused layout (and undone when unfusing).

    Fused only (``per_expert_prefix`` None: transformers has no per-expert form, so there is
    nothing to convert): ``input_major`` stores each expert as the right operand of ``x @ W``,
    ``gate_up_proj`` ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]``; ``interleaved`` alternates
    gate and up along the ``2I`` axis (unit ``j``: gate at ``2j``, up at ``2j + 1``) instead of
    gate half then up half; ``biases`` adds ``gate_up_proj_bias`` ``[E, 2I]`` (same order as
    the ``2I`` axis) and ``down_proj_bias`` ``[E, H]``.
    """

    per_expert_prefix: str | None
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    fused_prefix: str = "mlp.experts"
    fused_renames: tuple[tuple[str, str], ...] = ()
    input_major: bool = False
    interleaved: bool = False
    biases: bool = False


def _per_expert_prefix(moe: MoeLayout) -> str:
    if moe.per_expert_prefix is None:
        raise ValueError(f"{moe.fused_prefix} experts exist only fused; there is no per-expert layout to convert")
    return moe.per_expert_prefix


def _layer_expert_re(moe: MoeLayout) -> re.Pattern[str]:
    names = "|".join(re.escape(n) for n in (moe.gate, moe.up, moe.down))
    return re.compile(
        rf"^(?P<layer>.*\.layers\.\d+)\.{re.escape(_per_expert_prefix(moe))}\.(?P<e>\d+)\.(?P<w>{names})\.weight$"
    )


def _fused_re(moe: MoeLayout) -> re.Pattern[str]:
    return re.compile(rf"^(?P<layer>.*\.layers\.\d+)\.{re.escape(moe.fused_prefix)}\.(?P<w>gate_up_proj|down_proj)$")


def has_fused(tensors: Mapping[str, torch.Tensor], moe: MoeLayout) -> bool:
    pat = _fused_re(moe)
    return any(pat.match(n) for n in tensors)


def _rename(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        name = name.replace(old, new)
    return name


def fuse(tensors: Mapping[str, torch.Tensor], moe: MoeLayout) -> dict[str, torch.Tensor]:
    """Per-expert 2-D expert weights -> fused 3-D ``gate_up_proj``/``down_proj`` (see ``MoeLayout``).

    ``gate_up_proj[e] = cat([gate_e, up_e], dim=0)`` (``[2I, H]``), ``down_proj[e] = down_e``
    (``[H, I]``). Other tensors keep their order and values (names renamed per ``fused_renames``);
    each fused pair takes the place of its layer's first expert tensor.
    """
    pat = _layer_expert_re(moe)
    role = {moe.gate: "gate", moe.up: "up", moe.down: "down"}
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor | None] = {}
    for name, t in tensors.items():
        m = pat.match(name)
        if m is None:
            out[_rename(name, moe.fused_renames)] = t
            continue
        layer = m["layer"]
        if layer not in groups:
            groups[layer] = {"gate": {}, "up": {}, "down": {}}
            fused_layer = _rename(layer + ".", moe.fused_renames)[:-1]
            out[f"{fused_layer}.{moe.fused_prefix}.gate_up_proj"] = None  # placeholders keep order
            out[f"{fused_layer}.{moe.fused_prefix}.down_proj"] = None
        groups[layer][role[m["w"]]][int(m["e"])] = t
    for layer, g in groups.items():
        experts = sorted(g["gate"])
        if not experts or experts != list(range(len(experts))) or any(sorted(g[r]) != experts for r in ("up", "down")):
            raise ValueError(f"{layer}: incomplete or non-contiguous experts {[sorted(g[r]) for r in g]}")
        fused_layer = _rename(layer + ".", moe.fused_renames)[:-1]
        out[f"{fused_layer}.{moe.fused_prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([g["gate"][e], g["up"][e]], dim=0) for e in experts]
        ).contiguous()
        out[f"{fused_layer}.{moe.fused_prefix}.down_proj"] = torch.stack([g["down"][e] for e in experts]).contiguous()
    return out  # type: ignore[return-value]


def unfuse(tensors: Mapping[str, torch.Tensor], moe: MoeLayout) -> dict[str, torch.Tensor]:
    """Fused 3-D experts -> per-expert 2-D weights with the classic names; inverse of :func:`fuse`.

    Per layer, experts are emitted in order ``e = 0..E-1`` as gate, up, down (each a contiguous
    copy), in place of the fused pair.
    """
    per_expert = _per_expert_prefix(moe)
    pat = _fused_re(moe)
    undo = tuple((new, old) for old, new in moe.fused_renames)
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = pat.match(name)
        if m is not None:
            fused.setdefault(m["layer"], {})[m["w"]] = t
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for name, t in tensors.items():
        m = pat.match(name)
        if m is None:
            out[_rename(name, undo)] = t
            continue
        layer = m["layer"]
        if layer in done:
            continue
        done.add(layer)
        pair = fused[layer]
        if set(pair) != {"gate_up_proj", "down_proj"}:
            raise ValueError(f"{layer}: needs both gate_up_proj and down_proj, has {sorted(pair)}")
        gate_up, down = pair["gate_up_proj"], pair["down_proj"]
        n_exp, two_i, _ = gate_up.shape
        if two_i % 2 or down.shape[0] != n_exp or down.shape[2] != two_i // 2:
            raise ValueError(f"{layer}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} disagree")
        inter = two_i // 2
        base = _rename(layer + ".", undo)[:-1]
        for e in range(n_exp):
            prefix = f"{base}.{per_expert}.{e}"
            out[f"{prefix}.{moe.gate}.weight"] = gate_up[e, :inter].clone()
            out[f"{prefix}.{moe.up}.weight"] = gate_up[e, inter:].clone()
            out[f"{prefix}.{moe.down}.weight"] = down[e].clone()
    return out


def linear_experts(tensors: Mapping[str, torch.Tensor], layer: str, moe: MoeLayout) -> dict[str, torch.Tensor]:
    """The routed experts of ``layer`` (e.g. ``"model.layers.1"``) as stacked ``nn.Linear`` weights.

    Returns ``gate``/``up`` ``[E, I, H]`` and ``down`` ``[E, H, I]`` (so expert ``e`` computes
    ``down[e] @ act(gate[e] @ x, up[e] @ x)``), plus ``gate_bias``/``up_bias`` ``[E, I]`` and
    ``down_bias`` ``[E, H]`` where the layout has biases; from the per-expert layout or any
    fused one (read as ``moe`` says: row- or input-major, halves or interleaved).
    """
    fused = f"{layer}.{moe.fused_prefix}"
    if f"{fused}.gate_up_proj" not in tensors:
        pre = f"{layer}.{_per_expert_prefix(moe)}"
        count = len({n for n in tensors if n.startswith(pre + ".") and n.endswith(f".{moe.down}.weight")})
        if not count:
            raise KeyError(f"no experts of {layer} in the {moe.fused_prefix} or {moe.per_expert_prefix} layout")
        return {
            role: torch.stack([tensors[f"{pre}.{e}.{name}.weight"] for e in range(count)])
            for role, name in (("gate", moe.gate), ("up", moe.up), ("down", moe.down))
        }
    gate_up, down = tensors[f"{fused}.gate_up_proj"], tensors[f"{fused}.down_proj"]
    if moe.input_major:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    gate, up = _split_gate_up(gate_up, moe)
    out = {"gate": gate, "up": up, "down": down.contiguous()}
    if moe.biases:
        gate_bias, up_bias = _split_gate_up(tensors[f"{fused}.gate_up_proj_bias"], moe)
        out.update(gate_bias=gate_bias, up_bias=up_bias, down_bias=tensors[f"{fused}.down_proj_bias"].contiguous())
    return out


def _split_gate_up(t: torch.Tensor, moe: MoeLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, 2I, ...]`` -> gate and up ``[E, I, ...]``, each contiguous."""
    if moe.interleaved:
        return t[:, 0::2].contiguous(), t[:, 1::2].contiguous()
    inter = t.shape[1] // 2
    return t[:, :inter].contiguous(), t[:, inter:].contiguous()
