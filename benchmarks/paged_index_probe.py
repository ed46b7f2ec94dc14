"""Host time of the index arrays a decode step builds through ``PagedMLACache`` (CPU arrays, no copy to a GPU).

Per layer: ``reserve`` of one token a request (the writer's slots, ids, positions, lengths) and the attention's page
table, lengths and ids. Per step of a model (``--layers``, one allocator a layer as the Hugging Face integration keeps):
every layer's ``reserve`` and ``plan_attention`` (torch backend), each layer building its own, and with the layers
sharing one ``StepMemo`` (the integration's default since stop 52), where the first layer builds them.

    python benchmarks/paged_index_probe.py [--batches 8,32,128] [--context 4000] [--calls 200] [--layers 27]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from quantmla_core import PackFormat
from quantmla_core.paged import PagedMLACache

try:
    from quantmla_core import StepMemo
except ImportError:  # a tree before stop 52 (the "before" of RESULTS.md): its step without a memo only
    StepMemo = None

FMT = PackFormat.parse("C4R4")


def _allocators(batch: int, context: int, calls: int, layers: int, memo: StepMemo | None) -> list[PagedMLACache]:
    """``layers`` allocators of ``batch`` requests holding ``context`` tokens each, room for ``calls`` more."""
    pages = batch * (context // FMT.page_size + calls // FMT.page_size + 2)
    out = []
    for _ in range(layers):
        paged = PagedMLACache(FMT, pages, batch, 4, 128, "cpu", None, "torch", **({"memo": memo} if memo is not None else {}))
        ids = [paged.add_request() for _ in range(batch)]
        paged.reserve([(s, context) for s in ids])
        out.append(paged)
    return out


def per_layer_us(batch: int, context: int, calls: int) -> tuple[float, float]:
    """(reserve µs, attention arrays µs) a call of one allocator without a memo."""
    (paged,) = _allocators(batch, context, calls, 1, None)
    ids = paged.active_requests
    t0 = time.perf_counter()
    for _ in range(calls):
        paged.reserve([(s, 1) for s in ids])
    t1 = time.perf_counter()
    for _ in range(calls):
        paged.block_table(ids), paged.seq_lens(ids), paged._index_array(ids, np.int32)
    t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / calls, 1e6 * (t2 - t1) / calls


def per_step_us(batch: int, context: int, calls: int, layers: int, shared: bool) -> float | None:
    """µs a decode step of ``layers`` allocators spends in ``reserve`` and ``plan_attention`` (H 16, bfloat16); None
    when ``shared`` asks for a memo that this tree does not have."""
    if shared and StepMemo is None:
        return None
    memo = StepMemo() if shared else None
    model = _allocators(batch, context, calls, layers, memo)
    ids = model[0].active_requests
    t0 = time.perf_counter()
    for _ in range(calls):
        for paged in model:
            paged.reserve([(s, 1) for s in ids])
            paged.plan_attention(ids, num_heads=16, q_dtype=torch.bfloat16, softmax_scale=0.1, q_len=1, validate=False)
    return 1e6 * (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--layers", type=int, default=27)
    args = ap.parse_args()
    for b in map(int, args.batches.split(",")):
        reserve, arrays = per_layer_us(b, args.context, args.calls)
        print(f"B{b}: reserve {reserve:.1f} us, attention arrays {arrays:.1f} us a layer")
        own, shared = (per_step_us(b, args.context, args.calls, args.layers, s) for s in (False, True))
        memo = "no StepMemo in this tree" if shared is None else f"{shared:.0f} us sharing a StepMemo"
        print(f"B{b}: a step of {args.layers} layers (reserve + plan_attention): {own:.0f} us each layer its own, {memo}")


if __name__ == "__main__":
    main()
