"""Reference split-half bit packing (DESIGN.md §3.3, layout version 1)."""

from __future__ import annotations

import numpy as np


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes ``[..., d]`` (< 2^bits) -> bytes ``[..., d*bits/8]``; byte j holds elements
    ``j, j + d/k, ...`` (k = 8/bits), element ``j + i*d/k`` at bit ``i*bits``."""
    codes = np.asarray(codes, dtype=np.uint8)
    if bits == 8:
        return codes.copy()
    k = 8 // bits
    d = codes.shape[-1]
    n = d // k
    out = np.zeros(codes.shape[:-1] + (n,), dtype=np.uint16)
    for i in range(k):
        out |= codes[..., i * n : (i + 1) * n].astype(np.uint16) << (i * bits)
    return out.astype(np.uint8)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """bytes ``[..., n]`` -> codes ``[..., n*8/bits]`` uint8 (inverse of :func:`pack`)."""
    packed = np.asarray(packed, dtype=np.uint8)
    if bits == 8:
        return packed.copy()
    k = 8 // bits
    mask = (1 << bits) - 1
    return np.concatenate([(packed >> (i * bits)) & mask for i in range(k)], axis=-1).astype(np.uint8)
