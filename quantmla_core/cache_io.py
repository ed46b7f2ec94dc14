"""Saving and loading a cache: an :class:`~quantmla_core.cache.MLACache` (one layer) or a
:class:`~quantmla_core.paged.PagedMLACache` (every layer and the allocator's bookkeeping: free pages and rows, each
request's pages and length), as one safetensors file holding the arrays (pages, sink and local buffers) and, as
metadata, the format (layout version included, DESIGN.md §3.3: "the version is part of the format and of any saved
cache"), the protection sizes and the library version that wrote it. A file whose format or layout version this
library does not know is refused by name, never reinterpreted.

Needs ``safetensors`` (in the ``transformers`` and ``dev`` extras, or ``pip install safetensors``)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .cache import MLACache, _torch_protect_dtype
from .formats import PackFormat

if TYPE_CHECKING:
    from .paged import PagedMLACache

#: the ``kind`` metadata entry of a saved cache: one layer, or a paged cache of one or more layers
FILE_KIND = "quantmla.MLACache"
PAGED_KIND = "quantmla.PagedMLACache"
_ARRAYS = ("pages", "sink_buf", "local_buf")


def _safetensors():
    try:
        import safetensors  # noqa: F401
    except ImportError as e:  # pragma: no cover - safetensors is in the dev extra
        raise ImportError("saving and loading caches needs safetensors (pip install safetensors)") from e


def save_cache(cache: "MLACache | PagedMLACache", path: str | os.PathLike) -> None:
    """Write ``cache`` (torch tensors on any device, or NumPy arrays) to the safetensors file ``path``: an
    :class:`MLACache`, or a :class:`PagedMLACache` with all its layers and its allocator's bookkeeping."""
    from .paged import PagedMLACache
    from .validation import check_cache

    _safetensors()
    paged = cache if isinstance(cache, PagedMLACache) else None
    layers = [paged.layer(i) for i in range(paged.num_layers)] if paged else [check_cache(cache)]
    first = layers[0]
    meta = {"kind": PAGED_KIND if paged else FILE_KIND, "format": json.dumps(first.format.to_dict()),
            "max_seqs": str(first.max_seqs), "sink": str(first.sink), "local": str(first.local),
            "quantmla": _library_version()}
    if paged:
        meta.update(layers=str(len(layers)), state=json.dumps(paged.allocator_state()))
    names = [(f"{i}." if paged else "") + n for i in range(len(layers)) for n in _ARRAYS]
    arrays = [getattr(c, n) for c in layers for n in _ARRAYS]
    if first.is_numpy:
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(a) for k, a in zip(names, arrays)}, os.fspath(path), metadata=meta)
    else:
        from safetensors.torch import save_file

        save_file({k: a.detach().contiguous().cpu() for k, a in zip(names, arrays)}, os.fspath(path), metadata=meta)


def load_cache(path: str | os.PathLike, device: str | torch.device = "cpu") -> "MLACache | PagedMLACache":
    """The cache saved at ``path`` (an :class:`MLACache` or a :class:`PagedMLACache`, as saved), on ``device`` (a
    torch device, or ``"numpy"``: bfloat16 protection buffers become float32 there, exactly). ``ValueError`` naming
    what does not match when the file is not a saved cache of a format and layout version this library knows, or its
    arrays do not have that format's shapes and dtypes."""
    _safetensors()
    from safetensors import safe_open

    where = os.fspath(path)
    with safe_open(where, framework="pt") as f:
        meta = f.metadata() or {}
        kind = meta.get("kind")
        if kind not in (FILE_KIND, PAGED_KIND):
            raise ValueError(f"path: expected a saved QuantMLA cache (metadata kind {FILE_KIND!r} or {PAGED_KIND!r}), "
                             f"got kind {kind!r} in {where!r}")
        prefixes = [f"{i}." for i in range(_int_entry(meta, "layers"))] if kind == PAGED_KIND else [""]
        missing = [p + n for p in prefixes for n in _ARRAYS if p + n not in f.keys()]
        if missing:
            raise ValueError(f"path: the saved cache lacks {missing} ({where!r})")
        arrays = [{n: f.get_tensor(p + n) for n in _ARRAYS} for p in prefixes]
    fmt = _format_of(meta)
    sizes = {k: _int_entry(meta, k) for k in ("max_seqs", "sink", "local")}
    for layer in arrays:
        _check_arrays(fmt, layer, **sizes)
    layers = [_on_device(fmt, layer, device, **sizes) for layer in arrays]
    if kind == FILE_KIND:
        return layers[0]
    from .paged import PagedMLACache

    if len({c.num_pages for c in layers}) != 1:
        raise ValueError(f"pages: every layer of a paged cache has the same page count, got {[c.num_pages for c in layers]}")
    try:
        state = json.loads(meta.get("state", ""))
    except json.JSONDecodeError as e:
        raise ValueError(f"state: expected the allocator's state as JSON in the saved cache's metadata ({e})") from None
    return PagedMLACache.from_layers(layers, state)


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
