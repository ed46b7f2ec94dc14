"""Buffers that stay valid under CUDA-graph capture, shared by the GPU launchers.

A captured graph replays its kernels into the addresses they had at capture time. A temporary
allocated and freed inside the captured call (split partials, say) can be handed by the caching
allocator to a later allocation of the same capture, and every replay would then scribble over
it. :func:`carve` makes all the buffers of a call views of ONE allocation: they live as long as
any of them -- in practice as long as the outputs the caller keeps.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import torch

#: byte alignment of every view (covers vector loads and cp.async of 16 bytes, and cache lines)
ALIGN = 256


def carve(specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """One allocation holding a tensor per (shape, dtype) in ``specs``, each starting at a multiple
    of :data:`ALIGN` bytes; returned as views (uninitialised, like ``torch.empty``)."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    buf = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
    return [buf[o : o + n].view(dtype).view(shape) for (shape, dtype), o, n in zip(specs, offsets, sizes)]


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph (False without CUDA)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError):  # CPU-only builds
        return False


_CALL_OWNED = contextvars.ContextVar("quantmla_call_owned_scratch", default=False)


@contextlib.contextmanager
def call_owned_scratch() -> Iterator[None]:
    """Within: the launchers keep no allocation for a later call (no reused workspace, no kept prepared call or plan
    table); a call's scratch lives in its outputs' allocation or is freed when it returns. What torch.compile's CUDA
    graphs (``mode="reduce-overhead"``) ask of an operator in their warm-up runs, whose allocations come from the
    graphs' pool: every allocation it leaves alive must be one of its outputs."""
    token = _CALL_OWNED.set(True)
    try:
        yield
    finally:
        _CALL_OWNED.reset(token)


def owned_by_call() -> bool:
    """True within :func:`call_owned_scratch` (no CUDA query: for launchers that asked :func:`capturing` already)."""
    return _CALL_OWNED.get()


def nothing_kept() -> bool:
    """True where a call may keep no allocation for later calls: under CUDA-graph capture, or within
    :func:`call_owned_scratch`."""
    return owned_by_call() or capturing()
