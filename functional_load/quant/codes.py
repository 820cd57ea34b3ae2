"""Bit-level decoding shared by the formats: packed integer fields, FP4 (e2m1) codes, e8m0 scales.

Conventions (``shared/reference/quant-fixtures.md`` section 5, checked against each tool's own
dequantizer): integer fields are packed least significant first; FP4 e2m1 packs two codes per
byte, the low nibble first, bit 3 the sign; an e8m0 byte ``e`` is the scale ``2 ** (e - 127)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; bit 3 is the sign


def unpack_int32(words: torch.Tensor, bits: int, dim: int, interleave: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unpack ``32 // bits`` unsigned fields per int32 along ``dim`` (LSB first): the result has
    ``dim`` longer by the pack factor. ``interleave[e]`` is the field holding element ``e``."""
    import torch

    pf = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(pf, dtype=torch.int64) * bits
    view = [1] * (w.dim() + 1)
    view[dim + 1] = pf
    fields = (w.unsqueeze(dim + 1) >> shifts.view(view)) & ((1 << bits) - 1)
    if interleave is not None:
        fields = fields.index_select(dim + 1, torch.tensor(interleave))
    shape = list(w.shape)
    shape[dim] *= pf
    return fields.reshape(shape)


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """Bytes holding two e2m1 codes each (low nibble first) as float32 values, the last dimension doubled."""
    import torch

    magnitude = torch.tensor(FP4_E2M1, dtype=torch.float32)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1).long()
    return magnitude[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)


def e8m0_values(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 scales (uint8 bytes, or torch float8_e8m0fnu) as float32 ``2 ** (e - 127)``."""
    import torch

    raw = scales.view(torch.uint8) if scales.dtype == torch.float8_e8m0fnu else scales
    return torch.exp2(raw.float() - 127.0)


def groups_expand(scale: torch.Tensor, group: int, width: int) -> torch.Tensor:
    """Per-group scales ``[..., groups]`` over ``width`` values: each repeated ``group`` times."""
    return scale.repeat_interleave(group, dim=-1)[..., :width]
