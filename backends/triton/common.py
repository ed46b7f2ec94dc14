"""Host-side helpers shared by the Triton ops."""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Mapping

import torch

from . import interpreting


def ptr_or_dummy(t: torch.Tensor) -> torch.Tensor:
    """A tensor usable as a kernel pointer: empty buffers (sink=0 / local=0) become a
    one-element stand-in that the kernel never touches (its masks are all false)."""
    return t if t.numel() > 0 else torch.zeros(1, dtype=t.dtype, device=t.device)


@functools.lru_cache(maxsize=64)
def page_layout_constexprs(fmt) -> Mapping[str, int | bool]:
    """Kernel constexprs of the page layout, all from ``fmt`` (a :class:`PackFormat`): page size
    and bytes, section offsets (0 for sections the format lacks) and the scale dtypes. Cached
    per format (read-only: launchers unpack it on every call)."""
    secs = fmt.sections

    def off(name: str) -> int:
        return secs[name][0] if name in secs else 0

    return MappingProxyType(dict(
        P=fmt.page_size, PAGE_BYTES=fmt.page_bytes,
        C_CODES_OFF=off("content_codes"), R_CODES_OFF=off("rope_codes"),
        C_SCALES_OFF=off("content_scales"), C_ZEROS_OFF=off("content_zeros"),
        R_SCALES_OFF=off("rope_scales"), R_ZEROS_OFF=off("rope_zeros"),
        C_SCALE_BF16=fmt.content_scale_dtype == "bfloat16", R_SCALE_BF16=fmt.rope_scale_dtype == "bfloat16",
    ))


#: fused multiply-adds on (``enable_fp_fusion``), stated rather than left to the release: triton up to 3.9 fuses by
#: default, 3.9 warns that 3.10 will not, and every number in benchmarks/RESULTS.md and the conformance tolerances
#: were measured with fusion on
FP_FUSION = True


def launch_dims(num_warps: int, num_stages: int | None = None) -> dict:
    """Launch options (:data:`FP_FUSION` with them); the interpreter ignores them, so none are passed there."""
    if interpreting():
        return {}
    out = {"num_warps": num_warps, "enable_fp_fusion": FP_FUSION}
    if num_stages is not None:
        out["num_stages"] = num_stages
    return out
