"""Writer and decode attention of every available backend and format, against the BF16 baselines
measured in the same run (the library's own BF16 format and plain PyTorch over the unquantized
cache), on the device the run has (CUDA when present, else the CPU).

Cases come from :mod:`quantmla_core.testing` (the conformance tests' generator): random
requests with shuffled page tables. Every timed configuration is first checked against the float64
reference on the same cache. ``extra_info``: impl, format, H, B, L, bytes moved, GB/s, TFLOP/s,
device and versions.

    python -m pytest -m benchmark --benchmark-enable benchmarks/test_backends.py
    QUANTMLA_BENCH_SCALE=tiny ...   # seconds on a CPU (the CI smoke run uses it with --benchmark-disable)
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core import reference as ref
from quantmla_core.dispatch import DeviceInfo, Problem
from quantmla_core.testing import Case, allocate, build, check_attention

from benchmarks.machine import command_line, machine_info

pytestmark = pytest.mark.benchmark

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = "bfloat16" if DEVICE == "cuda" else "float32"
SCALES = {  # (heads, request lengths)
    "tiny": (4, (300, 130)),
    "cpu": (16, (8192,) * 4),
    "gpu": (16, (32768,) * 32),
}
SCALE = os.environ.get("QUANTMLA_BENCH_SCALE", "gpu" if DEVICE == "cuda" else "cpu")
HEADS, LENS = SCALES[SCALE]
FORMATS = ("C4R4", "C2R4", "BF16")
FLOP_PER_TOKEN_HEAD = 2 * (512 + 64) + 2 * 512


def _backends() -> list[str]:
    names = []
    for name in qm.registered_backends():
        if name == "reference":
            continue  # the oracle, not a contender
        b = qm.get_backend(name)
        if not b.not_supported_reasons(Problem("attention", qm.PackFormat.parse("C4R4"), DeviceInfo.of(torch.device(DEVICE)), DTYPE)):
            names.append(name)
    return names


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@functools.lru_cache(maxsize=4)
def _written(fmt_name: str, backend: str):
    """A cache holding every request of the case, written by ``backend``, plus the inputs."""
    case = Case(qm.PackFormat.parse(fmt_name), LENS, heads=HEADS, s_q=1, sink=4, local=128, dtype=DTYPE, seed=7)
    batch = build(case)
    args = batch.to(DEVICE, DTYPE)
    cache = allocate(case, batch, DEVICE)
    qm.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
             positions=args["positions"], seq_lens=args["seq_lens"], backend=backend)
    return case, batch, args, cache


def _info(benchmark, impl: str, fmt: str, nbytes: int, op: str = "attention") -> None:
    benchmark.extra_info.update(machine_info())
    benchmark.extra_info.update(op=op, impl=impl, format=fmt, H=HEADS, B=len(LENS), L=max(LENS), bytes=int(nbytes),
                                command=command_line(), scale=SCALE)


def _finish(benchmark, nbytes: int) -> None:
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable
        return
    t = stats.stats.median
    benchmark.extra_info["gbps"] = nbytes / t / 1e9
    benchmark.extra_info["tflops"] = FLOP_PER_TOKEN_HEAD * HEADS * sum(LENS) / t / 1e12


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", _backends())
def test_attention(benchmark, backend, fmt):
    case, batch, args, cache = _written(fmt, backend)
    kw = dict(block_table=args["block_table"], seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"],
              softmax_scale=batch.softmax_scale, backend=backend, validate=False)
    out, lse = qm.attention(args["q_latent"], args["q_rope"], cache, **kw)
    sub = slice(0, 1)  # correctness first, on the first request (the reference is slow)
    host = cache if DEVICE == "cpu" else qm.MLACache(cache.format, cache.pages.cpu(), cache.sink_buf.cpu(),
                                                      cache.local_buf.cpu(), cache.max_seqs, cache.sink, cache.local)
    want, want_lse = ref.decode_attention(args["q_latent"][sub].cpu(), args["q_rope"][sub].cpu(), host,
                                          batch.block_table[sub], batch.attn_seq_lens[sub], batch.attn_seq_ids[sub],
                                          batch.softmax_scale)
    check_attention(out[sub], lse[sub], want, want_lse, DTYPE)
    nbytes = sum(-(-n // case.fmt.page_size) for n in LENS) * case.fmt.page_bytes
    _info(benchmark, backend, fmt, nbytes)

    def run():
        qm.attention(args["q_latent"], args["q_rope"], cache, **kw)
        _sync()

    benchmark.pedantic(run, rounds=int(os.environ.get("QUANTMLA_BENCH_ROUNDS", "10")), warmup_rounds=1)
    _finish(benchmark, nbytes)


def test_torch_unquantized_baseline(benchmark):
    """Plain PyTorch absorbed MLA over the unquantized cache (bmm + softmax), queries' dtype."""
    case, batch, args, _ = _written("BF16", "torch")
    dt = getattr(torch, DTYPE)
    b = len(LENS)
    lmax = max(LENS)
    c = torch.zeros(b, lmax, 512, dtype=dt, device=DEVICE)
    kr = torch.zeros(b, lmax, 64, dtype=dt, device=DEVICE)
    start = 0
    order = np.argsort(batch.positions + 10**9 * batch.seq_ids, kind="stable")
    lat, rope = args["latent"][torch.from_numpy(order).to(DEVICE)], args["k_rope"][torch.from_numpy(order).to(DEVICE)]
    for i, n in enumerate(LENS):
        c[i, :n], kr[i, :n] = lat[start : start + n], rope[start : start + n]
        start += n
    mask = torch.arange(lmax, device=DEVICE)[None, :] >= torch.tensor(LENS, device=DEVICE)[:, None]
    q, qr = args["q_latent"][:, 0], args["q_rope"][:, 0]

    def attend():
        s = (torch.bmm(q, c.transpose(1, 2)) + torch.bmm(qr, kr.transpose(1, 2))).float() * batch.softmax_scale
        s = s.masked_fill(mask[:, None, :], float("-inf"))
        return torch.bmm(torch.softmax(s, -1).to(dt), c)

    host = lambda t: t.float().cpu().numpy()  # noqa: E731
    want = ref.mla_attention(host(q[0:1]), host(qr[0:1]), host(c[0, : LENS[0]]), host(kr[0, : LENS[0]]), batch.softmax_scale)[0][0]
    got = attend()[0].float().cpu().numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < (1e-2 if DTYPE == "bfloat16" else 1e-4)
    nbytes = sum(LENS) * (512 + 64) * c.element_size()
    _info(benchmark, "torch-bmm", "BF16" if DTYPE == "bfloat16" else "FP32", nbytes)

    def run():
        attend()
        _sync()

    benchmark.pedantic(run, rounds=int(os.environ.get("QUANTMLA_BENCH_ROUNDS", "10")), warmup_rounds=1)
    _finish(benchmark, nbytes)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", _backends())
def test_writer(benchmark, backend, fmt):
    case, batch, args, cache = _written(fmt, backend)
    nbytes = args["latent"].numel() * args["latent"].element_size() + args["k_rope"].numel() * args["k_rope"].element_size()
    _info(benchmark, backend, fmt, nbytes, op="write")
    kw = dict(slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"], positions=args["positions"],
              seq_lens=args["seq_lens"], backend=backend, validate=False)

    def run():
        qm.write(cache, args["latent"], args["k_rope"], **kw)
        _sync()

    benchmark.pedantic(run, rounds=int(os.environ.get("QUANTMLA_BENCH_ROUNDS", "5")), warmup_rounds=1)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        benchmark.extra_info["input_gbps"] = nbytes / stats.stats.median / 1e9
