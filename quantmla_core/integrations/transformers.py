"""Hugging Face ``transformers`` integration: ``generate()`` on a packed, low-bit MLA latent cache.

Two pieces::

    from quantmla_core.integrations.transformers import QuantMLACache, cache_kwarg, enable_quantmla

    handle = enable_quantmla(model, format="C4R4", sink=4, local=128)   # patch the MLA attention modules
    cache = QuantMLACache(model)                                          # format etc. from the handle
    out = model.generate(**inputs, max_new_tokens=64, **{cache_kwarg(model): cache})  # cache= (>= 5.2x) or past_key_values=
    print(cache.memory_report())                                          # real bytes vs BF16
    handle.disable()                                                      # back to the unmodified model

How a step runs, per MLA attention module (found with
``quantmla_core.calibration.adapters.find_mla_layers``, so every model family that adapter knows
is served the same way):

- **Prefill** (the layer's cache is still empty): the module's own ``forward`` runs unchanged, so
  attention over the prompt is computed from the fresh tokens in full precision, exactly as the
  unmodified model does. ``transformers`` hands the latent ``c = kv_a_layernorm(c_raw)``
  ``[B, 1, T, d_c]`` and the post-RoPE key ``k_rot [B, 1, T, d_r]`` to ``cache.update``; the
  :class:`QuantMLACache` layer writes the real (non-padding) tokens of every row to its
  :class:`~quantmla_core.PagedMLACache` in **one writer call**.
- **Decode** (the layer holds tokens; any number of new tokens per row): the absorbed form of
  DESIGN.md section 2 -- ``qc = q_nope @ W_UK`` (per head), the new tokens are written (one
  writer call), ``quantmla_core.attention`` runs on the packed pages plus the sink / local
  protection buffers with the module's softmax scale (``scaling``, YaRN's mscale^2 included),
  then ``W_UV`` and ``o_proj``. Queries and keys use the model's RoPE (``position_embeddings``)
  and its cached pair layout (``MLALayerSpec.apply_rope``).

Padding. ``transformers`` keeps one padded length for the whole batch (``get_seq_length``, masks);
the packed cache keeps only each row's real tokens, found from the attention mask at prefill, so
a left-padded batch gives every row the same cache as running it alone. Positions come from the
model (``position_ids`` derived from the attention mask), so RoPE is unaffected.

Transforms. A model whose QuantMLA transforms are already fused into its weights (calibration)
needs nothing more: its latent and RoPE key already live in the transformed coordinates. An
unfused model is quantized as it is (round-to-nearest). ``enable_quantmla(..., transforms=...)``
can fuse saved transforms first (in place; ``disable`` does not unfuse).

Requires a ``transformers`` version whose MLA modules cache the compressed latent through the
layered ``Cache`` API (5.x; ``DeepseekV2Attention``/``DeepseekV3Attention`` call
``cache.update(latent, k_rot, layer_idx)``).
"""

from __future__ import annotations

import inspect
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

try:
    import transformers as _hf  # noqa: F401  (the optional dependency)
    from transformers.cache_utils import Cache
except ImportError as _exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "quantmla_core.integrations.transformers needs the optional package 'transformers' "
        "(install it with: pip install 'quantmla[transformers]'); "
        f"importing it failed: {_exc}"
    ) from _exc

try:
    from transformers.cache_utils import CacheLayerMixin
except ImportError as _exc:  # pragma: no cover - old transformers
    raise ImportError(
        "quantmla_core.integrations.transformers needs a transformers version with the layered Cache API "
        f"(cache_utils.CacheLayerMixin, transformers >= 4.56; 5.x tested); found transformers {_hf.__version__}"
    ) from _exc

from ..formats import PackFormat
from ..host_copy import index_tensor, to_device
from ..paged import PagedMLACache, StepMemo

__all__ = [
    "QuantMLACache", "QuantMLALayer", "QuantMLAHandle", "enable_quantmla", "disable_quantmla", "cache_kwarg",
]

#: Query tokens per write + attention call in multi-token decode steps (DESIGN.md section 2 serves
#: S_q <= 16; a longer continuation of a cached sequence is processed in chunks of this size).
MAX_QUERY_CHUNK = 16
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")
_HANDLE_ATTR = "_quantmla_handle"


def cache_kwarg(model: nn.Module) -> str:
    """``model.generate``/``forward``'s cache keyword: ``"cache"`` (transformers >= 5.2x), else ``"past_key_values"``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _adapters():
    """``quantmla_core.calibration.adapters`` (imported lazily; it imports nothing optional)."""
    from ..calibration import adapters

    return adapters


def _value_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype handed to the writer / attention: bfloat16 stays, anything else becomes float32."""
    return dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32


# ---------------------------------------------------------------------------------------------
# the cache
# ---------------------------------------------------------------------------------------------
@dataclass
class _WriteUndo:
    """What one write changed, to take its last tokens back (:meth:`QuantMLALayer.crop`): the requests (``rows``),
    each one's length before it (``starts``), the tokens it wrote a row (``written``) and how many of them are still in
    the cache (``tokens``); with a local ring, ``slots`` [rows, window]: the ring rows of its last ``window`` positions,
    and ``prior`` [rows, window, d_c + d_r]: what each must hold once its position is gone (the token ``local``
    positions earlier: from the ring before the write, or from the write itself)."""

    rows: list[int]
    starts: list[int]
    written: int
    tokens: int
    slots: torch.Tensor | None = None
    prior: torch.Tensor | None = None

    @classmethod
    def record(cls, paged: PagedMLACache, items: list, t: int, local: int) -> "_WriteUndo":
        """Before ``paged`` writes ``t`` tokens to each of ``items`` (request, latent [t, d_c], k_rope [t, d_r])."""
        rows = [s for s, _, _ in items]
        starts = [paged.seq_len(s) for s in rows]
        if not local:
            return cls(rows, starts, t, t)
        m = min(t, local)
        ring = paged.cache.local_buf
        dev = ring.device
        a = torch.tensor(starts)[:, None]
        q = a + (t - m - local) + torch.arange(m)[None, :]  # [R, m] the positions the ring rows must hold again
        prior = torch.zeros((len(rows), m, ring.shape[-1]), dtype=ring.dtype, device=dev)
        in_ring, in_write = (q >= 0) & (q < a), q >= a
        if bool(in_ring.any()):  # host tensors: no sync
            r, i = in_ring.nonzero(as_tuple=True)
            prior[to_device(r, dev), to_device(i, dev)] = ring[to_device(torch.tensor(rows)[r], dev),
                                                             to_device(q[r, i] % local, dev)]
        if bool(in_write.any()):
            values = torch.stack([torch.cat([x, kr], -1) for _, x, kr in items]).to(ring.dtype)  # as the writers store
            r, i = in_write.nonzero(as_tuple=True)
            prior[to_device(r, dev), to_device(i, dev)] = values[to_device(r, dev), to_device(q[r, i] - a[r, 0], dev)]
        return cls(rows, starts, t, t, to_device((q + local) % local, dev), prior)

    def restore(self, paged: PagedMLACache, n: int) -> None:
        """Take the last ``n`` tokens still in the cache of this write back from every request."""
        keep = self.tokens - n
        if self.slots is not None:
            first = self.written - self.slots.shape[1]  # the window's first position, relative to the write
            lo, hi = keep - first, self.tokens - first
            rows = index_tensor(self.rows, np.int64, self.slots.device)[:, None]
            paged.cache.local_buf[rows, self.slots[:, lo:hi]] = self.prior[:, lo:hi]
        for s, a in zip(self.rows, self.starts):
            paged.truncate(s, a + keep)
        self.tokens = keep

    @property
    def removable(self) -> int:
        """Tokens of this write that can still be taken back (its last ``window`` positions with a ring)."""
        return self.tokens - (0 if self.slots is None else self.written - self.slots.shape[1])


def _removable(undo: list[_WriteUndo]) -> int:
    """Tokens the writes of ``undo`` can give back, last write first (an earlier write's only once the later ones
    are wholly gone)."""
    can = 0
    for u in reversed(undo):
        can += u.removable
        if u.removable < u.tokens:
            break
    return can


class QuantMLALayer(CacheLayerMixin):
    """One model layer's QuantMLA cache: a :class:`PagedMLACache` with one request per batch row.

    ``rows[b]`` is the request id (protection-buffer row) of batch row b. ``hf_len`` is the
    padded length ``transformers`` sees (same for every row); the pages hold only real tokens,
    so ``seq_lengths()`` may be shorter per row.
    """

    is_compileable = False
    is_croppable = False  # with rollback=True: the tokens of the last forward (crop)
    is_sliding = False
    supports_early_init = False

    def __init__(
        self,
        fmt: PackFormat,
        sink: int,
        local: int,
        backend: str,
        protect_dtype: Any = None,
        max_length: int | None = None,
        rollback: bool = False,
        memo: StepMemo | None = None,
    ) -> None:
        super().__init__()
        self.rollback = self.is_croppable = bool(rollback)
        self.format = fmt
        self.sink, self.local, self.backend = int(sink), int(local), backend
        self.protect_dtype = protect_dtype
        self.max_length = max_length
        self.memo = memo
        self.paged: PagedMLACache | None = None
        self.rows: list[int] = []
        self.hf_len = 0
        self.device: torch.device | None = None
        self._pending_valid: torch.Tensor | None = None
        self._undo: list[_WriteUndo] | None = []  # the last forward's writes (rollback); None: it cannot be undone

    def __repr__(self) -> str:
        return f"QuantMLALayer({_format_name(self.format)}, rows={len(self.rows)}, len={self.hf_len})"

    # ---------------------------------------------------------------- CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        """Bind the layer to a batch size and device (pages are allocated at the first write)."""
        self.device = key_states.device
        batch = int(key_states.shape[0])
        if self.paged is not None and self.paged.cache.pages.device != self.device:
            self.paged = None
        if self.paged is not None:
            self.paged.grow(0, batch)
        self.rows = [self.paged.add_request() for _ in range(batch)] if self.paged is not None else [-1] * batch
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Called by the model's own attention at prefill: store ``latent [B, 1, T, d_c]`` and
        ``k_rot [B, 1, T, d_r]`` (one writer call) and hand the fresh tokens back unchanged."""
        d_c, d_r = self.format.latent_dim, self.format.rope_dim
        if key_states.dim() != 4 or key_states.shape[1] != 1 or key_states.shape[-1] != d_c or value_states.shape[-1] != d_r:
            raise ValueError(
                f"QuantMLACache.update: expected the MLA latent [B, 1, T, {d_c}] and RoPE key [B, 1, T, {d_r}] "
                f"(transformers 5 MLA modules cache the compressed latent), got {tuple(key_states.shape)} and "
                f"{tuple(value_states.shape)}"
            )
        if self.hf_len > 0:
            raise RuntimeError(
                "QuantMLACache: decoding on a quantized cache needs the model's MLA attention to run the absorbed "
                "form; call quantmla_core.integrations.transformers.enable_quantmla(model) before generate()"
            )
        valid, self._pending_valid = self._pending_valid, None
        self.begin_step()
        self.write(key_states[:, 0], value_states[:, 0], valid)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.hf_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.hf_len

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # pages stay where they are
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        """Forget every request (pages are kept for reuse)."""
        if self.paged is not None:
            for s in self.rows:
                if s >= 0:
                    self.paged.free(s)
        self.rows, self.hf_len, self.is_initialized = [], 0, False
        self._undo = []

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers 5; a positive value is the length to keep, as
        transformers 4 passed it), with ``rollback=True`` only (:class:`QuantMLACache`). Tokens of the last forward
        can go, as assisted (speculative) generation removes the candidates it rejected: their pages go back to the
        free list, and the local-window ring rows they overwrote get back the older tokens they held.

        ``tokens_to_remove`` may be a 0-d integer tensor (transformers 5.17 assisted decoding passes
        ``-(candidate_length - n_matches)`` with ``n_matches`` a tensor): it is read as a Python int first: ``remove -= n``
        on a tensor would change ``n`` in place before ``hf_len`` takes it."""
        tokens_to_remove = int(tokens_to_remove)
        remove = self.hf_len - tokens_to_remove if tokens_to_remove > 0 else -tokens_to_remove
        if remove <= 0:
            return
        if not self.rollback:
            raise NotImplementedError("QuantMLACache.crop: make the cache with QuantMLACache(model, rollback=True) to "
                                      "remove tokens (assisted/speculative generation)")
        undo = self._undo
        can = _removable(undo or [])
        if undo is None or remove > can:
            raise NotImplementedError(
                f"QuantMLACache.crop: can remove {can} tokens (of the last forward: up to local={self.local} of each "
                f"write, and none of a forward with padding in it), asked to remove {remove}")
        while remove:
            n = min(remove, undo[-1].removable)
            undo[-1].restore(self.paged, n)
            remove -= n
            self.hf_len -= n
            if undo[-1].tokens == 0:
                undo.pop()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reindex([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reindex([b for b in range(len(self.rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex([int(i) for i in torch.as_tensor(indices).tolist()])

    # ---------------------------------------------------------------- QuantMLA ops
    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def seq_lengths(self) -> list[int]:
        """Real (unpadded) tokens held per batch row."""
        if self.paged is None:
            return [0] * len(self.rows)
        return [self.paged.seq_len(s) for s in self.rows]

    def _ensure_paged(self, batch: int, pages: int) -> None:
        """Allocate the page pool at the first write: ``pages`` (what the write needs) or the
        ``max_length`` reservation, whichever is larger."""
        if self.paged is not None:
            return
        assert self.device is not None
        if self.max_length:
            pages = max(pages, batch * -(-int(self.max_length) // self.format.page_size))
        self.paged = PagedMLACache(
            self.format, max(1, pages), max(1, batch), self.sink, self.local, self.device, self.protect_dtype, self.backend,
            memo=self.memo,
        )
        self.rows = [self.paged.add_request() for _ in range(batch)]

    def write(self, latent: torch.Tensor, k_rope: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Append ``latent [B, T, d_c]``, ``k_rope [B, T, d_r]`` (rows where ``valid [B, T]`` is True,
        all when None) with one writer call; advances the padded length by T."""
        if not self.is_initialized:
            self.lazy_initialization(latent)
        batch, t = int(latent.shape[0]), int(latent.shape[1])
        if batch != len(self.rows):
            raise ValueError(f"QuantMLACache: batch size changed from {len(self.rows)} to {batch} without reset()")
        dt = _value_dtype(latent.dtype)
        latent, k_rope = latent.to(dt), k_rope.to(dt)
        if valid is None and not self.rollback and self.paged is not None:
            self._write_every_row(latent, k_rope)
            return
        per_row: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (batch row, latent, k_rope)
        if valid is None:
            per_row = [(b, latent[b], k_rope[b]) for b in range(batch)]
        else:
            keep = valid.to(device="cpu", dtype=torch.bool)
            for b in range(batch):
                if bool(keep[b].all()):
                    per_row.append((b, latent[b], k_rope[b]))
                elif bool(keep[b].any()):
                    idx = torch.nonzero(keep[b]).flatten().to(latent.device)
                    per_row.append((b, latent[b].index_select(0, idx), k_rope[b].index_select(0, idx)))
        if per_row:
            p = self.format.page_size
            self._ensure_paged(batch, sum(-(-int(x.shape[0]) // p) for _, x, _ in per_row))
            paged = self.paged
            items = [(self.rows[b], x, r) for b, x, r in per_row]
            self._make_room([(s, int(x.shape[0])) for s, x, _ in items])
            self._record_undo(items, t, batch)
            paged.append_many(items)
        self.hf_len += t

    def _write_every_row(self, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
        """All ``t`` tokens of every row (a decode step without rollback): one reservation in row order, and the
        ``[B, t, d]`` tensors go to the writer as ``[B * t, d]`` without a slice and a copy per row."""
        t = int(latent.shape[1])
        paged = self.paged
        items = [(s, t) for s in self.rows]
        self._make_room(items)
        paged.write(paged.reserve(items), latent.reshape(-1, latent.shape[-1]), k_rope.reshape(-1, k_rope.shape[-1]))
        self.hf_len += t

    def _make_room(self, counts: list[tuple[int, int]]) -> None:
        """Grow the page pool (doubling when short) so that every ``(request, tokens)`` of ``counts`` fits."""
        paged = self.paged
        paged.grow(sum(paged.pages_needed(s, n) for s, n in counts), 0)

    def begin_step(self) -> None:
        """A forward starts: what :meth:`crop` may take back is its writes (the prefill, or a decode step's chunks)."""
        self._undo = []

    def _record_undo(self, items: list, t: int, batch: int) -> None:
        """With ``rollback``, note what this write changes so that :meth:`crop` can take it back, where every one of
        the ``batch`` rows gets all ``t`` tokens (otherwise this forward cannot be taken back)."""
        if not self.rollback or self._undo is None:
            return
        if len(items) != batch or any(int(x.shape[0]) != t for _, x, _ in items):
            self._undo = None
            return
        self._undo.append(_WriteUndo.record(self.paged, items, t, self.local))

    def attend(self, q_latent: torch.Tensor, q_rope: torch.Tensor, softmax_scale: float) -> torch.Tensor:
        """Causal attention of ``q [B, S, H, d]`` (the last S tokens of every row, just written) over
        the packed cache and protection buffers; returns ``[B, S, H, d_c]`` in the query dtype.

        S is at most :data:`MAX_QUERY_CHUNK` per call (longer steps are split by the caller, each
        chunk written before it attends, so the local ring always matches the lengths passed). The step's plan is
        made by the first layer to attend and run by every layer (:class:`~quantmla_core.paged.StepMemo`)."""
        assert self.paged is not None
        _, s_q, heads, _ = q_latent.shape
        plan = self.paged.plan_attention(self.rows, num_heads=int(heads), q_dtype=q_latent.dtype,
                                         softmax_scale=softmax_scale, q_len=int(s_q))
        return plan.run(q_latent, q_rope, self.paged.cache, return_lse=False)

    def _reindex(self, indices: list[int]) -> None:
        """New batch row i continues old row ``indices[i]`` (duplicates are forked, unused rows freed)."""
        self._undo = None
        if self.paged is None:
            self.rows = [self.rows[i] for i in indices] if self.rows else []
            return
        old = self.rows
        used = set(indices)
        for b, s in enumerate(old):
            if b not in used:
                self.paged.free(s)
        seen: set[int] = set()
        forks = [i for i in indices if i in seen or seen.add(i)]  # type: ignore[func-returns-value]
        pages = sum(self.paged.pages_needed(None, self.paged.seq_len(old[i])) for i in forks)
        self.paged.grow(pages, len(forks))
        seen.clear()
        rows = []
        for i in indices:
            if i in seen:
                rows.append(self.paged.fork(old[i]))
            else:
                seen.add(i)
                rows.append(old[i])
        self.rows = rows

    # ---------------------------------------------------------------- bytes
    def allocated_bytes(self) -> int:
        return 0 if self.paged is None else self.paged.allocated_bytes()

    def used_bytes(self) -> int:
        """Pages holding tokens plus the protection rows of the live requests."""
        if self.paged is None:
            return 0
        c = self.paged.cache
        row = int(c.sink_buf[0].numel() * c.sink_buf.element_size() + c.local_buf[0].numel() * c.local_buf.element_size())
        return self.paged.pages_in_use * self.format.page_bytes + len(self.rows) * row


class QuantMLACache(Cache):
    """A ``transformers`` ``Cache`` whose layers keep the MLA latent as packed low-bit pages.

    Args:
        model: the (enabled) model; format, sink, local, backend and dims default to what
            :func:`enable_quantmla` recorded on it. Either ``model`` or ``config`` is required.
        config: a model config instead of a model (``kv_lora_rank``, ``qk_rope_head_dim``,
            ``num_hidden_layers``).
        format: ``"C4R4"``, ``"C2R4"``, ``"C8R8"``, ``"BF16"``, ... or a :class:`PackFormat`.
        sink, local: protected tokens per request (DESIGN.md section 3.5).
        backend: ``"auto"``, ``"torch"``, ``"triton"``, ...
        max_length: tokens per row to reserve pages for up front (prompt + new tokens); without
            it pages are allocated at prefill and doubled when they run out.
        protect_dtype: protection-buffer dtype (bfloat16 default; float32 allowed on CPU).
        page_size, group_size: page tokens (16/32/64/128) and quantization group.
        rollback: let :meth:`crop` take back the tokens of the last forward (assisted / speculative generation:
            ``generate(..., assistant_model=...)`` or ``prompt_lookup_num_tokens=...``), up to ``local`` a row. It
            snapshots the local-window ring rows each write overwrites (a few small copies per layer and step), so it
            is off by default.

    One layer per decoder layer, each a :class:`QuantMLALayer` over its own
    :class:`~quantmla_core.PagedMLACache`; the layers' allocators share one
    :class:`~quantmla_core.paged.StepMemo` (``memo``), so a step's index arrays and attention plan are built by the
    first layer and reused by the rest. Any batch size, left padding and generation length.
    Memory: :meth:`allocated_bytes` (the real tensors), :meth:`used_bytes`, :meth:`bf16_bytes`
    and :meth:`memory_report`.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        config: Any = None,
        format: str | PackFormat | None = None,  # noqa: A002 - the issue's name
        sink: int | None = None,
        local: int | None = None,
        backend: str | None = None,
        max_length: int | None = None,
        protect_dtype: Any = None,
        page_size: int | None = None,
        group_size: int | None = None,
        rollback: bool = False,
    ) -> None:
        handle: QuantMLAHandle | None = getattr(model, _HANDLE_ATTR, None) if model is not None else None
        if model is None and config is None:
            raise ValueError("QuantMLACache: expected a model or a config, got neither")
        cfg = _adapters().text_config(config if config is not None else model.config)
        d_c, d_r = int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
        n_layers = int(cfg.num_hidden_layers)
        if model is not None:
            specs = handle.specs if handle is not None else _adapters().find_mla_layers(model)
            if specs:
                d_c, d_r = specs[0].d_c, specs[0].d_r
                n_layers = max(n_layers, max(s.layer_idx for s in specs) + 1)
        opts = handle.options if handle is not None else {}

        def pick(name: str, value: Any, default: Any) -> Any:
            return value if value is not None else opts.get(name, default)

        fmt = pick("format", format, "C4R4")
        page_size = pick("page_size", page_size, 64)
        group_size = pick("group_size", group_size, 64)
        if isinstance(fmt, str):
            fmt = PackFormat.parse(fmt, latent_dim=d_c, rope_dim=d_r, group_size=group_size, page_size=page_size)
        elif not isinstance(fmt, PackFormat):
            raise TypeError(f"format: expected a format name like 'C4R4' or a PackFormat, got {type(fmt).__name__}")
        if (fmt.latent_dim, fmt.rope_dim) != (d_c, d_r):
            raise ValueError(f"format: expected latent_dim={d_c}, rope_dim={d_r} (the model's), got {fmt.latent_dim}, {fmt.rope_dim}")
        self.format = fmt
        self.sink = int(pick("sink", sink, 4))
        self.local = int(pick("local", local, 128))
        self.backend = pick("backend", backend, "auto")
        self.protect_dtype = pick("protect_dtype", protect_dtype, None)
        if max_length is not None and int(max_length) < 1:
            raise ValueError(f"max_length: expected a positive token count, got {max_length}")
        self.memo = StepMemo()  # the layers' allocators run the same operations: a step's index arrays are built once
        layers = [
            QuantMLALayer(fmt, self.sink, self.local, self.backend, self.protect_dtype, max_length, rollback, self.memo)
            for _ in range(n_layers)
        ]
        super().__init__(layers=layers)
        self._valid_memo: tuple[Any, int, int, torch.Tensor | None] | None = None

    def __repr__(self) -> str:
        return (
            f"QuantMLACache(format={_format_name(self.format)}, sink={self.sink}, local={self.local}, "
            f"backend={self.backend!r}, layers={len(self.layers)}, seq_length={self.get_seq_length()})"
        )

    # ---------------------------------------------------------------- padding
    def token_validity(self, attention_mask: Any, past: int, q_len: int) -> torch.Tensor | None:
        """``[B, q_len]`` bool: which of the step's new tokens are real (not padding), read from the
        mask the model passes its attention (4-D bool/additive, or 2-D flash-style); None when
        every token is real or the mask cannot say. Memoized per step (all layers share the mask)."""
        memo = self._valid_memo
        if memo is not None and memo[0] is attention_mask and memo[1] == past and memo[2] == q_len:
            return memo[3]
        valid = _token_validity(attention_mask, past, q_len)
        self._valid_memo = (attention_mask, past, q_len, valid)
        return valid

    # ---------------------------------------------------------------- reporting
    def seq_lengths(self, layer_idx: int = 0) -> list[int]:
        """Real tokens cached per batch row (padding excluded)."""
        return self.layers[layer_idx].seq_lengths()

    def allocated_bytes(self) -> int:
        """Bytes of every tensor the cache allocated (pages and protection buffers, all layers)."""
        return sum(layer.allocated_bytes() for layer in self.layers)

    def used_bytes(self) -> int:
        """Bytes of the pages holding tokens plus the live requests' protection rows, all layers."""
        return sum(layer.used_bytes() for layer in self.layers)

    def bf16_bytes(self) -> int:
        """Bytes the same tokens take in an unquantized BF16 latent cache, ``(d_c + d_r) * 2`` per
        token and layer (what the BF16 ``DynamicCache`` of transformers holds, without padding)."""
        width = self.format.latent_dim + self.format.rope_dim
        return sum(sum(layer.seq_lengths()) * width * 2 for layer in self.layers)

    def memory_report(self) -> dict[str, Any]:
        """Bytes and ratios: ``allocated_bytes``, ``used_bytes``, ``bf16_bytes``, ``tokens``,
        ``bytes_per_token`` (used, per layer) and ``compression`` (bf16 / used)."""
        used, bf16 = self.used_bytes(), self.bf16_bytes()
        tokens = sum(self.seq_lengths()) if self.layers else 0
        n = max(1, len(self.layers))
        return {
            "format": _format_name(self.format),
            "sink": self.sink,
            "local": self.local,
            "layers": len(self.layers),
            "tokens": tokens,
            "allocated_bytes": self.allocated_bytes(),
            "used_bytes": used,
            "bf16_bytes": bf16,
            "bytes_per_token": used / n / tokens if tokens else 0.0,
            "compression": bf16 / used if used else 0.0,
        }


def _format_name(fmt: PackFormat) -> str:
    return fmt.name


def _token_validity(mask: Any, past: int, q_len: int) -> torch.Tensor | None:
    if isinstance(mask, Mapping):
        mask = mask.get("full_attention", next(iter(mask.values()), None))
    if mask is None or not torch.is_tensor(mask):
        return None
    if mask.dim() == 2:  # flash-attention style [B, kv] (1 = real token)
        if mask.shape[-1] < past + q_len:
            return None
        valid = mask[:, past : past + q_len].bool()
    elif mask.dim() == 4:
        if mask.shape[-1] < past + q_len:
            return None
        cols = mask[:, :, :, past : past + q_len]
        if cols.dtype == torch.bool:
            allowed = cols
        else:
            allowed = cols > torch.finfo(cols.dtype).min / 2
        valid = allowed.any(dim=2).any(dim=1)  # a real key is seen by at least its own query
    else:
        return None
    return None if bool(valid.all()) else valid


# ---------------------------------------------------------------------------------------------
# patching the attention modules
# ---------------------------------------------------------------------------------------------
@dataclass
class QuantMLAHandle:
    """What :func:`enable_quantmla` did to a model; :meth:`disable` undoes the patching.

    ``options`` (format, sink, local, backend, protect_dtype, page_size, group_size) are the
    defaults of :class:`QuantMLACache` built for this model; ``specs`` the patched layers.
    """

    model_ref: Any
    specs: list
    options: dict[str, Any]
    _saved: list[tuple[nn.Module, bool, Any]] = field(default_factory=list)
    enabled: bool = True
    fused_transforms: bool = False

    @property
    def model(self) -> nn.Module | None:
        return self.model_ref()

    def new_cache(self, **kwargs: Any) -> QuantMLACache:
        """A :class:`QuantMLACache` for this model (keyword arguments override the options)."""
        model = self.model
        if model is None:
            raise RuntimeError("QuantMLAHandle.new_cache: the model no longer exists")
        return QuantMLACache(model, **kwargs)

    def disable(self) -> None:
        """Restore the original attention ``forward`` of every patched module (fused transforms stay)."""
        if not self.enabled:
            return
        for module, had_own, old in self._saved:
            if had_own:
                module.forward = old
            else:
                module.__dict__.pop("forward", None)
        self._saved.clear()
        self.enabled = False
        model = self.model
        if model is not None and getattr(model, _HANDLE_ATTR, None) is self:
            delattr(model, _HANDLE_ATTR)

    def __enter__(self) -> "QuantMLAHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.disable()


def _fuse_transforms(model: nn.Module, specs: list, transforms: Any) -> None:
    from .. import transforms as tr

    if isinstance(transforms, (str, os.PathLike)):
        content, rope, _ = tr.load_transforms(transforms)
    elif isinstance(transforms, Mapping):
        content, rope = transforms.get("content"), transforms.get("rope")
    elif isinstance(transforms, (tuple, list)) and len(transforms) >= 2:
        content, rope = transforms[0], transforms[1]
    else:
        raise TypeError(
            "transforms: expected None, a directory saved by quantmla_core.transforms.save_transforms, "
            f"a (content, rope) pair of {{layer_idx: transform}} dicts or a dict with those keys, got {type(transforms).__name__}"
        )
    with torch.no_grad():
        tr.fuse(specs, content, rope)


def enable_quantmla(
    model: nn.Module,
    format: str | PackFormat = "C4R4",  # noqa: A002 - the issue's name
    sink: int = 4,
    local: int = 128,
    backend: str = "auto",
    transforms: Any = None,
    *,
    protect_dtype: Any = None,
    page_size: int = 64,
    group_size: int = 64,
) -> QuantMLAHandle:
    """Make the model's MLA attention modules decode with the absorbed form on a :class:`QuantMLACache`.

    Patches (per instance, nothing global) the ``forward`` of every MLA attention module found by
    ``quantmla_core.calibration.adapters.find_mla_layers``. With a :class:`QuantMLACache` passed
    to ``generate``/``forward`` (``cache=`` or ``past_key_values=``), prefill runs the module's own
    full-precision attention and writes the prompt to the packed cache in one writer call; later
    steps run ``q_nope @ W_UK -> quantmla_core.attention -> W_UV -> o_proj``. With any other cache
    (or none) the module behaves exactly as before.

    ``format``/``sink``/``local``/``backend``/``protect_dtype``/``page_size``/``group_size`` become
    the defaults of ``QuantMLACache(model)``. ``transforms``: None (use the weights as they are:
    already fused, or round-to-nearest), a directory written by
    ``quantmla_core.transforms.save_transforms``, or ``(content, rope)`` dicts keyed by layer index;
    given transforms are fused into the weights in place first. Returns a :class:`QuantMLAHandle`
    (``disable()`` restores the modules; also a context manager).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a transformers model (torch.nn.Module), got {type(model).__name__}")
    specs = _adapters().find_mla_layers(model)
    if not specs:
        raise ValueError(f"model: no MLA attention modules found in {type(model).__name__}")
    fmt_obj = format
    if isinstance(format, str):  # validate the name now, with the model's dims
        fmt_obj = PackFormat.parse(format, latent_dim=specs[0].d_c, rope_dim=specs[0].d_r, group_size=group_size, page_size=page_size)
    elif not isinstance(format, PackFormat):
        raise TypeError(f"format: expected a format name like 'C4R4' or a PackFormat, got {type(format).__name__}")
    for arg, v in (("sink", sink), ("local", local)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{arg}: expected an integer >= 0, got {v!r}")
    old = getattr(model, _HANDLE_ATTR, None)
    if isinstance(old, QuantMLAHandle):
        old.disable()
    handle = QuantMLAHandle(
        model_ref=weakref.ref(model),
        specs=specs,
        options=dict(
            format=fmt_obj, sink=sink, local=local, backend=backend, protect_dtype=protect_dtype,
            page_size=page_size, group_size=group_size,
        ),
    )
    if transforms is not None:
        _fuse_transforms(model, specs, transforms)
        handle.fused_transforms = True
    for spec in specs:
        module = spec.attn
        had_own = "forward" in module.__dict__
        original = module.forward
        handle._saved.append((module, had_own, module.__dict__.get("forward")))
        module.forward = _make_forward(spec, original)
    setattr(model, _HANDLE_ATTR, handle)
    return handle


def disable_quantmla(model: nn.Module) -> None:
    """Undo :func:`enable_quantmla` on ``model`` (no-op when not enabled)."""
    handle = getattr(model, _HANDLE_ATTR, None)
    if isinstance(handle, QuantMLAHandle):
        handle.disable()


def _make_forward(spec: Any, original: Any):
    """The patched ``forward`` of one MLA attention module."""
    sig = inspect.signature(original)
    positional = [
        p.name
        for p in sig.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ][1:]  # after hidden_states
    accepted = set(sig.parameters)
    cache_name = next((n for n in _CACHE_KWARGS if n in accepted), "cache")

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        if args:
            kwargs.update(zip(positional, args))
        cache = None
        for n in _CACHE_KWARGS:
            if kwargs.get(n) is not None:
                cache = kwargs.pop(n)
                break
        kwargs[cache_name] = cache
        if not isinstance(cache, QuantMLACache):
            return original(hidden_states, **kwargs)
        layer = cache.layers[spec.layer_idx]
        if not isinstance(layer, QuantMLALayer):
            raise TypeError(f"QuantMLACache layer {spec.layer_idx}: expected a QuantMLALayer, got {type(layer).__name__}")
        t = int(hidden_states.shape[1])
        valid = cache.token_validity(kwargs.get("attention_mask"), layer.hf_len, t)
        if layer.hf_len == 0:
            # prefill: the module's own full-precision attention over the fresh tokens; its
            # cache.update() call writes them (valid ones only) to the pages in one writer call
            layer._pending_valid = valid
            try:
                return original(hidden_states, **kwargs)
            finally:
                layer._pending_valid = None
        if valid is not None:
            raise ValueError(
                "attention_mask: QuantMLACache needs every token after the prompt to be real (padding only at "
                "prefill, e.g. left padding); the mask marks some new tokens as padding"
            )
        layer.begin_step()  # what crop() may take back: this forward's writes
        return _absorbed_forward(spec, layer, hidden_states, kwargs.get("position_embeddings"))

    forward.__wrapped_quantmla__ = original  # type: ignore[attr-defined]
    return forward


def _absorbed_forward(spec: Any, layer: QuantMLALayer, hidden_states: torch.Tensor, position_embeddings: Any):
    """Absorbed MLA over the packed cache for ``hidden_states [B, T, hidden]`` -> ``([B, T, hidden], None)``."""
    if position_embeddings is None:
        raise ValueError("position_embeddings: the MLA module got none; QuantMLA needs the model's RoPE tables")
    bsz, t, _ = hidden_states.shape
    h, dn, dr, dv, dc = spec.num_heads, spec.qk_nope_head_dim, spec.d_r, spec.v_head_dim, spec.d_c
    if spec.q_lora_rank is None:
        q = spec.q_proj(hidden_states)
    else:
        q = spec.q_b_proj(spec.q_a_layernorm(spec.q_a_proj(hidden_states)))
    q = q.view(bsz, t, h, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    kv = spec.kv_a_proj_with_mqa(hidden_states)
    latent = spec.kv_a_layernorm(kv[..., :dc])
    k_pe = kv[..., dc:]
    if spec.latent_scale != 1.0:
        latent = latent * spec.latent_scale
    if spec.query_scale != 1.0:
        q_nope, q_pe = q_nope * spec.query_scale, q_pe * spec.query_scale
    q_rot = spec.apply_rope(q_pe.transpose(1, 2), position_embeddings).transpose(1, 2)  # [B, T, H, d_r] f32
    k_rot = spec.apply_rope(k_pe.unsqueeze(1), position_embeddings)[:, 0]  # [B, T, d_r] f32

    w = spec.kv_b_proj.weight.view(h, dn + dv, dc)
    cdt = _value_dtype(w.dtype)
    q_latent = torch.einsum("bthn,hnc->bthc", q_nope.to(cdt), w[:, :dn].to(cdt))
    k_rot = k_rot.to(_value_dtype(latent.dtype))
    q_rot = q_rot.to(cdt)
    outs = []
    for a in range(0, t, MAX_QUERY_CHUNK):  # one writer call and one attention call per chunk
        b = min(t, a + MAX_QUERY_CHUNK)
        layer.write(latent[:, a:b], k_rot[:, a:b], None)
        outs.append(layer.attend(q_latent[:, a:b].contiguous(), q_rot[:, a:b].contiguous(), spec.softmax_scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [B, T, H, d_c]
    o = torch.einsum("bthc,hvc->bthv", out.to(w.dtype), w[:, dn:])
    bias = getattr(spec.kv_b_proj, "bias", None)
    if bias is not None:  # the key bias shifts every score of a head equally; the value bias survives
        o = o + bias.view(h, dn + dv)[:, dn:]
    o_proj = spec.o_proj
    return o_proj(o.reshape(bsz, t, h * dv).to(o_proj.weight.dtype)), None
