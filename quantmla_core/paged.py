"""``PagedMLACache``: a page allocator and per-request lengths on top of :class:`MLACache`.

For users without a serving engine (the Hugging Face integration and the benchmarks use
it). It is deliberately simple: a free list of pages, one protection-buffer row per live
request, page tables rebuilt on demand. Allocators that the same operations built (one a
layer of a model) can share what a step's bookkeeping produces through a :class:`StepMemo`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import torch

from .api import attention as _attention
from .api import write as _write
from .cache import MLACache
from .formats import PackFormat
from .plan import AttentionPlan, cache_geometry
from .plan import plan_attention as _plan_attention
from .host_copy import index_tensor


class OutOfPagesError(RuntimeError):
    """Raised when an append needs more pages (or request rows) than are free."""


@dataclass(frozen=True)
class WritePlan:
    """Where the tokens of one :meth:`PagedMLACache.reserve` call go: the index arrays of
    ``quantmla_core.write`` (on the cache's device), shared by every layer."""

    slot_mapping: Any
    seq_ids: Any
    positions: Any
    seq_lens: Any
    num_tokens: int


class StepMemo:
    """The write plans, attention index arrays and attention plans of recent steps, shared by allocators that the
    same operations built: the per-layer :class:`PagedMLACache` objects of one model, which the Hugging Face
    integration drives in lockstep. The first layer to reach a step builds them and the others take them, so a step
    builds its index arrays once, not once a layer.

    Keys hold an allocator's :attr:`PagedMLACache.history`, which two allocators share only when the same
    operations, from the same sizes, built them; a key no allocator reaches again simply ages out. At most
    ``capacity`` entries are kept, the least recently used dropped first. ``hits`` / ``misses`` count lookups.
    """

    def __init__(self, capacity: int = 16):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity: expected an integer >= 1, got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value kept for ``key``, or ``make()``'s, then kept."""
        if key in self._entries:
            self.hits += 1
            self._entries.move_to_end(key)
            return self._entries[key]
        self.misses += 1
        value = self._entries[key] = make()
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()

    def drop_plans_of(self, caches: Sequence[MLACache]) -> None:
        """Drop the attention plans made over any of ``caches`` (a plan holds its cache's arrays, so a grown
        allocator's old arrays are freed at once, not when its plans age out)."""
        for key in [k for k, v in self._entries.items() if isinstance(v, AttentionPlan) and any(v.cache is c for c in caches)]:
            del self._entries[key]


class PagedMLACache:
    """Allocator-managed MLA cache of one or more layers that share one page table.

    Request ids are the protection-buffer rows (``0 .. max_seqs-1``). Arrays follow the
    cache's kind: torch tensors on ``device``, or NumPy with ``device="numpy"``. With
    ``num_layers > 1`` every layer has its own pages and buffers but the same page ids, so one
    :meth:`reserve` (bookkeeping) is followed by one :meth:`write` per layer.

    ``memo``: a :class:`StepMemo` shared with other allocators driven by the same operations (a model's per-layer
    caches); :meth:`reserve`, :meth:`attention` and :meth:`plan_attention` then take what another allocator already
    built for the same state. Their arrays and plans are shared, so callers must not write into them.
    """

    def __init__(
        self,
        fmt: PackFormat | str,
        num_pages: int,
        max_seqs: int,
        sink: int = 4,
        local: int = 128,
        device: str | torch.device = "cpu",
        protect_dtype: Any = None,
        backend: str = "auto",
        num_layers: int = 1,
        memo: StepMemo | None = None,
    ):
        fmt = PackFormat.parse(fmt) if isinstance(fmt, str) else fmt
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers: expected an integer >= 1, got {num_layers!r}")
        self.cache = MLACache.allocate(fmt, num_pages, max_seqs, sink, local, device, protect_dtype)
        self._more_layers = [
            MLACache.allocate(fmt, num_pages, max_seqs, sink, local, device, protect_dtype) for _ in range(num_layers - 1)
        ]
        self.backend = backend
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._free_rows: list[int] = list(range(max_seqs - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        if memo is not None and not isinstance(memo, StepMemo):
            raise TypeError(f"memo: expected a StepMemo or None, got {type(memo).__name__}")
        self.memo = memo
        self.history = hash(("allocate", num_pages, max_seqs) + cache_geometry(self.cache))

    def _advance(self, *operation: Hashable) -> None:
        """Fold a bookkeeping operation into :attr:`history`."""
        self.history = hash((self.history,) + operation)

    def _memo_key(self, kind: str, *parts: Hashable) -> tuple | None:
        """The :class:`StepMemo` key of what this state builds, or None (no memo, or unhashable parts)."""
        if self.memo is None:
            return None
        key = (kind, self.history) + parts  # the history holds the sizes, dtypes and device
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def _shared(self, key: tuple | None, make: Callable[[], Any]) -> Any:
        return make() if key is None else self.memo.get(key, make)

    # ------------------------------------------------------------------ bookkeeping
    @property
    def format(self) -> PackFormat:
        return self.cache.format

    @property
    def num_layers(self) -> int:
        return 1 + len(self._more_layers)

    def layer(self, index: int) -> MLACache:
        """The :class:`MLACache` of one layer (layer 0 is ``self.cache``)."""
        if not 0 <= index < self.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.num_layers}, got {index}")
        return self.cache if index == 0 else self._more_layers[index - 1]

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def active_requests(self) -> list[int]:
        return sorted(self._lens)

    def seq_len(self, seq_id: int) -> int:
        return self._lens[self._check_live(seq_id)]

    def pages_needed(self, seq_id: int | None, new_tokens: int) -> int:
        """Pages an append of ``new_tokens`` would take from the free list."""
        have = 0 if seq_id is None else len(self._pages[seq_id])
        length = 0 if seq_id is None else self._lens[seq_id]
        return max(0, -(-(length + new_tokens) // self.format.page_size) - have)

    def add_request(self) -> int:
        """Reserve a request row; returns its id."""
        if not self._free_rows:
            raise OutOfPagesError(f"max_seqs: all {self.cache.max_seqs} request rows are in use")
        seq_id = self._free_rows.pop()
        self._pages[seq_id], self._lens[seq_id] = [], 0
        self._advance("add_request")
        return seq_id

    def free(self, seq_id: int) -> None:
        """Release a request's pages and row."""
        self._check_live(seq_id)
        self._free_pages.extend(reversed(self._pages.pop(seq_id)))
        del self._lens[seq_id]
        self._free_rows.append(seq_id)
        self._advance("free", seq_id)

    def truncate(self, seq_id: int, length: int) -> None:
        """Shorten a request to its first ``length`` tokens; pages past them go back to the free list. The pages and
        sink rows keep what the removed tokens wrote (nothing reads past a request's length), but the local ring
        does not get back the older tokens the removed ones overwrote: a caller that rolls tokens back restores those
        ring rows itself (the Hugging Face integration's ``crop``)."""
        self._check_live(seq_id)
        if not 0 <= length <= self._lens[seq_id]:
            raise ValueError(f"length: expected 0 <= length <= {self._lens[seq_id]} (request {seq_id}), got {length}")
        pages = self._pages[seq_id]
        keep = -(-length // self.format.page_size)
        self._free_pages.extend(reversed(pages[keep:]))
        del pages[keep:]
        self._lens[seq_id] = length
        self._advance("truncate", seq_id, length)

    def fork(self, seq_id: int) -> int:
        """New request holding a copy of ``seq_id``'s tokens (pages and protection rows copied)."""
        self._check_live(seq_id)
        src = self._pages[seq_id]
        if len(src) > len(self._free_pages):
            raise OutOfPagesError(f"fork: needs {len(src)} pages, {len(self._free_pages)} free")
        new = self.add_request()
        dst = [self._free_pages.pop() for _ in src]
        for c in (self.layer(i) for i in range(self.num_layers)):
            for a, b in zip(src, dst):
                c.pages[b] = c.pages[a]
            c.sink_buf[new] = c.sink_buf[seq_id]
            c.local_buf[new] = c.local_buf[seq_id]
        self._pages[new], self._lens[new] = dst, self._lens[seq_id]
        self._advance("fork", seq_id)
        return new

    @property
    def pages_in_use(self) -> int:
        return self.cache.num_pages - len(self._free_pages)

    def grow(self, min_free_pages: int = 0, min_free_rows: int = 0, double: bool = True) -> None:
        """Ensure at least ``min_free_pages`` free pages and ``min_free_rows`` free request rows.

        Allocates bigger caches for every layer and copies pages and protection rows; page ids,
        request ids and contents are kept. With ``double`` the page count at least doubles when
        it grows (amortised growth). Arrays are replaced: re-read ``layer(i)`` afterwards.
        """
        need_p = max(0, min_free_pages - len(self._free_pages))
        need_r = max(0, min_free_rows - len(self._free_rows))
        if not need_p and not need_r:
            return
        old = self.cache
        old_layers = [self.layer(i) for i in range(self.num_layers)]
        add_p = max(need_p, old.num_pages if (double and need_p) else 0)
        grown = []
        for i in range(self.num_layers):
            src = self.layer(i)
            dst = MLACache.allocate(src.format, src.num_pages + add_p, src.max_seqs + need_r, src.sink, src.local,
                                    src.device, None if src.is_numpy else src.sink_buf.dtype)
            dst.pages[: src.num_pages] = src.pages
            dst.sink_buf[: src.max_seqs] = src.sink_buf
            dst.local_buf[: src.max_seqs] = src.local_buf
            grown.append(dst)
        self.cache, self._more_layers = grown[0], grown[1:]
        self._free_pages = list(range(old.num_pages + add_p - 1, old.num_pages - 1, -1)) + self._free_pages
        self._free_rows = list(range(old.max_seqs + need_r - 1, old.max_seqs - 1, -1)) + self._free_rows
        self._advance("grow", add_p, need_r)
        if self.memo is not None:
            self.memo.drop_plans_of(old_layers)

    def allocator_state(self) -> dict[str, Any]:
        """The allocator's bookkeeping as plain lists and dicts (JSON-friendly): free pages and request rows in the
        order they are handed out, each live request's pages and length, and the backend."""
        return {"free_pages": list(self._free_pages), "free_rows": list(self._free_rows),
                "pages": {str(s): list(p) for s, p in self._pages.items()},
                "lens": {str(s): n for s, n in self._lens.items()}, "backend": self.backend}

    @classmethod
    def from_layers(cls, layers: Sequence[MLACache], state: dict[str, Any]) -> "PagedMLACache":
        """A cache over ``layers`` (same format and sizes) with the bookkeeping of :meth:`allocator_state`;
        ``ValueError`` naming what is inconsistent (a page or row owned twice or by no one, a length that does not
        fit its pages)."""
        first = layers[0]
        p = first.format.page_size
        try:
            pages = {int(s): [int(x) for x in v] for s, v in state["pages"].items()}
            lens = {int(s): int(n) for s, n in state["lens"].items()}
            free_pages, free_rows = [int(x) for x in state["free_pages"]], [int(x) for x in state["free_rows"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"state: expected free_pages, free_rows, pages and lens as in allocator_state(), got {e!r}") from None
        owned = sorted(free_pages + [x for v in pages.values() for x in v])
        if owned != list(range(first.num_pages)):
            raise ValueError(f"state: every page 0..{first.num_pages - 1} must be free or owned by exactly one request")
        if sorted(free_rows + list(pages)) != list(range(first.max_seqs)) or sorted(lens) != sorted(pages):
            raise ValueError(f"state: every request row 0..{first.max_seqs - 1} must be free or live exactly once")
        for s, n in lens.items():
            if len(pages[s]) != -(-n // p):
                raise ValueError(f"state: request {s} holds {len(pages[s])} pages for {n} tokens of {p} a page")
        self = cls.__new__(cls)
        self.cache, self._more_layers = first, list(layers[1:])
        self.backend = state.get("backend", "auto")
        self._free_pages, self._free_rows, self._pages, self._lens = free_pages, free_rows, pages, lens
        self.memo = None
        self.history = hash(("restored", tuple(free_pages), tuple(free_rows), tuple(sorted((s, tuple(v)) for s, v in pages.items())),
                             tuple(sorted(lens.items()))) + cache_geometry(first))
        return self

    def _check_live(self, seq_id: int) -> int:
        if seq_id not in self._lens:
            raise ValueError(f"seq_id: expected a live request id in {self.active_requests}, got {seq_id}")
        return seq_id

    # ------------------------------------------------------------------ arrays
    def _index_array(self, values: Sequence[int] | np.ndarray, dtype=np.int64):
        if self.cache.is_numpy:
            return np.asarray(values, dtype=dtype)
        return index_tensor(values, dtype, self.cache.pages.device)

    def block_table(self, seq_ids: Sequence[int]):
        """int32 ``[B, max_pages]`` page table (padded with 0) of the given requests."""
        width = max([len(self._pages[self._check_live(s)]) for s in seq_ids] + [1])
        table = np.zeros((len(seq_ids), width), dtype=np.int32)
        for i, s in enumerate(seq_ids):
            table[i, : len(self._pages[s])] = self._pages[s]
        return self._index_array(table, np.int32)

    def seq_lens(self, seq_ids: Sequence[int]):
        return self._index_array([self._lens[self._check_live(s)] for s in seq_ids], np.int32)

    # ------------------------------------------------------------------ ops
    def append(self, seq_id: int, latent: Any, k_rope: Any) -> None:
        """Append ``latent [n, d_c]``, ``k_rope [n, d_r]`` to one request (one writer call)."""
        self.append_many([(seq_id, latent, k_rope)])

    def append_many(self, items: Sequence[tuple[int, Any, Any]]) -> None:
        """Append tokens to several requests with a single writer call (single-layer caches)."""
        if self.num_layers != 1:
            raise ValueError(f"append_many: this cache has {self.num_layers} layers; use reserve() then write(plan, ..., layer=i)")
        plan = self.reserve([(s, int(x.shape[0])) for s, x, _ in items])
        cat = np.concatenate if self.cache.is_numpy else torch.cat
        self.write(plan, cat([x for _, x, _ in items]), cat([r for _, _, r in items]))

    def reserve(self, items: Sequence[tuple[int, int]]) -> WritePlan:
        """Give ``n`` more tokens to each ``(seq_id, n)``: allocate pages, advance lengths, and
        return the slots for :meth:`write` (tokens in item order; a request may appear more than once).
        All-or-nothing."""
        items = tuple((self._check_live(s), int(n)) for s, n in items)
        p = self.format.page_size
        lens: dict[int, int] = {}  # the new lengths of the requests named, kept apart until the pages are there
        starts, takes = [], []  # each item's first position and the pages it takes
        for s, n in items:
            if n < 0:
                raise ValueError(f"items: expected token counts >= 0, got {n} for request {s}")
            start = lens.get(s, self._lens[s])
            lens[s] = start + n
            starts.append(start)
            takes.append(-(-(start + n) // p) - -(-start // p))  # a request holds ceil(length / P) pages
        if sum(takes) > len(self._free_pages):
            raise OutOfPagesError(f"append: needs {sum(takes)} pages, {len(self._free_pages)} free")
        key = self._memo_key("reserve", items)
        free = self._free_pages
        for (s, _), k in zip(items, takes):
            if k:
                self._pages[s].extend(free.pop() for _ in range(k))
        self._lens.update(lens)
        self._advance("reserve", items)
        return self._shared(key, lambda: self._write_plan(items, starts))

    def _write_plan(self, items: tuple[tuple[int, int], ...], starts: list[int]) -> WritePlan:
        """The index arrays of :meth:`reserve` once its pages are allocated: ``starts`` are the lengths before it."""
        p = self.format.page_size
        parts: list[tuple[np.ndarray, ...]] = []  # (slots, seq ids, positions) per item or run of items
        run: list[tuple[int, int, int]] = []  # consecutive one-token items (a decode step) as plain integers

        def close_run() -> None:
            if run:
                parts.append(tuple(np.array(col, dtype=np.int64) for col in zip(*run)))
                run.clear()

        for (seq_id, n), start in zip(items, starts):
            pages = self._pages[seq_id]
            if n == 1:
                run.append((pages[start // p] * p + start % p, seq_id, start))
            else:
                close_run()
                pos = np.arange(start, start + n)
                parts.append((np.asarray(pages, dtype=np.int64)[pos // p] * p + pos % p, np.full(n, seq_id), pos))
        close_run()
        slots, seqs, positions = (np.concatenate(col) for col in zip(*parts))
        lens = np.zeros(self.cache.max_seqs, dtype=np.int64)
        lens[list(self._lens)] = list(self._lens.values())
        return WritePlan(
            self._index_array(slots),
            self._index_array(seqs),
            self._index_array(positions),
            self._index_array(lens),
            int(slots.shape[0]),
        )

    def write(self, plan: WritePlan, latent: Any, k_rope: Any, layer: int = 0) -> None:
        """Write the planned tokens ``latent [n, d_c]``, ``k_rope [n, d_r]`` into one layer."""
        _write(
            self.layer(layer),
            latent,
            k_rope,
            slot_mapping=plan.slot_mapping,
            seq_ids=plan.seq_ids,
            positions=plan.positions,
            seq_lens=plan.seq_lens,
            backend=self.backend,
        )

    def _attention_arrays(self, seq_ids: Sequence[int]) -> dict[str, Any]:
        """``block_table``, ``seq_lens`` and ``seq_ids`` of an attention over ``seq_ids`` (shared through the memo)."""
        ids = tuple(seq_ids)

        def make() -> dict[str, Any]:
            return {"block_table": self.block_table(ids), "seq_lens": self.seq_lens(ids),
                    "seq_ids": self._index_array(list(ids), np.int32)}

        return self._shared(self._memo_key("arrays", ids), make)

    def attention(self, q_latent: Any, q_rope: Any, seq_ids: Sequence[int], softmax_scale: float, layer: int = 0, **kwargs):
        """Decode attention for ``seq_ids`` (one per row of q); see ``quantmla_core.attention``."""
        kwargs.setdefault("backend", self.backend)
        return _attention(q_latent, q_rope, self.layer(layer), softmax_scale=softmax_scale,
                          **self._attention_arrays(seq_ids), **kwargs)

    def plan_attention(self, seq_ids: Sequence[int], *, num_heads: int, q_dtype: Any, softmax_scale: float,
                       q_len: int | None = None, **kwargs) -> AttentionPlan:
        """One decode step's attention for ``seq_ids``, planned once for every layer
        (``quantmla_core.plan_attention``): ``plan.run(q_latent, q_rope, cache.layer(i))``. Plan
        again after the lengths change (every step)."""
        kwargs.setdefault("backend", self.backend)
        ids = tuple(seq_ids)

        def make() -> AttentionPlan:
            return _plan_attention(self.cache, **self._attention_arrays(ids), num_heads=num_heads, q_dtype=q_dtype,
                                   softmax_scale=softmax_scale, q_len=q_len, **kwargs)

        key = self._memo_key("plan", ids, num_heads, q_dtype, softmax_scale, q_len, tuple(sorted(kwargs.items())))
        return self._shared(key, make)

    def allocated_bytes(self) -> int:
        """Bytes allocated for pages and protection buffers of every layer."""
        return sum(self.layer(i).nbytes() for i in range(self.num_layers))
