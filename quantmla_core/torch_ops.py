"""QuantMLA's write and attention as PyTorch custom operators, for models run under ``torch.compile``.

``quantmla_core.write`` / ``quantmla_core.attention`` take an :class:`~quantmla_core.cache.MLACache` and dispatch in
Python, which ``torch.compile`` cannot trace: it breaks the graph around every call (and ``fullgraph=True`` fails).
The operators here, ``torch.ops.quantmla.write`` and ``torch.ops.quantmla.attention`` (``torch.library.custom_op``),
take the cache as its tensors and the format as a string, declare what they mutate, and give ``torch.compile`` the
shapes of their outputs without running them, so a compiled decode step keeps them as single nodes of one graph::

    from quantmla_core import torch_ops

    @torch.compile(fullgraph=True)
    def step(cache, latent, k_rope, q_latent, q_rope, ...):
        torch_ops.write(cache, latent, k_rope, slot_mapping=..., seq_ids=..., positions=..., seq_lens=...)
        return torch_ops.attention(q_latent, q_rope, cache, block_table=..., seq_lens=..., seq_ids=..., softmax_scale=tau)

The wrappers :func:`write` and :func:`attention` take the same arguments as the public API and call the operators;
inside, the operators call that API (same checks, backends and results). Both run on every device the backends serve
(torch tensors only; a NumPy cache has no tensors to hand over). Neither has a gradient.
"""

from __future__ import annotations

import torch

from .api import attention as _attention
from .api import write as _write
from .backends.buffers import call_owned_scratch
from .cache import MLACache
from .formats import PackFormat
from .validation import check_cache

#: the operators' namespace: ``torch.ops.quantmla``
NAMESPACE = "quantmla"


def format_spec(fmt: PackFormat) -> str:
    """``fmt`` as the string the operators take (every field of :meth:`PackFormat.to_dict`), e.g.
    ``"C4R4/512/64/64/64/1"``: name / d_c / d_r / group size / page size / layout version."""
    d = fmt.to_dict()
    return "/".join(str(d[k]) for k in ("name", "latent_dim", "rope_dim", "group_size", "page_size", "version"))


def parse_format_spec(spec: str) -> PackFormat:
    """The :class:`PackFormat` of a :func:`format_spec` string; ``ValueError`` naming the expected form."""
    parts = spec.split("/")
    if len(parts) != 6 or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"format: expected 'NAME/d_c/d_r/group/page/version' (e.g. 'C4R4/512/64/64/64/1'), got {spec!r}")
    return PackFormat.parse(parts[0], *map(int, parts[1:]))


def _cache_of(fmt: str, pages: torch.Tensor, sink_buf: torch.Tensor, local_buf: torch.Tensor) -> MLACache:
    """The :class:`MLACache` over these tensors (no copy): ``sink_buf`` [max_seqs, sink, d_c + d_r], ``local_buf``
    [max_seqs, local, d_c + d_r]."""
    return MLACache(parse_format_spec(fmt), pages, sink_buf, local_buf, int(sink_buf.shape[0]), int(sink_buf.shape[1]),
                    int(local_buf.shape[1]))


@torch.library.custom_op(f"{NAMESPACE}::write", mutates_args=("pages", "sink_buf", "local_buf"))
def _write_op(pages: torch.Tensor, sink_buf: torch.Tensor, local_buf: torch.Tensor, latent: torch.Tensor,
              k_rope: torch.Tensor, slot_mapping: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor,
              seq_lens: torch.Tensor, fmt: str, backend: str) -> None:
    """:func:`quantmla_core.write` into the cache made of ``pages``, ``sink_buf`` and ``local_buf`` (``fmt``: a
    :func:`format_spec`)."""
    _write(_cache_of(fmt, pages, sink_buf, local_buf), latent, k_rope, slot_mapping=slot_mapping, seq_ids=seq_ids,
           positions=positions, seq_lens=seq_lens, backend=backend)


@_write_op.register_fake
def _write_fake(pages, sink_buf, local_buf, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens, fmt,
                backend) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::attention", mutates_args=())
def _attention_op(q_latent: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, sink_buf: torch.Tensor,
                  local_buf: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, seq_ids: torch.Tensor,
                  softmax_scale: float, fmt: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantmla_core.attention` over the cache made of ``pages``, ``sink_buf`` and ``local_buf``: (out shaped
    and typed like ``q_latent``, lse ``q_latent.shape[:-1]`` float32)."""
    # no workspace or prepared call kept across calls: under mode="reduce-overhead" the warm-up runs allocate from the
    # CUDA graphs' pool, where every live allocation must be one of the operator's outputs
    with call_owned_scratch():
        out, lse = _attention(q_latent, q_rope, _cache_of(fmt, pages, sink_buf, local_buf), block_table=block_table,
                              seq_lens=seq_lens, seq_ids=seq_ids, softmax_scale=softmax_scale, backend=backend)
    # an operator's outputs may not alias each other or its inputs (PyTorch checks), but under CUDA-graph capture the
    # CuPy backend carves out and lse from one allocation, so that its scratch lives as long as they do
    if _same_storage(out, lse):
        lse = lse.clone()
    return out, lse


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@_attention_op.register_fake
def _attention_fake(q_latent, q_rope, pages, sink_buf, local_buf, block_table, seq_lens, seq_ids, softmax_scale, fmt,
                    backend) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q_latent), q_latent.new_empty(q_latent.shape[:-1], dtype=torch.float32)


def _tensor_cache(cache: MLACache) -> MLACache:
    cache = check_cache(cache)
    if cache.is_numpy:
        raise TypeError("cache: expected an MLACache of torch tensors, got an MLACache of NumPy arrays")
    return cache


def write(cache: MLACache, latent: torch.Tensor, k_rope: torch.Tensor, *, slot_mapping: torch.Tensor,
          seq_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor, backend: str = "auto") -> None:
    """:func:`quantmla_core.write` through ``torch.ops.quantmla.write`` (same arguments and effect)."""
    c = _tensor_cache(cache)
    torch.ops.quantmla.write(c.pages, c.sink_buf, c.local_buf, latent, k_rope, slot_mapping, seq_ids, positions,
                             seq_lens, format_spec(c.format), backend)


def attention(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: MLACache, *, block_table: torch.Tensor,
              seq_lens: torch.Tensor, seq_ids: torch.Tensor, softmax_scale: float, backend: str = "auto",
              return_lse: bool = True):
    """:func:`quantmla_core.attention` through ``torch.ops.quantmla.attention`` (same arguments and results)."""
    c = _tensor_cache(cache)
    out, lse = torch.ops.quantmla.attention(q_latent, q_rope, c.pages, c.sink_buf, c.local_buf, block_table, seq_lens,
                                            seq_ids, float(softmax_scale), format_spec(c.format), backend)
    return (out, lse) if return_lse else out
