"""PyTorch decode attention over packed pages: the whole batch at once, a chunk of pages at a
time, float32 math, online softmax across chunks (so memory stays bounded at long contexts)."""

from __future__ import annotations

import torch

from .layout import decode_pages

#: tokens (summed over the batch) decoded per chunk: bounds the float32 scratch to ~150 MB
CHUNK_TOKENS = 65536


def _check_indices(cache, block_table: torch.Tensor, lens: torch.Tensor, ids: torch.Tensor) -> None:
    """Lengths, request rows and the pages they use must be in range. This backend reads these
    arrays on the host anyway, so the check costs one small copy."""
    p = cache.format.page_size
    width = block_table.shape[1]
    lens_h, ids_h = lens.tolist(), ids.tolist()
    for row, (length, seq) in enumerate(zip(lens_h, ids_h)):
        if length < 1 or -(-length // p) > width:
            raise ValueError(f"seq_lens[{row}]: expected 1..{width * p} (block_table width * P), got {length}")
        if not 0 <= seq < cache.max_seqs:
            raise ValueError(f"seq_ids[{row}]: expected a protection-buffer row in [0, {cache.max_seqs}), got {seq}")
    used = torch.arange(width, device=lens.device)[None, :] * p < lens[:, None]
    pages = block_table.long()
    bad = used & ((pages < 0) | (pages >= cache.num_pages))
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_table[{row}]: expected page indices in [0, {cache.num_pages}), got {int(pages[row, col])}")


def _protect(cache, c: torch.Tensor, kr: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor, ids: torch.Tensor) -> None:
    """In place: tokens ``pos [T]`` of every request (``c [B, T, d_c]``, ``kr [B, T, d_r]``) come
    from the sink buffer if ``n < sink``, else from the local ring if ``n >= L - local``. Only the
    protected (request, token) pairs are touched (a few hundred per request at most)."""
    dc = cache.format.latent_dim
    in_sink = pos[None, :] < torch.clamp(lens, max=cache.sink)[:, None]  # [B, T]
    if cache.sink > 0:
        bi, ti = in_sink.nonzero(as_tuple=True)
        if bi.numel():
            both = cache.sink_buf[ids[bi], pos[ti]].float()
            c[bi, ti], kr[bi, ti] = both[:, :dc], both[:, dc:]
    if cache.local > 0:
        in_local = (pos[None, :] >= (lens - cache.local)[:, None]) & (pos[None, :] < lens[:, None]) & ~in_sink
        bi, ti = in_local.nonzero(as_tuple=True)
        if bi.numel():
            both = cache.local_buf[ids[bi], pos[ti] % cache.local].float()
            c[bi, ti], kr[bi, ti] = both[:, :dc], both[:, dc:]


def attention(q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale: float):
    """q ``[B, S_q, H, d]`` -> out ``[B, S_q, H, d_c]`` (q's dtype), lse ``[B, S_q, H]`` float32.

    Query i of request b sees tokens ``< L_b - S_q + i + 1``."""
    fmt = cache.format
    p, dc, dr = fmt.page_size, fmt.latent_dim, fmt.rope_dim
    b, s_q, h, _ = q_latent.shape
    dev = q_latent.device
    lens, ids = seq_lens.long(), seq_ids.long()
    _check_indices(cache, block_table, lens, ids)
    n_pages = -(-int(lens.max()) // p)
    chunk = max(1, CHUNK_TOKENS // (b * p))
    qc, qr = q_latent.float().reshape(b, s_q * h, dc), q_rope.float().reshape(b, s_q * h, dr)
    limit = lens[:, None] - s_q + 1 + torch.arange(s_q, device=dev)[None, :]  # [B, S_q]
    m = torch.full((b, s_q, h), float("-inf"), device=dev)
    den = torch.zeros((b, s_q, h), device=dev)
    acc = torch.zeros((b, s_q, h, dc), device=dev)
    for p0 in range(0, n_pages, chunk):
        p1 = min(n_pages, p0 + chunk)
        cols = torch.arange(p0, p1, device=dev)
        needed = (cols[None, :] * p < lens[:, None]).reshape(-1)  # [B * pages in chunk]
        sel = needed.nonzero().squeeze(1)
        pc, pr = decode_pages(fmt, cache.pages[block_table[:, p0:p1].long().reshape(-1)[sel]])  # only real pages
        c = torch.zeros((needed.numel(), p, dc), device=dev)
        kr = torch.zeros((needed.numel(), p, dr), device=dev)
        c[sel], kr[sel] = pc.view(-1, p, dc), pr.view(-1, p, dr)
        c, kr = c.view(b, -1, dc), kr.view(b, -1, dr)
        pos = torch.arange(p0 * p, p1 * p, device=dev)
        # slots past a request's length hold whatever bytes the page had (NaN included): zero them
        # so that 0-weight * garbage cannot poison the sums
        past_end = (pos[None, :] >= lens[:, None])[..., None]
        c.masked_fill_(past_end, 0.0)
        kr.masked_fill_(past_end, 0.0)
        _protect(cache, c, kr, pos, lens, ids)
        scores = (torch.bmm(qc, c.transpose(1, 2)) + torch.bmm(qr, kr.transpose(1, 2))).view(b, s_q, h, -1) * softmax_scale
        visible = pos[None, None, :] < limit[:, :, None]  # [B, S_q, T]
        scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        w = torch.exp(scores - m_safe[..., None])
        scale_old = torch.exp(m - m_safe)
        den = den * scale_old + w.sum(-1)
        acc = acc * scale_old[..., None] + torch.bmm(w.view(b, s_q * h, -1), c).view(b, s_q, h, dc)
        m = m_new
    out = acc / den[..., None]
    lse = m + torch.log(den)
    return out.to(q_latent.dtype), lse
