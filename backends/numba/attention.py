"""Numba decode-attention launcher: plans tasks (request x head block x page range), runs
the page-tiled kernel and, for split requests, the log-sum-exp merge."""

from __future__ import annotations

import numba
import numpy as np
import torch

from .common import bits16, floats, indices, layout_vector, pages_view
from .kernels_attention import attend_tasks, merge_splits

#: query rows (S_q x heads) one task handles; more heads are split into blocks
MAX_ROWS = 64
#: a split covers at least this many pages
MIN_SPLIT_PAGES = 8
#: aim for this many tasks per thread when requests are split
TASKS_PER_THREAD = 2


def plan(lengths: np.ndarray, page_size: int, max_pages: int, s_q: int, heads: int, threads: int):
    """Tasks for ``B`` requests of ``lengths`` (int64 ``[B]``).

    Returns ``(head_block, task_b, task_h0, task_p0, task_p1, task_part, groups)``; ``groups`` is
    None when no request is split (every task writes its output directly), else
    ``(group_b, group_h0, group_start, group_end)`` indexing the partial results.
    """
    head_block = max(1, min(heads, MAX_ROWS // s_q))
    n_hb = -(-heads // head_block)
    b = lengths.shape[0]
    pages = np.clip((np.maximum(lengths, 0) + page_size - 1) // page_size, 0, max_pages)
    total = int(pages.sum()) * n_hb
    chunk = max(MIN_SPLIT_PAGES, -(-total // max(1, TASKS_PER_THREAD * threads)))
    splits = np.maximum(1, -(-pages // chunk))
    req = np.repeat(np.arange(b, dtype=np.int64), n_hb)  # one entry per (request, head block)
    h0 = np.tile(np.arange(n_hb, dtype=np.int64) * head_block, b)
    if int(splits.max(initial=1)) == 1:
        zeros = np.zeros(req.shape[0], np.int64)
        return head_block, req, h0, zeros, pages[req].astype(np.int64), np.full(req.shape[0], -1, np.int64), None
    per = splits[req]
    task_b = np.repeat(req, per)
    task_h0 = np.repeat(h0, per)
    group_end = np.cumsum(per)
    group_start = group_end - per
    k = np.arange(task_b.shape[0], dtype=np.int64) - np.repeat(group_start, per)  # split index in group
    step = -(-pages[task_b] // per[np.repeat(np.arange(req.shape[0]), per)])
    task_p0 = np.minimum(k * step, pages[task_b])
    task_p1 = np.minimum(task_p0 + step, pages[task_b])
    task_part = np.arange(task_b.shape[0], dtype=np.int64)
    groups = (req, h0, group_start.astype(np.int64), group_end.astype(np.int64))
    return head_block, task_b, task_h0, task_p0.astype(np.int64), task_p1.astype(np.int64), task_part, groups


def attention(q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale: float):
    """q ``[B, S_q, H, d_c]``/``[B, S_q, H, d_r]`` (NumPy float32 or CPU torch float32/bfloat16)
    -> out ``[B, S_q, H, d_c]`` in the query dtype and lse ``[B, S_q, H]`` float32, the same
    array kind as the query. Arguments validated by ``quantmla_core.attention``."""
    fmt = cache.format
    q = floats(q_latent)
    qr = floats(q_rope)
    b, s_q, heads, dc = q.shape
    pages, _ = pages_view(cache.pages)
    sink, sink_bf16, _ = bits16(cache.sink_buf)
    local, local_bf16, _ = bits16(cache.local_buf)
    if sink_bf16 != local_bf16:
        raise TypeError(f"cache: sink_buf and local_buf must share a dtype, got {cache.sink_buf.dtype} and {cache.local_buf.dtype}")
    table = indices(block_table)
    lens = indices(seq_lens)
    ids = indices(seq_ids)
    out = np.empty((b, s_q, heads, dc), np.float32)
    lse = np.empty((b, s_q, heads), np.float32)
    head_block, task_b, task_h0, task_p0, task_p1, task_part, groups = plan(
        lens, fmt.page_size, table.shape[1], s_q, heads, numba.get_num_threads()
    )
    rows = s_q * head_block
    n_parts = task_b.shape[0] if groups is not None else 1
    part_o = np.empty((n_parts, rows if groups is not None else 1, dc if groups is not None else 1), np.float32)
    part_lse = np.empty((n_parts, rows if groups is not None else 1), np.float32)
    attend_tasks(q, qr, pages, pages.view(np.uint16), pages.view(np.float32), table, lens, ids, sink, local,
                 sink_bf16, layout_vector(fmt), np.float32(softmax_scale), task_b, task_h0, task_p0, task_p1,
                 task_part, head_block, out, lse, part_o, part_lse)
    if groups is not None:
        merge_splits(*groups, head_block, part_o, part_lse, out, lse)
    if isinstance(q_latent, np.ndarray):
        return out.astype(q_latent.dtype, copy=False), lse
    return torch.from_numpy(out).to(q_latent.dtype), torch.from_numpy(lse)
