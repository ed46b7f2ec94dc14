"""Standalone timing probe of the CuPy backend on a GPU (run on the device machine).

For each shape: fill a cache with random pages (valid scales and zeros, random codes), check
the CuPy output against the torch backend (float32 math on the same pages), then time
CuPy attention for C4R4, C2R4 and the in-library BF16 format with CUDA-event medians
(``triton.testing.do_bench`` when available). Also times the writer on a long prompt.
Ratios use the FlashInfer BF16 anchors of shared/PERFORMANCE.md (measured 2026-11-30).

    python benchmarks/cupy_probe.py [--quick] [--variant auto|v1|v2|v3|v4|v5|v6|both|v2v3|v3v4|v3v5|v4v6] [--json OUT.json]

``--variant`` picks the attention kernel through ``QUANTMLA_CUPY_ATTENTION`` (``both``: each
configuration is checked and timed with v1 and then v2 in the same process, side by side;
``kernel`` in each result says what actually ran -- v2 falls back to v1 for formats it does
not serve, e.g. the BF16 format). ``--shapes 16x8x4096,128x32x32768`` (HxBxL) overrides
the shape list; ``--formats C4R4,C2R4`` the formats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

import torch
from quantmla_core.backends.cupy.variants import VARIANT_ENV, select_variant, variant_nvrtc
from quantmla_core.backends.cupy.attention import attention as cupy_attention
from quantmla_core.backends.torch.attention import attention as torch_attention

import quantmla_core as qm

#: FlashInfer 0.6.18.post1 BF16 latency (us) on an H200, PERFORMANCE.md anchors: (H, B, L) -> us
ANCHORS = {(16, 8, 4096): 28.1, (16, 8, 32768): 91.5, (16, 32, 32768): 291.0, (16, 32, 131072): 1251.0,
           (16, 128, 32768): 1205.0, (128, 8, 32768): 139.0, (128, 32, 32768): 559.0}


def bench(fn, reps: int = 50) -> float:
    """Median microseconds of ``fn`` (CUDA events, after warm-up)."""
    try:
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    except Exception:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return statistics.median(times)


def random_cache(fmt: qm.PackFormat, batch: int, length: int, sink: int = 4, local: int = 128):
    """Cache with ``batch`` requests of ``length`` tokens of random (valid) packed data."""
    p = fmt.page_size
    per = math.ceil(length / p)
    num_pages = batch * per
    cache = qm.MLACache.allocate(fmt, num_pages, batch, sink, local, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    cache.pages.copy_(torch.randint(0, 256, cache.pages.shape, dtype=torch.uint8, device="cuda", generator=g))
    if fmt.quantized:
        def sec(name):
            off, size = fmt.sections[name]
            return cache.pages[:, off : off + size]

        cs = (torch.rand((num_pages, size_of(fmt, "content_scales") // 2), device="cuda", generator=g) * 0.05 + 0.01)
        sec("content_scales").copy_(cs.to(torch.bfloat16).view(torch.uint8))
        sec("content_zeros").copy_(torch.randint(0, 2**fmt.content_bits, sec("content_zeros").shape, dtype=torch.uint8, device="cuda", generator=g))
        rs = torch.rand((num_pages, size_of(fmt, "rope_scales") // 4), device="cuda", generator=g) * 0.1 + 0.05
        sec("rope_scales").copy_(rs.view(torch.uint8))
        sec("rope_zeros").copy_(torch.randint(0, 2**fmt.rope_bits, sec("rope_zeros").shape, dtype=torch.uint8, device="cuda", generator=g))
    else:
        vals = torch.randn((num_pages, fmt.page_bytes // 2), device="cuda", generator=g).to(torch.bfloat16)
        cache.pages.copy_(vals.view(torch.uint8))
    cache.sink_buf.copy_(torch.randn(cache.sink_buf.shape, device="cuda", generator=g).to(torch.bfloat16))
    cache.local_buf.copy_(torch.randn(cache.local_buf.shape, device="cuda", generator=g).to(torch.bfloat16))
    table = torch.randperm(num_pages, device="cuda", generator=g).to(torch.int32).view(batch, per)
    lens = torch.full((batch,), length, dtype=torch.int64, device="cuda")
    ids = torch.arange(batch, device="cuda")
    return cache, table, lens, ids


def size_of(fmt, name):
    return fmt.sections[name][1]


@contextlib.contextmanager
def kernel_variant(variant: str):
    """Set ``QUANTMLA_CUPY_ATTENTION`` for the duration (the launcher reads it per call)."""
    old = os.environ.get(VARIANT_ENV)
    os.environ[VARIANT_ENV] = variant
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(VARIANT_ENV, None)
        else:
            os.environ[VARIANT_ENV] = old


def probe_attention(name: str, heads: int, batch: int, length: int, s_q: int = 1, check: bool = True,
                    variants: tuple[str, ...] = ("v1",), protection: tuple[int, int] = (4, 128)) -> list[dict]:
    """Check then time each kernel variant on the same cache and queries; one result per variant.
    ``protection``: (sink, local) of the cache; (0, 0) runs the build without the protected path."""
    fmt = qm.PackFormat.parse(name)
    cache, table, lens, ids = random_cache(fmt, batch, length, *protection)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn((batch, s_q, heads, fmt.latent_dim), device="cuda", generator=g).to(torch.bfloat16)
    r = torch.randn((batch, s_q, heads, fmt.rope_dim), device="cuda", generator=g).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(576)
    ref = None
    if check:
        nb = min(batch, 4)
        ref = torch_attention(q[:nb].float(), r[:nb].float(), cache, table[:nb], lens[:nb], ids[:nb], scale)
    results = []
    for variant in variants:
        with kernel_variant(variant):
            # the decision the launcher makes for this call (block-table capacity, query rows, NVRTC, batch)
            capability = torch.cuda.get_device_capability()
            ran, why = select_variant(fmt, "bfloat16", capability, table.shape[1] * fmt.page_size, s_q * heads,
                                      variant_nvrtc(capability), batch)
            t = time.time()
            out, lse = cupy_attention(q, r, cache, table, lens, ids, scale)
            torch.cuda.synchronize()
            first_call_s = time.time() - t  # includes NVRTC compilation on a cold cache
            rel = lse_err = float("nan")
            if ref is not None:
                nb = min(batch, 4)
                ro, rl = ref
                rel = float((out[:nb].float() - ro).norm() / ro.norm())
                lse_err = float((lse[:nb] - rl).abs().max())
                assert rel < 1e-2 and lse_err < 2e-2, f"{variant} {name} H{heads} B{batch} L{length}: rel {rel}, lse {lse_err}"
            us = bench(lambda c=cache: cupy_attention(q, r, c, table, lens, ids, scale))
        bytes_moved = batch * math.ceil(length / fmt.page_size) * fmt.page_bytes
        res = {"variant": variant, "kernel": ran, "fallback_reason": why, "format": name, "H": heads, "B": batch,
               "L": length, "S_q": s_q, "sink": protection[0], "local": protection[1], "us": us, "rel_err": rel, "lse_err": lse_err,
               "page_GBps": bytes_moved / us / 1e3, "tflops": 2176 * heads * s_q * batch * length / us / 1e6,
               "first_call_s": round(first_call_s, 2)}
        anchor = ANCHORS.get((heads, batch, length))
        if anchor and s_q == 1:
            res["flashinfer_bf16_us"] = anchor
            res["ratio_vs_flashinfer_bf16"] = us / anchor
        results.append(res)
    del cache
    torch.cuda.empty_cache()
    return results


def probe_writer(name: str, tokens: int) -> dict:
    fmt = qm.PackFormat.parse(name)
    cache = qm.MLACache.allocate(fmt, math.ceil(tokens / fmt.page_size), 1, 4, 128, device="cuda")
    lat = torch.randn((tokens, fmt.latent_dim), device="cuda", dtype=torch.bfloat16)
    kr = torch.randn((tokens, fmt.rope_dim), device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(tokens, device="cuda")
    ids = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    lens = torch.tensor([tokens], device="cuda")
    fn = lambda: qm.write(cache, lat, kr, slot_mapping=slots, seq_ids=ids, positions=slots, seq_lens=lens, backend="cupy")  # noqa: E731
    us = bench(fn)
    in_bytes = tokens * (fmt.latent_dim + fmt.rope_dim) * 2
    return {"op": "write", "format": name, "tokens": tokens, "us": us, "input_GBps": in_bytes / us / 1e3,
            "out_GBps": tokens * fmt.token_bytes / us / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--variant", choices=("auto", "v1", "v2", "v3", "v4", "v5", "v6", "both", "v2v3", "v3v4", "v3v5", "v4v6"), default="auto",
                    help="attention kernel(s) to time (both: v1 then v2 on the same inputs)")
    ap.add_argument("--shapes", default=None, help="comma-separated HxBxL, e.g. 16x32x32768,128x32x32768")
    ap.add_argument("--formats", default="C4R4,C2R4,BF16")
    ap.add_argument("--protection", default="4,128", help="sink,local of the probed caches (0,0: none)")
    ap.add_argument("--no-writer", action="store_true", help="skip the writer timing")
    args = ap.parse_args()
    variants = {"both": ("v1", "v2"), "v2v3": ("v2", "v3"), "v3v4": ("v3", "v4"), "v3v5": ("v3", "v5"), "v4v6": ("v4", "v6")}.get(args.variant, (args.variant,))
    protection = tuple(int(x) for x in args.protection.split(","))
    import cupy

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cupy": cupy.__version__,
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "driver": cupy.cuda.runtime.driverGetVersion()}
    print(json.dumps(info))
    shapes = [(16, 8, 4096), (16, 32, 32768), (16, 128, 32768), (128, 32, 32768), (16, 8, 32768), (16, 32, 131072)]
    if args.shapes:
        shapes = [tuple(int(x) for x in sh.lower().split("x")) for sh in args.shapes.split(",")]
    elif args.quick:
        shapes = shapes[:3]
    results = []
    for heads, batch, length in shapes:
        for name in args.formats.split(","):
            t = time.time()
            try:
                rs = probe_attention(name, heads, batch, length, check=(length * batch <= 32 * 32768), variants=variants,
                                     protection=protection)
            except Exception as exc:  # keep probing other shapes
                rs = [{"variant": args.variant, "format": name, "H": heads, "B": batch, "L": length, "error": repr(exc)[:300]}]
            for res in rs:
                res["wall_s"] = round(time.time() - t, 1)
                results.append(res)
                print(json.dumps(res), flush=True)
    if not args.no_writer:
        for name in ("C4R4", "BF16"):
            res = probe_writer(name, 131072)
            results.append(res)
            print(json.dumps(res), flush=True)
    print("\nvariant(kernel) format  H   B     L      us      GB/s(pages)  x FlashInfer-BF16  v2/v1")
    v1_us = {(r["format"], r["H"], r["B"], r["L"]): r["us"] for r in results if r.get("variant") == "v1" and "us" in r}
    for r in results:
        if "us" in r and "H" in r:
            base = v1_us.get((r["format"], r["H"], r["B"], r["L"]))
            speed = f"{r['us'] / base:.3f}" if base and r["variant"] == "v2" else ""
            print(f"{r['variant']}({r['kernel']})  {r['format']:5} {r['H']:4} {r['B']:4} {r['L']:7} {r['us']:9.1f} "
                  f"{r['page_GBps']:9.0f}   {r.get('ratio_vs_flashinfer_bf16', float('nan')):.3f}   {speed}")
        elif "error" in r:
            print(f"{r.get('variant')} {r['format']} H{r['H']} B{r['B']} L{r['L']}: ERROR {r['error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
