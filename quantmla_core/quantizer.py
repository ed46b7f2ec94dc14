"""Quantizer math and split-half bit packing in PyTorch (DESIGN.md §3.1, §3.3).

Used by the PyTorch backend and by calibration (differentiable fake quantization with a
straight-through estimator). The NumPy oracle in ``quantmla_core.reference`` implements the
same contract independently.

Per group of G consecutive elements, bits b, m = 2^b - 1, computed in float32::

    lo = min(min(x), 0); hi = max(max(x), 0)
    s  = store_dtype(min(max(hi - lo, 1e-8) / m, max finite of store_dtype))
    z  = clip(rint(-lo / s), 0, m)
    q  = clip(rint(x / s) + z, 0, m)
    x_hat = s * (q - z)

Interpretations (documented here because DESIGN.md is silent): non-finite inputs are
quantized as if they were 0 so that scales stay finite (the token is corrupted, its
neighbours are not); a scale that would overflow the store dtype is clamped to its
largest finite value.
"""

from __future__ import annotations

import torch

SCALE_FLOOR = 1e-8

_STORE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def store_dtype(name: str) -> torch.dtype:
    """Torch dtype for a PackFormat scale dtype name."""
    return _STORE_DTYPES[name]


def quantize(
    x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per-group quantization.

    x: ``[..., d]`` any float dtype (computed in float32). Returns ``codes [..., d]`` uint8,
    ``scale [..., d/G]`` in ``scale_dtype`` and ``zero [..., d/G]`` uint8.
    """
    m = float(2**bits - 1)
    *lead, d = x.shape
    g = x.float().reshape(*lead, d // group_size, group_size)
    g = torch.where(torch.isfinite(g), g, torch.zeros((), dtype=g.dtype, device=g.device))
    lo = g.amin(-1).clamp(max=0.0)
    hi = g.amax(-1).clamp(min=0.0)
    # divide by a tensor, not a Python scalar: CUDA turns scalar division into a multiplication by
    # the reciprocal, which is not correctly rounded and can move the stored scale by one ulp; made by a fill
    # (torch.tensor would copy from pageable host memory and synchronize the stream)
    s = (hi - lo).clamp(min=SCALE_FLOOR) / torch.full((), m, dtype=torch.float32, device=g.device)
    s = s.clamp(max=torch.finfo(scale_dtype).max).to(scale_dtype)
    s32 = s.float().unsqueeze(-1)
    z = torch.round(-lo.unsqueeze(-1) / s32).clamp(0, m)
    q = (torch.round(g / s32) + z).clamp(0, m)
    return q.to(torch.uint8).reshape(*lead, d), s, z.squeeze(-1).to(torch.uint8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """``codes [..., d]`` uint8, ``scale``/``zero [..., d/G]`` -> float32 ``[..., d]``."""
    *lead, d = codes.shape
    q = codes.float().reshape(*lead, d // group_size, group_size)
    x = scale.float().unsqueeze(-1) * (q - zero.float().unsqueeze(-1))
    return x.reshape(*lead, d)


def fake_quantize(x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Quantize-dequantize with a straight-through gradient (identity in the backward pass)."""
    codes, s, z = quantize(x.detach(), bits, group_size, scale_dtype)
    xq = dequantize(codes, s, z, group_size).to(x.dtype)
    return x + (xq - x).detach()


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Split-half packing: ``codes [..., d]`` uint8 < 2^bits -> ``[..., d*bits/8]`` uint8.

    Byte j holds elements ``j + i*d/k`` (k = 8/bits) in bits ``[i*bits, (i+1)*bits)``.
    """
    if bits == 8:
        return codes.to(torch.uint8)
    k = 8 // bits
    *lead, d = codes.shape
    parts = codes.to(torch.int32).reshape(*lead, k, d // k)
    out = torch.zeros((*lead, d // k), dtype=torch.int32, device=codes.device)
    for i in range(k):
        out |= parts[..., i, :] << (i * bits)
    return out.to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``[..., n]`` uint8 -> ``[..., n*8/bits]`` uint8."""
    if bits == 8:
        return packed
    k = 8 // bits
    mask = (1 << bits) - 1
    p = packed.to(torch.int32)
    parts = [(p >> (i * bits)) & mask for i in range(k)]
    return torch.cat(parts, dim=-1).to(torch.uint8)
