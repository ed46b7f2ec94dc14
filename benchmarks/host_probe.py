"""Host time of an eager CuPy attention call (GPU): H16 B8 L4K C4R4, where calls are host-bound.

Prints, for int32 and for int64 ``seq_lens``/``seq_ids``, the host microseconds per call through
``qm.attention`` and straight into the backend (launches only, no sync inside the loop) and the
eager ``do_bench`` time, then a cProfile of 300 calls by own time.

``--plan`` instead compares, per backend (``--backends``, default ``cupy,triton``) and format (C4R4, C2R4), at
``--heads`` heads (default 16), an eager
``qm.attention`` call with a planned ``plan.run`` (``qm.plan_attention`` made once; also with
caller-given ``out``/``lse``): host
microseconds per call, eager and CUDA-graph ``do_bench`` medians, with FlashInfer BF16 eager
and graphed in the same run when installed; ``--json PATH`` writes the rows.

    PYTHONPATH=. python -P benchmarks/host_probe.py
    PYTHONPATH=. python -P benchmarks/host_probe.py --plan --json results/h200_plan_host.json
    PYTHONPATH=. python -P benchmarks/host_probe.py --profile-plan   # cProfile of CuPy plan.run calls

``--launch`` times the CuPy calls twice in one process: with the backend's ``launch`` (the driver's
cuLaunchKernel on arguments packed by ``kernel_args.pack_args``) and with CuPy's own
``Function.__call__`` (how the backend launched until stop 20), beside FlashInfer BF16 eager.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(__file__))
import quantmla_core as qm  # noqa: E402
from _mla_bench_common import FlashInferMLA, Workload, gpu_info, host_us  # noqa: E402
from graph_probe import graphed  # noqa: E402
from quantmla_core.backends.cupy import attention as cupy_attention  # noqa: E402


def graph_us(fn) -> float:
    """do_bench median of ``fn`` captured once as a CUDA graph (its kernel time without the host)."""
    return do_bench(graphed(fn), warmup=25, rep=200, return_mode="median") * 1e3


def decode_inputs(batch: int, length: int, heads: int) -> tuple:
    """(workload, q [B, H, d_c], q_rope [B, H, d_r], index keyword arguments) of one decode step, the
    index arrays in the kernels' own dtypes (int32): a converted copy could not be graph-captured."""
    w = Workload(batch, length)
    q4, r4 = w.queries(heads)
    meta = {"block_table": w.table.int().contiguous(), "seq_lens": w.seq_lens.int().contiguous(),
            "seq_ids": w.seq_ids.int().contiguous()}
    return w, q4[:, 0].contiguous(), r4[:, 0].contiguous(), meta


def plan_rows(batch: int = 8, length: int = 4096, heads: int = 16, backends: tuple[str, ...] = ("cupy", "triton")
              ) -> list[dict]:
    """Eager qm.attention against plan.run (host us/call, eager and graph us) per backend in ``backends``
    and format."""
    w, q, r, meta = decode_inputs(batch, length, heads)
    rows = []
    why = FlashInferMLA.available()
    if why is None:
        fi = FlashInferMLA(w, w.bf16_dense(), heads, 0.07)
        rows.append({"backend": "flashinfer", "format": "BF16", "call": "run", "host_us": host_us(lambda: fi.run(q, r)),
                     "eager_us": do_bench(lambda: fi.run(q, r), warmup=25, rep=200, return_mode="median") * 1e3,
                     "graph_us": graph_us(lambda: fi.run(q, r))})
        del fi
    else:
        print(f"FlashInfer skipped: {why}", flush=True)
    for name in ("C4R4", "C2R4"):
        cache = w.build(name)
        for backend in backends:
            plan = qm.plan_attention(cache, num_heads=heads, q_dtype=torch.bfloat16, softmax_scale=0.07,
                                     backend=backend, **meta)
            o_buf, l_buf = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
            calls = {"attention": lambda: qm.attention(q, r, cache, softmax_scale=0.07, backend=backend, **meta),
                     "plan.run": lambda: plan.run(q, r),
                     "plan.run(out=)": lambda: plan.run(q, r, out=o_buf, lse=l_buf)}
            want = calls["attention"]()[0]
            assert torch.equal(calls["plan.run"]()[0], want), f"{backend} {name}: plan.run differs from attention"
            for call, fn in calls.items():
                rows.append({"backend": backend, "format": name, "call": call, "host_us": host_us(fn),
                             "eager_us": do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3,
                             "graph_us": graph_us(fn)})
                print(rows[-1], flush=True)
    for row in rows:
        row.update({"batch": batch, "length": length, "heads": heads})
    return rows


def launch_via_cupy_call(fn, grid, block, args, device_index, smem=0, stream=None, types=None, pdl=False) -> None:
    """The backend's launch before stop 20: CuPy's ``Function.__call__`` inside the stream's context (always a plain
    launch: ``pdl`` is ignored, which the combine's wait allows)."""
    from quantmla_core.backends.cupy import external_stream

    if types is not None:
        args = tuple(t(a) for t, a in zip(types, args))
    with stream or external_stream(device_index):
        fn(grid, block, args, shared_mem=smem)


def launch_rows(batch: int = 8, length: int = 4096, heads: int = 16) -> list[dict]:
    """CuPy qm.attention and plan.run with the driver launch and with CuPy's call (host us/call, eager
    do_bench us), FlashInfer BF16 eager beside; the outputs of both launch paths are checked equal."""
    w, q, r, meta = decode_inputs(batch, length, heads)
    rows = []
    if FlashInferMLA.available() is None:
        fi = FlashInferMLA(w, w.bf16_dense(), heads, 0.07)
        rows.append({"format": "BF16", "call": "flashinfer run", "launch": "-", "host_us": host_us(lambda: fi.run(q, r)),
                     "eager_us": do_bench(lambda: fi.run(q, r), warmup=25, rep=200, return_mode="median") * 1e3})
        del fi
    driver_launch = cupy_attention.launch
    for name in ("C4R4", "C2R4"):
        cache = w.build(name)
        plan = qm.plan_attention(cache, num_heads=heads, q_dtype=torch.bfloat16, softmax_scale=0.07, backend="cupy",
                                 **meta)
        calls = {"attention": lambda: qm.attention(q, r, cache, softmax_scale=0.07, backend="cupy", **meta),
                 "plan.run": lambda: plan.run(q, r)}
        outs = {}
        for label, fn in (("driver", driver_launch), ("cupy call", launch_via_cupy_call)):
            cupy_attention.launch = fn
            try:
                outs[label] = calls["plan.run"]()[0].clone()
                for call, run in calls.items():
                    rows.append({"format": name, "call": call, "launch": label, "host_us": host_us(run),
                                 "eager_us": do_bench(run, warmup=25, rep=200, return_mode="median") * 1e3})
                    print(rows[-1], flush=True)
            finally:
                cupy_attention.launch = driver_launch
        assert torch.equal(outs["driver"], outs["cupy call"]), f"{name}: the launch paths disagree"
    for row in rows:
        row.update({"batch": batch, "length": length, "heads": heads})
    return rows


def profile_plan_run(n: int = 300) -> None:
    """cProfile of ``n`` CuPy ``plan.run`` calls (H16 B8 L4K C4R4) by own time."""
    w = Workload(8, 4096)
    cache = w.build("C4R4")
    q4, r4 = w.queries(16)
    q, r = q4[:, 0].contiguous(), r4[:, 0].contiguous()
    plan = qm.plan_attention(cache, block_table=w.table, seq_lens=w.seq_lens, seq_ids=w.seq_ids, num_heads=16,
                             q_dtype=torch.bfloat16, softmax_scale=0.07, backend="cupy")
    print(f"plan.run host {host_us(lambda: plan.run(q, r)):.1f} us/call", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        plan.run(q, r)
    profile.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())


def _option(name: str, default: str) -> str:
    """The value after ``name`` on the command line, else ``default``."""
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main() -> None:
    if "--profile-plan" in sys.argv:
        profile_plan_run()
        return
    if "--plan" in sys.argv or "--launch" in sys.argv:
        backends = tuple(_option("--backends", "cupy,triton").split(","))
        heads = int(_option("--heads", "16"))
        rows = plan_rows(heads=heads, backends=backends) if "--plan" in sys.argv else launch_rows()
        if "--json" in sys.argv:
            path = sys.argv[sys.argv.index("--json") + 1]
            with open(path, "w") as f:
                json.dump({"gpu": gpu_info(), "command": " ".join(sys.argv), "rows": rows}, f, indent=1)
        for row in rows:
            print(f"{row.get('backend', row.get('launch')):10s} {row['format']:5s} {row['call']:14s} host "
                  f"{row['host_us']:6.1f} us/call  eager {row['eager_us']:6.1f} us"
                  + (f"  graph {row['graph_us']:6.1f} us" if "graph_us" in row else ""))
        return
    w = Workload(8, 4096)
    cache = w.build("C4R4")
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(8, 16, 512, device="cuda", generator=g).bfloat16()
    r = torch.randn(8, 16, 64, device="cuda", generator=g).bfloat16()
    for label, lens, ids in (("int32", w.seq_lens, w.seq_ids), ("int64", w.seq_lens.long(), w.seq_ids.long())):
        def api():
            return qm.attention(q, r, cache, block_table=w.table, seq_lens=lens, seq_ids=ids, softmax_scale=0.07,
                                backend="cupy")

        def backend_only():
            return cupy_attention.attention(q[:, None], r[:, None], cache, w.table, lens, ids, 0.07)

        eager = do_bench(api, warmup=25, rep=200, return_mode="median") * 1e3
        print(f"{label} seq_lens/seq_ids: qm.attention host {host_us(api):.1f} us/call, backend only "
              f"{host_us(backend_only):.1f} us/call, eager do_bench {eager:.1f} us", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        qm.attention(q, r, cache, block_table=w.table, seq_lens=w.seq_lens, seq_ids=w.seq_ids, softmax_scale=0.07,
                     backend="cupy")
    profile.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(20)
    print(out.getvalue())


if __name__ == "__main__":
    main()
