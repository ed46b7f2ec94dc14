"""Triton kernel v4 (Gluon, ``backends/triton/attention_v4_kernel.py``) checked without a GPU.

* Offline sm_90a builds (``offline_v4``) of every format it serves: no spills, shared memory within the 232,448 B a
  Hopper block may take, the expected ``wgmma`` count; skipped where this triton has no Gluon or no ``ptxas``.
* Its signature takes kernel v3's arguments (the launcher calls either with the same arguments and constexprs).
* A NumPy mirror of the loaders' word loads, shifts, joins and reshapes (Gluon has no interpreter) applied to pages
  the library's writer filled, bit-exact against ``reference.decode_page`` (float32, then bfloat16); controls with
  a wrong map must mismatch.
* A model of the two partitions' mbarrier protocol under random interleavings: no deadlock, no overwrite of a key
  slot or of P while a reader of it is pending, every read sees its own page; controls that drop a wait must fail.
* Kernel v5 (``attention_v5_kernel``, few query rows, the same loaders): offline sm_90a builds of its row blocks and
  prefetch depths (``wgmma`` count, pipelining, shared memory, spills, the register split).
"""

from __future__ import annotations

import ast
import inspect
import os
import random
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core import PackFormat
from quantmla_core import reference as ref
from quantmla_core.reference.quantize import bf16_round, bits_to_bf16

from mbarrier_model import Barrier as _Bar, failures, run_interleaved

pytest.importorskip("triton")

from quantmla_core.backends.triton import attention_v4_kernel as v4  # noqa: E402
from quantmla_core.backends.triton.heuristics import V4_PIPELINE  # noqa: E402

FORMATS = ("BF16", "C4R4", "C2R4")
SMEM_LIMIT = 232_448  # bytes of shared memory one Hopper block may take


def _needs_gluon():
    if v4.GLUON_IMPORT_ERROR is not None:
        pytest.skip(f"this triton has no usable Gluon: {v4.GLUON_IMPORT_ERROR}")


def _needs_ptxas():
    from quantmla_core.backends.triton.offline_build import _nvidia_tool

    if not os.path.exists(_nvidia_tool("ptxas")):
        pytest.skip("this triton bundles no ptxas")


def test_module_imports_without_gluon_errors():
    """The module imports on any triton; the kernel exists exactly where Gluon does."""
    assert isinstance(v4.GLUON_IMPORT_ERROR, (str, type(None)))
    assert (v4.split_kernel_v4 is not None) == (v4.GLUON_IMPORT_ERROR is None)


def test_signature_takes_v3_arguments():
    """Every parameter of ``split_kernel_v3`` in the same order (positional ones first), and whatever v4 adds has a
    default."""
    _needs_gluon()
    from quantmla_core.backends.triton.attention_v3_kernel import split_kernel_v3

    p3 = inspect.signature(split_kernel_v3.fn).parameters
    p4 = inspect.signature(v4.split_kernel_v4.fn).parameters
    assert list(p4)[: len(p3)] == list(p3)
    for name in list(p4)[len(p3):]:
        assert p4[name].default is not inspect.Parameter.empty, name
    for name, param in p3.items():  # constexprs stay constexprs, defaults stay defaults
        assert (param.annotation is inspect.Parameter.empty) == (p4[name].annotation is inspect.Parameter.empty), name
        assert (param.default is inspect.Parameter.empty) == (p4[name].default is inspect.Parameter.empty), name


@pytest.fixture(scope="module")
def reports() -> dict:
    """Each format's ``offline_v4.compile_report``, built in a subprocess without ``TRITON_INTERPRET`` (which this
    session sets, and under which Triton's frontend state from earlier tests can break a Gluon build)."""
    _needs_gluon()
    _needs_ptxas()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = {}
    configs = ((0, 0, 4, 0, 0), (1, 0, 4, 0, 0), (2, 0, 4, 0, 0), (3, 0, 4, 0, 0), (2, 3, 4, 0, 0), (1, 0, 8, 0, 0),
               (2, 0, 8, 0, 0), (3, 0, 8, 0, 0), (1, 0, 4, 1, 0), (1, 0, 8, 1, 0), (2, 0, 8, 1, 0), (1, 0, 8, 1, 1),
               (1, 4, 8, 1, 0), (4, 0, 8, 1, 0), (4, 0, 8, 1, 1))
    for pipeline, probe, warps, inline, order in configs:
        fmts = [f for f in FORMATS if pipeline != 4 or f != "BF16"]  # build 4 reads packed pages only
        cmd = [sys.executable, *(["-P"] if sys.flags.safe_path else []), "-m",
               "quantmla_core.backends.triton.offline_v4", *fmts, f"pipeline={pipeline}", f"probe={probe}",
               f"loader_warps={warps}", f"inline_prot={inline}", f"channel_order={order}"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tempfile.gettempdir())
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        assert len(lines) == len(fmts), r.stdout + r.stderr
        for fmt, line in zip(fmts, lines):
            key = (fmt, pipeline) if probe == 0 else (fmt, pipeline, "probe", probe)
            key = key if warps == 4 else (*key, "w8")
            key = (*key, "inline") if inline else key
            key = (*key, "channel_of") if order else key
            out[key] = ast.literal_eval(line)
            assert "err" not in out[key], out[key]
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_offline_probe_build(reports, fmt):
    """The measurement build without keys and without the loader's output product builds, its remaining wgmma (the
    attender's 40) still pipelined."""
    r = reports[fmt, 2, "probe", 3]
    assert r["probe"] == 3 and r["wgmma"] == 40 and not r["wgmma_serialized"] and r["spill_bytes"] == 0, r


@pytest.mark.parametrize("pipeline", [0, 1, 2, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_offline_sm90a_build(reports, fmt, pipeline):
    """(Almost) no spills; shared memory kc 128 KB + kr 16 KB + Q 72 KB + P 8 KB + alpha, l, barriers and the partitions'
    captured scalars (230,172 B with triton 3.6 and 3.7); 48 ``wgmma``: QK 9 x 4 (m64n64k16, K = 64 each), the
    attender's PV 4 (m64n256k16 over 64 tokens), the loader's PV 4, emitted twice (in its loop and after it)."""
    r = reports[fmt, pipeline]
    # build 1's packed loaders hold the next page's bytes beside the dequantization: C4R4 spills 68 bytes (3.7.1) or
    # 76 (3.6.0), C2R4 8 or 0, against ~1,200 instructions a page; build 2 holds only the content words
    assert r["spill_bytes"] <= (80 if pipeline in (1, 3) and fmt != "BF16" else 0), r
    # stop 54's builds had an empty-split path that left the wgmmas serialized, each waiting for the one before
    assert not r["wgmma_serialized"], r
    assert r["smem"] <= SMEM_LIMIT, r
    assert r["wgmma"] == 48, r
    assert r["regs"] <= 255, r
    assert max(r["setmaxnreg"]) == 256 and min(r["setmaxnreg"]) == (232 if fmt == "BF16" else 256 if pipeline else 248), r
    # one CTA of 4 + 4 warps after setmaxnreg fits the 64K-register file
    assert 128 * (256 + min(r["setmaxnreg"])) <= 65536


@pytest.mark.parametrize("pipeline", [1, 2, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_offline_sm90a_build_with_8_loader_warps(reports, fmt, pipeline):
    """With 8 loader warps (two warpgroups: half the tokens each to dequantize, half the loader's output channels
    each, m64n128 products): the same wgmma count, pipelined, and the register file shared as 128 x 232 (attender) +
    256 x 136 (loader). Build 2 is allowed a few spilled bytes (4 with triton 3.7.1's ptxas, 0 with 3.6's)."""
    r = reports[fmt, pipeline, "w8"]
    assert r["loader_warps"] == 8 and r["wgmma"] == 48 and not r["wgmma_serialized"], r
    assert r["spill_bytes"] <= (8 if pipeline == 2 else 0), r
    assert r["smem"] <= SMEM_LIMIT, r
    assert 136 in r["setmaxnreg"] and 232 in r["setmaxnreg"], r
    # the loader's and the attender's registers (120 and 256 are the launch's own) fill at most the 64K-register file
    loader, attender = sorted(v for v in r["setmaxnreg"] if 120 < v < 256)
    assert 256 * loader + 128 * attender <= 65536, r


@pytest.mark.parametrize("fmt", FORMATS)
def test_offline_default_builds_attend_to_protected_tokens_inline(reports, fmt):
    """The defaults (8 loader warps, ``V4_PIPELINE``'s build, the protected tokens in the last split): their copies
    of the sink's and the window's rows add no ``wgmma`` and leave them pipelined, in the same shared memory, with no
    spills and the 8-warp register split."""
    r = reports[fmt, V4_PIPELINE[fmt], "w8", "inline"]
    assert r["inline_prot"] and r["wgmma"] == 48 and not r["wgmma_serialized"], r
    assert r["smem"] <= SMEM_LIMIT and r["spill_bytes"] == 0, r
    assert 136 in r["setmaxnreg"] and 232 in r["setmaxnreg"], r


@pytest.mark.parametrize("fmt", ["C4R4", "C2R4"])
def test_offline_channel_order_builds(reports, fmt):
    """The defaults with packed key tiles in ``channel_of`` order (``CHANNEL_ORDER``): rearranging the queries and the
    protected rows in registers adds no ``wgmma`` and leaves them pipelined, in the same shared memory and register
    split. C4R4 may spill two words under triton 3.6.0 (none under 3.7.1)."""
    r = reports[fmt, V4_PIPELINE[fmt], "w8", "inline", "channel_of"]
    assert r["channel_order"] and r["inline_prot"] and r["wgmma"] == 48 and not r["wgmma_serialized"], r
    assert r["smem"] <= SMEM_LIMIT and r["spill_bytes"] <= (8 if fmt == "C4R4" else 0), r
    assert 136 in r["setmaxnreg"] and 232 in r["setmaxnreg"], r


@pytest.mark.parametrize("fmt", ["C4R4", "C2R4"])
def test_offline_async_output_product_build(reports, fmt):
    """Build 4 (the loader's output product left in flight while it converts the next page's low channels): its 48
    ``wgmma`` stay pipelined (none serialized across the loop's back edge), in the same shared memory and register
    split. Triton 3.6.0's build may spill two words (3.7.1's none)."""
    r = reports[fmt, 4, "w8", "inline", "channel_of"]
    assert r["pipeline"] == 4 and r["wgmma"] == 48 and not r["wgmma_serialized"], r
    assert r["smem"] <= SMEM_LIMIT and r["spill_bytes"] <= 8, r
    assert 136 in r["setmaxnreg"] and 232 in r["setmaxnreg"], r


@pytest.mark.parametrize("fmt", ["C4R4", "C2R4"])
def test_offline_made_up_words_keep_the_dequantization(reports, fmt):
    """Probe 4 (no packed page bytes loaded, words made from their addresses) must time the same dequantization: had
    the compiler found the words equal and folded it, the kernel would shrink by hundreds of instructions."""
    r, real = reports[fmt, 1, "probe", 4, "w8", "inline"], reports[fmt, 1, "w8", "inline"]
    if r["sass"] < 0:
        pytest.skip("no cuobjdump beside this triton")
    assert r["probe"] == 4 and r["wgmma"] == 48 and not r["wgmma_serialized"], r
    assert abs(r["sass"] - real["sass"]) <= 0.03 * real["sass"], (r["sass"], real["sass"])


# ---------------------------------------------------------------- kernel v5 (attention_v5_kernel.py)

#: kernel v5's offline builds: (block_r, ahead, protected tokens inline, channel order, attenders, formats)
V5_CONFIGS = ((16, 1, 1, 1, 1, FORMATS), (16, 2, 1, 1, 1, ("C4R4", "C2R4")), (32, 1, 1, 1, 1, ("C4R4",)),
              (16, 1, 1, 1, 2, ("C4R4", "C2R4")))


@pytest.fixture(scope="module")
def reports_v5() -> dict:
    """``offline_v4.compile_report_v5`` of :data:`V5_CONFIGS`, each in a subprocess without ``TRITON_INTERPRET``."""
    _needs_gluon()
    _needs_ptxas()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = {}
    for block_r, ahead, inline, order, attenders, fmts in V5_CONFIGS:
        cmd = [sys.executable, *(["-P"] if sys.flags.safe_path else []), "-m",
               "quantmla_core.backends.triton.offline_v4", *fmts, "kernel=5", f"block_r={block_r}", f"ahead={ahead}",
               f"inline_prot={inline}", f"channel_order={order}", f"attenders={attenders}",
               f"loader_warps={8 if attenders == 1 else 4}"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tempfile.gettempdir())
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        assert len(lines) == len(fmts), r.stdout + r.stderr
        for fmt, line in zip(fmts, lines):
            key = (fmt, block_r, ahead, attenders)
            out[key] = ast.literal_eval(line)
            assert "err" not in out[key], out[key]
    return out


@pytest.mark.parametrize("fmt,block_r,ahead", [(f, b, a) for b, a, _, _, t, fmts in V5_CONFIGS for f in fmts
                                               if t == 1])
def test_offline_v5_build(reports_v5, fmt, block_r, ahead):
    """68 ``wgmma``, pipelined: QK 9 x 4 (m64nRk16, A = the key tile, B = the queries) and PV 8 x 4 (A = the key tile
    read MN-major, 8 blocks of 64 channels); shared memory within a block's; the register file split as 128 x attender
    + 256 x converter (8 warps) with the converter's ``LOADER8_REGS`` for the rows; no spills at 16 rows (at 32 the
    attender's 128 output floats a thread may spill a few words)."""
    from quantmla_core.backends.triton.attention_v5_kernel import LOADER8_REGS

    r = reports_v5[fmt, block_r, ahead, 1]
    assert r["block_r"] == block_r and r["ahead"] == ahead and r["inline_prot"] and r["attenders"] == 1, r
    assert r["wgmma"] == 68 and not r["wgmma_serialized"], r
    assert r["smem"] <= SMEM_LIMIT, r
    assert r["spill_bytes"] <= (0 if block_r == 16 else 48), r
    converter = LOADER8_REGS.value[block_r]
    attender = max(v for v in r["setmaxnreg"] if v < 256)
    assert converter in r["setmaxnreg"] and 256 * converter + 128 * attender <= 65536, r


@pytest.mark.parametrize("fmt", ["C4R4", "C2R4"])
def test_offline_v5_two_attenders(reports_v5, fmt):
    """Two attenders: each issues its own 68 ``wgmma`` (136), pipelined; the merge buffers (attender 1's 32 KB of
    sums) within a block's shared memory; the register file split as 128 x (two attenders + converter, 4 warps each)
    at the registers the build sets; at most a few loop-invariant words spilled (attender 0 reloads them)."""
    from quantmla_core.backends.triton.attention_v5_kernel import ATTENDER2_REGS, LOADER2A_REGS

    r = reports_v5[fmt, 16, 1, 2]
    assert r["attenders"] == 2 and r["loader_warps"] == 4, r
    assert r["wgmma"] == 136 and not r["wgmma_serialized"], r
    assert r["smem"] <= SMEM_LIMIT, r
    assert r["spill_bytes"] <= 128, r
    regs = (ATTENDER2_REGS.value[4], LOADER2A_REGS.value[4])
    assert set(regs) <= set(r["setmaxnreg"]) and 128 * (max(r["setmaxnreg"][:-1]) + sum(regs)) <= 65536, r


# ---------------------------------------------------------------- the loaders' channel order, mirrored in NumPy


def _written_page(name: str, seed: int = 0) -> tuple[PackFormat, np.ndarray]:
    """One 64-token page filled by the torch backend's writer with random tokens (per-channel scales)."""
    fmt = PackFormat.parse(name)
    rng = np.random.default_rng(seed)
    n = fmt.page_size
    latent = (rng.standard_normal((n, fmt.latent_dim)) * rng.uniform(0.1, 4.0, fmt.latent_dim)).astype(np.float32)
    rope = rng.standard_normal((n, fmt.rope_dim)).astype(np.float32)
    cache = qm.MLACache.allocate(fmt, 2, 1, sink=0, local=0, device="cpu")
    cache.pages.zero_()
    idx = torch.arange(n, dtype=torch.int64)
    qm.write(cache, torch.from_numpy(latent), torch.from_numpy(rope), slot_mapping=idx + n, seq_ids=idx * 0,
             positions=idx, seq_lens=torch.tensor([n]), backend="torch")
    return fmt, cache.pages[1].numpy().copy()


def _rows(page: np.ndarray, off: int, per_token: int, dtype) -> np.ndarray:
    """The page's section at ``off`` as ``[64, per_token]`` elements of ``dtype`` (little endian)."""
    width = np.dtype(dtype).itemsize
    return page[off: off + 64 * per_token * width].view(dtype).reshape(64, per_token)


def _pair(w: np.ndarray, shift: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``ASM_PAIR``: ``(w >> shift) & mask`` in both 16-bit halves, OR 0x4300: two bfloat16 ``128 + code``."""
    x = w >> np.uint32(shift)
    mask = (1 << bits) - 1
    return (bits_to_bf16((x & mask) | 0x4300), bits_to_bf16(((x >> np.uint32(16)) & mask) | 0x4300))


def _scaled(x: np.ndarray, zb: np.ndarray, s: np.ndarray, f32_scale: bool) -> np.ndarray:
    k = bf16_round(x - zb[:, None])  # exact
    if f32_scale:
        return bf16_round((k * s[:, None]).astype(np.float32))
    return bf16_round(k * s[:, None])  # exact in float32, one rounding


def channel_of(j: np.ndarray) -> np.ndarray:
    """``common_kernels.channel_of``: ``j`` with bits 0 and 1 swapped."""
    return (j & -4) | ((j & 1) << 1) | ((j >> 1) & 1)


def _plane(w: np.ndarray, pl: int, bits: int, zb, s, f32_scale: bool, channel_order: bool) -> np.ndarray:
    """``attention_v4_loaders._plane``: gl.join = a new trailing axis, then a row-major reshape to [N, 4 W]."""
    lo0, hi0 = (_scaled(x, zb, s, f32_scale) for x in _pair(w, bits * pl, bits))
    lo1, hi1 = (_scaled(x, zb, s, f32_scale) for x in _pair(w, 8 + bits * pl, bits))
    if channel_order:
        k = np.stack([np.stack([lo0, lo1], -1), np.stack([hi0, hi1], -1)], -1)
    else:
        k = np.stack([np.stack([lo0, hi0], -1), np.stack([lo1, hi1], -1)], -1)
    return k.reshape(w.shape[0], 4 * w.shape[1])


def _to_channel_order(x: np.ndarray) -> np.ndarray:
    """``attention_v4_loaders.to_channel_order``: two gl.split (the last axis) and two gl.join, as written."""
    n, c = x.shape
    y = x.reshape(n, c // 4, 2, 2)
    y0, y1 = y[..., 0], y[..., 1]
    c0, c2 = y0[..., 0], y0[..., 1]
    c1, c3 = y1[..., 0], y1[..., 1]
    return np.stack([np.stack([c0, c1], -1), np.stack([c2, c3], -1)], -1).reshape(n, c)


def _mirror(fmt: PackFormat, page: np.ndarray, channel_order: bool, bits: int | None = None):
    """The loader's kc [64, d_c] and kr [64, d_r] tiles (float32 values of the bfloat16 it stores) for one page.
    ``bits`` (controls): the content's codes taken apart as codes of that many bits."""
    secs = {k: v[0] for k, v in fmt.sections.items()}
    dc, dr = fmt.latent_dim, fmt.rope_dim
    if not fmt.quantized:  # _load_bf16_page: a copy
        return (bits_to_bf16(_rows(page, secs["content_codes"], dc, "<u2")),
                bits_to_bf16(_rows(page, secs["rope_codes"], dr, "<u2")))
    cbits = fmt.content_bits if bits is None else bits
    cbytes, planes = dc * fmt.content_bits // 8, 8 // cbits
    words = _rows(page, secs["content_codes"], cbytes // 4, "<u4")
    scales = bits_to_bf16(_rows(page, secs["content_scales"], dc // 64, "<u2"))
    zeros = _rows(page, secs["content_zeros"], dc // 64, np.uint8)
    kc = np.full((64, dc), np.nan, np.float32)
    for c in range(cbytes // 64):
        for pl in range(planes):
            g = pl * cbytes // 64 + c
            zb = bits_to_bf16(zeros[:, g].astype(np.uint16) | 0x4300)  # _biased_zero
            col = pl * cbytes + 64 * c
            if col + 64 <= dc:
                kc[:, col: col + 64] = _plane(words[:, 16 * c: 16 * c + 16], pl, cbits, zb, scales[:, g], False,
                                                              channel_order)
    rw = _rows(page, secs["rope_codes"], dr * fmt.rope_bits // 8 // 4, "<u4")
    rs = _rows(page, secs["rope_scales"], 1, "<f4")[:, 0]
    rzb = bits_to_bf16(_rows(page, secs["rope_zeros"], 1, np.uint8)[:, 0].astype(np.uint16) | 0x4300)
    k0 = _plane(rw, 0, fmt.rope_bits, rzb, rs, True, channel_order)
    k1 = _plane(rw, 1, fmt.rope_bits, rzb, rs, True, channel_order)
    kr = np.stack([k0, k1], -1).transpose(0, 2, 1).reshape(64, dr)  # join, permute (0, 2, 1), reshape
    return kc, kr


def _oracle(fmt: PackFormat, page: np.ndarray, channel_order: bool):
    """The reference's decoded page as the loader's tiles: bfloat16 values, and with ``channel_order`` (packed
    formats) the columns in ``channel_of`` order."""
    c, kr = ref.decode_page(fmt, page)
    c, kr = bf16_round(c.astype(np.float32)), bf16_round(kr.astype(np.float32))
    if fmt.quantized and channel_order:
        c, kr = c[:, channel_of(np.arange(c.shape[1]))], kr[:, channel_of(np.arange(kr.shape[1]))]
    return c, kr


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)) or np.array_equal(a, b))


@pytest.mark.parametrize("channel_order", [False, True])
@pytest.mark.parametrize("name", FORMATS)
def test_loader_channel_order_matches_reference(name, channel_order):
    """The loader's tiles, in plain order and (``CHANNEL_ORDER``) in ``channel_of`` order, are the reference's
    decoded page in that order, bit for bit."""
    fmt, page = _written_page(name, seed=len(name))
    kc, kr = _mirror(fmt, page, channel_order)
    c_ref, r_ref = _oracle(fmt, page, channel_order)
    assert _same_bits(kc, c_ref), np.argwhere(kc != c_ref)[:5]
    assert _same_bits(kr, r_ref), np.argwhere(kr != r_ref)[:5]


def test_loader_channel_order_controls_mismatch():
    """The mirror catches a wrong map: each order's tiles against the reference in the other order (C4R4), 2-bit codes
    taken apart as nibbles (C2R4)."""
    fmt, page = _written_page("C4R4", seed=7)
    for channel_order in (False, True):
        kc, kr = _mirror(fmt, page, channel_order)
        c_other, r_other = _oracle(fmt, page, not channel_order)
        assert not _same_bits(kc, c_other) and not _same_bits(kr, r_other)
    fmt, page = _written_page("C2R4", seed=8)
    kc, _ = _mirror(fmt, page, False, bits=4)
    c_ref, _ = _oracle(fmt, page, False)
    assert not np.array_equal(kc, c_ref)


def test_channel_order_of_queries_and_protected_rows():
    """``to_channel_order`` (queries, protected rows) puts channel ``channel_of(j)`` in column ``j``, as the packed
    loader's tiles hold them with ``CHANNEL_ORDER``, and ``channel_of`` is its own inverse (the merge kernel writes
    the output through it)."""
    x = np.arange(3 * 64, dtype=np.float32).reshape(3, 64)
    j = np.arange(64)
    assert np.array_equal(_to_channel_order(x), x[:, channel_of(j)])
    assert np.array_equal(channel_of(channel_of(j)), j) and not np.array_equal(channel_of(j), j)
    assert sorted(channel_of(j[:4])) == [0, 1, 2, 3] and list(channel_of(j[:4])) == [0, 2, 1, 3]


def _per_group(x: np.ndarray) -> list[np.ndarray]:
    """``attention_v4_loaders._per_group``'s splits, as written: [64, 8] -> reshape [64, 2, 2, 2] -> three levels of
    gl.split (the last axis), named g0 .. g7 there."""
    y = x.reshape(x.shape[0], 2, 2, 2)
    c0, c1 = y[..., 0], y[..., 1]
    (b00, b01), (b10, b11) = (c0[..., 0], c0[..., 1]), (c1[..., 0], c1[..., 1])
    g0, g4, g2, g6 = b00[..., 0], b00[..., 1], b01[..., 0], b01[..., 1]
    g1, g5, g3, g7 = b10[..., 0], b10[..., 1], b11[..., 0], b11[..., 1]
    return [g0, g1, g2, g3, g4, g5, g6, g7]


def test_per_group_splits_give_groups_in_order():
    """The loader's vector load of a token's 8 scales (or zeros) hands group ``g`` to tuple entry ``g``."""
    x = np.arange(64 * 8).reshape(64, 8)
    assert all(np.array_equal(t, x[:, g]) for g, t in enumerate(_per_group(x)))
    assert not all(np.array_equal(t, x[:, g]) for g, t in enumerate(_per_group(x)[::-1]))


# ---------------------------------------------------------------- the mbarrier protocol, modelled

def _attender(n: int, drop: str | None, pipeline: bool = False):
    """``attention_v4_kernel.attender_partition``'s synchronizing statements, in order (``PIPELINE``: PV_lo(i - 1)
    retired and its key slot handed back before QK(i); else both after QK(i)). A split of no pages walks one."""
    for i in range(max(n, 1)):
        s = i % 2
        if pipeline:
            yield ("retire", "pv_lo")  # warpgroup_mma_wait(0) on PV_lo(i - 1)
            if i > 0:
                yield ("arrive", ("kempty", 1 - s))
        yield ("wait", ("kfull", s), (i // 2) & 1)
        yield ("read", ("k", s), i)  # QK(i), issued and retired by the wait below
        if not pipeline:
            yield ("retire", "pv_lo")  # warpgroup_mma_wait(0): QK(i) and PV_lo(i - 1)
            if i > 0:
                yield ("arrive", ("kempty", 1 - s))
        if drop != "pfree":
            yield ("wait", ("pfree",), (i & 1) ^ 1)
        yield ("write", ("p",), i)
        yield ("arrive", ("pready",))
        yield ("issue", "pv_lo", [(("k", s), i), (("p",), i)])  # reads until the next retire
    yield ("arrive", ("lfin",))
    yield ("retire", "pv_lo")


def _loader(n: int, drop: str | None, pv_early: bool = False):
    """``attention_v4_loaders.loader_partition``'s synchronizing statements, in order (``pv_early``: BF16 pages'
    build 2, page i's copy issued before the output product of page i - 1 and ``kfull`` arrived after both; the copy
    counts as written where it is issued, so that a reader still pending then is a hazard)."""
    def pv_hi(t):
        if drop != "pready":
            yield ("wait", ("pready",), t & 1)
        yield ("read", ("p",), t)
        yield ("read", ("k", t % 2), t)
        yield ("arrive", ("pfree",))
        yield ("arrive", ("kempty", t % 2))

    n_iter = max(n, 1)
    for i in range(n_iter):
        s = i % 2
        if drop != "kempty":
            yield ("wait", ("kempty", s), ((i // 2) & 1) ^ 1)
        yield ("write", ("k", s), i)
        if pv_early and i > 0:
            yield from pv_hi(i - 1)
        yield ("arrive", ("kfull", s))
        if not pv_early and i > 0:
            yield from pv_hi(i - 1)
    yield from pv_hi(n_iter - 1)
    yield ("wait", ("lfin",), 0)


#: the builds as (attender's early retire, loader ``pv_early``): 0 and 3; 1 and packed 2; BF16 pages' 2
BUILDS = {"0": (False, False), "1": (True, False), "2-BF16": (True, True)}


def _run_protocol(n: int, seed: int, drop: str | None = None, build: str = "0") -> None:
    """Both partitions under one random interleaving; AssertionError on a hazard or a deadlock."""
    bars = {("kfull", 0): _Bar(1), ("kfull", 1): _Bar(1), ("kempty", 0): _Bar(2), ("kempty", 1): _Bar(2),
            ("pready",): _Bar(1), ("pfree",): _Bar(1), ("lfin",): _Bar(1)}
    held = {("k", 0): None, ("k", 1): None, ("p",): None}  # page whose data each buffer holds
    pipeline, pv_early = BUILDS[build]
    procs = {"attender": _attender(n, drop, pipeline), "loader": _loader(n, drop, pv_early)}
    run_interleaved(procs, bars, held, random.Random(seed))
    for key, bar in bars.items():  # every barrier between phases: no stray arrival
        assert bar.pending == bar.count or key[0] == "kempty", (key, bar.pending)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 7])
def test_protocol_holds_under_random_interleavings(n, build):
    for seed in range(300):
        _run_protocol(n, seed, build=build)


def _failures(drop: str, build: str) -> int:
    return failures(lambda seed: _run_protocol(5, seed, drop, build))


@pytest.mark.parametrize("drop,build", [(d, b) for d in ("pfree", "kempty", "pready") for b in BUILDS
                                        if (d, b) != ("pfree", "2-BF16")])
def test_protocol_controls_fail_without_a_wait(drop, build):
    assert _failures(drop, build) > 0


def test_bf16_build_2_orders_p_by_kfull():
    """BF16 pages' build 2 arrives ``kfull(i)`` after its output product of page i - 1, and the attender writes P(i)
    only after ``kfull(i)``: its ``pfree`` wait is implied there (kept, as the other builds need it)."""
    assert _failures("pfree", "2-BF16") == 0


def _sync_calls(fn) -> list[str]:
    """The mbarrier calls of a partition's source, in order (``wait kfull``, ``arrive pready``, ...)."""
    src = inspect.getsource(fn.fn)
    return [f"{op} {bar}" for op, bar in re.findall(r"mbarrier\.(wait|arrive)\((\w+)", src)]


def test_protocol_model_follows_the_kernel():
    """The model's order of waits and arrivals is the partitions' (pv_hi's body once, as written)."""
    _needs_gluon()
    from quantmla_core.backends.triton import attention_v4_loaders as ld

    # the PIPELINE build's early arrival, then the plain build's after QK: both branches are in the source
    assert _sync_calls(v4.attender_partition) == ["arrive kempty", "wait kfull", "arrive kempty", "wait pfree",
                                                 "arrive pready", "arrive lfin"]
    assert _sync_calls(ld.loader_partition) == ["wait kempty", "arrive kfull", "wait lfin"]
    assert _sync_calls(ld._pv_hi) == ["wait pready", "arrive pfree", "arrive kempty_s"]


# ---------------------------------------------------------------- the protected pages' positions, mirrored in NumPy


def _protected_span(e: int, L: int, sink: int, local: int) -> tuple[int, int, int]:
    """``attention_v4_loaders.protected_span`` in Python: (base, lo, hi) of protected page ``e``."""
    sink_pages = -(-sink // 64)
    n_sink = min(sink, L)
    first_local = max(L - local, n_sink)
    if e < sink_pages:
        return e * 64, 0, n_sink
    return first_local + (e - sink_pages) * 64, first_local, min(L, first_local + local)


def _split_pages(L: int, sink: int, local: int, nsplit: int, s: int) -> tuple[int, int, int, int]:
    """``attention_v4_kernel._split_range`` in Python."""
    ps, pe = min(sink, L), max(L - local, min(sink, L))
    tb0, tb1 = ps // 128, -(-pe // 128)
    per = -(-(tb1 - tb0) // nsplit)
    t_lo = tb0 + s * per
    t_hi = min(t_lo + per, tb1)
    j_lo, j_hi = max(t_lo * 2, ps // 64), min(t_hi * 2, -(-pe // 64))
    return ps, pe, j_lo, max(j_hi - j_lo, 0)


def _kernel_rule(i: int, n_tiles: int, n_prot: int) -> bool:
    """``attention_v4_loaders.is_protected_page`` in Python."""
    return n_tiles <= i < n_tiles + n_prot


def _position_counts(sink: int, local: int, nsplit: int, span=_protected_span, rule=_kernel_rule) -> dict:
    """How often each position of a request is attended to, walking every split as the kernel does:
    ``max(n_tiles + n_prot, 1)`` steps (``n_prot`` protected pages on the last split only), step ``i`` a protected
    page where ``rule`` says so, else packed page ``j_lo + i`` (a dead page past ``n_tiles``)."""
    n_pages = -(-sink // 64) + -(-local // 64)
    out = {}
    for L in (1, 3, 4, 5, 63, 64, 65, 131, 132, 133, 300, 700, 9000, 20000):
        cnt = np.zeros(L, int)
        for s in range(nsplit):
            ps, pe, j_lo, n = _split_pages(L, sink, local, nsplit, s)
            n_prot = n_pages if s == nsplit - 1 else 0
            for i in range(max(n + n_prot, 1)):
                if rule(i, n, n_prot):
                    base, lo, hi = span(i - n, L, sink, local)
                else:
                    base, lo, hi = (j_lo + i) * 64, ps, pe if i < n else ps
                pos = base + np.arange(64)
                np.add.at(cnt, pos[(pos >= lo) & (pos < hi)], 1)
        out[L] = cnt
    return out


@pytest.mark.parametrize("sink,local", [(4, 128), (0, 128), (4, 0), (64, 64), (70, 200)])
@pytest.mark.parametrize("nsplit", [1, 3, 8, 20])
def test_split_pages_and_protected_pages_cover_every_position_once(sink, local, nsplit):
    """The splits' packed pages plus the last split's protected pages, walked as the kernel walks them, hold every
    position of a request exactly once, empty splits included. Controls: every span one token short must miss one;
    stop 56's rule (every step past the packed pages protected) counts the sink again in each empty split before the
    last, as it did on the GPU."""
    assert all((c == 1).all() for c in _position_counts(sink, local, nsplit).values())
    if local:
        def short(e, L, s, w):
            return _protected_span(e, L, s, w)[:2] + (_protected_span(e, L, s, w)[2] - 1,)
        assert not all((c == 1).all() for c in _position_counts(sink, local, nsplit, span=short).values())
    if sink and nsplit > 1:
        old = _position_counts(sink, local, nsplit, rule=lambda i, n, n_prot: i >= n)
        assert old[5][:min(sink, 5)].max() > 1
