"""Triton writer: one launch per call (see ``writer_kernel.py``)."""

from __future__ import annotations

import torch

from . import interpreting
from .common import launch_dims, page_layout_constexprs, ptr_or_dummy
from .heuristics import WRITER_BLOCK_T, WRITER_BLOCK_T_INTERPRETER, WRITER_NUM_WARPS
from .writer_kernel import write_kernel


def plane_view(dim: int, bits: int, group: int) -> tuple[int, int, int, bool]:
    """How the writer kernel views one token's ``dim`` values: ``[A, B, C]`` (row-major, A*B*C = dim)
    and ``span``, such that split-half packing (DESIGN §3.3: byte j holds elements j + p*dim/K,
    K = 8/bits, at bits p*bits) reads plane p = a (or a*B + b with ``span``) and byte b*C + c (or c),
    and every quantization group is one ``[a, b, :]`` slice (or one ``[a, :, :]`` with ``span``,
    where a group covers several planes). ``bits`` 16: unquantized, one row."""
    if bits >= 16:
        return 1, 1, dim, False
    k = 8 // bits
    plane = dim // k  # bytes per token
    if group <= plane:
        return k, plane // group, group, False
    planes_per_group = group // plane
    return k // planes_per_group, planes_per_group, plane, True


def content_view(fmt) -> tuple[int, int, int, bool]:
    """:func:`plane_view` of the content path of ``fmt`` (a :class:`PackFormat`)."""
    if not fmt.quantized:
        return plane_view(fmt.latent_dim, 16, fmt.latent_dim)
    return plane_view(fmt.latent_dim, fmt.content_bits, fmt.content_group_size)


def rope_view(fmt) -> tuple[int, int, int, bool]:
    """:func:`plane_view` of the RoPE path of ``fmt``."""
    if not fmt.quantized:
        return plane_view(fmt.rope_dim, 16, fmt.rope_dim)
    return plane_view(fmt.rope_dim, fmt.rope_bits, fmt.rope_group_size)


def _view_constexprs(prefix: str, a: int, b: int, c: int, span: bool) -> dict:
    return {f"{prefix}A": a, f"{prefix}B": b, f"{prefix}C": c, f"{prefix}_SPAN": span}


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
        **_view_constexprs("C", *content_view(fmt)), **_view_constexprs("R", *rope_view(fmt)),
        **page_layout_constexprs(fmt),
        BLOCK_T=block_t,
        **launch_dims(num_warps=num_warps or WRITER_NUM_WARPS),
    )
