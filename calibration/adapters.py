"""Adapters naming the modules and RoPE pair layout of ``transformers`` MLA models.

Everything in :mod:`quantmla_core.calibration` (and the Hugging Face integration) reaches an
MLA attention block only through an :class:`MLALayerSpec`, so supporting a new model family is a
matter of adding one :class:`MLAAdapter` entry with :func:`register_adapter`.

An MLA attention module (``nn.Module``) is recognised by its projections::

    q_proj                         [H*(d_nope+d_r), hidden]     (no q LoRA), or
    q_a_proj, q_a_layernorm, q_b_proj                           (q LoRA: hidden -> q_lora_rank -> H*(d_nope+d_r))
    kv_a_proj_with_mqa             [d_c + d_r, hidden]          rows [:d_c] content, [d_c:] raw (pre-RoPE) key
    kv_a_layernorm                 RMSNorm(d_c) with weight gamma; the cached latent is c = gamma * rmsnorm(c_raw)
    kv_b_proj                      [H*(d_nope+d_v), d_c]        per head h: rows [h*(d_nope+d_v) : +d_nope] = W_UK,h,
                                                                 the next d_v rows = W_UV,h
    o_proj                         [hidden, H*d_v]

RoPE pair layouts. ``rope_layout`` names how the *raw pre-RoPE* channels (rows ``d_c:`` of
``kv_a_proj_with_mqa`` and the last d_r rows of every head of ``q_proj``/``q_b_proj``) form the
pairs that RoPE rotates together; ``cache_rope_layout`` names the pairing of the *post-RoPE*
key ``k_rot`` that the model puts in its KV cache (and of the post-RoPE query rope part):

==================================  ===============  ===================  =====================================
model (config.model_type)           rope_layout      cache_rope_layout    why
==================================  ===============  ===================  =====================================
deepseek_v2                         interleaved      interleaved          complex multiply on (2i, 2i+1) pairs
                                                                          (``view_as_complex``), output
                                                                          flattened back in place
deepseek_v3, rope_interleave=True   interleaved      half                 ``apply_rotary_pos_emb_interleave``
(also kimi_k2 / kimi_k25 text,                                            rotates (2i, 2i+1) and writes
glm4_moe_lite, longcat_flash,                                             ``cat([even, odd])``: the cached k_rot
sarvam_mla)                                                               is laid out [even | odd], so pair i
                                                                          sits at (i, i + d_r/2)
deepseek_v3, rope_interleave=False  half             half                 neox-style ``rotate_half``: pairs
(glm4_moe_lite, sarvam_mla                                                (i, i + d_r/2) before and after
likewise)
==================================  ===============  ===================  =====================================

Every layout rotates pair i by the same angle ``pos * inv_freq[i]`` (times YaRN's attention
factor, a scalar); a per-pair complex scalar (the RoPE transform of DESIGN.md §6) therefore
commutes with RoPE in both layouts.

Models whose attention is not plain dense MLA are refused by name, with the reason (:data:`NOT_SERVED`): DeepSeek
Sparse Attention (``deepseek_v32``, ``glm_moe_dsa``, ``glm5_next``) cache the same latent, but each query attends only
to the ``index_topk`` tokens its indexer picks, and QuantMLA's decode attention is dense, so outputs would change past
that many tokens; DeepSeek-V4 (``deepseek_v4``) caches one compressed key-value head, not an MLA latent.

``softmax_scale`` is the module's ``scaling`` attribute (``qk_head_dim**-0.5``, times YaRN's
``mscale(factor, mscale_all_dim)**2`` when the model uses YaRN), i.e. the tau of DESIGN.md §2.

LongCat-Flash multiplies the post-norm latent by ``(hidden/d_c)**0.5`` and both query parts by
``(hidden/q_lora_rank)**0.5`` before caching; these scalars are recorded as ``latent_scale`` and
``query_scale`` (1.0 elsewhere) so that captured caches can be reproduced from module outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
from torch import nn

from ..transforms import rope_pair_indices

RopeLayout = Literal["interleaved", "half"]

__all__ = [
    "RopeLayout",
    "MLALayerSpec",
    "MLAAdapter",
    "register_adapter",
    "get_adapter",
    "registered_adapters",
    "find_mla_layers",
    "rope_pair_indices",
    "text_config",
]

ROLES = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


@dataclass
class MLALayerSpec:
    """One MLA attention block of a model, with its dims, softmax scale and pair layouts.

    The projection accessors (``q_proj``, ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``) return the live
    module (or ``None`` where the model has none, e.g. ``q_proj`` under q LoRA), resolved through
    ``module_names`` so adapters for models with other attribute names need no new code.
    """

    layer_idx: int
    attn: nn.Module
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    rope_layout: RopeLayout
    cache_rope_layout: RopeLayout = "interleaved"
    model_type: str = ""
    name: str = ""  # dotted module path inside the model
    latent_scale: float = 1.0
    query_scale: float = 1.0
    module_names: dict[str, str] = field(default_factory=lambda: {r: r for r in ROLES})

    # ------------------------------------------------------------------ modules
    def module(self, role: str) -> nn.Module | None:
        """The module playing ``role`` (one of ``ROLES``), or ``None`` when absent."""
        if role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
        attr = self.module_names.get(role, role)
        return getattr(self.attn, attr, None) if attr else None

    @property
    def q_proj(self) -> nn.Linear | None:
        return self.module("q_proj")

    @property
    def q_a_proj(self) -> nn.Linear | None:
        return self.module("q_a_proj")

    @property
    def q_a_layernorm(self) -> nn.Module | None:
        return self.module("q_a_layernorm")

    @property
    def q_b_proj(self) -> nn.Linear | None:
        return self.module("q_b_proj")

    @property
    def kv_a_proj_with_mqa(self) -> nn.Linear:
        return self.module("kv_a_proj_with_mqa")

    @property
    def kv_a_layernorm(self) -> nn.Module:
        return self.module("kv_a_layernorm")

    @property
    def kv_b_proj(self) -> nn.Linear:
        return self.module("kv_b_proj")

    @property
    def o_proj(self) -> nn.Linear:
        return self.module("o_proj")

    @property
    def q_out_proj(self) -> nn.Linear:
        """The projection whose output rows are the per-head queries (``q_proj`` or ``q_b_proj``)."""
        return self.q_proj if self.q_lora_rank is None else self.q_b_proj

    # ------------------------------------------------------------------ dims and helpers
    @property
    def d_c(self) -> int:
        return self.kv_lora_rank

    @property
    def d_r(self) -> int:
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rms_eps(self) -> float:
        norm = self.kv_a_layernorm
        return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))

    def rope_pairs(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Raw (pre-RoPE) pair channel indices ``[d_r/2, 2]``."""
        return rope_pair_indices(self.d_r, self.rope_layout, device)

    def cache_rope_pairs(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Pair channel indices ``[d_r/2, 2]`` of the cached (post-RoPE) k_rot and query rope part."""
        return rope_pair_indices(self.d_r, self.cache_rope_layout, device)

    def q_rope_rows(self) -> torch.Tensor:
        """Row indices ``[H, d_r]`` of each head's raw RoPE query slice in ``q_out_proj.weight``."""
        h = torch.arange(self.num_heads).unsqueeze(1) * self.qk_head_dim
        return h + self.qk_nope_head_dim + torch.arange(self.d_r).unsqueeze(0)

    def apply_rope(self, x: torch.Tensor, position_embeddings: Any) -> torch.Tensor:
        """RoPE as the model applies it: raw ``x [..., T, d_r]`` (pairs ``rope_layout``) -> post-RoPE in
        ``cache_rope_layout``.

        ``position_embeddings`` is what the model passes its attention: a complex ``freqs_cis
        [B, T, d_r/2]`` (DeepSeek-V2) or ``(cos, sin)`` each ``[B, T, d_r]`` = ``cat(f, f)``
        (DeepSeek-V3 family). ``x`` may carry a head axis before T (``[B, H, T, d_r]``).
        """
        if torch.is_tensor(position_embeddings) and position_embeddings.is_complex():
            cos, sin = position_embeddings.real, position_embeddings.imag
        else:
            cos, sin = position_embeddings
            cos, sin = cos[..., : self.d_r // 2], sin[..., : self.d_r // 2]
        cos, sin = cos.float(), sin.float()
        if x.dim() == 4:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        src = self.rope_pairs(x.device)
        dst = self.cache_rope_pairs(x.device)
        a, b = x[..., src[:, 0]].float(), x[..., src[:, 1]].float()
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        out = out.index_copy(-1, dst[:, 0], a * cos - b * sin).index_copy(-1, dst[:, 1], b * cos + a * sin)
        return out

    def describe(self) -> str:
        q = f"q_lora={self.q_lora_rank}" if self.q_lora_rank else "q_proj"
        return (
            f"layer {self.layer_idx} ({self.model_type}): H={self.num_heads} d_c={self.d_c} d_r={self.d_r} "
            f"d_nope={self.qk_nope_head_dim} d_v={self.v_head_dim} {q} tau={self.softmax_scale:.6g} "
            f"rope={self.rope_layout}->{self.cache_rope_layout}"
        )


@dataclass(frozen=True)
class MLAAdapter:
    """How to read one model family: which config types it covers and how pairs are laid out.

    ``rope_layouts(config) -> (rope_layout, cache_rope_layout)``; ``module_names`` maps the
    roles of ``ROLES`` to the attention module's attribute names; ``scales(attn, config) ->
    (latent_scale, query_scale)``.
    """

    model_types: tuple[str, ...]
    rope_layouts: Callable[[Any], tuple[str, str]]
    module_names: dict[str, str] = field(default_factory=lambda: {r: r for r in ROLES})
    scales: Callable[[nn.Module, Any], tuple[float, float]] = lambda attn, cfg: (1.0, 1.0)


def _v3_layouts(cfg: Any) -> tuple[str, str]:
    if getattr(cfg, "rope_interleave", True):
        return "interleaved", "half"
    return "half", "half"


def _longcat_scales(attn: nn.Module, cfg: Any) -> tuple[float, float]:
    return float(getattr(attn, "mla_scale_kv_lora", 1.0)), float(getattr(attn, "mla_scale_q_lora", 1.0))


_ADAPTERS: list[MLAAdapter] = [
    MLAAdapter(("deepseek_v2",), lambda cfg: ("interleaved", "interleaved")),
    MLAAdapter(("deepseek_v3", "kimi_k2", "glm4_moe_lite", "sarvam_mla"), _v3_layouts),
    MLAAdapter(("longcat_flash",), lambda cfg: ("interleaved", "half"), scales=_longcat_scales),
]


def register_adapter(adapter: MLAAdapter) -> None:
    """Add (in front, so it wins) an adapter for new model types."""
    _ADAPTERS.insert(0, adapter)


def registered_adapters() -> list[MLAAdapter]:
    return list(_ADAPTERS)


def text_config(config: Any) -> Any:
    """The language-model config (``text_config`` of multimodal wrappers such as Kimi-K2.5)."""
    sub = getattr(config, "get_text_config", None)
    if callable(sub):
        try:
            return sub()
        except TypeError:
            pass
    return getattr(config, "text_config", None) or config


_DSA = ("attends, per query, only to the index_topk tokens its DeepSeek Sparse Attention indexer picks; QuantMLA's "
        "decode attention is dense over the cached latent, so the model's outputs would change past index_topk tokens")

#: model types that look like MLA but that QuantMLA cannot serve as the model computes, with the reason
NOT_SERVED: dict[str, str] = {
    "deepseek_v32": _DSA,
    "glm_moe_dsa": _DSA,
    "glm5_next": _DSA,
    "glm5_next_text": _DSA,
    "deepseek_v4": "caches one compressed key-value head per token (compressor and indexer), not an MLA latent",
}


def get_adapter(model_type: str) -> MLAAdapter:
    """The adapter registered for ``model_type``; ``ValueError`` naming the type and why when none serves it."""
    for a in _ADAPTERS:
        if model_type in a.model_types:
            return a
    if model_type in NOT_SERVED:
        raise ValueError(f"model_type: {model_type!r} is not served: it {NOT_SERVED[model_type]}")
    raise ValueError(
        f"model_type: no MLA adapter for {model_type!r}; known: "
        f"{sorted(t for a in _ADAPTERS for t in a.model_types)} (add one with register_adapter)"
    )


def _is_mla_attention(m: nn.Module, names: dict[str, str]) -> bool:
    need = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    return all(isinstance(getattr(m, names.get(r, r), None), nn.Module) for r in need)


def _softmax_scale(attn: nn.Module, cfg: Any, qk_head_dim: int) -> float:
    s = getattr(attn, "scaling", None) or getattr(attn, "softmax_scale", None)
    if s is not None:
        return float(s)
    scale = qk_head_dim**-0.5
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rp.get("rope_type", rp.get("type", "default")) != "default" and rp.get("mscale_all_dim"):
        factor = rp["factor"]
        m = 0.1 * rp["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return scale


def find_mla_layers(model: nn.Module) -> list[MLALayerSpec]:
    """All MLA attention blocks of a ``transformers`` model, in module order.

    The adapter is chosen by ``config.model_type`` (of the text config); a model whose type has
    no adapter raises ``ValueError``. Returns ``[]`` for a model without MLA blocks.
    """
    cfg = text_config(getattr(model, "config", None))
    model_type = getattr(cfg, "model_type", "") if cfg is not None else ""
    adapter = get_adapter(model_type)
    rope_layout, cache_layout = adapter.rope_layouts(cfg)
    specs: list[MLALayerSpec] = []
    names = dict(adapter.module_names)
    for name, m in model.named_modules():
        if not _is_mla_attention(m, names):
            continue

        def g(attr: str, default: Any = None) -> Any:
            v = getattr(m, attr, None)
            return v if v is not None else getattr(cfg, attr, default)

        kv_lora = int(g("kv_lora_rank"))
        d_r = int(g("qk_rope_head_dim"))
        d_nope = int(g("qk_nope_head_dim"))
        q_lora = getattr(m, "q_lora_rank", getattr(cfg, "q_lora_rank", None))
        lat_s, q_s = adapter.scales(m, cfg)
        specs.append(
            MLALayerSpec(
                layer_idx=int(getattr(m, "layer_idx", len(specs))),
                attn=m,
                num_heads=int(g("num_heads", None) or cfg.num_attention_heads),
                q_lora_rank=int(q_lora) if q_lora else None,
                kv_lora_rank=kv_lora,
                qk_nope_head_dim=d_nope,
                qk_rope_head_dim=d_r,
                v_head_dim=int(g("v_head_dim")),
                softmax_scale=_softmax_scale(m, cfg, d_nope + d_r),
                rope_layout=rope_layout,  # type: ignore[arg-type]
                cache_rope_layout=cache_layout,  # type: ignore[arg-type]
                model_type=model_type,
                name=name,
                latent_scale=lat_s,
                query_scale=q_s,
                module_names=names,
            )
        )
    return specs
