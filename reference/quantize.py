"""Reference quantizer (DESIGN.md §3.1), NumPy.

The quantizer is specified in float32 arithmetic, so it runs in float32 here too; only the
dequantized values are returned in float64. Non-finite inputs count as 0 and an
overflowing scale is clamped to the store dtype's largest finite value (same contract as
``quantmla_core.quantizer``).
"""

from __future__ import annotations

import numpy as np

BF16_MAX = np.float32(3.3895313892515355e38)
FLOAT32_MAX = np.finfo(np.float32).max


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even); returns float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def bf16_to_bits(x: np.ndarray) -> np.ndarray:
    """float32 values already representable in bfloat16 -> their uint16 bit patterns."""
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bits_to_bf16(b: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 values."""
    return (np.asarray(b).astype(np.uint32) << 16).view(np.float32)


def quantize_groups(
    x: np.ndarray, bits: int, group: int, scale_dtype: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x ``[..., d]`` -> codes ``[..., d]`` uint8, scales ``[..., d/G]`` float32 (holding the
    stored value: bfloat16-rounded when ``scale_dtype == "bfloat16"``), zeros ``[..., d/G]`` uint8."""
    m = np.float32(2**bits - 1)
    x = np.asarray(x, dtype=np.float32)
    *lead, d = x.shape
    g = x.reshape(*lead, d // group, group)
    g = np.where(np.isfinite(g), g, np.float32(0))
    lo = np.minimum(g.min(axis=-1), np.float32(0))
    hi = np.maximum(g.max(axis=-1), np.float32(0))
    with np.errstate(over="ignore"):
        s = np.maximum(hi - lo, np.float32(1e-8)) / m
    if scale_dtype == "bfloat16":
        s = bf16_round(np.minimum(s, BF16_MAX))
    elif scale_dtype == "float32":
        s = np.minimum(s, FLOAT32_MAX).astype(np.float32)
    else:
        raise ValueError(f"scale_dtype: expected 'bfloat16' or 'float32', got {scale_dtype!r}")
    z = np.clip(np.rint(-lo / s), 0, m)
    q = np.clip(np.rint(g / s[..., None]) + z[..., None], 0, m)
    return q.astype(np.uint8).reshape(*lead, d), s.astype(np.float32), z.astype(np.uint8)


def dequantize_groups(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group: int) -> np.ndarray:
    """codes ``[..., d]``, scales/zeros ``[..., d/G]`` -> float64 ``[..., d]``."""
    *lead, d = codes.shape
    q = codes.astype(np.float64).reshape(*lead, d // group, group)
    x = scales.astype(np.float64)[..., None] * (q - zeros.astype(np.float64)[..., None])
    return x.reshape(*lead, d)
