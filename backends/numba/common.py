"""Host-side helpers of the Numba backend: the layout vector handed to the kernels and
zero-copy NumPy views of CPU tensors. Imports no numba."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...formats import PackFormat

# Slots of the int64 layout vector built by :func:`layout_vector` (kernels index it with these).
L_P, L_DC, L_DR, L_QUANT, L_BC, L_BR, L_GC, L_GR, L_NGC, L_NGR = range(10)
L_OFF_CC, L_OFF_RC, L_OFF_CS, L_OFF_CZ, L_OFF_RS, L_OFF_RZ, L_CC_BYTES, L_RC_BYTES = range(10, 18)
LAYOUT_LEN = 18


def layout_vector(fmt: PackFormat) -> np.ndarray:
    """int64 ``[LAYOUT_LEN]``: every size and byte offset the kernels need, read from ``fmt``.

    BF16 formats set the bit widths to 16 and the scale/zero slots to 0 (no such sections).
    """
    lay = np.zeros(LAYOUT_LEN, np.int64)
    lay[L_P], lay[L_DC], lay[L_DR] = fmt.page_size, fmt.latent_dim, fmt.rope_dim
    lay[L_QUANT] = int(fmt.quantized)
    lay[L_BC], lay[L_BR] = fmt.content_bits, fmt.rope_bits
    lay[L_OFF_CC], lay[L_OFF_RC] = fmt.content_codes_offset, fmt.rope_codes_offset
    lay[L_CC_BYTES], lay[L_RC_BYTES] = fmt.content_code_bytes, fmt.rope_code_bytes
    if fmt.quantized:
        lay[L_GC], lay[L_GR] = fmt.content_group_size, fmt.rope_group_size
        lay[L_NGC], lay[L_NGR] = fmt.content_groups, fmt.rope_groups
        lay[L_OFF_CS], lay[L_OFF_CZ] = fmt.content_scales_offset, fmt.content_zeros_offset
        lay[L_OFF_RS], lay[L_OFF_RZ] = fmt.rope_scales_offset, fmt.rope_zeros_offset
        # the kernels address scales as whole uint16 / float32 elements of the page row
        assert fmt.content_scale_bytes == 2 * fmt.content_groups and fmt.rope_scale_bytes == 4 * fmt.rope_groups
        assert fmt.content_scales_offset % 2 == 0 and fmt.rope_scales_offset % 4 == 0
    assert fmt.page_bytes % 4 == 0
    return lay


def shared_view(x: Any) -> tuple[np.ndarray, bool]:
    """NumPy view sharing memory with a NumPy array or CPU tensor; bfloat16 tensors come back
    as their uint16 bit patterns with the flag True."""
    if isinstance(x, np.ndarray):
        return x, False
    if x.device.type != "cpu":
        raise ValueError(f"numba backend: expected NumPy arrays or CPU tensors, got a tensor on {x.device}")
    x = x.detach()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16), True
    return x.numpy(), False


def bits16(x: Any) -> tuple[np.ndarray, bool, bool]:
    """uint16 bit view of float32 or bfloat16 data, so that every kernel has one signature.

    Returns ``(bits, is_bf16, copied)``: bfloat16 ``[..., d]`` -> uint16 ``[..., d]``; float32
    ``[..., d]`` -> uint16 ``[..., 2d]`` (element e in halves 2e (low) and 2e+1 (high),
    little endian). C-contiguous; ``copied`` tells that it is a copy (writes must be copied
    back), which happens only for non-contiguous inputs.
    """
    arr, is_bf16 = shared_view(x)
    if not is_bf16 and arr.dtype != np.float32:
        arr = arr.astype(np.float32)
        copied = True
    else:
        copied = False
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
        copied = True
    return (arr if is_bf16 else arr.view(np.uint16)), is_bf16, copied


def pages_view(x: Any) -> tuple[np.ndarray, bool]:
    """C-contiguous uint8 view of the pages and whether it is a copy (non-contiguous input)."""
    arr, _ = shared_view(x)
    if arr.flags.c_contiguous:
        return arr, False
    return np.ascontiguousarray(arr), True


def copy_back(dst: Any, src: np.ndarray, is_bf16: bool) -> None:
    """Write a kernel's working copy ``src`` back into the caller's array ``dst``."""
    view, _ = shared_view(dst)
    view[...] = src if is_bf16 or src.dtype == view.dtype else src.view(np.float32)


def floats(x: Any) -> np.ndarray:
    """C-contiguous float32 copy/view of values (bfloat16 converted once)."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:
        x = x.detach().float()
    arr, _ = shared_view(x)
    return np.ascontiguousarray(arr, dtype=np.float32)


def indices(x: Any) -> np.ndarray:
    """C-contiguous int64 host copy of an index array or tensor."""
    arr = x if isinstance(x, np.ndarray) else x.detach().cpu().numpy()
    return np.ascontiguousarray(arr, dtype=np.int64)
