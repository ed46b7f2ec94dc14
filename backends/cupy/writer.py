"""CuPy writer launcher: one fused launch quantizes, packs, writes pages and updates protection."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...formats import PackFormat
from . import WRITER_WARPS, device_pointer, format_defines, get_kernel, launch


def writer_defines(fmt: PackFormat, dtype: str) -> dict[str, int]:
    """``-D`` defines of ``kernels/writer.cu`` for ``fmt`` and input dtype ("float32"/"bfloat16")."""
    d = format_defines(fmt)
    d.update(QMLA_IN_BF16=int(dtype == "bfloat16"), QMLA_WRITER_WARPS=WRITER_WARPS)
    return d


_KERNELS: dict[tuple, Any] = {}


def _writer_kernel(fmt: PackFormat, dtype: str, dev: int):
    """Compiled ``qmla_write`` for ``fmt``, input dtype and device, cached here: building the
    defines and the compile-cache key takes tens of µs, as much as a short write's kernel."""
    key = (fmt, dtype, dev, WRITER_WARPS)
    fn = _KERNELS.get(key)
    if fn is None:
        fn = _KERNELS[key] = get_kernel("writer.cu", "qmla_write", writer_defines(fmt, dtype), dev)
    return fn


def _i64(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int64).contiguous()


def _aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous with a 16-byte aligned start (the kernel reads rows with vector loads),
    copied only when it is not already."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _require_contiguous(name: str, x: Any) -> None:
    if isinstance(x, torch.Tensor) and not x.is_contiguous():
        raise ValueError(f"cache.{name}: the CuPy backend writes in place and needs a contiguous tensor")


def write(cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens) -> None:
    """See ``quantmla_core.write``. latent ``[N, d_c]``, k_rope ``[N, d_r]`` (float32 or
    bfloat16 CUDA tensors); slot/seq/position arrays ``[N]`` and seq_lens ``[max_seqs]`` int32
    or int64. Slots outside ``[0, num_pages * P)`` are skipped by the kernel (masked)."""
    fmt = cache.format
    n = int(latent.shape[0])
    if n == 0:
        return
    for name in ("pages", "sink_buf", "local_buf"):
        _require_contiguous(name, getattr(cache, name))
    dtype = "bfloat16" if latent.dtype == torch.bfloat16 else "float32"
    dev = latent.device.index if latent.device.index is not None else torch.cuda.current_device()
    fn = _writer_kernel(fmt, dtype, dev)
    latent, k_rope = _aligned_rows(latent), _aligned_rows(k_rope)
    slots, ids, pos, lens = _i64(slot_mapping), _i64(seq_ids), _i64(positions), _i64(seq_lens)
    p = lambda x: np.uint64(device_pointer(x))  # noqa: E731
    args = (
        p(latent), p(k_rope), p(slots), p(ids), p(pos), p(lens), p(cache.pages),
        p(cache.sink_buf), p(cache.local_buf), np.int32(n), np.int64(cache.num_pages * fmt.page_size),
        np.int32(cache.max_seqs), np.int32(cache.sink), np.int32(cache.local),
    )
    grid = ((n + WRITER_WARPS - 1) // WRITER_WARPS,)
    launch(fn, grid, (WRITER_WARPS * 32,), args, dev)
