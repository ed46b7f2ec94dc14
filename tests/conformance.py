"""Conformance helpers every backend's tests call: writer vs reference, attention vs reference."""

from __future__ import annotations

import numpy as np
import torch

import quantmla_core as qm
from quantmla_core import reference as ref
from quantmla_core.reference.quantize import bits_to_bf16
from quantmla_core.testing import Case, allocate, check_attention, write_case


def _pages_np(cache) -> np.ndarray:
    return cache.pages if isinstance(cache.pages, np.ndarray) else cache.pages.cpu().numpy()


def assert_pages_match(fmt: qm.PackFormat, got: np.ndarray, want: np.ndarray, written_pages: np.ndarray,
                       inputs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
    """Codes may differ by ±1 only where the reference's x/s sits on a .5 boundary (DESIGN §3.1);
    scales, zeros and BF16 values must be identical. Checked per section on written pages.
    ``inputs``: (latent, k_rope, slot_mapping) as written; with them every differing code is held
    to the rule itself (:func:`assert_code_diffs_at_half`), without them at most 0.1 % may differ
    (bfloat16 inputs put x/s exactly on a tie for ~0.1-0.2 % of 8-bit codes, where a kernel that
    rounds an exact product may go either way)."""
    for name, (off, size) in fmt.sections.items():
        g = got[written_pages, off : off + size]
        w = want[written_pages, off : off + size]
        if name.endswith("codes") and fmt.quantized:
            bits = fmt.content_bits if name.startswith("content") else fmt.rope_bits
            gu, wu = ref.unpack(g, bits).astype(int), ref.unpack(w, bits).astype(int)
            diff = np.abs(gu - wu)
            assert diff.max() <= 1, f"{name}: code differs by {diff.max()}"
            if inputs is None:
                assert (diff > 0).mean() < 1e-3, f"{name}: {(diff > 0).mean():.2%} codes differ by 1"
        else:
            assert np.array_equal(g, w), f"{name}: bytes differ in {(g != w).sum()} places"
    if inputs is not None:
        assert_code_diffs_at_half(fmt, got, want, *inputs)


def _token_sections(fmt: qm.PackFormat, pages: np.ndarray, slots: np.ndarray, name: str) -> np.ndarray:
    """Bytes of section ``name`` of each token at global ``slots`` -> ``[n, bytes per token]``."""
    off, size = fmt.sections[name]
    per_page = pages[slots // fmt.page_size, off : off + size]
    rows = per_page.reshape(len(slots), fmt.page_size, size // fmt.page_size)
    return rows[np.arange(len(slots)), slots % fmt.page_size]


def _stored_scales(raw: np.ndarray, scale_dtype: str) -> np.ndarray:
    """``[n, groups * bytes]`` stored scale bytes -> float64 ``[n, groups]``."""
    if scale_dtype == "bfloat16":
        return bits_to_bf16(raw.copy().view("<u2")).astype(np.float64)
    return raw.copy().view("<f4").astype(np.float64)


def assert_code_diffs_at_half(fmt: qm.PackFormat, got: np.ndarray, want: np.ndarray, latent: np.ndarray,
                              k_rope: np.ndarray, slot_mapping: np.ndarray) -> None:
    """DESIGN §3.1's ±1 rule, strictly: a code may differ from the reference's only where x/s
    (s the stored scale) lies within float32 rounding of a .5 boundary, and only to the code on
    the other side of it. ``latent [N, d_c]``, ``k_rope [N, d_r]``: the float32 values written at
    ``slot_mapping [N]`` (the last write of a slot wins); ``got``/``want``: uint8 page arrays."""
    if not fmt.quantized:
        return
    num_slots = got.shape[0] * fmt.page_size
    last = {int(s): i for i, s in enumerate(slot_mapping) if 0 <= s < num_slots}
    slots = np.fromiter(last.keys(), np.int64, len(last))
    rows = np.fromiter(last.values(), np.int64, len(last))
    for path, x_all, bits, group, scale_dtype in (
        ("content", latent, fmt.content_bits, fmt.content_group_size, fmt.content_scale_dtype),
        ("rope", k_rope, fmt.rope_bits, fmt.rope_group_size, fmt.rope_scale_dtype),
    ):
        codes_got = ref.unpack(_token_sections(fmt, got, slots, f"{path}_codes"), bits)
        codes_want = ref.unpack(_token_sections(fmt, want, slots, f"{path}_codes"), bits)
        differs = codes_got != codes_want
        if not differs.any():
            continue
        x = np.asarray(x_all, np.float32)[rows].astype(np.float64)
        x = np.where(np.isfinite(x), x, 0.0)
        s = _stored_scales(_token_sections(fmt, want, slots, f"{path}_scales"), scale_dtype)
        z = np.repeat(_token_sections(fmt, want, slots, f"{path}_zeros").astype(np.int64), group, axis=1)
        quotient = x / np.repeat(s, group, axis=1)
        near_half = np.abs(quotient - np.floor(quotient) - 0.5) <= 2.0**-19 * np.maximum(1.0, np.abs(quotient))
        m = (1 << bits) - 1
        below = np.clip(np.floor(quotient).astype(np.int64) + z, 0, m)  # the two codes either side of it
        above = np.clip(below + 1, 0, m)
        bad = differs & ~(near_half & ((codes_got == below) | (codes_got == above)))
        assert not bad.any(), (f"{path} codes: {bad.sum()} differ from the reference other than across a .5 boundary "
                               f"(x/s = {quotient[bad][:4]})")


def write_both(case: Case, backend: str, device: str, dtype: str = "float32"):
    """Write a case with ``backend`` on ``device`` and with the reference on NumPy-compatible CPU."""
    batch, _, cache = write_case(case, device, dtype, backend)
    host_args = batch.to("cpu", dtype)
    want = allocate(case, batch, "cpu", protect_dtype=cache.sink_buf.dtype if not isinstance(cache.sink_buf, np.ndarray) else torch.float32)
    ref.write(want, host_args["latent"], host_args["k_rope"], batch.slot_mapping, batch.seq_ids, batch.positions, batch.seq_lens)
    return batch, cache, want


def check_writer(case: Case, backend: str, device: str, dtype: str = "float32") -> None:
    batch, cache, want = write_both(case, backend, device, dtype)
    written = np.unique(batch.slot_mapping[batch.slot_mapping >= 0] // case.fmt.page_size)
    host = batch.to("cpu", dtype)
    inputs = (host["latent"].float().numpy(), host["k_rope"].float().numpy(), batch.slot_mapping)
    assert_pages_match(case.fmt, _pages_np(cache), want.pages.numpy(), written, inputs)
    for buf in ("sink_buf", "local_buf"):
        got, exp = getattr(cache, buf), getattr(want, buf)
        got = torch.as_tensor(got).cpu().float()
        assert torch.equal(got, exp.float()), f"{buf} differs"


def check_attention_case(case: Case, write_backend: str, attn_backend: str, device: str, dtype: str = "float32"):
    """Write with one backend, attend with another; compare with the reference on the same cache."""
    batch, args, cache = write_case(case, device, dtype, write_backend)
    out, lse = qm.attention(args["q_latent"], args["q_rope"], cache, block_table=args["block_table"],
                            seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"],
                            softmax_scale=batch.softmax_scale, backend=attn_backend)
    host_cache = cache if device in ("cpu", "numpy") else cache_to_cpu(cache)
    q = args["q_latent"] if device == "numpy" else args["q_latent"].cpu()
    r = args["q_rope"] if device == "numpy" else args["q_rope"].cpu()
    ref_out, ref_lse = ref.decode_attention(q, r, host_cache, batch.block_table, batch.attn_seq_lens,
                                            batch.attn_seq_ids, batch.softmax_scale)
    assert str(out.dtype).endswith(dtype), f"out dtype {out.dtype}, expected {dtype}"
    return check_attention(out, lse, ref_out, ref_lse, dtype)


def reference_outputs(batch, args, cache):
    """The float64 reference's (out, lse) for ``write_case``'s ``batch`` and ``args`` over ``cache`` (any torch
    device: copied to host memory first)."""
    return ref.decode_attention(args["q_latent"].cpu(), args["q_rope"].cpu(), cache_to_cpu(cache), batch.block_table,
                                batch.attn_seq_lens, batch.attn_seq_ids, batch.softmax_scale)


def check_poisoned_partials(monkeypatch, launcher, case: Case, num_splits: int, variant: str) -> None:
    """Triton split kernel ``variant`` (``launcher``: ``backends.triton.attention``) over ``case`` on CUDA in
    ``num_splits`` splits, with its partials' memory and the outputs NaN-filled: the outputs come back finite (every
    partial a split owns was written) and match the reference."""
    carve = launcher.carve
    monkeypatch.setattr(launcher, "carve", lambda specs, device: [t.fill_(float("nan")) for t in carve(specs, device)])
    batch, args, cache = write_case(case, "cuda", "bfloat16")
    out = torch.full_like(args["q_latent"], float("nan"))
    lse = torch.full(args["q_latent"].shape[:-1], float("nan"), device="cuda")
    call = launcher.prepare(cache, args["block_table"], args["attn_seq_lens"], args["attn_seq_ids"],
                            *args["q_latent"].shape[:3], torch.bfloat16, batch.softmax_scale, num_splits=num_splits,
                            variant=variant)
    call.run(args["q_latent"], args["q_rope"], cache, out=out, lse=lse)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    want_out, want_lse = reference_outputs(batch, args, cache)
    check_attention(out, lse, want_out, want_lse, "bfloat16")


def cache_to_cpu(cache):
    """A copy of a device cache in host memory (torch CPU tensors)."""
    return qm.MLACache(cache.format, cache.pages.cpu(), cache.sink_buf.cpu(), cache.local_buf.cpu(),
                       cache.max_seqs, cache.sink, cache.local)
