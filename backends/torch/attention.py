"""PyTorch decode attention over packed pages: one request at a time, float32 math."""

from __future__ import annotations

import torch

from .layout import decode_pages


def _pages_of(cache, table_row: torch.Tensor, length: int, row: int, seq_id: int) -> torch.Tensor:
    """Page indices of one request, checked (this backend syncs anyway, so the check is free)."""
    p = cache.format.page_size
    n_pages = (length + p - 1) // p
    if length < 1 or n_pages > table_row.shape[0]:
        raise ValueError(f"seq_lens[{row}]: expected 1..{table_row.shape[0] * p} (block_table width * P), got {length}")
    if not 0 <= seq_id < cache.max_seqs:
        raise ValueError(f"seq_ids[{row}]: expected a protection-buffer row in [0, {cache.max_seqs}), got {seq_id}")
    pages = table_row[:n_pages].long()
    bad = (pages < 0) | (pages >= cache.num_pages)
    if bool(bad.any()):
        raise ValueError(f"block_table[{row}]: expected page indices in [0, {cache.num_pages}), got {pages[bad][0].item()}")
    return pages


def _gather(cache, pages: torch.Tensor, length: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``c [L, d_c]``, ``kr [L, d_r]`` with protected tokens taken from the buffers."""
    fmt = cache.format
    c, kr = decode_pages(fmt, cache.pages[pages])
    c, kr = c[:length], kr[:length]
    dc = fmt.latent_dim
    n_sink = min(cache.sink, length)
    if n_sink:
        both = cache.sink_buf[seq_id, :n_sink].float()
        c[:n_sink], kr[:n_sink] = both[:, :dc], both[:, dc:]
    first_local = max(length - cache.local, n_sink)
    if cache.local > 0 and first_local < length:
        pos = torch.arange(first_local, length, device=c.device)
        both = cache.local_buf[seq_id, pos % cache.local].float()
        c[pos], kr[pos] = both[:, :dc], both[:, dc:]
    return c, kr


def attention(q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale: float):
    """q ``[B, S_q, H, d]`` -> out ``[B, S_q, H, d_c]`` (q's dtype), lse ``[B, S_q, H]`` float32."""
    b, s_q, h, dc = q_latent.shape
    out = torch.empty((b, s_q, h, dc), dtype=torch.float32, device=q_latent.device)
    lse = torch.empty((b, s_q, h), dtype=torch.float32, device=q_latent.device)
    lens, ids = seq_lens.tolist(), seq_ids.tolist()
    for i in range(b):
        length = int(lens[i])
        pages = _pages_of(cache, block_table[i], length, i, int(ids[i]))
        c, kr = _gather(cache, pages, length, int(ids[i]))
        scores = softmax_scale * (q_latent[i].float() @ c.T + q_rope[i].float() @ kr.T)  # [S_q, H, L]
        limit = length - s_q + 1 + torch.arange(s_q, device=c.device)
        hidden = torch.arange(length, device=c.device)[None, :] >= limit[:, None]
        scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
        lse[i] = torch.logsumexp(scores, dim=-1)
        out[i] = torch.softmax(scores, dim=-1) @ c
    return out.to(q_latent.dtype), lse
