"""Host time of the index arrays a ``PagedMLACache`` builds for one layer's decode step (CPU arrays, no copy to a GPU):
``reserve`` of one token a request (the writer's slots, ids, positions, lengths) and the attention's page table,
lengths and ids. The Hugging Face integration keeps one ``PagedMLACache`` a layer, so a step pays this once a layer.

    python benchmarks/paged_index_probe.py [--batches 8,32,128] [--context 4000] [--calls 200]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from quantmla_core import PackFormat
from quantmla_core.paged import PagedMLACache


def per_layer_us(batch: int, context: int, calls: int) -> tuple[float, float]:
    """(reserve µs, attention arrays µs) a call for ``batch`` requests of ``context`` tokens, C4R4 pages."""
    fmt = PackFormat.parse("C4R4")
    paged = PagedMLACache(fmt, batch * (context // fmt.page_size + calls // fmt.page_size + 2), batch, 4, 128, "cpu",
                          None, "torch")
    ids = [paged.add_request() for _ in range(batch)]
    paged.reserve([(s, context) for s in ids])
    t0 = time.perf_counter()
    for _ in range(calls):
        paged.reserve([(s, 1) for s in ids])
    t1 = time.perf_counter()
    for _ in range(calls):
        paged.block_table(ids), paged.seq_lens(ids), paged._index_array(ids, np.int32)
    t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / calls, 1e6 * (t2 - t1) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    for b in map(int, args.batches.split(",")):
        reserve, arrays = per_layer_us(b, args.context, args.calls)
        print(f"B{b}: reserve {reserve:.1f} us, attention arrays {arrays:.1f} us a layer")


if __name__ == "__main__":
    main()
