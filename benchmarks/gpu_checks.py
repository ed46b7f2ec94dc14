"""GPU spot checks beyond the conformance suites: every GPU backend against the float64 reference
on a request that grows past a page boundary one decode token at a time (the serving pattern).

    python -m benchmarks.gpu_checks
"""

from __future__ import annotations

import numpy as np
import torch

import quantmla_core as qm
from quantmla_core import reference as ref


def growth_check(backend: str, fmt_name: str, prompt: int = 1024, steps: int = 8, heads: int = 16) -> list[float]:
    """Relative error of attention after each single-token append (bf16 values, sink 4, local 128)."""
    fmt = qm.PackFormat.parse(fmt_name)
    pc = qm.PagedMLACache(fmt, num_pages=2 + (prompt + steps) // 64, max_seqs=2, device="cuda", backend=backend)
    a = pc.add_request()
    g = torch.Generator(device="cuda").manual_seed(0)
    chan = torch.exp(0.7 * torch.randn(512, device="cuda", generator=g))
    lat = lambda n: (torch.randn(n, 512, device="cuda", generator=g) * chan).bfloat16()  # noqa: E731
    rop = lambda n: torch.randn(n, 64, device="cuda", generator=g).bfloat16()  # noqa: E731
    pc.append(a, lat(prompt), rop(prompt))
    errs = []
    for _ in range(steps):
        pc.append(a, lat(1), rop(1))
        q = torch.randn(1, heads, 512, device="cuda", generator=g).bfloat16() / 8
        qr = torch.randn(1, heads, 64, device="cuda", generator=g).bfloat16() / 8
        out, lse = pc.attention(q, qr, [a], softmax_scale=0.0722)
        host = qm.MLACache(fmt, pc.cache.pages.cpu(), pc.cache.sink_buf.cpu(), pc.cache.local_buf.cpu(), 2, 4, 128)
        want, want_lse = ref.decode_attention(q.cpu(), qr.cpu(), host, pc.block_table([a]).cpu(), pc.seq_lens([a]).cpu(),
                                              np.array([a]), 0.0722)
        errs.append(float(np.linalg.norm(out.float().cpu().numpy() - want) / np.linalg.norm(want)))
    return errs


def main() -> None:
    for backend in ("cupy", "triton", "torch"):
        for name in ("C4R4", "BF16"):
            try:
                errs = growth_check(backend, name)
                print(f"growth {backend:<7} {name}: max rel err {max(errs):.2e}  per step {['%.1e' % e for e in errs]}")
            except Exception as exc:  # report and go on: this is a diagnostic
                print(f"growth {backend:<7} {name}: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
