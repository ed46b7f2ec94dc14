"""Decode attention planned once per step and run per layer (FlashInfer's plan/run split).

A decode step asks every layer the same question: the same block table, lengths, request ids,
head count and query shape, only the queries and the layer's cache differ. :func:`plan_attention`
checks those arguments and chooses the backend once; :meth:`AttentionPlan.run` then checks only
the queries (shape, dtype, device by identity, no sync) and launches. On the CuPy backend the
plan also fixes the kernel variant, its launch plan and the packed scalar arguments, on the Triton
backend the variant, its launch plan, constexprs, grids and how the protected tiles spread over
programs, so a run is the output (and partials) allocation and the launches::

    plan = qm.plan_attention(caches[0], block_table=table, seq_lens=lens, seq_ids=ids,
                             num_heads=16, q_dtype=torch.bfloat16, softmax_scale=tau)
    for layer in range(num_layers):
        out = plan.run(q_latent[layer], q_rope[layer], caches[layer], return_lse=False)

A plan reads ``block_table``, ``seq_lens`` and ``seq_ids`` as they were when it was made: plan
again when they change (every step). The results equal :func:`quantmla_core.attention`'s with
the same arguments, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import validation as v
from .api import _attention_backend, _check_query_values
from .cache import MLACache

#: (q_latent, q_rope, cache, out | None, lse | None[, want_lse]) -> (out, lse), queries and results in the planned
#: shape ([B, H, d] or [B, S_q, H, d]); lse may be None where want_lse is False; from Backend.plan_attention
Runner = Callable[..., tuple[Any, Any]]


def cache_geometry(cache: MLACache) -> tuple:
    """What a plan fixes about a cache: every shape, dtype and scalar the launches depend on."""
    return (cache.format, tuple(cache.pages.shape), cache.pages.dtype, str(cache.device), tuple(cache.sink_buf.shape),
            cache.sink_buf.dtype, tuple(cache.local_buf.shape), cache.local_buf.dtype, cache.max_seqs, cache.sink,
            cache.local)


class AttentionPlan:
    """A planned decode-attention call; made by :func:`plan_attention`.

    ``backend``: the chosen backend's name; ``q_shape`` / ``rope_shape``: the query shapes
    :meth:`run` takes; ``q_dtype``: their dtype."""

    def __init__(self, cache: MLACache, runner: Runner, backend: str, q_shape: tuple[int, ...], q_dtype: Any,
                 validate: bool):
        self.cache = cache
        self.backend = backend
        self.q_shape = q_shape
        self.rope_shape = q_shape[:-1] + (cache.format.rope_dim,)
        self.q_dtype = q_dtype
        self._runner = runner
        self._validate = validate
        self._geometry = cache_geometry(cache)
        self._device = None if cache.is_numpy else cache.pages.device
        self._lse_dtype = np.dtype(np.float32) if cache.is_numpy else torch.float32

    def run(self, q_latent: Any, q_rope: Any, cache: MLACache | None = None, *, out: Any = None, lse: Any = None,
            return_lse: bool = True):
        """q_latent ``q_shape``, q_rope ``rope_shape`` (``q_dtype``, on the cache's device) over
        ``cache`` (default: the cache planned with; another layer's cache of the same geometry
        may be given) -> ``out`` shaped and typed like q_latent and, with ``return_lse``, ``lse``
        float32 ``q_shape[:-1]``. ``out`` / ``lse`` given: the results are written into them
        (the CuPy and Triton backends write there directly; contiguous, and for CuPy 16-byte aligned)."""
        if cache is None:
            cache = self.cache
        elif cache is not self.cache and (not isinstance(cache, MLACache) or cache_geometry(cache) != self._geometry):
            raise ValueError(f"cache: expected an MLACache of the planned geometry {self._describe(self._geometry)}, "
                             f"got {self._describe(cache_geometry(cache)) if isinstance(cache, MLACache) else type(cache).__name__}")
        self._check_array("q_latent", q_latent, self.q_shape, self.q_dtype)
        self._check_array("q_rope", q_rope, self.rope_shape, self.q_dtype)
        if out is not None:
            self._check_array("out", out, self.q_shape, self.q_dtype)
        if lse is not None:
            self._check_array("lse", lse, self.q_shape[:-1], self._lse_dtype)
        if self._validate:
            _check_query_values(q_latent, q_rope)
        if return_lse:
            return self._runner(q_latent, q_rope, cache, out, lse)
        return self._runner(q_latent, q_rope, cache, out, lse, want_lse=False)[0]

    def _check_array(self, name: str, x: Any, shape: tuple[int, ...], dtype: Any) -> None:
        """``x`` must be an array of the cache's kind and device with exactly ``shape`` and ``dtype``."""
        if self._device is None:
            ok = isinstance(x, np.ndarray)
        else:
            ok = isinstance(x, torch.Tensor) and x.device == self._device
        if not (ok and tuple(x.shape) == shape and x.dtype == dtype):
            where = "numpy" if self._device is None else str(self._device)
            got = f"{type(x).__name__} shape {tuple(x.shape)} dtype {x.dtype}" if hasattr(x, "shape") else type(x).__name__
            if hasattr(x, "device"):
                got += f" on {x.device}"
            raise ValueError(f"{name}: expected the planned shape {shape}, dtype {dtype} on {where}, got {got}")

    @staticmethod
    def _describe(g: tuple) -> str:
        fmt, pages, _pd, dev, _ss, sink_dt, _ls, _ld, max_seqs, sink, local = g
        return f"({fmt.name}, pages {pages} on {dev}, max_seqs {max_seqs}, sink {sink}, local {local}, {sink_dt})"


def plan_attention(
    cache: MLACache,
    *,
    block_table: Any,
    seq_lens: Any,
    seq_ids: Any,
    num_heads: int,
    q_dtype: Any,
    softmax_scale: float,
    q_len: int | None = None,
    backend: str = "auto",
    validate: bool | None = None,
) -> AttentionPlan:
    """Plan :func:`quantmla_core.attention` for one decode step.

    The arguments mean what they mean there; ``num_heads`` and ``q_len`` give the query shape:
    ``[B, H, d_c]`` when ``q_len`` is None, else ``[B, q_len, H, d_c]`` (B from block_table).
    ``q_dtype``: torch.float32 / torch.bfloat16 (np.float32 for NumPy caches). ``validate``
    (default: on for CPU/NumPy) checks the index values now and the queries' finiteness per run.
    """
    cache = v.check_cache(cache)
    table = v.VALUE_DTYPES_NUMPY if cache.is_numpy else v.VALUE_DTYPES_TORCH
    key = np.dtype(q_dtype) if cache.is_numpy and not isinstance(q_dtype, torch.dtype) else q_dtype
    if key not in table:
        raise TypeError(f"q_dtype: expected one of {[str(k) for k in table]}, got {q_dtype!r}")
    for name, val in (("num_heads", num_heads), ("q_len", 1 if q_len is None else q_len)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {val!r}")
    scale = v.check_scale(softmax_scale)
    v.check_array("block_table", block_table, cache)
    if block_table.ndim != 2 or block_table.shape[0] == 0:
        raise ValueError(f"block_table: expected shape [B, max_pages] with B >= 1, got {tuple(block_table.shape)}")
    b, heads, s_q = int(block_table.shape[0]), int(num_heads), 1 if q_len is None else int(q_len)
    validate = v.default_validate(cache) if validate is None else validate
    impl = _attention_backend(cache, block_table, seq_lens, seq_ids, b, heads, s_q, table[key], backend, validate)
    d_c = cache.format.latent_dim
    q_shape = (b, heads, d_c) if q_len is None else (b, s_q, heads, d_c)
    runner = impl.plan_attention(cache, block_table, seq_lens, seq_ids, q_shape, key, scale)
    return AttentionPlan(cache, runner, impl.name, q_shape, key, validate)
