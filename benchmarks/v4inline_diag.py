"""Where kernel v4 with the protected tokens inline differs from v4 with the protected-tile kernel (sm_90 GPU).

For each format, build, request lengths and split count it runs both on the same cache and queries and prints, per
request, the largest difference of the outputs and of the log-sum-exps, whether a second inline call repeats the
first bit for bit, and where the first differing query rows are.

    PYTHONPATH=. python -P benchmarks/v4inline_diag.py [--formats BF16,C4R4] [--builds 1w8,0]
"""

from __future__ import annotations

import argparse
import os

import torch

from quantmla_core import PackFormat
from quantmla_core.backends.triton import attention as A
from quantmla_core.testing import Case, write_case

LENS = [(20000, 5, 9000), (5,), (20000, 5), (5, 9000), (9000,), (300, 5), (20000,), (9000, 5)]
SPLITS = [None, 1, 2, 8, 19, 20, 21]


def _set_build(build: str, inline: bool) -> None:
    pipeline, _, warps = build.partition("w")
    os.environ[A.V4_PIPELINE_ENV] = pipeline
    os.environ[A.V4_LOADER_WARPS_ENV] = warps or "4"
    os.environ[A.V4_INLINE_PROTECT_ENV] = "1" if inline else "0"


def _run(case_args, build: str, inline: bool, splits: int | None):
    batch, args, cache = case_args
    _set_build(build, inline)
    out, lse = A.attention(args["q_latent"], args["q_rope"], cache, args["block_table"], args["attn_seq_lens"],
                           args["attn_seq_ids"], batch.softmax_scale, num_splits=splits, variant="v4")
    torch.cuda.synchronize()
    return out.float(), lse.float()


def report(fmt: str, build: str, lens: tuple[int, ...], splits: int | None, case_args) -> None:
    o0, l0 = _run(case_args, build, False, splits)
    o1, l1 = _run(case_args, build, True, splits)
    o2, l2 = _run(case_args, build, True, splits)
    same = torch.equal(o1, o2) and torch.equal(l1, l2)
    cells = []
    for b in range(len(lens)):
        err_o = (o1[b] - o0[b]).abs().nan_to_num(1e9)
        err_l = (l1[b] - l0[b]).abs().nan_to_num(1e9)
        do, dl = err_o.max().item(), err_l.max().item()
        bad = ""
        if do > 0.05 or dl > 0.01:
            rows = (err_o.amax(-1) > 0.05) | (err_l > 0.01)
            idx = rows.nonzero()[:4].tolist()
            bad = f" BAD rows(s,h)={idx} n={int(rows.sum())} nan={int(o1[b].isnan().sum())}"
        cells.append(f"L{lens[b]}: dout {do:.3g} dlse {dl:.3g}{bad}")
    print(f"{fmt} {build} lens={lens} splits={splits} repeat={'same' if same else 'DIFFERS'} | " + " | ".join(cells),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="BF16,C4R4")
    ap.add_argument("--builds", default="1w8,0")
    ap.add_argument("--lens", default=None, help="e.g. 20000_5_9000,5")
    a = ap.parse_args()
    lens_list = [tuple(int(x) for x in s.split("_")) for s in a.lens.split(",")] if a.lens else LENS
    for fmt in a.formats.split(","):
        for lens in lens_list:
            case = Case(PackFormat.parse(fmt), lens, heads=128, sink=4, local=128, seed=4242)
            case_args = write_case(case, "cuda", "bfloat16")
            for build in a.builds.split(","):
                for splits in SPLITS:
                    try:
                        report(fmt, build, lens, splits, case_args)
                    except Exception as e:  # noqa: BLE001 - a diagnostic: print and go on
                        print(f"{fmt} {build} lens={lens} splits={splits} ERROR {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
