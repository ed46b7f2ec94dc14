"""Host-side helpers shared by the Triton ops."""

from __future__ import annotations

import torch

from . import interpreting


def ptr_or_dummy(t: torch.Tensor) -> torch.Tensor:
    """A tensor usable as a kernel pointer: empty buffers (sink=0 / local=0) become a
    one-element stand-in that the kernel never touches (its masks are all false)."""
    return t if t.numel() > 0 else torch.zeros(1, dtype=t.dtype, device=t.device)


def launch_dims(num_warps: int, num_stages: int | None = None) -> dict:
    """Launch options; the interpreter ignores them, so none are passed there."""
    if interpreting():
        return {}
    out = {"num_warps": num_warps}
    if num_stages is not None:
        out["num_stages"] = num_stages
    return out
