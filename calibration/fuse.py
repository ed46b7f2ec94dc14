"""Fusing learned transforms into a model, saving it, and the quantization-off equivalence check."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
from torch import nn

from quantmla_core.transforms import ContentTransform, RopeTransform, load_transforms, save_transforms

from .adapters import find_mla_layers

__all__ = ["fuse_model", "save_fused", "equivalence_check", "random_transforms", "TRANSFORMS_NAME"]

TRANSFORMS_NAME = "quantmla_transforms"


@torch.no_grad()
def fuse_model(model: nn.Module, content: Mapping[int, ContentTransform] | None = None,
               rope: Mapping[int, RopeTransform] | None = None) -> nn.Module:
    """Fold per-layer transforms (keyed by ``layer_idx``) into ``model``'s weights, in place; returns it.

    Gamma for each content transform is read from the layer as it is before fusion, so fuse an
    unfused model exactly once. The softmax scale (YaRN mscale included) is untouched: the
    transforms keep every score.
    """
    for spec in find_mla_layers(model):
        i = spec.layer_idx
        if content and i in content:
            content[i].fuse(spec)
        if rope and i in rope:
            rope[i].fuse(spec)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        cfg.quantmla = {"transforms": TRANSFORMS_NAME, "fused": True}
    return model


def save_fused(model: nn.Module, out_dir: str | os.PathLike, content: Mapping[int, ContentTransform],
               rope: Mapping[int, RopeTransform], meta: Mapping[str, Any] | None = None, tokenizer: Any = None) -> None:
    """``save_pretrained`` the fused model, plus ``quantmla_transforms.safetensors``/``.json`` beside it."""
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    save_transforms(out_dir, content, rope, meta=dict(meta or {}), name=TRANSFORMS_NAME)


def load_fused_transforms(out_dir: str | os.PathLike):
    """``(content, rope, meta)`` saved next to a fused model."""
    return load_transforms(out_dir, name=TRANSFORMS_NAME)


def random_transforms(model: nn.Module, seed: int = 0, rot_std: float = 0.2, scale_std: float = 0.7
                      ) -> tuple[dict[int, ContentTransform], dict[int, RopeTransform]]:
    """Random (far from identity) transforms for every MLA layer, for fusion tests."""
    g = torch.Generator().manual_seed(seed)
    content, rope = {}, {}
    for s in find_mla_layers(model):
        c = ContentTransform(s.d_c, gamma=s.kv_a_layernorm.weight.detach().float() * s.latent_scale,
                             log_scale=(scale_std * torch.randn(s.d_c, generator=g)).clamp(-2, 2))
        c.A.data.copy_(rot_std * torch.randn(s.d_c, s.d_c, generator=g))
        r = RopeTransform(s.d_r, s.rope_layout, s.cache_rope_layout,
                          log_scale=(scale_std * torch.randn(s.d_r // 2, generator=g)).clamp(-2, 2),
                          angle=torch.rand(s.d_r // 2, generator=g) * 6.283)
        content[s.layer_idx], rope[s.layer_idx] = c, r
    return content, rope


def _attn_outputs(model: nn.Module, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    outs: list[torch.Tensor] = []
    hs = [s.attn.register_forward_hook(lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o).detach()))
          for s in find_mla_layers(model)]
    try:
        logits = model(input_ids=input_ids, use_cache=False).logits.detach()
    finally:
        for h in hs:
            h.remove()
    return outs, logits


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten()))


@torch.no_grad()
def equivalence_check(original: nn.Module, fused: nn.Module, input_ids: torch.Tensor) -> dict[str, Any]:
    """Quantization off: compare the fused model with the original on ``input_ids [B, T]``.

    Returns ``layer_rel_err`` (relative Frobenius error of every MLA layer's attention output,
    each model fed its own hidden states), ``logits_rel_err``, ``nll_original``, ``nll_fused``.
    """
    dev = next(original.parameters()).device
    ids = input_ids.to(dev)
    a, la = _attn_outputs(original, ids)
    b, lb = _attn_outputs(fused, ids.to(next(fused.parameters()).device))
    rel = lambda x, y: float((x.float() - y.float().to(x.device)).norm() / x.float().norm().clamp_min(1e-30))
    return {
        "layer_rel_err": [rel(x, y) for x, y in zip(a, b)],
        "logits_rel_err": rel(la, lb),
        "nll_original": _nll(la, ids),
        "nll_fused": _nll(lb.to(dev), ids),
    }


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=float)
