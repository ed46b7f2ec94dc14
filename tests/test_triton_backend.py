"""Triton backend against the reference.

Without a GPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set by
conftest.py) on small shapes; with a GPU the same tests run on CUDA and, in addition, at the
real shapes of DeepSeek-V2-Lite (H=16) and V3 (H=128), d_c=512, d_r=64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core import PackFormat, get_backend
from quantmla_core import reference as ref
from quantmla_core.testing import Case, allocate, build, check_attention, edge_lengths, generate_cases

from conformance import check_attention_case, check_writer

pytest.importorskip("triton")

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
BACKEND = get_backend("triton")


def _served(case: Case) -> bool:
    """Cases the backend declares it can attend over (C2R2 at d_r=32 has 8-wide slices: no)."""
    from quantmla_core.dispatch import DeviceInfo, Problem

    return not BACKEND.extra_reasons(Problem("attention", case.fmt, DeviceInfo("cuda"), num_heads=case.heads, q_len=case.s_q))


CASES = [c for c in generate_cases(BACKEND.capabilities, quick=not GPU) if _served(c)]
FORMATS = ("C4R4", "C2R4", "C4R8", "C8R8", "BF16")
DIMS = ((512, 64), (256, 32))


def _fmt_cases() -> list[Case]:
    """Every required format and dims at the edge lengths (several requests per batch)."""
    out, seed = [], 1000
    for name in FORMATS:
        for dc, dr in DIMS:
            fmt = PackFormat.parse(name, latent_dim=dc, rope_dim=dr)
            for lens in edge_lengths(fmt, 4, 16)[1:]:
                seed += 1
                out.append(Case(fmt, lens, heads=4, seed=seed))
    return out


FMT_CASES = _fmt_cases()


def test_backend_declares_cpu_only_in_interpreter():
    devices = BACKEND.capabilities.devices
    assert {"cuda", "rocm"} <= devices
    import os

    assert ("cpu" in devices) == (os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", FMT_CASES[::2] if not GPU else FMT_CASES, ids=str)
def test_writer_matches_reference(case, dtype):
    check_writer(case, "triton", DEVICE, dtype)


@pytest.mark.parametrize("case", FMT_CASES + CASES, ids=str)
def test_attention_matches_reference(case):
    """Pages written by the torch backend, read by Triton (float32 queries, tight tolerance)."""
    check_attention_case(case, "torch", "triton", DEVICE)


@pytest.mark.parametrize("case", FMT_CASES[::3], ids=str)
def test_triton_write_triton_read(case):
    check_attention_case(case, "triton", "triton", DEVICE)


@pytest.mark.parametrize("case", FMT_CASES[1::4], ids=str)
def test_triton_write_torch_read(case):
    check_attention_case(case, "triton", "torch", DEVICE)


@pytest.mark.parametrize("case", [c for c in FMT_CASES if c.fmt.latent_dim == 512][::2], ids=str)
def test_bf16_inputs(case):
    check_attention_case(case, "torch", "triton", DEVICE, "bfloat16")


@pytest.mark.parametrize("fmt_name", ["C4R4", "C2R4", "BF16"])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_split_counts_and_causal_sq(fmt_name, splits):
    """Forced split counts (some splits empty), S_q > 1 with and without protection."""
    from quantmla_core.backends.triton.attention import attention as triton_attention

    fmt = PackFormat.parse(fmt_name)
    for case in (Case(fmt, (300, 77, 5), heads=2, s_q=3, seed=splits), Case(fmt, (200, 9), heads=3, s_q=5, sink=0, local=0, seed=7 + splits)):
        batch = build(case)
        args = batch.to(DEVICE)
        cache = allocate(case, batch, DEVICE)
        qm.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
                 positions=args["positions"], seq_lens=args["seq_lens"], backend="torch")
        out, lse = triton_attention(args["q_latent"], args["q_rope"], cache, args["block_table"], args["attn_seq_lens"],
                                    args["attn_seq_ids"], batch.softmax_scale, num_splits=splits)
        host = qm.MLACache(cache.format, cache.pages.cpu(), cache.sink_buf.cpu(), cache.local_buf.cpu(), cache.max_seqs, cache.sink, cache.local)
        want_out, want_lse = ref.decode_attention(args["q_latent"].cpu(), args["q_rope"].cpu(), host, batch.block_table,
                                                  batch.attn_seq_lens, batch.attn_seq_ids, batch.softmax_scale)
        check_attention(out, lse, want_out, want_lse, "float32")


def test_bad_slots_are_skipped():
    """Slots -1 and out of range write nothing; the rest of the cache keeps its poison."""
    fmt = PackFormat.parse("C4R4")
    case = Case(fmt, (70,))
    batch = build(case)
    args = batch.to(DEVICE)
    slots = args["slot_mapping"].clone()
    slots[::3] = -1
    slots[1::7] = batch.num_pages * fmt.page_size + 5  # beyond the cache: masked in the kernel
    cache = allocate(case, batch, DEVICE)
    from quantmla_core.backends.triton.writer import write as triton_write

    triton_write(cache, args["latent"], args["k_rope"], slots, args["seq_ids"], args["positions"], args["seq_lens"])
    want = allocate(case, batch, "cpu")
    keep = slots.cpu().numpy()
    keep = np.where(keep >= batch.num_pages * fmt.page_size, -1, keep)
    ref.write(want, batch.latent, batch.k_rope, keep, batch.seq_ids, batch.positions, batch.seq_lens)
    assert torch.equal(cache.pages.cpu(), want.pages)


def test_output_shapes_3d_query():
    fmt = PackFormat.parse("C2R4")
    case = Case(fmt, (65, 3), heads=5)
    batch = build(case)
    args = batch.to(DEVICE)
    cache = allocate(case, batch, DEVICE)
    qm.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
             positions=args["positions"], seq_lens=args["seq_lens"], backend="triton")
    out, lse = qm.attention(args["q_latent"][:, 0], args["q_rope"][:, 0], cache, block_table=args["block_table"],
                            seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"],
                            softmax_scale=batch.softmax_scale, backend="triton")
    assert out.shape == (2, 5, 512) and lse.shape == (2, 5) and out.dtype == torch.float32


# ---------------------------------------------------------------- real shapes (GPU only)
REAL = [
    Case(PackFormat.parse(name), lens, heads=h, s_q=s_q, sink=4, local=128, seed=5000 + i)
    for i, (name, lens, h, s_q) in enumerate(
        [(n, (4099, 5, 700, 8192), h, s) for n in FORMATS for h in (16, 128) for s in (1, 4)]
    )
]


@pytest.mark.skipif(not GPU, reason="real shapes need a GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", REAL, ids=str)
def test_real_shapes_gpu(case, dtype):
    check_attention_case(case, "triton", "triton", "cuda", dtype)
