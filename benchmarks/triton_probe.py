"""Standalone probe for fast iteration on the GPU: correctness at real shapes, then timings of
Triton C4R4 / C2R4 / BF16 against FlashInfer BF16 and plain PyTorch BF16, kernel variants
(n_regs / n_spills), and the writer on a 128K-token prompt. Writes JSON under $OUT.

    PYTHONPATH=. python benchmarks/triton_probe.py [--quick]
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(__file__))
import quantmla_core as qm  # noqa: E402
from _mla_bench_common import (  # noqa: E402
    BF16_TOKEN_BYTES, FLOP_PER_TOKEN_HEAD, FlashInferMLA, Workload, gpu_info, torch_bf16_attention,
)
from quantmla_core.backends.triton import attention as tatt  # noqa: E402
from quantmla_core.backends.triton.writer import write as triton_write  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/probe_out")
os.makedirs(OUT, exist_ok=True)
RES: dict = {"info": gpu_info(), "rows": [], "variants": [], "checks": []}
SCALE = 1.0 / 576 ** 0.5
T0 = time.time()


def dump():
    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(RES, f, indent=1)


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # µs


def check(out, want, what):
    rel = float((out.float() - want.float()).norm() / want.float().norm())
    RES["checks"].append({"what": what, "rel": rel})
    print(f"check {what}: rel {rel:.2e}", flush=True)
    return rel


def run_triton(q, r, cache, work, overrides=None):
    return tatt.attention(q, r, cache, work.table, work.seq_lens, work.seq_ids, SCALE, overrides=overrides)


def main(quick: bool):
    pairs = [(8, 4096), (32, 32768), (8, 32768), (128, 32768), (32, 131072)]
    if os.environ.get("PROBE_PAIRS"):
        pairs = [tuple(int(x) for x in p.split("x")) for p in os.environ["PROBE_PAIRS"].split(",")]
    if quick:
        pairs = pairs[:2]
    fi_reason = FlashInferMLA.available()
    print("flashinfer:", fi_reason or "ok", flush=True)
    for (B, L) in pairs:
        work = Workload(B, L)
        caches = {}
        for name in ("C4R4", "C2R4", "BF16"):
            caches[name] = work.build(name)
        torch.cuda.synchronize()
        kv = work.bf16_dense()
        for H in (16, 128):
            if time.time() - T0 > float(os.environ.get("PROBE_BUDGET_S", "420")):
                print("time budget: stopping", flush=True)
                dump()
                return
            q4, r4 = work.queries(H)
            q, r = q4[:, 0], r4[:, 0]
            row = {"H": H, "B": B, "L": L}
            # correctness of the first 2 requests vs the torch backend on the same cache
            sub = slice(0, 2)
            for name, cache in caches.items():
                out, _ = run_triton(q4, r4, cache, work)
                want, _ = qm.attention(q4[sub], r4[sub], cache, block_table=work.table[sub], seq_lens=work.seq_lens[sub],
                                       seq_ids=work.seq_ids[sub], softmax_scale=SCALE, backend="torch", validate=False)
                rel = check(out[sub], want, f"{name} H{H} B{B} L{L}")
                t = bench(lambda: run_triton(q4, r4, cache, work))
                byts = cache.format.page_bytes * work.num_pages
                row[name] = {"us": t, "GBps": byts / t / 1e3, "TFLOPs": FLOP_PER_TOKEN_HEAD * H * B * L / t / 1e6, "rel": rel,
                             "n_regs": getattr(tatt.LAST_LAUNCH.get("split"), "n_regs", None),
                             "n_spills": getattr(tatt.LAST_LAUNCH.get("split"), "n_spills", None),
                             "plan": str(tatt.LAST_LAUNCH.get("plan"))}
            if B * L <= 32 * 32768 or H == 16:
                try:
                    t = bench(lambda: torch_bf16_attention(q, r, kv, SCALE))
                    row["torch_bf16"] = {"us": t, "GBps": B * L * BF16_TOKEN_BYTES / t / 1e3}
                except torch.OutOfMemoryError:
                    row["torch_bf16"] = {"us": None, "note": "OOM"}
                    torch.cuda.empty_cache()
            if fi_reason is None:
                try:
                    fi = FlashInferMLA(work, kv, H, SCALE)
                    ofi = fi.run(q, r)
                    want = torch_bf16_attention(q[:2], r[:2], kv[:2], SCALE)
                    row["fi_rel_vs_torch"] = check(ofi[:2], want, f"flashinfer H{H} B{B} L{L}")
                    t = bench(lambda: fi.run(q, r))
                    row["flashinfer_bf16"] = {"us": t, "GBps": B * L * BF16_TOKEN_BYTES / t / 1e3,
                                              "TFLOPs": FLOP_PER_TOKEN_HEAD * H * B * L / t / 1e6}
                    del fi
                except Exception as exc:  # report, keep going
                    row["flashinfer_bf16"] = {"us": None, "note": f"{type(exc).__name__}: {exc}"[:300]}
            RES["rows"].append(row)
            base = row.get("flashinfer_bf16", {}).get("us")
            summary = " ".join(f"{k}={v['us']:.1f}us({v.get('GBps', 0):.0f}GB/s)" for k, v in row.items()
                               if isinstance(v, dict) and v.get("us"))
            ratios = " ".join(f"{k}/FI={row[k]['us'] / base:.2f}" for k in ("C4R4", "C2R4", "BF16") if base)
            print(f"H={H} B={B} L={L}: {summary} {ratios}", flush=True)
            dump()
            # kernel variants on the key shape
            if (B, L) == (32, 32768):
                for name in ("C4R4", "C2R4"):
                    for ov in ({"block_n": 64}, {"num_warps": 2}, {"num_warps": 8}, {"num_stages": 3}, {"skip_pv": True}):
                        if H == 16 and "block_r" in ov:
                            continue
                        try:
                            run_triton(q4, r4, caches[name], work, ov)
                            t = bench(lambda: run_triton(q4, r4, caches[name], work, ov))
                            k = tatt.LAST_LAUNCH.get("split")
                            v = {"fmt": name, "H": H, "ov": str(ov), "us": t, "n_regs": getattr(k, "n_regs", None),
                                 "n_spills": getattr(k, "n_spills", None)}
                        except Exception as exc:
                            v = {"fmt": name, "H": H, "ov": str(ov), "err": f"{type(exc).__name__}: {exc}"[:300]}
                        RES["variants"].append(v)
                        print("variant", v, flush=True)
                    dump()
        del caches, kv
        torch.cuda.empty_cache()

    # writer: a 128K-token prompt, bf16 input, into C4R4 pages
    work = Workload(1, 131072)
    cache = qm.MLACache.allocate(qm.PackFormat.parse("C4R4"), work.num_pages, 1, 4, 128, "cuda")
    latent, rope = work.tokens(0, 131072)
    slot, b, pos = work.slots(0, 131072)
    lens = torch.tensor([131072], device="cuda")
    in_bytes = 131072 * 576 * 2
    for bt in (1, 4, 16):
        t = bench(lambda: triton_write(cache, latent, rope, slot, b, pos, lens, block_t=bt))
        RES[f"writer_block_t{bt}"] = {"us": t, "input_GBps": in_bytes / t / 1e3}
        print(f"writer block_t={bt}:", RES[f"writer_block_t{bt}"], flush=True)
    t = bench(lambda: triton_write(cache, latent, rope, slot, b, pos, lens))
    RES["writer"] = {"us": t, "input_GBps": in_bytes / t / 1e3}
    print("writer 128K C4R4 bf16:", RES["writer"], flush=True)
    dump()


if __name__ == "__main__":
    main("--quick" in sys.argv)
