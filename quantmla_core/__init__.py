"""QuantMLA: low-bit MLA KV caches and decode attention on packed pages.

Quick start::

    import quantmla_core as qm
    fmt = qm.PackFormat.parse("C4R4")
    cache = qm.MLACache.allocate(fmt, num_pages, max_seqs, device="cuda")
    qm.write(cache, latent, k_rope, slot_mapping=..., seq_ids=..., positions=..., seq_lens=...)
    out, lse = qm.attention(q_latent, q_rope, cache, block_table=..., seq_lens=..., seq_ids=...,
                            softmax_scale=tau)
    # a decode step: plan once, run per layer (quantmla_core.plan)
    plan = qm.plan_attention(cache, block_table=..., seq_lens=..., seq_ids=..., num_heads=16,
                             q_dtype=torch.bfloat16, softmax_scale=tau)
    out, lse = plan.run(q_latent, q_rope, layer_cache)
"""

from .api import attention, write
from .cache import MLACache, compression_ratio, memory_bytes
from .cache_io import load_cache, save_cache
from .dispatch import (
    Backend,
    Capabilities,
    DeviceInfo,
    NoBackendError,
    Problem,
    available_backends,
    get_backend,
    registered_backends,
    select_backend,
)
from .formats import PackFormat
from .paged import OutOfPagesError, PagedMLACache, StepMemo, WritePlan
from .plan import AttentionPlan, plan_attention

__version__ = "0.1.0"

__all__ = [
    "PackFormat",
    "MLACache",
    "PagedMLACache",
    "WritePlan",
    "StepMemo",
    "OutOfPagesError",
    "write",
    "attention",
    "plan_attention",
    "AttentionPlan",
    "memory_bytes",
    "save_cache",
    "load_cache",
    "compression_ratio",
    "Backend",
    "Capabilities",
    "DeviceInfo",
    "Problem",
    "NoBackendError",
    "available_backends",
    "get_backend",
    "registered_backends",
    "select_backend",
]
