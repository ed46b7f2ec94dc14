"""Host arrays to the device without synchronizing the stream (index arrays of decode steps, plan tables)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch


def index_tensor(values: Sequence[int] | np.ndarray, dtype: Any, device: torch.device) -> torch.Tensor:
    """``values`` as a torch ``dtype`` (NumPy dtype) tensor on ``device``, made on the host (:func:`to_device`)."""
    return to_device(torch.from_numpy(np.ascontiguousarray(values, dtype=dtype)), device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the GPU.

    On CUDA the host copy is pinned and sent with ``non_blocking=True``: a copy from pageable
    memory synchronizes the stream first (torch waits for every queued kernel), which a decode
    step that rebuilds its index arrays per layer would pay once per array and layer. torch's
    pinned-memory allocator keeps the host block until the copy has run."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
