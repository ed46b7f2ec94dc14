"""A second CUDA stream per device, for a launch that may run beside the one before it.

The CuPy and Triton launchers run their protected-token kernel there, concurrently with the split kernel
(under CUDA-graph capture the fork becomes a parallel branch of the graph); the merge waits for both.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
_LOCK = threading.Lock()


def side_stream(dev: int) -> torch.cuda.Stream:
    """The second stream of device ``dev``, made once (one per device and process)."""
    s = _SIDE_STREAMS.get(dev)
    if s is None:
        with _LOCK:
            s = _SIDE_STREAMS.setdefault(dev, torch.cuda.Stream(dev))
    return s


def fork_side_stream(dev: int) -> torch.cuda.Stream:
    """The side stream of ``dev``, ordered after the work queued so far on the current stream."""
    side = side_stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    return side


def join_side_stream(dev: int, side: torch.cuda.Stream) -> None:
    """Order the current stream's next work after everything queued on ``side``."""
    torch.cuda.current_stream(dev).wait_stream(side)


def launching_on(side: torch.cuda.Stream | None):
    """A context in which launches go to ``side`` (torch's and Triton's current stream); None: the current one."""
    return contextlib.nullcontext() if side is None else torch.cuda.stream(side)
