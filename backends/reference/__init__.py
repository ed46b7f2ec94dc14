"""The float64 NumPy oracle exposed as a (slow) backend for NumPy arrays and CPU tensors."""

from __future__ import annotations

import numpy as np
import torch

from ...dispatch import Backend, Capabilities


class ReferenceBackend(Backend):
    name = "reference"
    capabilities = Capabilities(devices=frozenset({"cpu", "numpy"}))

    def write(self, cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens) -> None:
        from ... import reference

        reference.write(cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens)

    def attention(self, q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale, *, want_lse: bool = True):
        from ... import reference

        out, lse = reference.decode_attention(q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale)
        if isinstance(q_latent, np.ndarray):
            return out.astype(q_latent.dtype), lse.astype(np.float32)
        return torch.from_numpy(out).to(q_latent.dtype), torch.from_numpy(lse).float()
