"""Offline-fusible QuantMLA transforms (DESIGN.md §6), differentiable, in PyTorch.

Content path. With ``u = RMSNorm_weightless(c_raw)`` and ``gamma = kv_a_layernorm.weight`` the
native cache is ``c = u * gamma``; the transformed cache is ``z = u @ R * s`` with ``R``
orthogonal (``d_c x d_c``) and ``s > 0``. ``R = R0 @ cayley(A)`` where ``cayley(A) =
(I - K)^-1 (I + K)``, ``K = A - A^T`` (identity at ``A = 0``; ``R0`` a fixed orthogonal base,
identity unless a baseline such as a Hadamard sets it) and ``s = exp(clip(log_s, -2, 2))``.
Fusion in ``nn.Linear`` layout (``weight[out, in]``)::

    kv_a_proj_with_mqa.weight[:d_c]  <-  R^T @ W[:d_c]          (and bias[:d_c] <- bias[:d_c] @ R)
    kv_a_layernorm.weight            <-  s
    kv_b_proj.weight[h-th W_UK / W_UV rows]  <-  W @ diag(gamma) @ R @ diag(1/s)

RoPE path. Per pair i (the model's native pairing, ``layout``), keys get ``s_i Rot(phi_i)``
and queries ``Rot(phi_i) / s_i`` where ``Rot(phi)(a, b) = (a cos phi - b sin phi,
a sin phi + b cos phi)``; every ``q . k`` is kept. These commute with RoPE, so they are fused
into the raw (pre-RoPE) rows of ``kv_a_proj_with_mqa[d_c:]`` and of every head's RoPE slice of
``q_proj``/``q_b_proj`` (pairs ``layout``), and applied to cached post-RoPE values with the
cache pairing ``cache_layout`` (e.g. DeepSeek-V3 with ``rope_interleave``: raw pairs
(2i, 2i+1), cached pairs (i, i + d_r/2); see ``quantmla_core.calibration.adapters``).

Both transforms compute in the dtype of their parameters (float32 by default); fusion computes
in float64 and writes back in the weights' dtype. Saved as ``<path>.safetensors`` (tensors)
plus ``<path>.json`` (kind, dims, pair layouts, format name, free metadata).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Mapping

import torch
from torch import nn

LOG_SCALE_CLIP = 2.0
LAYOUTS = ("interleaved", "half")

__all__ = [
    "ContentTransform",
    "RopeTransform",
    "cayley",
    "hadamard",
    "rope_pair_indices",
    "save_transforms",
    "load_transforms",
    "fuse",
    "LOG_SCALE_CLIP",
]


# ---------------------------------------------------------------------- helpers
def rope_pair_indices(dim: int, layout: str, device: torch.device | str | None = None) -> torch.Tensor:
    """``[dim/2, 2]`` int64 channel indices of each RoPE pair: (2i, 2i+1) or (i, i + dim/2)."""
    if dim % 2:
        raise ValueError(f"dim: expected an even RoPE dimension, got {dim}")
    i = torch.arange(dim // 2, device=device)
    if layout == "interleaved":
        return torch.stack([2 * i, 2 * i + 1], dim=1)
    if layout == "half":
        return torch.stack([i, i + dim // 2], dim=1)
    raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def cayley(a: torch.Tensor) -> torch.Tensor:
    """Orthogonal ``(I - K)^-1 (I + K)`` with ``K = a - a^T``; ``a [d, d]`` -> ``[d, d]``."""
    k = a - a.transpose(-1, -2)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.solve(eye - k, eye + k)


def hadamard(d: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix ``[d, d]`` (orthogonal, symmetric); d a power of two."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"d: expected a power of two for a Hadamard matrix, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(dtype=dtype, device=device)


def _pair_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mult: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of the last dim of ``x [..., d]`` by (cos, sin) ``[d/2]`` and scale by ``mult``."""
    a = x[..., pairs[:, 0]]
    b = x[..., pairs[:, 1]]
    na = (a * cos - b * sin) * mult
    nb = (a * sin + b * cos) * mult
    out = torch.empty_like(x, dtype=torch.result_type(x, cos))
    out = out.index_copy(-1, pairs[:, 0], na).index_copy(-1, pairs[:, 1], nb)
    return out


def _write_pair(prefix: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    d = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(d, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, prefix + ".safetensors")
    with open(prefix + ".json", "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)


def _read_pair(prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    with open(prefix + ".json") as f:
        meta = json.load(f)
    return load_file(prefix + ".safetensors"), meta


def _strip(path: str | os.PathLike) -> str:
    p = os.fspath(path)
    for ext in (".safetensors", ".json"):
        if p.endswith(ext):
            return p[: -len(ext)]
    return p


# ---------------------------------------------------------------------- content
class ContentTransform(nn.Module):
    """Content-latent transform ``z = u @ R * s`` (DESIGN.md §6).

    The maps compute in the wider of the input's and the parameters' dtypes.

    Parameters: ``A [d, d]`` (Cayley generator, zero = identity), ``log_s [d]``. Buffers:
    ``R0 [d, d]`` fixed orthogonal base, ``gamma [d]`` the layer's ``kv_a_layernorm.weight``
    (times any constant latent multiplier), needed to map native caches/queries.
    """

    kind = "content"

    def __init__(
        self,
        dim: int,
        gamma: torch.Tensor | None = None,
        base: torch.Tensor | None = None,
        log_scale: torch.Tensor | None = None,
        learn_rotation: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.dim = int(dim)
        self.learn_rotation = bool(learn_rotation)
        self.A = nn.Parameter(torch.zeros(dim, dim, dtype=dtype), requires_grad=learn_rotation)
        ls = torch.zeros(dim, dtype=dtype) if log_scale is None else log_scale.detach().to(dtype).clone()
        self.log_s = nn.Parameter(ls)
        self.register_buffer("R0", torch.eye(dim, dtype=dtype) if base is None else base.detach().to(dtype).clone())
        self.register_buffer("gamma", torch.ones(dim, dtype=dtype) if gamma is None else gamma.detach().to(dtype).clone())
        self.meta: dict[str, Any] = {}

    # ---- the maps
    @property
    def R(self) -> torch.Tensor:
        """Orthogonal ``[d, d]``: ``R0 @ cayley(A)`` (``R0`` alone when the rotation is frozen at zero)."""
        if not self.learn_rotation and not bool(self.A.detach().any()):
            return self.R0
        return self.R0 @ cayley(self.A)

    @property
    def s(self) -> torch.Tensor:
        """Positive scale ``[d]`` = exp(clip(log_s, -2, 2))."""
        return torch.exp(self.log_s.clamp(-LOG_SCALE_CLIP, LOG_SCALE_CLIP))

    def apply_to_normalized(self, u: torch.Tensor) -> torch.Tensor:
        """``u [..., d]`` (weightless-RMSNormed latent) -> transformed cache ``z = u R s``."""
        dt = torch.promote_types(u.dtype, self.R0.dtype)
        return (u.to(dt) @ self.R.to(dt)) * self.s.to(dt)

    def apply_to_cache(self, c: torch.Tensor) -> torch.Tensor:
        """Native cache ``c = u * gamma [..., d]`` -> ``z [..., d]`` (divides by gamma)."""
        return self.apply_to_normalized(c / self.gamma.to(torch.promote_types(c.dtype, self.gamma.dtype)))

    def apply_to_query(self, qc: torch.Tensor) -> torch.Tensor:
        """Absorbed content query ``qc [..., d]`` (``qc . c`` = native score) -> ``(qc * gamma) R / s``."""
        dt = torch.promote_types(qc.dtype, self.gamma.dtype)
        return ((qc.to(dt) * self.gamma.to(dt)) @ self.R.to(dt)) / self.s.to(dt)

    def inverse(self, z: torch.Tensor) -> torch.Tensor:
        """Transformed cache ``z [..., d]`` -> native cache ``(z / s) R^T * gamma``."""
        dt = torch.promote_types(z.dtype, self.gamma.dtype)
        return ((z.to(dt) / self.s.to(dt)) @ self.R.to(dt).transpose(0, 1)) * self.gamma.to(dt)

    def inverse_query(self, q: torch.Tensor) -> torch.Tensor:
        """Transformed query -> native absorbed query ``(q * s) R^T / gamma``."""
        dt = torch.promote_types(q.dtype, self.gamma.dtype)
        return ((q.to(dt) * self.s.to(dt)) @ self.R.to(dt).transpose(0, 1)) / self.gamma.to(dt)

    # ---- fusion
    @torch.no_grad()
    def fuse(self, layer: Any) -> None:
        """Fold into the layer's weights (an ``MLALayerSpec`` or a transformers MLA attention module).

        Uses the layer's current ``kv_a_layernorm.weight`` as gamma (so fuse once, into the
        unfused model).
        """
        L = _LayerView.of(layer)
        d = L.d_c
        if d != self.dim:
            raise ValueError(f"layer: kv_lora_rank {d} does not match the transform dim {self.dim}")
        kva = L.kv_a_proj_with_mqa
        w = kva.weight
        R = self.R.detach().double().to(w.device)
        s = self.s.detach().double().to(w.device)
        w.data[:d] = (R.T @ w.data[:d].double()).to(w.dtype)
        if kva.bias is not None:
            kva.bias.data[:d] = (kva.bias.data[:d].double() @ R).to(kva.bias.dtype)
        norm = L.kv_a_layernorm
        gamma = norm.weight.data.double().clone()
        norm.weight.data.copy_(s.to(norm.weight.dtype))
        kvb = L.kv_b_proj
        m = gamma.unsqueeze(1) * R / s.unsqueeze(0)  # diag(gamma) R diag(1/s)
        kvb.weight.data.copy_((kvb.weight.data.double() @ m).to(kvb.weight.dtype))

    # ---- persistence
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        t = {"A": self.A.detach(), "log_s": self.log_s.detach(), "R0": self.R0, "gamma": self.gamma,
             "R": self.R.detach(), "s": self.s.detach()}
        return t, {"kind": self.kind, "dim": self.dim, "learn_rotation": self.learn_rotation, **self.meta}

    @classmethod
    def from_state(cls, t: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> "ContentTransform":
        obj = cls(int(meta["dim"]), gamma=t["gamma"], base=t["R0"], log_scale=t["log_s"],
                  learn_rotation=bool(meta.get("learn_rotation", True)), dtype=t["log_s"].dtype)
        obj.A.data.copy_(t["A"])
        obj.meta = {k: v for k, v in meta.items() if k not in ("kind", "dim", "learn_rotation")}
        return obj

    def save(self, path: str | os.PathLike) -> None:
        """Write ``path.safetensors`` + ``path.json``."""
        t, m = self.state()
        _write_pair(_strip(path), t, m)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ContentTransform":
        t, m = _read_pair(_strip(path))
        return cls.from_state(t, m)


# ---------------------------------------------------------------------- RoPE
class RopeTransform(nn.Module):
    """Per-pair complex scalar ``s_i e^{i phi_i}`` on the RoPE key (DESIGN.md §6).

    Parameters ``phi [d/2]`` and ``log_s [d/2]`` (clipped to [-2, 2]). ``layout``: pairing of
    the raw pre-RoPE channels (used by :meth:`fuse`); ``cache_layout``: pairing of post-RoPE
    cached keys and queries (used by ``apply_to_*``; defaults to ``layout``).
    """

    kind = "rope"

    def __init__(
        self,
        dim: int,
        layout: str = "interleaved",
        cache_layout: str | None = None,
        log_scale: torch.Tensor | None = None,
        angle: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        cache_layout = layout if cache_layout is None else cache_layout
        if cache_layout not in LAYOUTS:
            raise ValueError(f"cache_layout: expected one of {LAYOUTS}, got {cache_layout!r}")
        if dim % 2:
            raise ValueError(f"dim: expected an even RoPE dimension, got {dim}")
        self.dim, self.layout, self.cache_layout = int(dim), layout, cache_layout
        n = dim // 2
        self.phi = nn.Parameter(torch.zeros(n, dtype=dtype) if angle is None else angle.detach().to(dtype).clone())
        self.log_s = nn.Parameter(torch.zeros(n, dtype=dtype) if log_scale is None else log_scale.detach().to(dtype).clone())
        self.register_buffer("pairs", rope_pair_indices(dim, layout), persistent=False)
        self.register_buffer("cache_pairs", rope_pair_indices(dim, cache_layout), persistent=False)
        self.meta: dict[str, Any] = {}

    @property
    def s(self) -> torch.Tensor:
        """Per-pair positive scale ``[d/2]``."""
        return torch.exp(self.log_s.clamp(-LOG_SCALE_CLIP, LOG_SCALE_CLIP))

    def _map(self, x: torch.Tensor, key: bool, inverse: bool, raw: bool) -> torch.Tensor:
        pairs = (self.pairs if raw else self.cache_pairs).to(x.device)
        dt = torch.promote_types(x.dtype, self.phi.dtype)  # float64 inputs are computed in float64
        phi = (-self.phi if inverse else self.phi).to(dt)
        s = self.s.to(dt)
        mult = s if key != inverse else 1.0 / s
        return _pair_rotate(x.to(dt), torch.cos(phi), torch.sin(phi), mult, pairs)

    def apply_to_cache(self, kr: torch.Tensor, raw: bool = False) -> torch.Tensor:
        """Key ``kr [..., d]`` -> ``s Rot(phi) kr`` per pair (cache pairing; ``raw=True``: pre-RoPE pairing)."""
        return self._map(kr, key=True, inverse=False, raw=raw)

    def apply_to_query(self, qr: torch.Tensor, raw: bool = False) -> torch.Tensor:
        """Query rope part ``qr [..., d]`` -> ``Rot(phi) qr / s`` per pair."""
        return self._map(qr, key=False, inverse=False, raw=raw)

    def inverse(self, kr: torch.Tensor, raw: bool = False) -> torch.Tensor:
        """Transformed key -> native key (``Rot(-phi) / s``)."""
        return self._map(kr, key=True, inverse=True, raw=raw)

    def inverse_query(self, qr: torch.Tensor, raw: bool = False) -> torch.Tensor:
        """Transformed query -> native query (``Rot(-phi) * s``)."""
        return self._map(qr, key=False, inverse=True, raw=raw)

    @torch.no_grad()
    def fuse(self, layer: Any) -> None:
        """Fold into ``kv_a_proj_with_mqa`` rows ``[d_c:]`` and each head's RoPE rows of ``q_proj``/``q_b_proj``."""
        L = _LayerView.of(layer)
        if L.d_r != self.dim:
            raise ValueError(f"layer: qk_rope_head_dim {L.d_r} does not match the transform dim {self.dim}")
        dev = L.kv_a_proj_with_mqa.weight.device
        pairs = self.pairs.to(dev)
        phi = self.phi.detach().double().to(dev)
        cos, sin = torch.cos(phi), torch.sin(phi)
        s = self.s.detach().double().to(dev)

        def rot_rows(w: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
            # w [d_r, in]: rows are output channels; act on rows as on a key vector
            wd = w.double().transpose(0, 1)  # [in, d_r]
            return _pair_rotate(wd, cos, sin, mult, pairs).transpose(0, 1).to(w.dtype)

        kva = L.kv_a_proj_with_mqa
        d = L.d_c
        kva.weight.data[d:] = rot_rows(kva.weight.data[d:], s)
        if kva.bias is not None:
            kva.bias.data[d:] = rot_rows(kva.bias.data[d:].unsqueeze(1), s).squeeze(1)
        qp = L.q_out_proj
        hd = L.qk_nope_head_dim + L.d_r
        wq = qp.weight.data.view(L.num_heads, hd, -1)
        for h in range(L.num_heads):
            wq[h, L.qk_nope_head_dim:] = rot_rows(wq[h, L.qk_nope_head_dim:], 1.0 / s)
        if qp.bias is not None:
            bq = qp.bias.data.view(L.num_heads, hd)
            for h in range(L.num_heads):
                bq[h, L.qk_nope_head_dim:] = rot_rows(bq[h, L.qk_nope_head_dim:].unsqueeze(1), 1.0 / s).squeeze(1)

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        t = {"phi": self.phi.detach(), "log_s": self.log_s.detach(), "s": self.s.detach()}
        return t, {"kind": self.kind, "dim": self.dim, "layout": self.layout, "cache_layout": self.cache_layout, **self.meta}

    @classmethod
    def from_state(cls, t: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> "RopeTransform":
        obj = cls(int(meta["dim"]), meta["layout"], meta.get("cache_layout"), log_scale=t["log_s"], angle=t["phi"],
                  dtype=t["phi"].dtype)
        obj.meta = {k: v for k, v in meta.items() if k not in ("kind", "dim", "layout", "cache_layout")}
        return obj

    def save(self, path: str | os.PathLike) -> None:
        t, m = self.state()
        _write_pair(_strip(path), t, m)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RopeTransform":
        t, m = _read_pair(_strip(path))
        return cls.from_state(t, m)


# ---------------------------------------------------------------------- layer view
class _LayerView:
    """Duck-typed access to an MLA layer: an ``MLALayerSpec`` or a transformers attention module."""

    def __init__(self, attn: nn.Module, num_heads: int, d_c: int, d_r: int, d_nope: int, q_lora: bool) -> None:
        self.kv_a_proj_with_mqa = attn.kv_a_proj_with_mqa
        self.kv_a_layernorm = attn.kv_a_layernorm
        self.kv_b_proj = attn.kv_b_proj
        self.q_out_proj = attn.q_b_proj if q_lora else attn.q_proj
        self.num_heads, self.d_c, self.d_r, self.qk_nope_head_dim = num_heads, d_c, d_r, d_nope

    @classmethod
    def of(cls, layer: Any) -> "_LayerView":
        if hasattr(layer, "q_out_proj") and hasattr(layer, "kv_lora_rank"):  # MLALayerSpec-like
            v = cls.__new__(cls)
            v.kv_a_proj_with_mqa, v.kv_a_layernorm = layer.kv_a_proj_with_mqa, layer.kv_a_layernorm
            v.kv_b_proj, v.q_out_proj = layer.kv_b_proj, layer.q_out_proj
            v.num_heads, v.d_c, v.d_r = layer.num_heads, layer.kv_lora_rank, layer.qk_rope_head_dim
            v.qk_nope_head_dim = layer.qk_nope_head_dim
            return v
        if isinstance(layer, nn.Module) and hasattr(layer, "kv_a_proj_with_mqa"):
            cfg = getattr(layer, "config", None)
            g = lambda a: getattr(layer, a, None) if getattr(layer, a, None) is not None else getattr(cfg, a)
            q_lora = getattr(layer, "q_b_proj", None) is not None
            nh = getattr(layer, "num_heads", None) or cfg.num_attention_heads
            return cls(layer, int(nh), int(g("kv_lora_rank")), int(g("qk_rope_head_dim")),
                       int(g("qk_nope_head_dim")), q_lora)
        raise TypeError(f"layer: expected an MLALayerSpec or an MLA attention module, got {type(layer).__name__}")


# ---------------------------------------------------------------------- model-level helpers
def fuse(layers: Iterable[Any], content: Mapping[int, ContentTransform] | None = None,
         rope: Mapping[int, RopeTransform] | None = None) -> None:
    """Fuse per-layer transforms (keyed by ``layer_idx``) into ``layers`` (``MLALayerSpec`` list)."""
    for L in layers:
        idx = int(L.layer_idx)
        if content and idx in content:
            content[idx].fuse(L)
        if rope and idx in rope:
            rope[idx].fuse(L)


def save_transforms(directory: str | os.PathLike, content: Mapping[int, ContentTransform],
                    rope: Mapping[int, RopeTransform], meta: Mapping[str, Any] | None = None,
                    name: str = "quantmla_transforms") -> None:
    """Write all layers' transforms to ``directory/name.safetensors`` + ``name.json``."""
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, Any] = {}
    for kind, group in (("content", content), ("rope", rope)):
        for idx, tr in group.items():
            t, m = tr.state()
            for k, v in t.items():
                tensors[f"layers.{idx}.{kind}.{k}"] = v
            layers.setdefault(str(idx), {})[kind] = m
    _write_pair(os.path.join(os.fspath(directory), name), tensors, {"version": 1, "layers": layers, **dict(meta or {})})


def load_transforms(directory: str | os.PathLike, name: str = "quantmla_transforms"
                    ) -> tuple[dict[int, ContentTransform], dict[int, RopeTransform], dict[str, Any]]:
    """Inverse of :func:`save_transforms`: ``(content, rope, meta)``."""
    t, meta = _read_pair(os.path.join(os.fspath(directory), name))
    content: dict[int, ContentTransform] = {}
    rope: dict[int, RopeTransform] = {}
    for idx, kinds in meta["layers"].items():
        for kind, m in kinds.items():
            pre = f"layers.{idx}.{kind}."
            sub = {k[len(pre):]: v for k, v in t.items() if k.startswith(pre)}
            if kind == "content":
                content[int(idx)] = ContentTransform.from_state(sub, m)
            else:
                rope[int(idx)] = RopeTransform.from_state(sub, m)
    return content, rope, {k: v for k, v in meta.items() if k != "layers"}
