"""Input checks of the public API. Every error names the argument, what was expected and what was got."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .cache import MLACache

INDEX_DTYPES_TORCH = (torch.int32, torch.int64)
VALUE_DTYPES_TORCH = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
VALUE_DTYPES_NUMPY = {np.dtype(np.float32): "float32"}


def _desc(x: Any) -> str:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        dev = "numpy" if isinstance(x, np.ndarray) else str(x.device)
        return f"{type(x).__name__} shape {tuple(x.shape)} dtype {x.dtype} on {dev}"
    return type(x).__name__


def check_cache(cache: Any) -> MLACache:
    if not isinstance(cache, MLACache):
        raise TypeError(f"cache: expected an MLACache, got {_desc(cache)}")
    shape = tuple(cache.pages.shape)
    # kernels may read page 0 in place of a token they mask (CuPy v5), so an empty pool is refused here
    if len(shape) != 2 or shape[0] < 1 or shape[1] != cache.format.page_bytes:
        raise ValueError(f"cache.pages: expected shape [num_pages >= 1, {cache.format.page_bytes}] "
                         f"(page_bytes of {cache.format.name}), got {shape}")
    return cache


def check_array(name: str, x: Any, cache: MLACache) -> None:
    """x must be the same array kind as the cache (NumPy, or a tensor on the cache's device)."""
    if cache.is_numpy:
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array (the cache is NumPy), got {_desc(x)}")
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor on {cache.pages.device}, got {_desc(x)}")
    if x.device != cache.pages.device:
        raise ValueError(f"{name}: expected a tensor on {cache.pages.device} (the cache's device), got one on {x.device}")


def value_dtype(name: str, x: Any) -> str:
    table = VALUE_DTYPES_NUMPY if isinstance(x, np.ndarray) else VALUE_DTYPES_TORCH
    key = x.dtype
    if key not in table:
        raise TypeError(f"{name}: expected dtype in {[str(k) for k in table]}, got {x.dtype}")
    return table[key]


def check_index(name: str, x: Any, shape: tuple[int, ...]) -> None:
    if isinstance(x, np.ndarray):
        ok = np.issubdtype(x.dtype, np.integer)
    else:
        ok = x.dtype in INDEX_DTYPES_TORCH
    if not ok:
        raise TypeError(f"{name}: expected an int32 or int64 array, got dtype {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")


def check_shape(name: str, x: Any, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")


def host(x: Any) -> np.ndarray:
    """Host copy of an index array (syncs on GPU)."""
    return x if isinstance(x, np.ndarray) else x.detach().cpu().numpy()


def check_range(name: str, values: np.ndarray, lo: int, hi: int, what: str) -> None:
    """All values in [lo, hi)."""
    if values.size == 0:
        return
    bad = np.flatnonzero((values < lo) | (values >= hi))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}: expected {what} in [{lo}, {hi}), got {int(values.flat[i])} at index {i}")


def check_finite(name: str, x: Any) -> None:
    finite = np.isfinite(x).all() if isinstance(x, np.ndarray) else bool(torch.isfinite(x).all())
    if not finite:
        raise ValueError(f"{name}: expected finite values, got NaN or Inf")


def check_scale(softmax_scale: Any) -> float:
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, np.floating)):
        raise TypeError(f"softmax_scale: expected a float, got {type(softmax_scale).__name__}")
    v = float(softmax_scale)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"softmax_scale: expected a finite value > 0, got {v}")
    return v


def default_validate(cache: MLACache) -> bool:
    """Syncing checks run by default where they are cheap: NumPy and CPU caches."""
    return cache.is_numpy or cache.pages.device.type == "cpu"


def protect_dtype_name(cache: MLACache) -> str:
    dt = cache.sink_buf.dtype
    return "bfloat16" if dt == torch.bfloat16 else "float32"
