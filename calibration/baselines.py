"""Codecs for the learned transforms and the baselines, all sharing one quantizer.

A codec is ``(encode, decode)``: content ``encode(u [.., d_c]) -> cached``, ``decode(cached) ->
native c``; RoPE ``encode(kr [.., d_r]) -> cached``, ``decode(cached) -> native kr``.

* RTN: no transform (content cache is the native ``c = u * gamma``; RoPE key as is).
* SmoothQuant-style: positive per-channel scales only (content: ``z = u * s``; RoPE: one scale per
  pair, keys times s, queries divided), from the α formula of DESIGN.md §7, α chosen from the grid
  by held-out objective (content: attention-output NMSE; RoPE: the RoPE objective).
* QuaRot-style: normalized Hadamard. Content ``z = u H`` (fusible: ``R0 = H``, ``s = 1``); RoPE
  ``k' = kr H`` applied post-RoPE online (queries ``qr H``), not fusible.
"""

from __future__ import annotations

from typing import Sequence

import torch

from quantmla_core.transforms import LOG_SCALE_CLIP, ContentTransform, RopeTransform, hadamard

from .capture import LayerData
from .objectives import Codec, QuantSpec, content_objective, rope_objective

ALPHAS: tuple[float, ...] = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)

__all__ = [
    "ALPHAS",
    "content_codec",
    "rope_codec",
    "rtn_content",
    "rtn_rope",
    "content_scale_init",
    "rope_scale_init",
    "smooth_content",
    "smooth_rope",
    "quarot_content",
    "quarot_rope",
    "eval_content",
    "eval_rope",
]


def content_codec(t: ContentTransform) -> Codec:
    return t.apply_to_normalized, t.inverse


def rope_codec(t: RopeTransform) -> Codec:
    return t.apply_to_cache, t.inverse


def rtn_content(d: LayerData) -> Codec:
    g = d.gamma
    return (lambda u: u * g), (lambda c: c)


def rtn_rope(d: LayerData) -> Codec:
    return (lambda k: k), (lambda k: k)


def _pct(x: torch.Tensor, q: float = 0.999) -> torch.Tensor:
    """Per-channel ``q`` quantile of ``x [..., C]`` -> ``[C]`` (float32, floored at 1e-8)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    if flat.shape[0] > 2**20:  # torch.quantile's size limit: subsample rows evenly
        flat = flat[:: flat.shape[0] // 2**20 + 1]
    return torch.quantile(flat, q, dim=0).clamp_min(1e-8)


def _alpha_scale(a: torch.Tensor, alpha: float) -> torch.Tensor:
    la = a.log()
    return (alpha * (la.mean() - la)).clamp(-LOG_SCALE_CLIP, LOG_SCALE_CLIP)


def content_scale_init(d: LayerData, alpha: float) -> torch.Tensor:
    """``log s_j = clip(α (mean_k log a_k - log a_j), -2, 2)``, a_j the 99.9th pct of ``|u_j|``; ``[d_c]``."""
    return _alpha_scale(_pct(d.u.abs()), alpha)


def rope_scale_init(d: LayerData, alpha: float, cache_layout: str) -> torch.Tensor:
    """Per-pair log-scale ``[d_r/2]``, a_i the 99.9th pct of the pair magnitude ``|(k_a, k_b)|`` (tied per pair)."""
    from quantmla_core.transforms import rope_pair_indices

    p = rope_pair_indices(d.kr.shape[-1], cache_layout, d.kr.device)
    mag = torch.sqrt(d.kr[..., p[:, 0]] ** 2 + d.kr[..., p[:, 1]] ** 2)
    return _alpha_scale(_pct(mag), alpha)


@torch.no_grad()
def eval_content(d: LayerData, codec: Codec, qs: QuantSpec, chunk: int = 8) -> float:
    """Content objective over all sequences of ``d`` (ratio of sums, computed in chunks)."""
    num = den = 0.0
    for i in range(0, d.n, chunk):
        sub = d.subset(slice(i, i + chunk))
        den_i = sub.y.pow(2).sum().item()
        num += content_objective(sub, codec, qs).item() * den_i
        den += den_i
    return num / max(den, 1e-30)


@torch.no_grad()
def eval_rope(d: LayerData, codec: Codec, qs: QuantSpec, chunk: int = 8) -> float:
    """RoPE objective over all sequences of ``d`` (ratio of sums, computed in chunks)."""
    from .objectives import causal_mask

    num = den = 0.0
    for i in range(0, d.n, chunk):
        sub = d.subset(slice(i, i + chunk))
        m = causal_mask(sub.kr.shape[1], sub.kr.device)
        den_i = (torch.einsum("nhtr,nsr->nhts", sub.qr, sub.kr) * m).pow(2).sum().item()
        num += rope_objective(sub, codec, qs).item() * den_i
        den += den_i
    return num / max(den, 1e-30)


def smooth_content(train: LayerData, val: LayerData, qs: QuantSpec, alphas: Sequence[float] = ALPHAS
                   ) -> tuple[ContentTransform, float, float]:
    """Scales-only content transform, α by held-out objective -> ``(transform, alpha, val_objective)``."""
    best = None
    for a in alphas:
        t = ContentTransform(train.u.shape[-1], gamma=train.gamma, log_scale=content_scale_init(train, a),
                             learn_rotation=False).to(train.u.device)
        v = eval_content(val, content_codec(t), qs)
        if best is None or v < best[2]:
            best = (t, a, v)
    assert best is not None
    best[0].meta.update(method="smoothquant", alpha=best[1])
    return best


def smooth_rope(train: LayerData, val: LayerData, qs: QuantSpec, layout: str, cache_layout: str,
                alphas: Sequence[float] = ALPHAS) -> tuple[RopeTransform, float, float]:
    """Per-pair scales only, α by held-out RoPE objective -> ``(transform, alpha, val_objective)``."""
    best = None
    for a in alphas:
        t = RopeTransform(train.kr.shape[-1], layout, cache_layout,
                          log_scale=rope_scale_init(train, a, cache_layout)).to(train.kr.device)
        v = eval_rope(val, rope_codec(t), qs)
        if best is None or v < best[2]:
            best = (t, a, v)
    assert best is not None
    best[0].meta.update(method="smoothquant", alpha=best[1])
    return best


def quarot_content(d: LayerData) -> ContentTransform:
    """Hadamard content rotation ``z = u H`` (fusible)."""
    dc = d.u.shape[-1]
    t = ContentTransform(dc, gamma=d.gamma, base=hadamard(dc, device=d.u.device), learn_rotation=False).to(d.u.device)
    t.meta.update(method="quarot")
    return t


def quarot_rope(d: LayerData) -> Codec:
    """Online post-RoPE Hadamard on the key (the query gets the same rotation; exact q.k)."""
    h = hadamard(d.kr.shape[-1], device=d.kr.device)
    return (lambda k: k @ h), (lambda k: k @ h.T)
