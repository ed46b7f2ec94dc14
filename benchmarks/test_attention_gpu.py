"""pytest-benchmark: Triton packed-page decode attention vs BF16 baselines on one GPU.

    python -m pytest benchmarks/test_attention_gpu.py -m benchmark --benchmark-enable \
        --benchmark-json benchmarks/results/triton_attention.json

Compares, in one run, Triton C4R4 / C2R4 / BF16 (and the "cupy" backend where it is
available) against FlashInfer BF16 (``BatchMLAPagedAttentionWrapper``, fa3; skipped with a
message when not installed) and plain PyTorch BF16 (bmm + softmax), over H in {16, 128},
B in {8, 32, 128}, L in {4K, 32K, 128K} (combinations past the memory budget are dropped),
plus the Triton writer on a 128K-token prompt. Every configuration is checked against the
torch backend on the same cache (first two requests) before it is timed.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.benchmark, pytest.mark.gpu]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
import quantmla_core as qm  # noqa: E402
from _mla_bench_common import (  # noqa: E402
    BF16_TOKEN_BYTES, FLOP_PER_TOKEN_HEAD, FlashInferMLA, Workload, gpu_info, torch_bf16_attention,
)

SCALE = 1.0 / 576 ** 0.5
HEADS = (16, 128)
BATCHES = (8, 32, 128)
LENGTHS = (4096, 32768, 131072)
#: drop shapes whose BF16 cache (dense + paged copy for FlashInfer) would pass this many bytes
MAX_BF16_BYTES = 40 * 2**30
FORMATS = ("C4R4", "C2R4", "BF16")


def _backends() -> list[str]:
    out = ["triton"]
    if qm.available_backends().get("cupy") is None:
        out.append("cupy")
    return out


SHAPES = [(b, l) for b in BATCHES for l in LENGTHS if b * l * BF16_TOKEN_BYTES * 2 <= MAX_BF16_BYTES]


@functools.lru_cache(maxsize=1)
def _workload(b: int, l: int) -> Workload:
    torch.cuda.empty_cache()
    return Workload(b, l)


@functools.lru_cache(maxsize=3)
def _cache(b: int, l: int, name: str):
    return _workload(b, l).build(name)


@functools.lru_cache(maxsize=1)
def _dense(b: int, l: int):
    return _workload(b, l).bf16_dense()


def _extra(benchmark, h, b, l, nbytes):
    info = gpu_info()
    benchmark.extra_info.update(info)
    benchmark.extra_info.update({"H": h, "B": b, "L": l, "bytes": nbytes})

    def finish():
        t = benchmark.extra_info.get("device_us", benchmark.stats.stats.median * 1e6) / 1e6
        benchmark.extra_info["GBps"] = nbytes / t / 1e9
        benchmark.extra_info["TFLOPs"] = FLOP_PER_TOKEN_HEAD * h * b * l / t / 1e12

    return finish


def _timed(benchmark, fn):
    """pytest-benchmark's wall clock (a host sync per call) for its own statistics, and the
    device time (median of CUDA events, L2 flushed between runs, ``triton.testing.do_bench``)
    in ``extra_info["device_us"]``, which the report and GB/s use: launch-bound small shapes
    would otherwise read the host round trip."""
    import triton.testing

    def sync_fn():
        fn()
        torch.cuda.synchronize()

    for _ in range(3):
        sync_fn()
    benchmark.extra_info["device_us"] = float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")) * 1e3
    benchmark.pedantic(sync_fn, rounds=10, iterations=3, warmup_rounds=1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("h", HEADS)
@pytest.mark.parametrize("b,l", SHAPES)
def test_packed_attention(benchmark, backend, fmt, h, b, l):
    work = _workload(b, l)
    cache = _cache(b, l, fmt)
    q, r = work.queries(h)
    kw = dict(block_table=work.table, seq_lens=work.seq_lens, seq_ids=work.seq_ids, softmax_scale=SCALE, validate=False)
    try:
        out, _ = qm.attention(q, r, cache, backend=backend, **kw)
    except qm.NoBackendError as exc:
        pytest.skip(str(exc))
    sub = slice(0, 2)
    want, _ = qm.attention(q[sub], r[sub], cache, backend="torch", block_table=work.table[sub],
                           seq_lens=work.seq_lens[sub], seq_ids=work.seq_ids[sub], softmax_scale=SCALE, validate=False)
    rel = float((out[sub].float() - want.float()).norm() / want.float().norm())
    assert rel < 1e-2, f"{backend} {fmt}: relative error {rel:.3g}"
    finish = _extra(benchmark, h, b, l, cache.format.page_bytes * work.num_pages)
    benchmark.group = f"H{h}-B{b}-L{l}"
    benchmark.extra_info["rel_err"] = rel
    _timed(benchmark, lambda: qm.attention(q, r, cache, backend=backend, **kw))
    finish()


@pytest.mark.parametrize("h", HEADS)
@pytest.mark.parametrize("b,l", SHAPES)
def test_flashinfer_bf16(benchmark, h, b, l):
    why = FlashInferMLA.available()
    if why:
        pytest.skip(f"FlashInfer BF16 anchor not run: {why} (install the carried wheels, PERFORMANCE.md)")
    work = _workload(b, l)
    kv = _dense(b, l)
    q, r = work.queries(h)
    fi = FlashInferMLA(work, kv, h, SCALE)
    out = fi.run(q[:, 0], r[:, 0])
    want = torch_bf16_attention(q[:2, 0], r[:2, 0], kv[:2], SCALE)
    rel = float((out[:2].float() - want.float()).norm() / want.float().norm())
    assert rel < 2e-2, f"flashinfer relative error {rel:.3g}"
    finish = _extra(benchmark, h, b, l, b * l * BF16_TOKEN_BYTES)
    benchmark.group = f"H{h}-B{b}-L{l}"
    _timed(benchmark, lambda: fi.run(q[:, 0], r[:, 0]))
    finish()


@pytest.mark.parametrize("h", HEADS)
@pytest.mark.parametrize("b,l", SHAPES)
def test_torch_bf16(benchmark, h, b, l):
    if b * h * l * 6 > 16 * 2**30:
        pytest.skip("score matrix too large for the plain PyTorch baseline")
    work = _workload(b, l)
    kv = _dense(b, l)
    q, r = work.queries(h)
    q, r = q[:, 0], r[:, 0]
    finish = _extra(benchmark, h, b, l, b * l * BF16_TOKEN_BYTES)
    benchmark.group = f"H{h}-B{b}-L{l}"
    _timed(benchmark, lambda: torch_bf16_attention(q, r, kv, SCALE))
    finish()


def test_writer_128k_prompt(benchmark):
    """Triton writer: a 128K-token BF16 prompt into C4R4 pages, one launch."""
    triton_write = qm.get_backend("triton").write

    work = Workload(1, 131072)
    cache = qm.MLACache.allocate(qm.PackFormat.parse("C4R4"), work.num_pages, 1, 4, 128, "cuda")
    latent, rope = work.tokens(0, 131072)
    slot, seq, pos = work.slots(0, 131072)
    lens = torch.tensor([131072], device="cuda")
    in_bytes = 131072 * 576 * 2
    benchmark.extra_info.update(gpu_info())
    _timed(benchmark, lambda: triton_write(cache, latent, rope, slot, seq, pos, lens))
    benchmark.extra_info["input_bytes"] = in_bytes
    benchmark.extra_info["input_GBps"] = in_bytes / (benchmark.extra_info["device_us"] * 1e-6) / 1e9
