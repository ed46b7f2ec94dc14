"""``python -m quantmla_core.demo``: write a synthetic MLA cache and run decode attention.

Allocates a :class:`PagedMLACache` per format on the best device present, writes a few
thousand tokens of synthetic MLA latents (per-channel outliers, like real models) for several
requests, runs decode attention with ``backend="auto"`` and prints the backend, bytes per
token, compression against BF16, relative error against unquantized float64 attention, and
the time per attention call.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from . import reference as ref
from .cache import compression_ratio
from .dispatch import DeviceInfo, Problem, select_backend
from .formats import PackFormat
from .paged import PagedMLACache


def _synthetic(n: int, fmt: PackFormat, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    chan = np.exp(rng.normal(0.0, 0.8, fmt.latent_dim))
    latent = rng.standard_normal((n, fmt.latent_dim)) * chan
    k_rope = rng.standard_normal((n, fmt.rope_dim)) * np.exp(rng.normal(0.0, 0.5, fmt.rope_dim))
    return latent.astype(np.float32), k_rope.astype(np.float32)


def _time(fn, repeats: int, device: str) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def run(formats: list[str], lengths: list[int], heads: int, device: str, backend: str, repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = PackFormat.parse(formats[0])
    data = [_synthetic(n, base, rng) for n in lengths]
    q = rng.standard_normal((len(lengths), heads, base.latent_dim)).astype(np.float32) / 4
    qr = rng.standard_normal((len(lengths), heads, base.rope_dim)).astype(np.float32) / 4
    tau = 1.0 / np.sqrt(192.0)
    exact = [ref.mla_attention(q[i : i + 1], qr[i : i + 1], c, r, tau)[0][0] for i, (c, r) in enumerate(data)]
    for name in formats:
        fmt = PackFormat.parse(name)
        pages = sum(-(-n // fmt.page_size) for n in lengths)
        pc = PagedMLACache(fmt, pages, len(lengths), device=device, backend=backend)
        ids = [pc.add_request() for _ in lengths]
        to_dev = lambda a: torch.from_numpy(a).to(device=device, dtype=dtype)  # noqa: E731
        pc.append_many([(s, to_dev(c), to_dev(r)) for s, (c, r) in zip(ids, data)])
        problem = Problem("attention", fmt, DeviceInfo.of(pc.cache.pages), "bfloat16" if dtype == torch.bfloat16 else "float32",
                          "bfloat16", heads, 1)
        chosen = select_backend(problem, backend).name
        qd, qrd = to_dev(q), to_dev(qr)
        out, _ = pc.attention(qd, qrd, ids, softmax_scale=tau)
        got = out.float().cpu().numpy()
        err = float(np.sqrt(sum(np.sum((got[i] - exact[i]) ** 2) for i in range(len(ids))) / sum(np.sum(e**2) for e in exact)))
        seconds = _time(lambda: pc.attention(qd, qrd, ids, softmax_scale=tau), repeats, device)
        rows.append(dict(format=name, backend=chosen, token_bytes=fmt.token_bytes,
                         ratio=compression_ratio(fmt, max(lengths)), ratio_128k=compression_ratio(fmt, 131072), error=err, ms=seconds * 1e3))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="C4R4,C2R4,BF16", help="comma-separated formats")
    ap.add_argument("--lengths", default="1500,900,2600,300", help="comma-separated request lengths")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = run(args.formats.split(","), lengths, args.heads, args.device, args.backend, args.repeats)
    print(f"QuantMLA demo: {len(lengths)} requests, {sum(lengths)} tokens, H={args.heads}, d_c=512, d_r=64, "
          f"sink=4, local=128, device={args.device}")
    print(f"{'format':<7} {'backend':<10} {'B/token':>8} {'vs BF16':>8} {'@128K':>7} {'rel. error':>11} {'ms/call':>9}")
    for r in rows:
        print(f"{r['format']:<7} {r['backend']:<10} {r['token_bytes']:>8} {r['ratio']:>7.2f}x {r['ratio_128k']:>6.2f}x {r['error']:>11.2e} {r['ms']:>9.2f}")
    print("compression: memory_bytes() (pages + BF16 sink/local buffers) vs BF16 pages, at the longest request and at 128K;")
    print("error: relative Frobenius error of the latent output against float64 attention on the unquantized data.")


if __name__ == "__main__":
    main()
