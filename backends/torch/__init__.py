"""Plain-PyTorch backend: works on any torch device; the portable, slow-but-sure fallback."""

from __future__ import annotations

from ...dispatch import Backend, Capabilities


class TorchBackend(Backend):
    name = "torch"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda", "rocm", "mps", "xpu"}))

    def write(self, cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens) -> None:
        from .writer import write

        write(cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens)

    def attention(self, q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale, *, want_lse: bool = True):
        from .attention import attention

        return attention(q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale)
