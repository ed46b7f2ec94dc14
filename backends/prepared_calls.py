"""Prepared attention calls kept for reuse, shared by the GPU launchers' eager paths.

A launcher's ``prepare`` decides everything of a call that does not depend on the queries (kernel variant, launch
plan, constants) from the index tensors, the cache geometry, the query shape and the ``QUANTMLA_*`` variables it
reads. Deciding it again on every eager call is host time a decode step pays per layer; :func:`reuse_or_prepare` keeps
the result while nothing it was made from changed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..envvars import recording, snapshot

_LOCK = threading.Lock()


def reuse_or_prepare(kept: dict, key: tuple, keep: int, make: Callable[[], Any], holds: Callable[[Any], bool]) -> Any:
    """The call ``kept[key]`` holds while the variables ``make`` read when it was made hold the same values
    (:func:`~quantmla_core.envvars.recording`, :func:`~quantmla_core.envvars.snapshot`); else ``make()``, kept under
    ``key`` where ``holds(call)`` (it holds the caller's index tensors themselves, whose identities ``key`` names,
    not copies of this call's values). At most ``keep`` calls are kept, the oldest dropped first."""
    entry = kept.get(key)
    if entry is not None and snapshot(entry[0]) == entry[1]:
        return entry[2]
    with recording() as read:
        call = make()
    if holds(call):
        names = tuple(dict.fromkeys(read))
        with _LOCK:
            kept.pop(key, None)
            kept[key] = (names, snapshot(names), call)
            while len(kept) > keep:
                kept.pop(next(iter(kept)))
    return call


def call_key(cache, block_table, seq_lens, seq_ids) -> tuple:
    """The part of a kept call's key every launcher shares: the index tensors' identities (a kept call holds them, so
    the ids stay theirs), shapes and strides, and the cache's geometry (any layer's cache of it serves the call)."""
    return (id(block_table), block_table.shape, block_table.stride(), id(seq_lens), seq_lens.shape, seq_lens.stride(),
            id(seq_ids), seq_ids.shape, seq_ids.stride(), cache.format, cache.pages.device, cache.pages.shape[0],
            cache.max_seqs, cache.sink, cache.local, cache.sink_buf.dtype)
