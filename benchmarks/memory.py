"""Memory table: the real allocation of a cache against ``memory_bytes()``.

For each format and context length, one request's cache is allocated through
:class:`~quantmla_core.PagedMLACache` (pages, sink and local buffers) and its page table is
built; the bytes the device allocator actually handed out (``torch.cuda.memory_allocated``
deltas on a GPU, tensor sizes on the CPU) are compared with the accounting of DESIGN.md §3.6.

    python -m benchmarks.memory --device cuda --out benchmarks/results/memory.json
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

import quantmla_core as qm

from .machine import command_line, machine_info

FORMATS = ("BF16", "C8R8", "C4R4", "C2R4")
LENGTHS = (4096, 32768, 131072, 1048576)


def _allocated(device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return 0


def measure(fmt_name: str, length: int, device: str, sink: int = 4, local: int = 128) -> dict:
    """Real bytes of one request's cache (pages + protection + page table) vs memory_bytes()."""
    fmt = qm.PackFormat.parse(fmt_name)
    protect = (sink, local) if fmt.quantized else (0, 0)  # the BF16 baseline needs no protection
    pages = -(-length // fmt.page_size)
    gc.collect()
    before = _allocated(device)
    cache = qm.PagedMLACache(fmt, pages, 1, *protect, device=device)
    table = torch.arange(pages, dtype=torch.int32, device=device)[None]  # the request's page table
    if device.startswith("cuda"):
        real = _allocated(device) - before
    else:
        real = cache.allocated_bytes() + table.numel() * table.element_size()
    accounted = qm.memory_bytes(fmt, length, *protect)
    bf16 = qm.memory_bytes(qm.PackFormat.parse("BF16"), length, 0, 0)
    del cache, table
    return {
        "format": fmt_name, "length": length, "real_bytes": int(real), "memory_bytes": int(accounted),
        "page_table_bytes": 4 * pages, "agreement": real / accounted, "compression_vs_bf16": bf16 / real,
    }


def memory_table(formats=FORMATS, lengths=LENGTHS, device: str = "cpu") -> list[dict]:
    return [measure(f, n, device) for n in lengths for f in formats]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--out", default=None, help="write JSON here")
    args = ap.parse_args(argv)
    rows = memory_table(lengths=[int(x) for x in args.lengths.split(",")], device=args.device)
    print(f"{'format':<6} {'L':>8} {'real MiB':>10} {'memory_bytes MiB':>17} {'real/accounted':>15} {'vs BF16':>8}")
    for r in rows:
        print(f"{r['format']:<6} {r['length']:>8} {r['real_bytes'] / 2**20:>10.2f} {r['memory_bytes'] / 2**20:>17.2f} "
              f"{r['agreement']:>15.5f} {r['compression_vs_bf16']:>7.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_info(), "command": command_line(), "device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
