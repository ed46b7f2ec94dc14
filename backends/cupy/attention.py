"""CuPy decode-attention launcher: split-KV tensor-core kernel plus a log-sum-exp combine."""

from __future__ import annotations

import math

import numpy as np
import torch

from ...formats import PackFormat
from . import ATTN_TILE, ATTN_WARPS, device_pointer, format_defines, get_kernel, launch

LOG2E = 1.4426950408889634
#: CTAs per SM the split heuristic aims for (the kernel fits 2-3 per SM)
TARGET_CTAS_PER_SM = 4


def attention_defines(fmt: PackFormat, dtype: str) -> dict[str, int]:
    """``-D`` defines of ``kernels/attention.cu`` for ``fmt`` and query dtype.

    float32 queries use a split (hi + lo) bf16 A operand for float32-level accuracy.
    """
    d = format_defines(fmt)
    bf16 = dtype == "bfloat16"
    d.update(QMLA_IN_BF16=int(bf16), QMLA_SPLIT=1 if bf16 else 2)
    return d


def attention_smem_bytes(fmt: PackFormat) -> int:
    """Dynamic shared memory of one attention block (mirrors the SMEM_* sizes in attention.cu)."""
    ncol = fmt.latent_dim // ATTN_WARPS
    ld = ncol + 24
    ng = fmt.content_groups + 1 if fmt.quantized else 1
    kv = ATTN_WARPS * ATTN_TILE * ld * 2
    scl = 2 * ATTN_TILE * ng * 4
    xchg = ATTN_WARPS * (ATTN_TILE // 8) * 32 * 16
    staging = ATTN_WARPS * ATTN_TILE * (fmt.content_code_bytes // ATTN_WARPS + 32 + 8)
    return kv + scl + xchg + staging


def plan_splits(batch: int, row_groups: int, max_tokens: int, sm_count: int) -> tuple[int, int]:
    """(num_splits, tiles_per_split) so that batch * row_groups * num_splits fills the GPU.

    ``max_tokens`` is the block table's capacity (max_pages * P), so planning needs no sync."""
    tiles = max(1, math.ceil(max_tokens / ATTN_TILE))
    base = batch * row_groups
    want = max(1, math.ceil(TARGET_CTAS_PER_SM * sm_count / base))
    splits = min(want, tiles)
    per = math.ceil(tiles / splits)
    return math.ceil(tiles / per), per


def attention(q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale: float):
    """q ``[B, S_q, H, d_c]`` / ``[B, S_q, H, d_r]`` (float32 or bfloat16, CUDA) -> out
    ``[B, S_q, H, d_c]`` in q's dtype and lse ``[B, S_q, H]`` float32."""
    fmt = cache.format
    b, s_q, h, dc = (int(x) for x in q_latent.shape)
    dtype = "bfloat16" if q_latent.dtype == torch.bfloat16 else "float32"
    device = q_latent.device
    dev = device.index if device.index is not None else torch.cuda.current_device()
    rows = s_q * h
    row_groups = (rows + 15) // 16
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    ids = seq_ids.to(torch.int64).contiguous()
    q, r = q_latent.contiguous(), q_rope.contiguous()
    max_pages = int(table.shape[1])
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
    splits, per = plan_splits(b, row_groups, max(1, max_pages) * fmt.page_size, sm_count)

    smem = attention_smem_bytes(fmt)
    defines = attention_defines(fmt, dtype)
    attn = get_kernel("attention.cu", "qmla_attn", defines, dev, smem)
    combine = get_kernel("attention.cu", "qmla_combine", defines, dev)

    o_part = torch.empty((b * rows, splits, dc), dtype=torch.float32, device=device)
    ml_part = torch.empty((b * rows, splits, 2), dtype=torch.float32, device=device)
    out = torch.empty((b, s_q, h, dc), dtype=q_latent.dtype, device=device)
    lse = torch.empty((b, s_q, h), dtype=torch.float32, device=device)

    p = lambda x: np.uint64(device_pointer(x))  # noqa: E731
    args = (
        p(q), p(r), p(cache.pages), p(cache.sink_buf), p(cache.local_buf), p(table), p(lens), p(ids),
        p(o_part), p(ml_part), np.int32(s_q), np.int32(h), np.int32(max_pages), np.int32(table.stride(0)),
        np.int32(cache.num_pages), np.int32(cache.max_seqs), np.int32(cache.sink), np.int32(cache.local),
        np.int32(per), np.int32(splits), np.float32(softmax_scale * LOG2E),
    )
    launch(attn, (b * row_groups, splits), (ATTN_WARPS * 32,), args, dev, smem)
    launch(combine, (b * rows,), (128,), (p(o_part), p(ml_part), p(out), p(lse), np.int32(splits)), dev)
    return out, lse
