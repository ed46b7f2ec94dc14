"""The packed MLA cache object and memory accounting (DESIGN.md §3.4–3.6)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .formats import PackFormat


@dataclass
class MLACache:
    """Packed pages plus the protection buffers of one layer.

    ``pages``: uint8 ``[num_pages, format.page_bytes]``.
    ``sink_buf``: ``[max_seqs, sink, d_c + d_r]`` and ``local_buf``: ``[max_seqs, local, d_c + d_r]``
    in the protection dtype (``local_buf`` is a ring indexed by ``position % local``).
    Arrays are torch tensors on one device, or NumPy arrays (``device="numpy"``; NumPy has
    no bfloat16, so NumPy caches protect in float32).
    """

    format: PackFormat
    pages: Any
    sink_buf: Any
    local_buf: Any
    max_seqs: int
    sink: int
    local: int

    @classmethod
    def allocate(
        cls,
        fmt: PackFormat,
        num_pages: int,
        max_seqs: int,
        sink: int = 4,
        local: int = 128,
        device: str | torch.device = "cuda",
        protect_dtype: torch.dtype | str | None = None,
    ) -> "MLACache":
        """Allocate an uninitialised cache.

        ``protect_dtype`` defaults to bfloat16 for torch devices and float32 for
        ``device="numpy"``; float32 is accepted on CPU and NumPy only.
        """
        if not isinstance(fmt, PackFormat):
            raise TypeError(f"fmt: expected a PackFormat, got {type(fmt).__name__}")
        for arg, v, lo in (("num_pages", num_pages, 1), ("max_seqs", max_seqs, 1), ("sink", sink, 0), ("local", local, 0)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{arg}: expected an integer >= {lo}, got {v!r}")
        width = fmt.latent_dim + fmt.rope_dim
        if str(device) == "numpy":
            pdt = np.dtype(_np_protect_dtype(protect_dtype))
            return cls(
                fmt,
                np.empty((num_pages, fmt.page_bytes), np.uint8),
                np.zeros((max_seqs, sink, width), pdt),
                np.zeros((max_seqs, local, width), pdt),
                int(max_seqs),
                int(sink),
                int(local),
            )
        dev = torch.device(device)
        pdt = _torch_protect_dtype(protect_dtype, dev)
        return cls(
            fmt,
            torch.empty((num_pages, fmt.page_bytes), dtype=torch.uint8, device=dev),
            torch.zeros((max_seqs, sink, width), dtype=pdt, device=dev),
            torch.zeros((max_seqs, local, width), dtype=pdt, device=dev),
            int(max_seqs),
            int(sink),
            int(local),
        )

    @property
    def num_pages(self) -> int:
        return int(self.pages.shape[0])

    @property
    def is_numpy(self) -> bool:
        return isinstance(self.pages, np.ndarray)

    @property
    def device(self) -> str | torch.device:
        return "numpy" if self.is_numpy else self.pages.device

    def nbytes(self) -> int:
        """Bytes actually allocated for pages and protection buffers."""
        if self.is_numpy:
            return int(self.pages.nbytes + self.sink_buf.nbytes + self.local_buf.nbytes)
        return sum(int(t.numel() * t.element_size()) for t in (self.pages, self.sink_buf, self.local_buf))


def _np_protect_dtype(protect_dtype) -> str:
    if protect_dtype in (None, "float32", np.float32, torch.float32):
        return "float32"
    raise ValueError(f"protect_dtype: NumPy caches support only float32 (no bfloat16 in NumPy), got {protect_dtype!r}")


def _torch_protect_dtype(protect_dtype, dev: torch.device) -> torch.dtype:
    if protect_dtype is None or protect_dtype in ("bfloat16", torch.bfloat16):
        return torch.bfloat16
    if protect_dtype in ("float32", torch.float32):
        if dev.type != "cpu":
            raise ValueError(f"protect_dtype: float32 protection is allowed on CPU only, got device {dev}")
        return torch.float32
    raise ValueError(f"protect_dtype: expected bfloat16 or float32 (CPU), got {protect_dtype!r}")


def memory_bytes(fmt: PackFormat, seq_len: int, sink: int = 4, local: int = 128) -> int:
    """Cache bytes of one request of ``seq_len`` tokens: whole pages plus its BF16 protection buffers."""
    if seq_len < 0:
        raise ValueError(f"seq_len: expected >= 0, got {seq_len}")
    return math.ceil(seq_len / fmt.page_size) * fmt.page_bytes + (sink + local) * (fmt.latent_dim + fmt.rope_dim) * 2


def compression_ratio(fmt: PackFormat, seq_len: int, sink: int = 4, local: int = 128) -> float:
    """BF16 page bytes (no protection) over :func:`memory_bytes` of ``fmt`` at ``seq_len``."""
    bf16 = PackFormat.parse("BF16", fmt.latent_dim, fmt.rope_dim, fmt.group_size, fmt.page_size)
    return memory_bytes(bf16, seq_len, 0, 0) / memory_bytes(fmt, seq_len, sink, local)
