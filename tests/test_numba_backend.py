"""Numba CPU backend against the float64 reference (DESIGN.md §8), plus its own edges:
split sequences, head blocks, bf16/float32 protection, masked writes (guard pages), lazy import
and the on-disk kernel cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

import quantmla_core as qm  # noqa: E402
from quantmla_core import reference as ref  # noqa: E402
from quantmla_core.backends.numba import NumbaBackend  # noqa: E402
from quantmla_core.reference.pages import encode_token  # noqa: E402
from quantmla_core.dispatch import DeviceInfo, NoBackendError, Problem, select_backend  # noqa: E402
from quantmla_core.testing import POISON_BYTE, Case, allocate, build, generate_cases  # noqa: E402

from conformance import assert_pages_match, check_attention_case, check_writer  # noqa: E402

CAP = NumbaBackend.capabilities
CASES = generate_cases(CAP, quick=False)
QUICK = generate_cases(CAP, quick=True)
DEVICES = ["cpu", "numpy"]

C4R4 = qm.PackFormat.parse("C4R4")
# long requests over small pages: the planner splits them (checked below) and merges by LSE
SPLIT_CASES = [
    Case(qm.PackFormat.parse("C4R4", page_size=16), (1000,), heads=4, s_q=1, seed=401),
    Case(qm.PackFormat.parse("C2R4", page_size=16), (700, 37), heads=3, s_q=3, seed=402),
    Case(qm.PackFormat.parse("BF16", latent_dim=256, rope_dim=32, page_size=16), (520,), heads=2, s_q=2, local=0, seed=403),
]
# more rows than one task takes: heads split into blocks (last block partial)
HEAD_BLOCK_CASES = [
    Case(C4R4, (150, 70), heads=20, s_q=4, seed=404),
    Case(qm.PackFormat.parse("C8R8", latent_dim=256, rope_dim=32), (90,), heads=70, s_q=1, seed=405),
]


# ---------------------------------------------------------------------- conformance
@pytest.mark.parametrize("case", CASES, ids=str)
def test_writer_matches_reference_cpu(case):
    check_writer(case, "numba", "cpu")


@pytest.mark.parametrize("case", QUICK, ids=str)
def test_writer_matches_reference_numpy(case):
    check_writer(case, "numba", "numpy")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_attention_matches_reference_cpu(case):
    check_attention_case(case, "numba", "numba", "cpu")


@pytest.mark.parametrize("case", QUICK, ids=str)
def test_attention_matches_reference_numpy(case):
    check_attention_case(case, "numba", "numba", "numpy")


@pytest.mark.parametrize("case", SPLIT_CASES + HEAD_BLOCK_CASES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_split_and_head_blocks_match_reference(case, device):
    from quantmla_core.backends.numba.attention import plan

    head_block, task_b, _, task_p0, task_p1, _, groups = plan(
        np.asarray(case.lens, np.int64), case.fmt.page_size, 10**6, case.s_q, case.heads, threads=2
    )
    if case in SPLIT_CASES:
        assert groups is not None and task_b.shape[0] > len(case.lens), "case meant to exercise splits has none"
    else:
        assert head_block < case.heads, "case meant to exercise head blocks has one block"
    # the tasks of each request tile its pages exactly once
    for b, n in enumerate(case.lens):
        spans = sorted((int(p0), int(p1)) for tb, p0, p1 in zip(task_b, task_p0, task_p1) if tb == b)
        covered = sorted({p for p0, p1 in spans for p in range(p0, p1)})
        assert covered == list(range(-(-n // case.fmt.page_size)))
    check_attention_case(case, "numba", "numba", device)


@pytest.mark.parametrize("case", QUICK[:4] + [c for c in CASES if c.s_q > 1], ids=str)
def test_bf16_inputs(case):
    check_writer(case, "numba", "cpu", "bfloat16")
    check_attention_case(case, "numba", "numba", "cpu", "bfloat16")


@pytest.mark.parametrize("case", CASES[::3], ids=str)
def test_numba_write_torch_read(case):
    check_attention_case(case, "numba", "torch", "cpu")


@pytest.mark.parametrize("case", CASES[1::3], ids=str)
def test_torch_write_numba_read(case):
    check_attention_case(case, "torch", "numba", "cpu")


@pytest.mark.parametrize("case", CASES[2::6], ids=str)
def test_reference_write_numba_read(case):
    check_attention_case(case, "reference", "numba", "cpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["C4R4", "BF16"])
def test_float32_protection_on_cpu_tensors(name, dtype):
    """CPU caches may protect in float32: the buffers hold the exact inputs, attention reads them."""
    case = Case(qm.PackFormat.parse(name), (70, 9), heads=4, s_q=2, seed=500)
    batch = build(case)
    args = batch.to("cpu", dtype)
    cache = allocate(case, batch, "cpu", protect_dtype=torch.float32)
    want = allocate(case, batch, "cpu", protect_dtype=torch.float32)
    w = dict(slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"], positions=args["positions"], seq_lens=args["seq_lens"])
    qm.write(cache, args["latent"], args["k_rope"], backend="numba", **w)
    ref.write(want, args["latent"], args["k_rope"], batch.slot_mapping, batch.seq_ids, batch.positions, batch.seq_lens)
    written = np.unique(batch.slot_mapping // case.fmt.page_size)
    assert_pages_match(case.fmt, cache.pages.numpy(), want.pages.numpy(), written)
    assert torch.equal(cache.sink_buf, want.sink_buf) and torch.equal(cache.local_buf, want.local_buf)
    assert cache.local_buf.abs().sum() > 0
    out, lse = qm.attention(args["q_latent"], args["q_rope"], cache, block_table=args["block_table"],
                            seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"],
                            softmax_scale=batch.softmax_scale, backend="numba")
    ref_out, ref_lse = ref.decode_attention(args["q_latent"], args["q_rope"], cache, batch.block_table,
                                            batch.attn_seq_lens, batch.attn_seq_ids, batch.softmax_scale)
    assert out.dtype == getattr(torch, dtype)
    qm.testing.check_attention(out, lse, ref_out, ref_lse, dtype)


def test_three_dim_queries_and_auto_selection():
    """[B, H, d] queries come back [B, H, d]; auto picks numba for CPU tensors and NumPy arrays."""
    case = Case(C4R4, (40, 130), heads=5, seed=501)
    batch = build(case)
    for device in DEVICES:
        args = batch.to(device)
        problem = Problem("attention", C4R4, DeviceInfo.of(args["q_latent"]))
        assert select_backend(problem, env={}).name == "numba"
        cache = allocate(case, batch, device)
        qm.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
                 positions=args["positions"], seq_lens=args["seq_lens"], backend="numba")
        out, lse = qm.attention(args["q_latent"][:, 0], args["q_rope"][:, 0], cache, block_table=args["block_table"],
                                seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"],
                                softmax_scale=batch.softmax_scale, backend="numba")
        ref_out, ref_lse = ref.decode_attention(args["q_latent"][:, 0], args["q_rope"][:, 0], cache, batch.block_table,
                                                batch.attn_seq_lens, batch.attn_seq_ids, batch.softmax_scale)
        assert tuple(out.shape) == (2, 5, 512) and tuple(lse.shape) == (2, 5)
        qm.testing.check_attention(out, lse, ref_out, ref_lse, "float32")


# quantizer edges: tests/test_writer_rules.py (every writer backend)


# ---------------------------------------------------------------------- bad input
def _small(device: str):
    case = Case(qm.PackFormat.parse("C4R4", latent_dim=256, rope_dim=32), (20, 70), heads=2, local=8, seed=600)
    batch = build(case)
    args = batch.to(device)
    cache = allocate(case, batch, device)
    qm.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
             positions=args["positions"], seq_lens=args["seq_lens"], backend="numba")
    return batch, args, cache


def _call_write(cache, args, **over):
    kw = dict(latent=args["latent"], k_rope=args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
              positions=args["positions"], seq_lens=args["seq_lens"], backend="numba")
    kw.update(over)
    qm.write(cache, kw.pop("latent"), kw.pop("k_rope"), **kw)


def _call_attention(cache, args, batch, **over):
    kw = dict(q_latent=args["q_latent"], q_rope=args["q_rope"], block_table=args["block_table"],
              seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"], softmax_scale=batch.softmax_scale,
              backend="numba")
    kw.update(over)
    return qm.attention(kw.pop("q_latent"), kw.pop("q_rope"), cache, **kw)


BAD_WRITES = [
    (lambda a: {"latent": a["latent"][:, :100]}, ValueError, "latent: expected shape"),
    (lambda a: {"latent": a["latent"].astype(np.float64)}, TypeError, "latent: expected dtype"),
    (lambda a: {"k_rope": a["k_rope"][:-1]}, ValueError, "k_rope: expected shape"),
    (lambda a: {"slot_mapping": a["slot_mapping"].astype(np.float32)}, TypeError, "slot_mapping: expected an int32 or int64"),
    (lambda a: {"slot_mapping": a["slot_mapping"] + 10_000}, ValueError, "slot_mapping: expected -1 or a slot index"),
    (lambda a: {"seq_ids": a["seq_ids"] + 5}, ValueError, "seq_ids: expected a protection-buffer row"),
    (lambda a: {"positions": a["positions"] + 1000}, ValueError, "positions: expected 0 <= position"),
    (lambda a: {"latent": np.where(np.arange(256) == 3, np.nan, a["latent"]).astype(np.float32)}, ValueError, "latent: expected finite"),
]


@pytest.mark.parametrize("make,exc,match", BAD_WRITES, ids=[m for _, _, m in BAD_WRITES])
def test_bad_writes_raise_and_leave_cache_alone(make, exc, match):
    batch, args, cache = _small("numpy")
    args = dict(args, latent=args["latent"] * 2, k_rope=args["k_rope"] * 2)  # would change every byte
    before = (cache.pages.copy(), cache.sink_buf.copy(), cache.local_buf.copy())
    with pytest.raises(exc, match=match):
        _call_write(cache, args, **make(args))
    assert np.array_equal(cache.pages, before[0])
    assert np.array_equal(cache.sink_buf, before[1]) and np.array_equal(cache.local_buf, before[2])


BAD_ATTENTION = [
    (lambda a: {"q_rope": a["q_rope"][..., :-1]}, ValueError, "q_rope: expected shape"),
    (lambda a: {"q_latent": a["q_latent"].astype(np.float64)}, TypeError, "q_latent: expected dtype"),
    (lambda a: {"block_table": a["block_table"] + 100}, ValueError, r"block_table\[0\]: expected a page index"),
    (lambda a: {"attn_seq_lens": a["attn_seq_lens"] + 10_000}, ValueError, "seq_lens: expected a length"),
    (lambda a: {"attn_seq_ids": a["attn_seq_ids"] + 7}, ValueError, "seq_ids: expected a protection-buffer row"),
    (lambda a: {"softmax_scale": -1.0}, ValueError, "softmax_scale: expected a finite value > 0"),
]


@pytest.mark.parametrize("make,exc,match", BAD_ATTENTION, ids=[m for _, _, m in BAD_ATTENTION])
def test_bad_attention_raises(make, exc, match):
    batch, args, cache = _small("numpy")
    over = make(args)
    kw = {{"attn_seq_lens": "seq_lens", "attn_seq_ids": "seq_ids"}.get(k, k): v for k, v in over.items()}
    with pytest.raises(exc, match=match):
        _call_attention(cache, args, batch, **kw)


def test_unsupported_problems_name_the_reason():
    gpu = Problem("attention", C4R4, DeviceInfo("cuda", "fake", (9, 0), 132))
    with pytest.raises(NoBackendError, match="device 'cuda'"):
        select_backend(gpu, "numba", env={})


# ---------------------------------------------------------------------- masked writes
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["C4R4", "BF16"])
def test_bad_slots_never_write_outside_the_cache(device, name):
    """Guard rows around the pages and the protection buffers stay poisoned when slots and seq
    ids are out of range (validate=False); the valid tokens of the same call are written."""
    fmt = qm.PackFormat.parse(name, latent_dim=256, rope_dim=32, page_size=16)
    num_pages, max_seqs, guard = 4, 2, 2
    width = fmt.latent_dim + fmt.rope_dim
    rng = np.random.default_rng(11)
    big_pages = np.full((num_pages + 2 * guard, fmt.page_bytes), POISON_BYTE, np.uint8)
    big_sink = rng.standard_normal((max_seqs + 2 * guard, 4, width)).astype(np.float32)
    big_local = rng.standard_normal((max_seqs + 2 * guard, 8, width)).astype(np.float32)
    originals = (big_pages.copy(), big_sink.copy(), big_local.copy())
    if device == "numpy":
        views = [big_pages, big_sink, big_local]
    else:
        views = [torch.from_numpy(big_pages), torch.from_numpy(big_sink), torch.from_numpy(big_local)]
    pages, sink, local = (v[guard:-guard] for v in views)
    cache = qm.MLACache(fmt, pages, sink, local, max_seqs, 4, 8)
    n_slots = num_pages * fmt.page_size
    slots = np.array([0, n_slots, n_slots + 5, -1, -7, 10**12, 17, 3, 40, n_slots - 1], np.int64)
    ids = np.array([0, 0, 1, 0, 1, 0, 2, -1, 9, 1], np.int64)  # 2, -1, 9: outside the buffers
    pos = np.array([1, 2, 3, 0, 1, 2, 0, 2, 3, 5], np.int64)
    lens = np.array([6, 6], np.int64)
    latent = rng.standard_normal((10, fmt.latent_dim)).astype(np.float32)
    k_rope = rng.standard_normal((10, fmt.rope_dim)).astype(np.float32)
    conv = (lambda x: x) if device == "numpy" else torch.from_numpy
    qm.write(cache, conv(latent), conv(k_rope), slot_mapping=conv(slots), seq_ids=conv(ids), positions=conv(pos),
             seq_lens=conv(lens), backend="numba", validate=False)
    for big, orig in zip((big_pages, big_sink, big_local), originals):
        assert np.array_equal(big[:guard], orig[:guard]) and np.array_equal(big[-guard:], orig[-guard:])
    # the same call's valid tokens went where they belong
    valid = (slots >= 0) & (slots < n_slots)
    want = qm.MLACache.allocate(fmt, num_pages, max_seqs, 4, 8, device="cpu", protect_dtype=torch.float32)
    want.pages[...] = POISON_BYTE
    want.sink_buf[...] = torch.from_numpy(originals[1][guard:-guard])
    want.local_buf[...] = torch.from_numpy(originals[2][guard:-guard])
    ok_ids = valid & (ids >= 0) & (ids < max_seqs)
    ref.write(want, latent[ok_ids], k_rope[ok_ids], slots[ok_ids], ids[ok_ids], pos[ok_ids], lens)
    for t in np.flatnonzero(valid & ~ok_ids):  # packed but not protected
        encode_token(fmt, want.pages.numpy()[slots[t] // 16], int(slots[t] % 16), latent[t], k_rope[t])
    assert_pages_match(fmt, big_pages[guard:-guard], want.pages.numpy(), np.arange(num_pages))
    assert np.array_equal(big_sink[guard:-guard], want.sink_buf.numpy())
    assert np.array_equal(big_local[guard:-guard], want.local_buf.numpy())
    assert not np.array_equal(big_pages[guard:-guard], originals[0][guard:-guard])


def test_bad_pages_in_attention_stay_in_bounds():
    """validate=False with page ids outside the cache: no crash, finite output (pages read as 0)."""
    batch, args, cache = _small("numpy")
    table = args["block_table"].copy()
    table[0, 0] = 10**9
    table[1, 1] = -3
    out, lse = _call_attention(cache, args, batch, block_table=table, validate=False)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


# ---------------------------------------------------------------------- packaging
def _run(code: str) -> str:
    env = dict(os.environ)
    env.pop("QUANTMLA_BACKEND", None)
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_import_does_not_load_numba():
    out = _run("""
        import sys
        import quantmla_core as qm
        from quantmla_core.backends.numba import NumbaBackend
        qm.get_backend("numba")
        print("numba" in sys.modules)
    """)
    assert out.strip().endswith("False")


def test_second_process_loads_kernels_from_disk_cache():
    _small("numpy")  # make sure this process compiled (and cached) the NumPy signatures
    out = _run("""
        import numpy as np
        import quantmla_core as qm
        from quantmla_core.testing import Case, allocate, build
        from quantmla_core.backends.numba import kernels_attention as ka, kernels_writer as kw
        case = Case(qm.PackFormat.parse("C4R4", latent_dim=256, rope_dim=32), (20, 70), heads=2, local=8, seed=600)
        b = build(case); a = b.to("numpy"); cache = allocate(case, b, "numpy")
        qm.write(cache, a["latent"], a["k_rope"], slot_mapping=a["slot_mapping"], seq_ids=a["seq_ids"],
                 positions=a["positions"], seq_lens=a["seq_lens"], backend="numba")
        qm.attention(a["q_latent"], a["q_rope"], cache, block_table=a["block_table"], seq_lens=a["attn_seq_lens"],
                     seq_ids=a["attn_seq_ids"], softmax_scale=b.softmax_scale, backend="numba")
        for f in (kw.write_tokens, ka.attend_tasks):
            print(f.__name__, sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values()))
    """)
    for line in out.strip().splitlines():
        name, hits, misses = line.split()
        assert int(hits) >= 1 and int(misses) == 0, out
