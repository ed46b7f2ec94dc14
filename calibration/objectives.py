"""The two calibration objectives (DESIGN.md §7), with the quantizer in the loop (STE).

Both objectives take *codecs*: a content codec ``(encode(u) -> cached values, decode(cached)
-> native c)`` and a RoPE codec ``(encode(kr) -> cached, decode(cached) -> native kr)``, so
that learned transforms, RTN, SmoothQuant-style scales and Hadamard rotations are scored by the
same code and the same quantizer (``quantmla_core.quantizer.fake_quantize``).

* content: ``||Y(Q(z), kr) - Y(c, kr)||^2 / ||Y(c, kr)||^2`` with Y the attention output after
  ``o_proj``, the RoPE path exact;
* RoPE: ``||Omega * (qr . Q(k')^T - qr . kr^T)||^2 / ||Omega * qr . kr^T||^2`` over all heads,
  Omega the causal mask (query t sees keys <= t), the content path exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from quantmla_core.formats import PackFormat
from quantmla_core.quantizer import dequantize, fake_quantize, quantize, store_dtype

from .capture import LayerData

Codec = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]

__all__ = ["QuantSpec", "attention_output", "content_objective", "rope_objective", "causal_mask"]


@dataclass(frozen=True)
class QuantSpec:
    """Bits, group sizes and scale dtypes of the two paths, from a :class:`PackFormat` name."""

    content_bits: int
    rope_bits: int
    content_group: int
    rope_group: int
    content_scale_dtype: torch.dtype = torch.bfloat16
    rope_scale_dtype: torch.dtype = torch.float32
    ste: str = "range"

    @classmethod
    def from_format(cls, fmt: str | PackFormat, d_c: int, d_r: int, ste: str = "range") -> "QuantSpec":
        """Group sizes follow DESIGN.md §3.4 (a vector shorter than G forms one group)."""
        f = PackFormat.parse(fmt) if isinstance(fmt, str) else fmt
        if not f.quantized:
            raise ValueError(f"fmt: calibration needs a quantized format, got {f.name}")
        gc, gr = min(f.group_size, d_c), min(f.group_size, d_r)
        if d_c % gc or d_r % gr:
            raise ValueError(f"fmt: dims d_c={d_c}, d_r={d_r} are not multiples of the group size {f.group_size}")
        if ste not in ("range", "identity"):
            raise ValueError(f"ste: expected 'range' or 'identity', got {ste!r}")
        return cls(f.content_bits, f.rope_bits, gc, gr, store_dtype(f.content_scale_dtype),
                   store_dtype(f.rope_scale_dtype), ste)

    def _fq(self, x: torch.Tensor, bits: int, g: int, dt: torch.dtype) -> torch.Tensor:
        if self.ste == "identity":
            return fake_quantize(x, bits, g, dt)
        return fake_quantize_range_ste(x, bits, g, dt)

    def q_content(self, z: torch.Tensor) -> torch.Tensor:
        return self._fq(z, self.content_bits, self.content_group, self.content_scale_dtype)

    def q_rope(self, k: torch.Tensor) -> torch.Tensor:
        return self._fq(k, self.rope_bits, self.rope_group, self.rope_scale_dtype)


def fake_quantize_range_ste(x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Quantize-dequantize (values exactly those of ``quantmla_core.quantizer``) with a range-aware STE.

    The straight-through estimator is applied to the rounding only: with the group step
    ``s = (max(x,0) - min(x,0)) / m`` kept differentiable, ``d x_hat / d x = 1`` and
    ``d x_hat / d s = (x_hat - x) / s`` (LSQ-style). The plain identity STE
    (``quantizer.fake_quantize``) ignores that the step grows with the group's range, so its
    gradient always says "scale this channel up"; this one sees the range. ``x [..., d]``.
    """
    m = float(2**bits - 1)
    *lead, d = x.shape
    codes, s_st, z = quantize(x.detach(), bits, group_size, scale_dtype)
    xq = dequantize(codes, s_st, z, group_size).to(x.dtype)
    g = x.reshape(*lead, d // group_size, group_size)
    s_diff = ((g.amax(-1).clamp(min=0.0) - g.amin(-1).clamp(max=0.0)) / m).clamp_min(1e-8)
    s_det = s_st.float().clamp_min(1e-8).unsqueeze(-1)
    r = ((xq - x).detach().reshape_as(g) / s_det)  # rounding residual in steps
    out = g + r * s_diff.unsqueeze(-1)
    return out.reshape(*lead, d) + (xq - out.reshape(*lead, d)).detach()


def causal_mask(T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[T, T]`` bool, True where query t may see key n (n <= t)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def attention_output(d: LayerData, c: torch.Tensor, kr: torch.Tensor) -> torch.Tensor:
    """MLA attention after ``o_proj`` (absorbed form, DESIGN.md §2), float32.

    ``c [N, T, d_c]`` native content cache, ``kr [N, T, d_r]`` post-RoPE key -> ``Y [N, T, hidden]``.
    """
    scores = torch.einsum("nhtc,nsc->nhts", d.qc, c) + torch.einsum("nhtr,nsr->nhts", d.qr, kr)  # d.qc: absorbed
    T = c.shape[1]
    scores = (scores * d.tau).masked_fill(~causal_mask(T, c.device), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    lat = torch.einsum("nhts,nsc->nhtc", p, c)
    v = torch.einsum("nhtc,hvc->nthv", lat, d.w_uv)
    v = v.reshape(*v.shape[:2], -1)
    return torch.nn.functional.linear(v, d.o_weight, d.o_bias)


def _nmse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).pow(2).sum() / b.pow(2).sum().clamp_min(1e-30)


def content_objective(d: LayerData, codec: Codec, qs: QuantSpec, quantize: bool = True) -> torch.Tensor:
    """Normalized attention-output error of the content path (scalar tensor, differentiable)."""
    enc, dec = codec
    z = enc(d.u)
    zq = qs.q_content(z) if quantize else z
    c_hat = dec(zq)
    return _nmse(attention_output(d, c_hat, d.kr), d.y)


def rope_objective(d: LayerData, codec: Codec, qs: QuantSpec, quantize: bool = True) -> torch.Tensor:
    """Normalized causal-masked positional QK error over all heads (scalar tensor)."""
    enc, dec = codec
    k = enc(d.kr)
    kq = qs.q_rope(k) if quantize else k
    k_hat = dec(kq)
    T = d.kr.shape[1]
    m = causal_mask(T, d.kr.device)
    s_ref = torch.einsum("nhtr,nsr->nhts", d.qr, d.kr)
    s_hat = torch.einsum("nhtr,nsr->nhts", d.qr, k_hat)
    err = ((s_hat - s_ref) * m).pow(2).sum()
    return err / (s_ref * m).pow(2).sum().clamp_min(1e-30)
