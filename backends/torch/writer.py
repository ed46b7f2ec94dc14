"""PyTorch writer: quantize, pack and scatter tokens into pages; update protection buffers."""

from __future__ import annotations

import torch

from .layout import encode_tokens, section_view


def write(cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens) -> None:
    """See ``quantmla_core.write``. Tokens whose slot is -1 or out of range, or whose seq id is
    out of range, are skipped (masked), so a bad index never writes outside the cache."""
    fmt = cache.format
    slots = slot_mapping.long()
    seqs = seq_ids.long()
    live = (slots >= 0) & (slots < cache.num_pages * fmt.page_size)
    idx = live.nonzero().squeeze(1)
    if idx.numel() == 0:
        return
    c, kr = latent[idx].float(), k_rope[idx].float()
    page, offset = slots[idx] // fmt.page_size, slots[idx] % fmt.page_size
    for name, data in encode_tokens(fmt, c, kr).items():
        section_view(cache.pages, fmt, name)[page, offset] = data
    _protect(cache, torch.cat([c, kr], dim=1), seqs[idx], positions[idx].long(), seq_lens.long())


def _protect(cache, both: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, seq_lens: torch.Tensor) -> None:
    valid = (seq >= 0) & (seq < cache.max_seqs) & (pos >= 0)
    both = both.to(cache.sink_buf.dtype)
    if cache.sink > 0:
        m = valid & (pos < cache.sink)
        cache.sink_buf[seq[m], pos[m]] = both[m]
    if cache.local > 0:
        length = seq_lens[seq.clamp(0, cache.max_seqs - 1)]
        m = valid & (pos >= length - cache.local)
        cache.local_buf[seq[m], pos[m] % cache.local] = both[m]
