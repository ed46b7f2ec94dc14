"""Saving and loading an :class:`~quantmla_core.cache.MLACache`: one safetensors file holding its three arrays (pages,
sink and local buffers) and, as metadata, the format (layout version included, DESIGN.md §3.3: "the version is part of
the format and of any saved cache"), the protection sizes and the library version that wrote it. A file whose format
or layout version this library does not know is refused by name, never reinterpreted.

Needs ``safetensors`` (in the ``transformers`` and ``dev`` extras, or ``pip install safetensors``)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from .cache import MLACache, _torch_protect_dtype
from .formats import PackFormat

#: the ``kind`` metadata entry of a saved cache
FILE_KIND = "quantmla.MLACache"
_ARRAYS = ("pages", "sink_buf", "local_buf")


def _safetensors():
    try:
        import safetensors  # noqa: F401
    except ImportError as e:  # pragma: no cover - safetensors is in the dev extra
        raise ImportError("saving and loading caches needs safetensors (pip install safetensors)") from e


def save_cache(cache: MLACache, path: str | os.PathLike) -> None:
    """Write ``cache`` (torch tensors on any device, or NumPy arrays) to the safetensors file ``path``."""
    from .validation import check_cache

    _safetensors()
    cache = check_cache(cache)
    meta = {"kind": FILE_KIND, "format": json.dumps(cache.format.to_dict()), "max_seqs": str(cache.max_seqs),
            "sink": str(cache.sink), "local": str(cache.local), "quantmla": _library_version()}
    if cache.is_numpy:
        from safetensors.numpy import save_file

        save_file({n: np.ascontiguousarray(getattr(cache, n)) for n in _ARRAYS}, os.fspath(path), metadata=meta)
    else:
        from safetensors.torch import save_file

        save_file({n: getattr(cache, n).detach().contiguous().cpu() for n in _ARRAYS}, os.fspath(path), metadata=meta)


def load_cache(path: str | os.PathLike, device: str | torch.device = "cpu") -> MLACache:
    """The cache saved at ``path``, on ``device`` (a torch device, or ``"numpy"``: bfloat16 protection buffers become
    float32 there, exactly). ``ValueError`` naming what does not match when the file is not a saved cache of a format
    and layout version this library knows, or its arrays do not have that format's shapes and dtypes."""
    _safetensors()
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("kind") != FILE_KIND:
            raise ValueError(f"path: expected a saved QuantMLA cache (metadata kind {FILE_KIND!r}), got kind "
                             f"{meta.get('kind')!r} in {os.fspath(path)!r}")
        missing = [n for n in _ARRAYS if n not in f.keys()]
        if missing:
            raise ValueError(f"path: the saved cache lacks {missing} ({os.fspath(path)!r})")
        arrays = {n: f.get_tensor(n) for n in _ARRAYS}
    fmt = _format_of(meta)
    sizes = {k: _int_entry(meta, k) for k in ("max_seqs", "sink", "local")}
    _check_arrays(fmt, arrays, **sizes)
    return _on_device(fmt, arrays, device, **sizes)


def _library_version() -> str:
    from . import __version__

    return __version__


def _format_of(meta: dict[str, str]) -> PackFormat:
    try:
        d = json.loads(meta["format"])
        return PackFormat.from_dict(d)
    except KeyError as e:
        raise ValueError(f"format: the saved cache's metadata lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"format: the saved cache's format {meta.get('format')!r} is not one this library knows "
                         f"(quantmla {meta.get('quantmla', '?')} wrote it): {e}") from None


def _int_entry(meta: dict[str, str], key: str) -> int:
    raw = meta.get(key)
    if raw is None or not raw.isdigit():
        raise ValueError(f"{key}: expected a non-negative integer in the saved cache's metadata, got {raw!r}")
    return int(raw)


def _check_arrays(fmt: PackFormat, arrays: dict[str, torch.Tensor], max_seqs: int, sink: int, local: int) -> None:
    width = fmt.latent_dim + fmt.rope_dim
    pages = arrays["pages"]
    if pages.dtype != torch.uint8 or pages.ndim != 2 or pages.shape[1] != fmt.page_bytes:
        raise ValueError(f"pages: expected uint8 [num_pages, {fmt.page_bytes}] for {fmt}, got {pages.dtype} "
                         f"{list(pages.shape)}")
    for name, n in (("sink_buf", sink), ("local_buf", local)):
        buf = arrays[name]
        if list(buf.shape) != [max_seqs, n, width] or buf.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{name}: expected bfloat16 or float32 [{max_seqs}, {n}, {width}], got {buf.dtype} "
                             f"{list(buf.shape)}")
    if arrays["sink_buf"].dtype != arrays["local_buf"].dtype:
        raise ValueError(f"local_buf: expected the sink buffer's dtype {arrays['sink_buf'].dtype}, got "
                         f"{arrays['local_buf'].dtype}")


def _on_device(fmt: PackFormat, arrays: dict[str, torch.Tensor], device: Any, max_seqs: int, sink: int,
               local: int) -> MLACache:
    if str(device) == "numpy":
        host = [arrays["pages"].numpy()] + [arrays[n].float().numpy() for n in _ARRAYS[1:]]
        return MLACache(fmt, *host, max_seqs, sink, local)
    dev = torch.device(device)
    _torch_protect_dtype(arrays["sink_buf"].dtype, dev)  # float32 protection is for CPU caches only
    return MLACache(fmt, *(arrays[n].to(dev) for n in _ARRAYS), max_seqs, sink, local)
