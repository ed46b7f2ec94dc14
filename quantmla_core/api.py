"""Public entry points: :func:`write` and :func:`attention` (DESIGN.md §4)."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import validation as v
from .cache import MLACache
from .dispatch import Backend, DeviceInfo, Problem, select_backend


def write(
    cache: MLACache,
    latent: Any,
    k_rope: Any,
    *,
    slot_mapping: Any,
    seq_ids: Any,
    positions: Any,
    seq_lens: Any,
    backend: str = "auto",
    validate: bool | None = None,
) -> None:
    """Quantize, pack and store N new tokens; update the sink and local protection buffers.

    latent ``[N, d_c]``, k_rope ``[N, d_r]`` (float32 or bfloat16; float32 for NumPy);
    slot_mapping ``[N]`` (``page * P + offset``, -1 skips the token), seq_ids ``[N]`` (row of
    each token's request in the protection buffers), positions ``[N]``, seq_lens
    ``[max_seqs]`` (each request's length after this write). Integer arrays int32/int64.
    ``validate`` (default: on for CPU/NumPy) checks index ranges and finite values. Without it,
    every backend masks bad indices: a slot outside the pages skips the token, and a seq id outside
    ``[0, max_seqs)`` or a negative position skips its protection copies.
    """
    cache = v.check_cache(cache)
    fmt = cache.format
    for name, x in (("latent", latent), ("k_rope", k_rope)):
        v.check_array(name, x, cache)
    if latent.ndim != 2 or latent.shape[1] != fmt.latent_dim:
        raise ValueError(f"latent: expected shape [N, {fmt.latent_dim}], got {tuple(latent.shape)}")
    n = int(latent.shape[0])
    v.check_shape("k_rope", k_rope, (n, fmt.rope_dim))
    dtype = v.value_dtype("latent", latent)
    if v.value_dtype("k_rope", k_rope) != dtype:
        raise TypeError(f"k_rope: expected dtype {latent.dtype} (same as latent), got {k_rope.dtype}")
    for name, x, shape in (
        ("slot_mapping", slot_mapping, (n,)),
        ("seq_ids", seq_ids, (n,)),
        ("positions", positions, (n,)),
        ("seq_lens", seq_lens, (cache.max_seqs,)),
    ):
        v.check_array(name, x, cache)
        v.check_index(name, x, shape)
    if validate is None:
        validate = v.default_validate(cache)
    if validate:
        _validate_write_values(cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens)
    problem = Problem("write", fmt, DeviceInfo.of(cache.pages), dtype, v.protect_dtype_name(cache))
    select_backend(problem, backend).write(cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens)


def _validate_write_values(cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens) -> None:
    slots, ids, pos, lens = (v.host(x) for x in (slot_mapping, seq_ids, positions, seq_lens))
    v.check_range("slot_mapping", slots, -1, cache.num_pages * cache.format.page_size, "-1 or a slot index")
    live = slots >= 0
    v.check_range("seq_ids", ids[live], 0, cache.max_seqs, "a protection-buffer row")
    v.check_range("seq_lens", lens, 0, np.iinfo(np.int64).max, "a length")
    if live.any():
        limit = lens[ids[live]]
        bad = np.flatnonzero((pos[live] < 0) | (pos[live] >= limit))
        if bad.size:
            i = int(np.flatnonzero(live)[bad[0]])
            raise ValueError(
                f"positions: expected 0 <= position < seq_lens[seq_ids[i]] = {int(lens[ids[i]])}, "
                f"got {int(pos[i])} at index {i}"
            )
    v.check_finite("latent", latent)
    v.check_finite("k_rope", k_rope)


def attention(
    q_latent: Any,
    q_rope: Any,
    cache: MLACache,
    *,
    block_table: Any,
    seq_lens: Any,
    seq_ids: Any,
    softmax_scale: float,
    backend: str = "auto",
    return_lse: bool = True,
    validate: bool | None = None,
):
    """Decode attention over the packed cache (absorbed MLA, DESIGN.md §2).

    q_latent ``[B, H, d_c]`` or ``[B, S_q, H, d_c]``, q_rope ``[..., d_r]`` likewise (float32
    or bfloat16); block_table ``[B, max_pages]`` int32; seq_lens ``[B]`` (lengths including
    the S_q query tokens, already written); seq_ids ``[B]``. Query i of S_q sees tokens
    ``< L - S_q + i + 1``. Returns ``out`` shaped and typed like q_latent and, with
    ``return_lse``, ``lse [B, (S_q,) H]`` float32 (natural log of the scaled-score sums).

    ``seq_lens`` must be the lengths the cache was last written with: the local ring holds the
    last ``local`` tokens of that length, so attending with a shorter length reads ring slots that
    newer tokens have overwritten (write and attend in chunks instead). Each length must be at
    least S_q; on GPU (``validate`` off by default) this is not checked and a shorter request
    returns -inf in its lse rows.
    """
    cache = v.check_cache(cache)
    dtype, b, s_q, heads = _check_queries(cache, q_latent, q_rope)
    scale = v.check_scale(softmax_scale)
    squeeze = q_latent.ndim == 3
    validate = v.default_validate(cache) if validate is None else validate
    impl = _attention_backend(cache, block_table, seq_lens, seq_ids, b, heads, s_q, dtype, backend, validate)
    if validate:
        _check_query_values(q_latent, q_rope)
    kw = {} if return_lse else {"want_lse": False}  # a backend may then skip allocating lse
    if squeeze and not impl.takes_3d_queries:
        out, lse = impl.attention(q_latent[:, None], q_rope[:, None], cache, block_table, seq_lens, seq_ids, scale, **kw)
        if not return_lse:
            return out[:, 0]
        out, lse = out[:, 0], lse[:, 0]
    else:
        out, lse = impl.attention(q_latent, q_rope, cache, block_table, seq_lens, seq_ids, scale, **kw)
    return (out, lse) if return_lse else out


def _check_queries(cache: MLACache, q_latent: Any, q_rope: Any) -> tuple[str, int, int, int]:
    """Array kind, shapes and dtypes of the queries -> (value dtype name, B, S_q, H)."""
    fmt = cache.format
    for name, x in (("q_latent", q_latent), ("q_rope", q_rope)):
        v.check_array(name, x, cache)
    if q_latent.ndim not in (3, 4) or q_latent.shape[-1] != fmt.latent_dim:
        raise ValueError(
            f"q_latent: expected shape [B, H, {fmt.latent_dim}] or [B, S_q, H, {fmt.latent_dim}], got {tuple(q_latent.shape)}"
        )
    v.check_shape("q_rope", q_rope, tuple(q_latent.shape[:-1]) + (fmt.rope_dim,))
    dtype = v.value_dtype("q_latent", q_latent)
    if v.value_dtype("q_rope", q_rope) != dtype:
        raise TypeError(f"q_rope: expected dtype {q_latent.dtype} (same as q_latent), got {q_rope.dtype}")
    b = int(q_latent.shape[0])
    s_q = 1 if q_latent.ndim == 3 else int(q_latent.shape[1])
    heads = int(q_latent.shape[-2])
    if b == 0 or heads == 0 or s_q == 0:
        raise ValueError(f"q_latent: expected non-empty batch, query and head dims, got {tuple(q_latent.shape)}")
    return dtype, b, s_q, heads


def _attention_backend(cache: MLACache, block_table: Any, seq_lens: Any, seq_ids: Any, b: int, heads: int, s_q: int,
                       dtype: str, backend: str, validate: bool) -> Backend:
    """Check the index arguments of an attention call (their values too where ``validate`` says so)
    and choose the backend that serves it."""
    fmt = cache.format
    v.check_array("block_table", block_table, cache)
    if block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table: expected shape [{b}, max_pages], got {tuple(block_table.shape)}")
    v.check_index("block_table", block_table, tuple(block_table.shape))
    for name, x in (("seq_lens", seq_lens), ("seq_ids", seq_ids)):
        v.check_array(name, x, cache)
        v.check_index(name, x, (b,))
    if validate:
        _validate_index_values(cache, block_table, seq_lens, seq_ids, s_q)
    problem = Problem("attention", fmt, DeviceInfo.of(cache.pages), dtype, v.protect_dtype_name(cache), heads, s_q, b,
                      int(block_table.shape[1]) * fmt.page_size)
    return select_backend(problem, backend)


def _validate_index_values(cache, block_table, seq_lens, seq_ids, s_q: int) -> None:
    table, lens, ids = (v.host(x) for x in (block_table, seq_lens, seq_ids))
    p = cache.format.page_size
    v.check_range("seq_lens", lens, s_q, table.shape[1] * p + 1, f"a length >= S_q={s_q} and <= max_pages * P")
    v.check_range("seq_ids", ids, 0, cache.max_seqs, "a protection-buffer row")
    used = np.arange(table.shape[1])[None, :] < ((lens.astype(np.int64) + p - 1) // p)[:, None]
    bad = used & ((table < 0) | (table >= cache.num_pages))
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"block_table[{i}]: expected a page index in [0, {cache.num_pages}), got {int(table[i, j])} at index {j}")


def _check_query_values(q_latent, q_rope) -> None:
    v.check_finite("q_latent", q_latent)
    v.check_finite("q_rope", q_rope)
