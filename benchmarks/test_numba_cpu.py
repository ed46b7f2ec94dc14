"""Numba CPU backend: decode attention on the packed cache against PyTorch float32 attention over
the unquantized cache (absorbed MLA, same shape), and the fused writer on a 32K-token prompt.

Shape (issue 3): H = 16, B = 4, L = 32K, S_q = 1, d_c = 512, d_r = 64, page 64, C4R4 and C2R4,
plus the in-library BF16 format as the BF16 baseline (DESIGN.md §8). Every timed configuration
is checked against the float64 reference first. Run::

    python -m pytest benchmarks/test_numba_cpu.py -m benchmark --benchmark-enable -s

Ratios (``vs_torch_fp32`` = numba time / PyTorch float32 time, < 1 is faster) go into
``extra_info`` and a summary printed at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core import reference as ref

pytest.importorskip("numba")
pytestmark = pytest.mark.benchmark

from benchmarks.machine import command_line, machine_info  # noqa: E402

B, H, L, S_Q = 4, 16, 32768, 1
DC, DR, P = 512, 64, 64
PROMPT = 32768
ROUNDS = int(os.environ.get("QUANTMLA_BENCH_ROUNDS", "5"))
TAU = 1.0 / np.sqrt(DC + DR)
FLOP = 2 * B * S_Q * H * L * (2 * DC + DR)  # QK (d_c + d_r) + PV (d_c), multiply-add = 2
RESULTS: dict[str, float] = {}


@pytest.fixture(scope="module")
def data():
    """Random MLA-like operands (per-channel scales on the content path), shared by every config."""
    rng = np.random.default_rng(2026)
    chan = np.exp(rng.normal(0, 0.7, DC)).astype(np.float32)
    latent = rng.standard_normal((B * L, DC), dtype=np.float32) * chan
    k_rope = rng.standard_normal((B * L, DR), dtype=np.float32) * 2
    q_latent = (rng.standard_normal((B, S_Q, H, DC), dtype=np.float32) / np.sqrt(chan)).astype(np.float32)
    q_rope = rng.standard_normal((B, S_Q, H, DR), dtype=np.float32)
    return {"latent": torch.from_numpy(latent), "k_rope": torch.from_numpy(k_rope),
            "q_latent": torch.from_numpy(q_latent), "q_rope": torch.from_numpy(q_rope)}


def _extra(benchmark, nbytes: int, seconds: float, **more) -> None:
    benchmark.extra_info.update(machine_info())
    benchmark.extra_info.update(command=command_line(), bytes_moved=int(nbytes), gb_per_s=nbytes / seconds / 1e9,
                                shape=dict(B=B, H=H, L=L, S_q=S_Q, d_c=DC, d_r=DR, page=P), **more)


def _median(benchmark) -> float:
    return float(benchmark.stats.stats.median)


def _packed_cache(fmt: qm.PackFormat, d) -> tuple[qm.MLACache, dict]:
    """Cache holding B requests of L tokens (written by the numba writer), shuffled page table."""
    pages_per = L // fmt.page_size
    cache = qm.MLACache.allocate(fmt, B * pages_per, B, device="cpu")
    perm = torch.from_numpy(np.random.default_rng(1).permutation(B * pages_per).astype(np.int32))
    table = perm.reshape(B, pages_per)
    idx = torch.arange(B * L)
    seq, pos = idx // L, idx % L
    slots = table[seq, pos // fmt.page_size].long() * fmt.page_size + pos % fmt.page_size
    lens = torch.full((B,), L, dtype=torch.int64)
    qm.write(cache, d["latent"], d["k_rope"], slot_mapping=slots, seq_ids=seq, positions=pos, seq_lens=lens,
             backend="numba")
    args = dict(block_table=table, seq_lens=lens.int(), seq_ids=torch.arange(B), softmax_scale=float(TAU))
    return cache, args


def _check_against_reference(out, lse, cache, args, d) -> float:
    """Request 0 against the float64 reference on the same cache; returns the relative error."""
    want, want_lse = ref.decode_attention(d["q_latent"][:1], d["q_rope"][:1], cache, args["block_table"][:1],
                                          args["seq_lens"][:1], args["seq_ids"][:1], args["softmax_scale"])
    got = out[:1].double().numpy()
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert rel <= 1e-4, f"relative error {rel:.3g} vs reference"
    assert float(np.abs(lse[:1].double().numpy() - want_lse).max()) <= 1e-3
    return rel


def test_attention_torch_fp32(benchmark, data):
    """Baseline: PyTorch float32 absorbed MLA over the unquantized cache, same shape."""
    c = data["latent"].reshape(B, L, DC)
    kr = data["k_rope"].reshape(B, L, DR)
    qc, qr = data["q_latent"][:, 0], data["q_rope"][:, 0]

    def run():
        scores = TAU * (torch.bmm(qc, c.transpose(1, 2)) + torch.bmm(qr, kr.transpose(1, 2)))
        return torch.bmm(torch.softmax(scores, dim=-1), c), torch.logsumexp(scores, dim=-1)

    out, lse = run()
    want, want_lse = ref.mla_attention(qc[:1].numpy(), qr[:1].numpy(), c[0].numpy(), kr[0].numpy(), TAU)
    rel = float(np.linalg.norm(out[:1].double().numpy() - want) / np.linalg.norm(want))
    assert rel <= 1e-4 and float(np.abs(lse[:1].double().numpy() - want_lse).max()) <= 1e-3
    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    t = _median(benchmark)
    RESULTS["torch-fp32"] = t
    _extra(benchmark, B * L * (DC + DR) * 4, t, tflops=FLOP / t / 1e12, rel_err=rel, torch_threads=torch.get_num_threads())


@pytest.mark.parametrize("name", ["C4R4", "C2R4", "BF16"])
def test_attention_numba(benchmark, data, name):
    import numba

    fmt = qm.PackFormat.parse(name, DC, DR, page_size=P)
    cache, args = _packed_cache(fmt, data)
    qc, qr = data["q_latent"], data["q_rope"]

    def run():
        return qm.attention(qc, qr, cache, backend="numba", validate=False, **args)

    out, lse = run()
    rel = _check_against_reference(out, lse, cache, args, data)
    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    t = _median(benchmark)
    RESULTS[f"numba-{name}"] = t
    nbytes = B * (L // P) * fmt.page_bytes
    more = dict(format=name, rel_err=rel, tflops=FLOP / t / 1e12, numba_threads=numba.get_num_threads())
    if "torch-fp32" in RESULTS:
        more["vs_torch_fp32"] = t / RESULTS["torch-fp32"]
    _extra(benchmark, nbytes, t, **more)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_writer_prompt(benchmark, data, backend):
    """One 32K-token prompt (C4R4) written in one call: quantize, pack, page write, protection."""
    fmt = qm.PackFormat.parse("C4R4", DC, DR, page_size=P)
    n_pages = PROMPT // P
    cache = qm.MLACache.allocate(fmt, n_pages + 1, 1, device="cpu")
    cache.pages.zero_()
    latent, k_rope = data["latent"][:PROMPT], data["k_rope"][:PROMPT]
    perm = torch.from_numpy(np.random.default_rng(3).permutation(n_pages + 1)[:n_pages].astype(np.int64))
    pos = torch.arange(PROMPT)
    kw = dict(slot_mapping=perm[pos // P] * P + pos % P, seq_ids=torch.zeros(PROMPT, dtype=torch.int64),
              positions=pos, seq_lens=torch.tensor([PROMPT]), backend=backend, validate=False)

    def run():
        qm.write(cache, latent, k_rope, **kw)

    run()
    # correctness: the first pages against the reference writer
    head = 3 * P
    want = qm.MLACache.allocate(fmt, n_pages + 1, 1, device="cpu")
    want.pages.zero_()
    ref.write(want, latent[:head], k_rope[:head], kw["slot_mapping"][:head], kw["seq_ids"][:head], pos[:head],
              kw["seq_lens"])
    used = perm[:3].numpy()
    for sec, (off, size) in fmt.sections.items():
        got_b, want_b = cache.pages.numpy()[used, off : off + size], want.pages.numpy()[used, off : off + size]
        limit = 1e-3 if sec.endswith("codes") else 0.0  # codes may differ at .5 boundaries (DESIGN §3.1)
        assert (got_b != want_b).mean() <= limit, f"writer section {sec} differs from the reference"
    rounds = ROUNDS if backend == "numba" else 1
    benchmark.pedantic(run, rounds=rounds, warmup_rounds=0 if backend == "torch" else 1, iterations=1)
    t = _median(benchmark)
    RESULTS[f"writer-{backend}"] = t
    more = dict(format="C4R4", tokens=PROMPT)
    if backend == "torch" and "writer-numba" in RESULTS:
        more["numba_vs_torch"] = RESULTS["writer-numba"] / t
    _extra(benchmark, PROMPT * (DC + DR) * 4, t, **more)


def test_first_call_compile_time(benchmark):
    """Cold compile (empty NUMBA_CACHE_DIR) and the second process (kernels loaded from disk)."""
    code = textwrap.dedent("""
        import time, numpy as np, quantmla_core as qm
        from quantmla_core.testing import Case, allocate, build
        case = Case(qm.PackFormat.parse("C4R4"), (300, 70), heads=16, seed=1)
        b = build(case); a = b.to("cpu"); cache = allocate(case, b, "cpu")
        t0 = time.perf_counter()
        qm.write(cache, a["latent"], a["k_rope"], slot_mapping=a["slot_mapping"], seq_ids=a["seq_ids"],
                 positions=a["positions"], seq_lens=a["seq_lens"], backend="numba")
        t1 = time.perf_counter()
        qm.attention(a["q_latent"], a["q_rope"], cache, block_table=a["block_table"], seq_lens=a["attn_seq_lens"],
                     seq_ids=a["attn_seq_ids"], softmax_scale=b.softmax_scale, backend="numba")
        t2 = time.perf_counter()
        print(t1 - t0, t2 - t1)
    """)
    timings: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)

        def run(label: str) -> None:
            res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            w, a = map(float, res.stdout.split())
            timings[label] = (w, a)

        start = time.perf_counter()
        run("cold")
        cold = time.perf_counter() - start
        benchmark.pedantic(run, args=("warm",), rounds=1, iterations=1)
    RESULTS["compile-writer"], RESULTS["compile-attention"] = timings["cold"]
    RESULTS["warm-writer"], RESULTS["warm-attention"] = timings["warm"]
    benchmark.extra_info.update(machine_info())
    benchmark.extra_info.update(command=command_line(), cold_process_s=cold, first_write_s=timings["cold"][0],
                                first_attention_s=timings["cold"][1], cached_write_s=timings["warm"][0],
                                cached_attention_s=timings["warm"][1])


def test_interleaved_ratio(benchmark, data):
    """The fair ratio on a shared machine: torch fp32 and numba C4R4/C2R4 timed in alternation,
    round by round, so that all three see the same load. Medians of ``ROUNDS * 2`` rounds."""
    c = data["latent"].reshape(B, L, DC)
    kr = data["k_rope"].reshape(B, L, DR)
    qc, qr = data["q_latent"][:, 0], data["q_rope"][:, 0]

    def torch_fp32():
        scores = TAU * (torch.bmm(qc, c.transpose(1, 2)) + torch.bmm(qr, kr.transpose(1, 2)))
        return torch.bmm(torch.softmax(scores, dim=-1), c), torch.logsumexp(scores, dim=-1)

    runs = {"torch-fp32": torch_fp32}
    for name in ("C4R4", "C2R4"):
        cache, args = _packed_cache(qm.PackFormat.parse(name, DC, DR, page_size=P), data)
        out, lse = qm.attention(data["q_latent"], data["q_rope"], cache, backend="numba", **args)
        _check_against_reference(out, lse, cache, args, data)
        runs[f"numba-{name}"] = (lambda cache=cache, args=args: qm.attention(
            data["q_latent"], data["q_rope"], cache, backend="numba", validate=False, **args))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for f in runs.values():
        f()
    for _ in range(2 * ROUNDS):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    med = {k: float(np.median(v)) for k, v in times.items()}
    for k, v in med.items():
        RESULTS[f"interleaved-{k}"] = v
    benchmark.pedantic(runs["numba-C4R4"], rounds=1, iterations=1)
    benchmark.extra_info.update(machine_info())
    benchmark.extra_info.update(command=command_line(), medians_s=med,
                                c4r4_vs_torch_fp32=med["numba-C4R4"] / med["torch-fp32"],
                                c2r4_vs_torch_fp32=med["numba-C2R4"] / med["torch-fp32"])


def test_summary():
    """Print the ratios of this run (and whether the CPU target holds)."""
    if "torch-fp32" not in RESULTS:
        pytest.skip("baseline not timed in this run")
    base = RESULTS["torch-fp32"]
    lines = [f"machine: {machine_info()['cpu']} ({machine_info()['cores']} cores)",
             f"torch fp32 attention (unquantized cache): {base * 1e3:.1f} ms"]
    for name in ("C4R4", "C2R4", "BF16"):
        if f"numba-{name}" in RESULTS:
            t = RESULTS[f"numba-{name}"]
            lines.append(f"numba {name}: {t * 1e3:.1f} ms  ratio {t / base:.2f}x of torch fp32")
    if "writer-numba" in RESULTS:
        t = RESULTS["writer-numba"]
        lines.append(f"numba writer, {PROMPT}-token prompt: {t * 1e3:.1f} ms ({PROMPT * (DC + DR) * 4 / t / 1e9:.2f} GB/s of float32 input)")
    if "writer-torch" in RESULTS:
        lines.append(f"torch writer, same prompt: {RESULTS['writer-torch'] * 1e3:.1f} ms")
    if "compile-writer" in RESULTS:
        lines.append(f"first-call compile: writer {RESULTS['compile-writer']:.1f} s, attention {RESULTS['compile-attention']:.1f} s;"
                     f" cached: {RESULTS['warm-writer']:.2f} s, {RESULTS['warm-attention']:.2f} s")
    if "interleaved-torch-fp32" in RESULTS:
        tb = RESULTS["interleaved-torch-fp32"]
        lines.append("interleaved medians: " + ", ".join(
            f"{k} {RESULTS['interleaved-' + k] * 1e3:.1f} ms" for k in ("torch-fp32", "numba-C4R4", "numba-C2R4")))
        lines.append(f"interleaved ratios: C4R4 {RESULTS['interleaved-numba-C4R4'] / tb:.2f}x, "
                     f"C2R4 {RESULTS['interleaved-numba-C2R4'] / tb:.2f}x of torch fp32")
        lines.append(f"target C4R4 <= torch fp32 (interleaved): {'met' if RESULTS['interleaved-numba-C4R4'] <= tb else 'NOT met'}")
    print("\n" + "\n".join(lines))
