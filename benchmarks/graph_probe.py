"""Eager vs CUDA-graph replay of one attention call (H200): how much of a short call is host time.

For each shape and backend it times ``quantmla_core.attention`` eagerly (CUDA events around
back-to-back calls, so host time shows when it exceeds the GPU's) and as a replayed CUDA graph
of the same call (GPU time only), beside FlashInfer BF16 when it is installed (eagerly and, where its call can be
captured, as a CUDA graph: ``flashinfer_graph_us``), timed before a shape's rows and again after them
(``flashinfer_after_us``, ``flashinfer_graph_after_us``): at large shapes the GPU may reach its power cap meanwhile.

    PYTHONPATH=. python -P benchmarks/graph_probe.py [--shapes 16x8x4096,16x32x32768x4,...] [--dims 256,32] [--json F]

A shape is HxBxL or HxBxLxS_q (S_q query tokens per request, causal; FlashInfer is timed at S_q = 1 only, and only at
the default dims, d_c 512 / d_r 64).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(__file__))
import quantmla_core as qm  # noqa: E402
from quantmla_core.testing import capture_graph  # noqa: E402
from _mla_bench_common import FlashInferMLA, Workload, add_probe_arguments, probe_shapes  # noqa: E402

SCALE = 1.0 / 576 ** 0.5


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # µs


def graphed(fn):
    """``fn`` captured into a CUDA graph (after two warm-up calls): the graph's replay."""
    return capture_graph(fn)[0].replay


def _graph_or_none(fn) -> float | None:
    """``fn`` timed as a replayed CUDA graph, or None (with the reason printed) where it cannot be captured."""
    try:
        return bench(graphed(fn))
    except Exception as exc:  # a wrapper that cannot be captured: its eager time stands alone
        print(f"(not timed as a CUDA graph: {type(exc).__name__}: {exc})", flush=True)
        return None


def _settings(args) -> list[dict[str, str]]:
    """The environment settings to time: ``--sweep NAME=V1,V2`` or ``--settings "A=1 B=2;A=1"``."""
    if args.settings:
        return [dict(kv.split("=", 1) for kv in group.split()) for group in args.settings.split(";")]
    if args.sweep:
        var, values = args.sweep.split("=", 1)
        return [{var: v} for v in values.split(",")]
    return [{}]


def _probe_shape(h: int, b: int, l: int, args, settings: list[dict[str, str]], s_q: int = 1) -> list[dict]:
    """Every format x backend x setting at one shape (one workload and query set)."""
    work = Workload(b, l, latent_dim=args.latent_dim, rope_dim=args.rope_dim)
    q, r = work.queries(h, s_q)
    kw = work.attention_kwargs(SCALE)
    fi_us = fi_graph_us = None
    if s_q == 1 and (args.latent_dim, args.rope_dim) == (512, 64) and not FlashInferMLA.available():
        kv = work.bf16_dense()
        fi = FlashInferMLA(work, kv, h, SCALE)

        def fi_call():
            return fi.run(q[:, 0], r[:, 0])

        fi_us = bench(fi_call)
        fi_graph_us = _graph_or_none(fi_call)
    rows = []
    for name in args.formats.split(","):
        cache = work.build(name, sink=args.sink, local=args.local)
        for backend in args.backends.split(","):
            for setting in settings:
                os.environ.update(setting)

                def call(backend=backend, cache=cache):
                    return qm.attention(q, r, cache, backend=backend, **kw)

                start = time.time()
                eager = bench(call)
                graph = bench(graphed(call))
                for var in setting:
                    os.environ.pop(var, None)
                row = {"H": h, "B": b, "L": l, "S_q": s_q, "format": name, "d_c": args.latent_dim, "d_r": args.rope_dim,
                       "backend": backend, "eager_us": eager,
                       "graph_us": graph, "flashinfer_us": fi_us, "flashinfer_graph_us": fi_graph_us,
                       "sink": args.sink, "local": args.local,
                       "setting": " ".join(f"{k}={v}" for k, v in setting.items()),
                       "wall_start": start, "wall_end": time.time()}
                rows.append(row)
                fi_txt = f"  FI {fi_us:7.1f} us: eager {eager / fi_us:5.2f}x graph {graph / fi_us:5.2f}x" if fi_us else ""
                fi_txt += f" (FI graph {fi_graph_us:7.1f} us)" if fi_graph_us else ""
                print(f"H{h} B{b} L{l}{f' S{s_q}' if s_q > 1 else ''} {name} {backend:<6} {row['setting']:<32} eager {eager:8.1f} us  "
                      f"graph {graph:8.1f} us{fi_txt}", flush=True)
    if fi_us is not None:
        # timed again after the rows: a GPU at its power cap runs slower the longer it has run hot, so the first
        # FlashInfer time (of a cool GPU) alone would favour it
        after = {"flashinfer_after_us": bench(fi_call), "flashinfer_graph_after_us": _graph_or_none(fi_call)}
        for row in rows:
            row.update(after)
        graph_after = after["flashinfer_graph_after_us"]
        print(f"H{h} B{b} L{l} FI again after the rows: eager {after['flashinfer_after_us']:7.1f} us"
              + (f", graph {graph_after:7.1f} us" if graph_after else ""), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    add_probe_arguments(ap, shapes="16x8x4096,16x32x4096,16x32x32768,128x8x4096", formats="C4R4",
                        backends="cupy,triton")
    ap.add_argument("--sweep", default=None,
                    help="NAME=V1,V2,...: an environment variable to sweep (read per call by the launchers)")
    ap.add_argument("--settings", default=None,
                    help='"A=1 B=2;A=1;...": environment settings to time one after another (instead of --sweep)')
    ap.add_argument("--dims", default="512,64", help="d_c,d_r of the caches and queries (FlashInfer: 512,64 only)")
    args = ap.parse_args(argv)
    args.latent_dim, args.rope_dim = (int(x) for x in args.dims.split(","))
    settings = _settings(args)
    probe_shapes(args, lambda h, b, l, *s_q: _probe_shape(h, b, l, args, settings, *s_q))


if __name__ == "__main__":
    main()
