"""Numba writer launcher: zero-copy NumPy views of the cache, one fused kernel call."""

from __future__ import annotations

import numpy as np

from .common import bits16, copy_back, indices, layout_vector, pages_view
from .kernels_writer import write_tokens

#: tokens per parallel work item (scratch is allocated once per item)
CHUNK = 64


def write(cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens) -> None:
    """See ``quantmla_core.write`` (arguments validated there).

    latent ``[N, d_c]``, k_rope ``[N, d_r]``: float32 NumPy arrays, or float32/bfloat16 CPU
    tensors (bfloat16 read through its bits, no conversion copy). Index arrays int32/int64.
    Writes in place into ``cache.pages`` / ``cache.sink_buf`` / ``cache.local_buf`` (views, no
    copies). A token whose slot is -1 or out of range is skipped, so a bad index never
    writes outside the cache.
    """
    n = int(latent.shape[0])
    if n == 0:
        return
    fmt = cache.format
    pages, pages_copied = pages_view(cache.pages)
    sink, sink_bf16, sink_copied = bits16(cache.sink_buf)
    local, local_bf16, local_copied = bits16(cache.local_buf)
    if sink_bf16 != local_bf16:
        raise TypeError(f"cache: sink_buf and local_buf must share a dtype, got {cache.sink_buf.dtype} and {cache.local_buf.dtype}")
    c, c_bf16, _ = bits16(latent)
    r, r_bf16, _ = bits16(k_rope)
    if c_bf16 != r_bf16:
        raise TypeError(f"k_rope: expected the dtype of latent ({latent.dtype}), got {k_rope.dtype}")
    write_tokens(pages, pages.view(np.uint16), pages.view(np.float32), c, r, c_bf16, indices(slot_mapping),
                 indices(seq_ids), indices(positions), indices(seq_lens), sink, local, sink_bf16, layout_vector(fmt), CHUNK)
    if pages_copied:
        copy_back(cache.pages, pages, False)
    if sink_copied:
        copy_back(cache.sink_buf, sink, sink_bf16)
    if local_copied:
        copy_back(cache.local_buf, local, local_bf16)
