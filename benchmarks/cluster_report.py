"""How many of v6's merging clusters the GPU runs at once (``cuOccupancyMaxActiveClusters``), beside its single CTAs.

For each format and cluster size it compiles v6's merging build (``QUANTMLA_CUPY_V6_MERGE``) and prints the driver's
count of resident clusters, the CTAs they hold and the single CTAs the GPU holds: where the clusters hold fewer CTAs,
``plans.v6_merge_reason`` keeps the combine.

    PYTHONPATH=. python -P benchmarks/cluster_report.py [--formats C4R4] [--sizes 2,4,8] [--json F]
"""

from __future__ import annotations

import argparse
import json

import torch

import quantmla_core as qm
from quantmla_core.backends.cupy import function_ptr, resident_ctas
from quantmla_core.backends.cupy.builds import V6_THREADS
from quantmla_core.backends.cupy.clusters import max_active_clusters
from quantmla_core.backends.cupy.knobs import V6Knobs
from quantmla_core.backends.cupy.plans import _v6_kernel, device_info, v6_rope_fold


def report(fmt_name: str, size: int, dev: int) -> dict:
    """The resident clusters of ``size`` v6 CTAs (``fmt_name``'s merging build) and single CTAs on device ``dev``."""
    fmt = qm.PackFormat.parse(fmt_name)
    sm_count, _cap = device_info(dev)
    attn, smem = _v6_kernel(fmt, dev, True, V6Knobs(), False, v6_rope_fold(fmt), False, size)
    clusters = max_active_clusters(function_ptr(attn), (1, size, 1), V6_THREADS, smem, dev) if size > 1 else None
    row = {"format": fmt_name, "cluster": size, "active_clusters": clusters,
           "cluster_ctas": None if clusters is None else clusters * size,
           "resident_ctas": resident_ctas(attn, V6_THREADS, smem, dev, sm_count), "sms": sm_count}
    print(f"{fmt_name} clusters of {size}: {clusters} at once ({row['cluster_ctas']} CTAs); single CTAs "
          f"{row['resident_ctas']} on {sm_count} SMs", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="C4R4")
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.cuda.current_device()
    rows = [report(f, int(s), dev) for f in args.formats.split(",") for s in args.sizes.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
