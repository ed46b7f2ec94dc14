"""Standalone probe for fast iteration on the GPU: correctness at real shapes, then timings of
Triton C4R4 / C2R4 / BF16 against FlashInfer BF16 and plain PyTorch BF16, kernel variants
(n_regs / n_spills), and the writer on a 128K-token prompt. Writes JSON under $OUT.

    PYTHONPATH=. python benchmarks/triton_probe.py [--quick]

``PROBE_VARIANTS=v1,v2`` times each split-kernel variant (``QUANTMLA_TRITON_ATTENTION``) side by
side (columns ``C4R4``/``C4R4_v2``, ratios to FlashInfer from the same run); ``v2z`` is v2 with
zero points subtracted on the operand (switch ``zsub``). The probe starts by compiling every
variant at H=16 and H=128 (bf16 and float32 queries) and printing its ``n_regs`` / ``n_spills``.
``PROBE_SKIP_WRITER=1`` skips the writer timings; ``PROBE_KNOBS=0`` skips the kernel-switch sweep.
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
RES: dict = {"info": gpu_info(), "rows": [], "variants": [], "checks": [], "kernels": []}
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


VARIANTS = [v.strip() for v in os.environ.get("PROBE_VARIANTS", "auto").split(",") if v.strip()]
FORMATS = ("C4R4", "C2R4", "BF16")


def col(name: str, variant: str) -> str:
    return name if variant == "v1" else f"{name}_{variant}"


#: probe-only variant names: a kernel variant plus kernel switches
PRESETS = {"v2z": ("v2", {"zsub": True})}


def run_triton(q, r, cache, work, overrides=None, variant="auto"):
    variant, preset = PRESETS.get(variant, (variant, {}))
    ov = {**preset, **(overrides or {})} or None
    return tatt.attention(q, r, cache, work.table, work.seq_lens, work.seq_ids, SCALE, overrides=ov,
                          variant=variant)


def kernel_stats() -> dict:
    k = tatt.LAST_LAUNCH.get("split")
    return {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
            "ran": tatt.LAST_LAUNCH.get("variant"), "plan": str(tatt.LAST_LAUNCH.get("plan"))}


def report_kernels():
    """Compile every variant for the shapes timed below and print registers/spills first."""
    work = Workload(2, 4096)
    for name in FORMATS:
        cache = work.build(name)
        for H in (16, 128):
            q4, r4 = work.queries(H)
            for v in VARIANTS:
                for dt in (torch.bfloat16, torch.float32):
                    try:
                        run_triton(q4.to(dt), r4.to(dt), cache, work, variant=v)
                        st = kernel_stats()
                    except Exception as exc:  # report, keep going
                        st = {"err": f"{type(exc).__name__}: {exc}"[:300]}
                    st.update(fmt=name, H=H, variant=v, q=str(dt).split(".")[-1])
                    RES["kernels"].append(st)
                    print("kernel", st, flush=True)
    dump()


#: kernel switches timed per variant at B=32, L=32K (block_r ones only at H=128), for the
#: formats in $PROBE_KNOB_FMTS (default C4R4). v1's were measured before (RESULTS.md).
KNOBS = {
    "v2": ({"hold_raw": True}, {"pv_form": 1}, {"num_stages": 2}, {"num_warps": 8}, {"maxnreg": 232}, {"block_n": 32},
           {"skip_pv": True}, {"zsub": True, "hold_raw": True}, {"block_r": 32, "num_warps": 4},
           {"block_r": 32, "num_warps": 8}, {"block_r": 64, "num_warps": 8}),
}
KNOB_FMTS = [f for f in os.environ.get("PROBE_KNOB_FMTS", "C4R4").split(",") if f]


def main(quick: bool):
    pairs = [(8, 4096), (32, 32768), (8, 32768), (128, 32768), (32, 131072)]
    if os.environ.get("PROBE_PAIRS"):
        pairs = [tuple(int(x) for x in p.split("x")) for p in os.environ["PROBE_PAIRS"].split(",")]
    if quick:
        pairs = pairs[:2]
    fi_reason = FlashInferMLA.available()
    print("flashinfer:", fi_reason or "ok", "variants:", VARIANTS, flush=True)
    report_kernels()
    for (B, L) in pairs:
        work = Workload(B, L)
        caches = {}
        for name in FORMATS:
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
                want, _ = qm.attention(q4[sub], r4[sub], cache, block_table=work.table[sub], seq_lens=work.seq_lens[sub],
                                       seq_ids=work.seq_ids[sub], softmax_scale=SCALE, backend="torch", validate=False)
                for v in VARIANTS:
                    try:
                        out, _ = run_triton(q4, r4, cache, work, variant=v)
                        rel = check(out[sub], want, f"{col(name, v)} H{H} B{B} L{L}")
                        t = bench(lambda: run_triton(q4, r4, cache, work, variant=v))
                    except Exception as exc:  # report, keep going
                        row[col(name, v)] = {"us": None, "note": f"{type(exc).__name__}: {exc}"[:300]}
                        print("error", col(name, v), row[col(name, v)]["note"], flush=True)
                        continue
                    byts = cache.format.page_bytes * work.num_pages
                    row[col(name, v)] = {"us": t, "GBps": byts / t / 1e3, "TFLOPs": FLOP_PER_TOKEN_HEAD * H * B * L / t / 1e6,
                                         "rel": rel, **kernel_stats()}
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
            ratios = " ".join(f"{col(n, v)}/FI={row[col(n, v)]['us'] / base:.2f}" for n in FORMATS for v in VARIANTS
                              if base and row.get(col(n, v), {}).get("us"))
            print(f"H={H} B={B} L={L}: {summary} {ratios}", flush=True)
            dump()
            # kernel variants on the key shape
            if (B, L) == (32, 32768) and os.environ.get("PROBE_KNOBS", "1") != "0":
                for kvar in [v for v in VARIANTS if v in KNOBS]:
                    for name in KNOB_FMTS:
                        for ov in KNOBS[kvar]:
                            if H == 16 and "block_r" in ov:
                                continue
                            try:
                                run_triton(q4, r4, caches[name], work, ov, variant=kvar)
                                t = bench(lambda: run_triton(q4, r4, caches[name], work, ov, variant=kvar))
                                v = {"variant": kvar, "fmt": name, "H": H, "ov": str(ov), "us": t, **kernel_stats()}
                            except Exception as exc:
                                v = {"variant": kvar, "fmt": name, "H": H, "ov": str(ov), "err": f"{type(exc).__name__}: {exc}"[:300]}
                            RES["variants"].append(v)
                            print("variant", v, flush=True)
                        dump()
        del caches, kv
        torch.cuda.empty_cache()

    if os.environ.get("PROBE_SKIP_WRITER") == "1":
        return
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
