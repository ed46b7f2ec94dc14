"""Reference MLA decode attention (absorbed form, DESIGN.md §2), float64 NumPy."""

from __future__ import annotations

import numpy as np

from .pages import _floats, _host, gather_request


def mla_attention(qc, qr, c, kr, softmax_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Plain absorbed MLA attention over unquantized operands.

    qc ``[S, H, d_c]``, qr ``[S, H, d_r]``, c ``[L, d_c]``, kr ``[L, d_r]``. Query i (of S)
    sees tokens ``n < L - S + i + 1``. Returns float64 ``out [S, H, d_c]``, ``lse [S, H]``
    (natural log of the summed exponentials of the scaled scores).
    """
    qc, qr = np.asarray(qc, np.float64), np.asarray(qr, np.float64)
    c, kr = np.asarray(c, np.float64), np.asarray(kr, np.float64)
    s_q, length = qc.shape[0], c.shape[0]
    scores = softmax_scale * (np.einsum("shd,nd->shn", qc, c) + np.einsum("shd,nd->shn", qr, kr))
    visible = np.arange(length)[None, :] < (length - s_q + np.arange(s_q) + 1)[:, None]
    scores = np.where(visible[:, None, :], scores, -np.inf)
    mx = scores.max(axis=-1, keepdims=True)
    e = np.exp(scores - mx)
    den = e.sum(axis=-1, keepdims=True)
    out = np.einsum("shn,nd->shd", e / den, c)
    lse = (np.log(den) + mx)[..., 0]
    return out, lse


def decode_attention(
    q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """Reference of ``quantmla_core.attention`` over an ``MLACache``.

    q_latent ``[B, H, d_c]`` or ``[B, S_q, H, d_c]`` (q_rope likewise). Returns float64
    ``out`` shaped like q_latent and ``lse [B, (S_q,) H]``.
    """
    qc, qr = _floats(q_latent).astype(np.float64), _floats(q_rope).astype(np.float64)
    squeeze = qc.ndim == 3
    if squeeze:
        qc, qr = qc[:, None], qr[:, None]
    table, lens, ids = _host(block_table), _host(seq_lens), _host(seq_ids)
    b, s_q, h, dc = qc.shape
    out = np.empty((b, s_q, h, dc))
    lse = np.empty((b, s_q, h))
    for i in range(b):
        c, kr = gather_request(cache, table[i], int(lens[i]), int(ids[i]))
        out[i], lse[i] = mla_attention(qc[i], qr[i], c, kr, softmax_scale)
    if squeeze:
        return out[:, 0], lse[:, 0]
    return out, lse
