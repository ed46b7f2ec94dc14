"""Numba CPU backend: fused writer and decode attention over packed pages (NumPy arrays and CPU tensors).

Numba is imported lazily (in :mod:`.writer` / :mod:`.attention`), so importing this module never
needs it; without numba the backend reports itself unavailable. Compiled kernels are cached on
disk (``cache=True``), so only the first process on a machine pays the compile time.
"""

from __future__ import annotations

from ...dispatch import Backend, Capabilities


class NumbaBackend(Backend):
    """Every layout-v1 format (content/RoPE bits 2, 4, 8 and BF16), any dims the format allows,
    page sizes 16-128, group sizes 32/64/128, float32/bfloat16 values, float32/bfloat16 protection."""

    name = "numba"
    capabilities = Capabilities(devices=frozenset({"cpu", "numpy"}))
    requires = ("numba",)

    def write(self, cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens) -> None:
        from .writer import write

        write(cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens)

    def attention(self, q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale, *, want_lse: bool = True):
        from .attention import attention

        return attention(q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale)
