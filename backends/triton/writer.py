"""Triton writer: one launch per call (see ``writer_kernel.py``)."""

from __future__ import annotations

import torch

from . import interpreting
from .common import launch_dims, page_layout_constexprs, ptr_or_dummy
from .heuristics import WRITER_BLOCK_T, WRITER_BLOCK_T_INTERPRETER, WRITER_NUM_WARPS
from .writer_kernel import write_kernel


def write(cache, latent: torch.Tensor, k_rope: torch.Tensor, slot_mapping: torch.Tensor, seq_ids: torch.Tensor,
          positions: torch.Tensor, seq_lens: torch.Tensor, block_t: int | None = None,
          num_warps: int | None = None) -> None:
    """Quantize and store ``latent [N, d_c]``, ``k_rope [N, d_r]`` (float32/bfloat16) into
    ``cache`` at ``slot_mapping [N]`` and update the sink/local buffers. Arguments are already
    validated by ``quantmla_core.write``; bad slots are masked in the kernel. ``block_t``
    (tokens per program) and ``num_warps`` override the heuristics."""
    fmt = cache.format
    n = int(latent.shape[0])
    if n == 0:
        return
    latent = latent if latent.stride(-1) == 1 else latent.contiguous()
    k_rope = k_rope if k_rope.stride(-1) == 1 else k_rope.contiguous()
    in_bf16 = latent.dtype == torch.bfloat16
    prot_bf16 = cache.sink_buf.dtype == torch.bfloat16
    quant = fmt.quantized
    if block_t is None:
        block_t = WRITER_BLOCK_T_INTERPRETER if interpreting() else WRITER_BLOCK_T
    write_kernel[(-(-n // block_t),)](
        latent, k_rope, slot_mapping, seq_ids, positions, seq_lens,
        cache.pages, ptr_or_dummy(cache.sink_buf), ptr_or_dummy(cache.local_buf),
        latent.stride(0), k_rope.stride(0), n, cache.num_pages * fmt.page_size, cache.max_seqs,
        cache.sink, cache.local,
        IN_BF16=in_bf16, PROT_BF16=prot_bf16, QUANT=quant,
        DC=fmt.latent_dim, DR=fmt.rope_dim,
        CBITS=fmt.content_bits if quant else 16, RBITS=fmt.rope_bits if quant else 16,
        CG=fmt.content_group_size if quant else min(64, fmt.latent_dim),
        RG=fmt.rope_group_size if quant else min(64, fmt.rope_dim),
        **page_layout_constexprs(fmt),
        BLOCK_T=block_t,
        **launch_dims(num_warps=num_warps or WRITER_NUM_WARPS),
    )
