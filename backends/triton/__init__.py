"""Triton backend: fused writer and split-KV decode attention on packed pages.

Serves CUDA and ROCm GPUs; on a CPU only under ``TRITON_INTERPRET=1`` (the Triton interpreter,
used by CI without a GPU). Nothing here imports ``triton`` at module import time: the ops
(``writer.py``, ``attention.py``) are imported lazily on first use.
"""

from __future__ import annotations

import re

from ...dispatch import Backend, Capabilities, Problem
from ...envvars import getenv

#: the oldest triton whose compiler builds every kernel here: 3.2 and older reject tuples built inside a kernel (the
#: query slices of kernels v2 and v3); checked by compiling every launch for sm_90, sm_80, gfx942 and gfx90a under
#: triton 3.0 to 3.9 (benchmarks/RESULTS.md, "Stop 42")
MIN_TRITON = (3, 3)

#: the first triton whose interpreter takes a loop bound loaded from memory under numpy 2.4 or newer: before it,
#: ``range(t_lo, t_hi)`` calls ``int()`` on a one-element array, which numpy 2.4 refuses ("only 0-dimensional arrays
#: can be converted to Python scalars"); the attention kernels' tile loops are bounded by each request's length
INTERPRETER_LOOP_FIX = (3, 7)
#: the numpy release that turned the conversion above from a deprecation warning into an error
NUMPY_STRICT_SCALARS = (2, 4)

#: smallest K of a ``tl.dot``; a packed slice (see ``attention.py``) must be at least this wide
MIN_DOT_K = 16


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""
    return getenv("TRITON_INTERPRET", "0") not in ("", "0")


def slice_width(dim: int, bits: int, group: int) -> int:
    """Width of one unpacked slice of a ``dim``-wide vector at ``bits`` (16: BF16).

    Split-half packing puts element ``j + i*dim/k`` in plane ``i`` of byte ``j`` (k = 8/bits),
    so a slice of ``min(group, dim/k)`` consecutive elements comes from one plane of one run of
    consecutive bytes and lies inside one quantization group.
    """
    if bits == 16:
        return min(64, dim)
    return min(group, dim * bits // 8)


def _release(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def triton_version_reason(version: str) -> str | None:
    """Why a triton of ``version`` (``triton.__version__``, e.g. ``"3.2.0"`` or ``"3.3.0+gitabc"``) cannot build
    these kernels, or None."""
    release = _release(version)
    if release is None:
        return f"triton version {version!r} is not of the form MAJOR.MINOR"
    if release < MIN_TRITON:
        want = ".".join(map(str, MIN_TRITON))
        return f"triton {version} is older than {want}, the oldest release that builds these kernels (pip install 'triton>={want}')"
    return None


def interpreter_loop_reason(triton_version: str, numpy_version: str) -> str | None:
    """Why the interpreter of triton ``triton_version`` cannot run the attention kernels beside numpy
    ``numpy_version``, or None (checked: triton 3.6.0 fails with numpy 2.4.6 and passes with 2.3.5; 3.7.0 fixed it)."""
    tv, nv = _release(triton_version), _release(numpy_version)
    if tv is None or nv is None or tv >= INTERPRETER_LOOP_FIX or nv < NUMPY_STRICT_SCALARS:
        return None
    fix, strict = ".".join(map(str, INTERPRETER_LOOP_FIX)), ".".join(map(str, NUMPY_STRICT_SCALARS))
    return (f"the interpreter of triton {triton_version} cannot run the attention kernels with numpy {numpy_version}: "
            f"before triton {fix} it converts loop bounds with int() on one-element arrays, which numpy {strict} "
            f"refuses (pip install 'triton>={fix}' or 'numpy<{strict}')")


def _capabilities(devices: frozenset[str]) -> Capabilities:
    return Capabilities(
        devices=frozenset(devices),
        content_bits=frozenset({2, 4, 8, 16}),
        rope_bits=frozenset({2, 4, 8, 16}),
        latent_dims=frozenset({128, 256, 512, 1024}),  # powers of two (tl.arange extents)
        rope_dims=frozenset({32, 64, 128}),
        max_heads=1024,
        max_q_len=64,
    )


class TritonBackend(Backend):
    """Portable Triton kernels (no inline PTX, TMA or warp specialisation)."""

    name = "triton"
    _DEVICES = frozenset({"cuda", "rocm"})

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """Declared capabilities; "cpu" is served only under ``TRITON_INTERPRET=1``."""
        return _capabilities(self._DEVICES | ({"cpu"} if interpreting() else set()))

    requires = ("triton",)

    def unavailable_reason(self) -> str | None:
        why = super().unavailable_reason()
        if why:
            return why
        import triton

        return triton_version_reason(triton.__version__)

    def extra_reasons(self, problem: Problem) -> list[str]:
        reasons: list[str] = []
        if problem.device.kind == "cpu" and not interpreting():
            reasons.append("CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)")
        if problem.device.kind == "cpu" and interpreting() and problem.op == "attention":
            import numpy
            import triton

            why = interpreter_loop_reason(triton.__version__, numpy.__version__)
            if why:
                reasons.append(why)
        f = problem.format
        if problem.op == "attention":
            gc = f.content_group_size if f.quantized else 64
            gr = f.rope_group_size if f.quantized else 64
            for what, dim, bits, g in (("content", f.latent_dim, f.content_bits, gc), ("rope", f.rope_dim, f.rope_bits, gr)):
                w = slice_width(dim, bits, g)
                if w < MIN_DOT_K:
                    reasons.append(
                        f"{what} slices of {w} elements ({dim} dims at {bits} bits) are narrower than a tl.dot "
                        f"(K >= {MIN_DOT_K})"
                    )
        return reasons

    def write(self, cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens) -> None:
        from .writer import write

        write(cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens)

    def attention(self, q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale: float, *, want_lse: bool = True):
        from .attention import attention

        return attention(q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale)

    def plan_attention(self, cache, block_table, seq_lens, seq_ids, q_shape, q_dtype, softmax_scale):
        """Variant, launch plan, constexprs and the protected tiles decided once (``PreparedCall``); a run
        allocates the partials (and the outputs unless given) and launches the kernels."""
        from .attention import prepare

        b, h = q_shape[0], q_shape[-2]
        call = prepare(cache, block_table, seq_lens, seq_ids, b, 1 if len(q_shape) == 3 else q_shape[1], h, q_dtype,
                       softmax_scale)

        def run(q_latent, q_rope, layer_cache, out=None, lse=None, want_lse=True):
            return call.run(q_latent, q_rope, layer_cache, out, lse)

        return run
