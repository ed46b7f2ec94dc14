"""Shared set-up for the Triton attention benchmarks (probe script and pytest-benchmark file).

Builds large paged caches on the GPU with the Triton writer, the FlashInfer BF16 anchor
(``BatchMLAPagedAttentionWrapper``, fa3, when installed) and a plain-PyTorch BF16 baseline.
"""

from __future__ import annotations

import json
import math
import subprocess
import statistics
import time
from typing import Callable

import torch

import quantmla_core as qm
from quantmla_core import PackFormat

PAGE = 64
SINK, LOCAL = 4, 128
BF16_TOKEN_BYTES = 1152
FLOP_PER_TOKEN_HEAD = 2 * 576 + 2 * 512


def host_us(fn, n: int = 300, warmup: int = 20, batches: int = 10) -> float:
    """Host microseconds per call of ``fn``: launches only, no synchronization inside a batch; the median
    over ``batches`` batches of ``n // batches`` calls, each after a sync (a shared host's stalls land in
    a few batches instead of in every mean)."""
    for _ in range(warmup):
        fn()
    per_batch = max(1, n // batches)
    means = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        means.append((time.perf_counter() - t0) / per_batch * 1e6)
    torch.cuda.synchronize()
    return statistics.median(means)


def add_probe_arguments(ap, shapes: str, formats: str, backends: str) -> None:
    """The command-line arguments every GPU probe shares, with the probe's defaults: the ones :func:`probe_shapes`
    reads (``--shapes``, ``--protection``, ``--json``) and the formats and backends it times."""
    ap.add_argument("--shapes", default=shapes)
    ap.add_argument("--formats", default=formats)
    ap.add_argument("--backends", default=backends)
    ap.add_argument("--protection", default="4,128", help="sink,local of the probed caches (0,0: none)")
    ap.add_argument("--json", default=None)


def probe_shapes(args, probe: Callable[..., list[dict]]) -> list[dict]:
    """The rows of ``probe(h, b, l, *s_q)`` over ``args.shapes`` (comma-separated HxBxL or HxBxLxS_q), freeing the
    CUDA cache after each shape; written with :func:`gpu_info` to ``args.json`` when given. ``args.protection``
    ("sink,local") becomes ``args.sink`` and ``args.local`` first (the probes' command lines)."""
    args.sink, args.local = (int(x) for x in args.protection.split(","))
    rows: list[dict] = []
    for shape in args.shapes.split(","):
        rows += probe(*(int(x) for x in shape.split("x")))
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": gpu_info(), "rows": rows}, f, indent=1)
    return rows


def gpu_info() -> dict:
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        pass
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        info["driver"] = "?"
    return info


class Workload:
    """B requests of L tokens each (same page table shape for every format), of ``latent_dim`` + ``rope_dim`` channels
    (DeepSeek's 512 + 64 by default; the baselines and FlashInfer take only those), on ``device`` (the probes' GPU;
    the CPU for tests of the harness)."""

    def __init__(self, batch: int, length: int, seed: int = 0, latent_dim: int = 512, rope_dim: int = 64,
                 device: str = "cuda"):
        self.batch, self.length = batch, length
        self.latent_dim, self.rope_dim, self.device = latent_dim, rope_dim, device
        g = torch.Generator(device=self.device).manual_seed(seed)
        self.pages_per = math.ceil(length / PAGE)
        self.num_pages = batch * self.pages_per
        self.table = torch.randperm(self.num_pages, device=self.device, generator=g).view(batch, self.pages_per).int()
        self.seq_lens = torch.full((batch,), length, dtype=torch.int32, device=self.device)
        self.seq_ids = torch.arange(batch, dtype=torch.int32, device=self.device)
        self.chan = torch.exp(torch.randn(latent_dim, device=self.device, generator=g) * 0.7)
        self.seed = seed

    def tokens(self, start: int, stop: int):
        """Random latent/rope for global token indices [start, stop) (request-major), bf16."""
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1000003 + start)
        n = stop - start
        latent = (torch.randn(n, self.latent_dim, device=self.device, generator=g) * self.chan).to(torch.bfloat16)
        rope = (torch.randn(n, self.rope_dim, device=self.device, generator=g) * 2).to(torch.bfloat16)
        return latent, rope

    def slots(self, start: int, stop: int):
        idx = torch.arange(start, stop, device=self.device)
        b, pos = idx // self.length, idx % self.length
        slot = self.table[b, pos // PAGE].long() * PAGE + pos % PAGE
        return slot, b, pos

    def build(self, fmt_name: str, chunk: int = 1 << 20, sink: int = SINK, local: int = LOCAL,
              writer: str = "triton") -> qm.MLACache:
        """The workload's tokens written into a ``fmt_name`` cache keeping ``sink``/``local`` tokens by the ``writer``
        backend."""
        fmt = PackFormat.parse(fmt_name, latent_dim=self.latent_dim, rope_dim=self.rope_dim)
        cache = qm.MLACache.allocate(fmt, self.num_pages, self.batch, sink, local, self.device)
        total = self.batch * self.length
        lens = torch.full((self.batch,), self.length, dtype=torch.int64, device=self.device)
        for s in range(0, total, chunk):
            e = min(total, s + chunk)
            latent, rope = self.tokens(s, e)
            slot, b, pos = self.slots(s, e)
            qm.write(cache, latent, rope, slot_mapping=slot, seq_ids=b, positions=pos, seq_lens=lens,
                     backend=writer, validate=False)
        return cache

    def attention_kwargs(self, scale: float) -> dict:
        """The keyword arguments of ``quantmla_core.attention`` over this workload's requests (unvalidated, as the
        GPU probes time it)."""
        return {"block_table": self.table.to(torch.int32).contiguous(), "seq_lens": self.seq_lens.to(torch.int64),
                "seq_ids": self.seq_ids.to(torch.int64), "softmax_scale": scale, "validate": False}

    def queries(self, heads: int, s_q: int = 1, seed: int = 1):
        g = torch.Generator(device=self.device).manual_seed(seed)
        q = torch.randn(self.batch, s_q, heads, self.latent_dim, device=self.device, generator=g)
        q = (q / self.chan.sqrt()).to(torch.bfloat16)
        r = torch.randn(self.batch, s_q, heads, self.rope_dim, device=self.device, generator=g).to(torch.bfloat16)
        return q, r

    def bf16_dense(self):
        """Contiguous BF16 [B, L, d_c + d_r] of the same tokens (for the PyTorch and FlashInfer baselines)."""
        width = self.latent_dim + self.rope_dim
        kv = torch.empty(self.batch, self.length, width, dtype=torch.bfloat16, device=self.device)
        flat = kv.view(-1, width)
        for s in range(0, self.batch * self.length, 1 << 20):
            e = min(self.batch * self.length, s + (1 << 20))
            latent, rope = self.tokens(s, e)
            flat[s:e, :self.latent_dim], flat[s:e, self.latent_dim:] = latent, rope
        return kv


def torch_bf16_attention(q, r, kv, scale):
    """Plain PyTorch BF16 MLA decode (bmm + softmax), S_q = 1: q [B,H,512], r [B,H,64], kv [B,L,576]."""
    qq = torch.cat([q, r], dim=-1)  # [B, H, 576]
    s = torch.bmm(qq, kv.transpose(1, 2)).float() * scale  # [B, H, L]
    p = torch.softmax(s, dim=-1).to(torch.bfloat16)
    return torch.bmm(p, kv[:, :, :512])


class FlashInferMLA:
    """FlashInfer BF16 anchor over a paged copy of the dense cache; ``None`` when not installed."""

    @staticmethod
    def available() -> str | None:
        try:
            import flashinfer  # noqa: F401

            return None
        except Exception as exc:
            return f"flashinfer not importable ({type(exc).__name__}: {exc})"

    def __init__(self, work: Workload, kv: torch.Tensor, heads: int, scale: float):
        import flashinfer

        b, length = work.batch, work.length
        pages = work.num_pages
        # paged copy in the same page order as the quantized caches
        ckv = torch.empty(pages, PAGE, 512, dtype=torch.bfloat16, device="cuda")
        kpe = torch.empty(pages, PAGE, 64, dtype=torch.bfloat16, device="cuda")
        padded = torch.zeros(b, work.pages_per * PAGE, 576, dtype=torch.bfloat16, device="cuda")
        padded[:, :length] = kv
        padded = padded.view(b, work.pages_per, PAGE, 576)
        ckv[work.table.long()] = padded[..., :512]
        kpe[work.table.long()] = padded[..., 512:]
        del padded
        self.ckv, self.kpe = ckv, kpe
        self.ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        self.w = flashinfer.mla.BatchMLAPagedAttentionWrapper(self.ws, backend="fa3")
        qo_indptr = torch.arange(b + 1, dtype=torch.int32, device="cuda")
        kv_indptr = torch.arange(b + 1, dtype=torch.int32, device="cuda") * work.pages_per
        kv_indices = work.table.reshape(-1).int()
        kv_lens = work.seq_lens.int()
        self.w.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, heads, 512, 64, PAGE, False, scale,
                    torch.bfloat16, torch.bfloat16)

    def run(self, q, r):
        return self.w.run(q, r, self.ckv, self.kpe)
