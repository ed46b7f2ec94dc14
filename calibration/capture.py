"""Teacher activations: calibration tokens, attention-input hooks, and per-layer MLA tensors.

The teacher is the unmodified model (its own dtype, e.g. BF16 or float32). Forward pre-hooks on
every MLA attention module record its ``hidden_states`` input and ``position_embeddings``;
:func:`layer_tensors` then recomputes, in float32, everything the objectives need for that
layer (see :class:`LayerData`). A forward hook records the module's own output so that the
recomputation can be checked against the model (``LayerCapture.y_model``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Sequence

import torch
from torch import nn

from .adapters import MLALayerSpec

__all__ = [
    "default_text",
    "read_texts",
    "tokenize",
    "make_sequences",
    "LayerCapture",
    "LayerData",
    "capture",
    "layer_tensors",
    "rms_normalize",
]


# ---------------------------------------------------------------------- text
def default_text() -> str:
    """The embedded calibration text (``calibration/data/default.txt``, written for this project)."""
    try:
        return resources.files("quantmla_core.calibration").joinpath("data/default.txt").read_text(encoding="utf-8")
    except (FileNotFoundError, ModuleNotFoundError):
        here = os.path.join(os.path.dirname(__file__), "data", "default.txt")
        with open(here, encoding="utf-8") as f:
            return f.read()


def read_texts(paths: Sequence[str | os.PathLike] | None) -> str:
    """Concatenate local text files (the embedded default when ``paths`` is empty)."""
    if not paths:
        return default_text()
    parts = []
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
    return "\n\n".join(parts)


def tokenize(text: str, tokenizer: Any | None, vocab_size: int) -> torch.Tensor:
    """Token ids ``[n]`` int64. Without a tokenizer: UTF-8 bytes modulo ``vocab_size`` (tiny test models)."""
    if tokenizer is not None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long) % vocab_size


def make_sequences(ids: torch.Tensor, n: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``n`` windows of ``seq_len`` tokens, ``[n, seq_len]`` int64.

    Windows start at evenly spaced offsets over the token stream; a stream shorter than
    ``n * seq_len`` is cycled (windows then overlap; starts are jittered by ``seed``).
    """
    if ids.numel() == 0:
        raise ValueError("text: calibration text produced no tokens")
    total = n * seq_len
    reps = (total + seq_len) // ids.numel() + 2
    stream = ids.repeat(reps)
    g = torch.Generator().manual_seed(seed)
    span = max(ids.numel(), 1)
    step = span / max(n, 1)
    jitter = torch.randint(0, max(int(step), 1), (n,), generator=g)
    starts = [int(i * step) + int(j) for i, j in zip(range(n), jitter)]
    return torch.stack([stream[s : s + seq_len] for s in starts])


# ---------------------------------------------------------------------- capture
@dataclass
class LayerCapture:
    """Raw captures for one layer: inputs ``x [N, T, hidden]``, position embeddings per batch."""

    spec: MLALayerSpec
    x: list[torch.Tensor] = field(default_factory=list)
    pos: list[Any] = field(default_factory=list)
    y_model: list[torch.Tensor] = field(default_factory=list)


def _to_cpu(pe: Any) -> Any:
    if torch.is_tensor(pe):
        return pe.detach().cpu()
    if isinstance(pe, (tuple, list)):
        return type(pe)(_to_cpu(p) for p in pe)
    return pe


@torch.no_grad()
def capture(model: nn.Module, specs: Sequence[MLALayerSpec], input_ids: torch.Tensor, batch_size: int = 4,
            progress: bool = False) -> dict[int, LayerCapture]:
    """Run the teacher on ``input_ids [N, T]`` and record each MLA layer's attention inputs/outputs.

    Returns ``{layer_idx: LayerCapture}``; tensors on CPU in the model's dtype.
    """
    caps = {s.layer_idx: LayerCapture(s) for s in specs}
    handles = []
    for s in specs:
        cap = caps[s.layer_idx]

        def pre(mod: nn.Module, args: tuple, kwargs: dict, cap: LayerCapture = cap) -> None:
            hs = kwargs.get("hidden_states", args[0] if args else None)
            pe = kwargs.get("position_embeddings")
            if pe is None:
                pe = next((a for a in args[1:] if torch.is_tensor(a) or isinstance(a, tuple)), None)
            cap.x.append(hs.detach().cpu())
            cap.pos.append(_to_cpu(pe))

        def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any, cap: LayerCapture = cap) -> None:
            y = out[0] if isinstance(out, (tuple, list)) else out
            cap.y_model.append(y.detach().cpu())

        handles.append(s.attn.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(s.attn.register_forward_hook(post, with_kwargs=True))
    dev = next(model.parameters()).device
    it = range(0, input_ids.shape[0], batch_size)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="teacher forward", unit="batch")
    try:
        for i in it:
            model(input_ids=input_ids[i : i + batch_size].to(dev), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return caps


# ---------------------------------------------------------------------- per-layer tensors
def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last dim, float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@dataclass
class LayerData:
    """Float32 teacher tensors of one layer (N sequences of T tokens), on one device.

    ``u [N, T, d_c]`` weightless-normalized latent; ``gamma [d_c]`` (times the adapter's
    ``latent_scale``) so the native cache is ``c = u * gamma``; ``kr [N, T, d_r]`` post-RoPE key
    (cache pairing); ``qn [N, H, T, d_nope]`` query content part and ``w_uk [H, d_nope, d_c]``
    (the absorbed query ``qc = qn @ W_UK [N, H, T, d_c]`` is formed on demand, per mini-batch);
    ``qr [N, H, T, d_r]`` post-RoPE query rope part; ``w_uv [H, d_v, d_c]``; ``tau`` the softmax
    scale; ``y [N, T, hidden]`` teacher attention output after ``o_proj`` recomputed from these.
    """

    spec: MLALayerSpec
    u: torch.Tensor
    gamma: torch.Tensor
    kr: torch.Tensor
    qn: torch.Tensor
    qr: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    tau: float
    y: torch.Tensor

    @property
    def c(self) -> torch.Tensor:
        return self.u * self.gamma

    @property
    def qc(self) -> torch.Tensor:
        """Absorbed content query ``[N, H, T, d_c]`` (computed on each access)."""
        return torch.einsum("nhtd,hdc->nhtc", self.qn, self.w_uk)

    @property
    def n(self) -> int:
        return self.u.shape[0]

    def subset(self, idx: slice | torch.Tensor) -> "LayerData":
        """Rows (sequences) ``idx`` of every per-sequence tensor."""
        return LayerData(self.spec, self.u[idx], self.gamma, self.kr[idx], self.qn[idx], self.qr[idx], self.w_uk,
                         self.w_uv, self.o_weight, self.o_bias, self.tau, self.y[idx])


@torch.no_grad()
def layer_tensors(cap: LayerCapture, device: torch.device | str = "cpu") -> LayerData:
    """Recompute one layer's MLA tensors in float32 from captured inputs (see :class:`LayerData`)."""
    from .objectives import attention_output  # local import: objectives imports this module's types

    s = cap.spec
    H, dn, dr, dc, dv = s.num_heads, s.qk_nope_head_dim, s.d_r, s.d_c, s.v_head_dim

    def lin(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        w = m.weight.detach().float().to(device)
        b = None if m.bias is None else m.bias.detach().float().to(device)
        return torch.nn.functional.linear(x, w, b)

    us, krs, qns, qrs = [], [], [], []
    kvb = s.kv_b_proj.weight.detach().float().to(device).view(H, dn + dv, dc)
    w_uk, w_uv = kvb[:, :dn], kvb[:, dn:]
    for x, pe in zip(cap.x, cap.pos):
        x = x.float().to(device)
        B, T, _ = x.shape
        pe = pe.to(device) if torch.is_tensor(pe) else tuple(p.to(device) for p in pe)
        if s.q_lora_rank is None:
            q = lin(s.q_proj, x)
        else:
            qa = lin(s.q_a_proj, x)
            norm = s.q_a_layernorm
            q = rms_normalize(qa, float(getattr(norm, "variance_epsilon", 1e-6))) * norm.weight.detach().float().to(device)
            q = lin(s.q_b_proj, q)
        q = q.view(B, T, H, dn + dr).transpose(1, 2) * s.query_scale
        qn, qraw = q[..., :dn], q[..., dn:]
        ckv = lin(s.kv_a_proj_with_mqa, x)
        us.append(rms_normalize(ckv[..., :dc], s.rms_eps))
        krs.append(s.apply_rope(ckv[..., dc:], pe))
        qrs.append(s.apply_rope(qraw, pe))
        qns.append(qn.contiguous())
    gamma = s.kv_a_layernorm.weight.detach().float().to(device) * s.latent_scale
    o_w = s.o_proj.weight.detach().float().to(device)
    o_b = None if s.o_proj.bias is None else s.o_proj.bias.detach().float().to(device)
    data = LayerData(s, torch.cat(us), gamma, torch.cat(krs), torch.cat(qns), torch.cat(qrs), w_uk, w_uv, o_w, o_b,
                     float(s.softmax_scale), torch.empty(0))
    ys = []
    for i in range(0, data.n, 8):  # chunked: the absorbed query is d_c wide per head
        sub = data.subset(slice(i, i + 8))
        ys.append(attention_output(sub, sub.c, sub.kr))
    data.y = torch.cat(ys)
    return data
