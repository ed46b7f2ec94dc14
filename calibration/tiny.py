"""Tiny random-weight MLA models for tests, demos and the results table (no downloads).

``tiny_model(arch="v2"|"v3", q_lora=..., yarn=..., rope_interleave=..., outliers=...)`` builds a
float32 ``DeepseekV2ForCausalLM``/``DeepseekV3ForCausalLM`` from its config class.
``plant_outliers`` scales a few latent channels (rows of ``kv_a_proj_with_mqa[:d_c]`` and entries
of ``kv_a_layernorm.weight``) and a few RoPE pairs (rows of ``kv_a_proj_with_mqa[d_c:]``), the
way real MLA models carry a handful of large channels.
"""

from __future__ import annotations

import torch
from torch import nn

from .adapters import find_mla_layers, rope_pair_indices

__all__ = ["tiny_config", "tiny_model", "plant_outliers"]


def tiny_config(arch: str = "v3", *, q_lora: bool = True, yarn: bool = False, rope_interleave: bool = True,
                hidden: int = 64, heads: int = 4, d_c: int = 64, d_r: int = 32, d_nope: int = 16, d_v: int = 16,
                layers: int = 2, vocab: int = 256, max_pos: int = 512):
    """A transformers config for a 2-layer MLA model (first layer dense, second MoE)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": max_pos // 4,
                "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                  kv_lora_rank=d_c, q_lora_rank=(hidden // 2 if q_lora else None), qk_nope_head_dim=d_nope,
                  qk_rope_head_dim=d_r, v_head_dim=d_v, n_routed_experts=4, num_experts_per_tok=2,
                  n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=max_pos, rope_parameters=rope,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    if arch == "v2":
        from transformers import DeepseekV2Config

        return DeepseekV2Config(**common)
    if arch == "v3":
        from transformers import DeepseekV3Config

        return DeepseekV3Config(**common, n_group=1, topk_group=1, rope_interleave=rope_interleave)
    raise ValueError(f"arch: expected 'v2' or 'v3', got {arch!r}")


@torch.no_grad()
def plant_outliers(model: nn.Module, content_channels: int = 4, content_gain: float = 12.0, rope_pairs: int = 2,
                   rope_gain: float = 8.0, seed: int = 0) -> None:
    """Scale a few latent channels and RoPE pairs of every MLA layer (in place)."""
    g = torch.Generator().manual_seed(seed)
    for s in find_mla_layers(model):
        w = s.kv_a_proj_with_mqa.weight
        ch = torch.randperm(s.d_c, generator=g)[:content_channels]
        w[ch] *= content_gain
        gam = s.kv_a_layernorm.weight
        gam.copy_(torch.exp(0.5 * torch.randn(s.d_c, generator=g)))
        pairs = rope_pair_indices(s.d_r, s.rope_layout)
        # low-frequency pairs (the last ones) carry the large values in real models
        for i in range(s.d_r // 2 - rope_pairs, s.d_r // 2):
            w[s.d_c + pairs[i]] *= rope_gain


def tiny_model(arch: str = "v3", *, outliers: bool = False, seed: int = 0, **cfg) -> nn.Module:
    """A float32 eval-mode tiny CausalLM with random weights (``cfg`` goes to :func:`tiny_config`)."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **cfg)
    config._attn_implementation = "eager"
    if arch == "v2":
        from transformers import DeepseekV2ForCausalLM as M
    else:
        from transformers import DeepseekV3ForCausalLM as M
    model = M(config).float().eval()
    with torch.no_grad():  # random init of HF is small; make attention non-trivial
        for s in find_mla_layers(model):
            for m in (s.q_proj, s.q_a_proj, s.q_b_proj, s.kv_a_proj_with_mqa, s.kv_b_proj, s.o_proj):
                if m is not None:
                    nn.init.normal_(m.weight, std=m.weight.shape[1] ** -0.5)
    if outliers:
        plant_outliers(model, seed=seed)
    return model
