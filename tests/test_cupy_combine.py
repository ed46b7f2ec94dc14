"""CuPy backend: the log-sum-exp combine (``kernels/attention.cu``'s ``qmla_combine``) on its own, on a GPU.

Split counts around its batch of loads (1, 7, 8, 9, 16, 17, 64, 100), splits that saw no token, rows that saw
none, launched plainly and with PDL, against a float64 merge of the same partials. Outputs start poisoned.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cupy_backend import gpu

import quantmla_core as qm
from quantmla_core.backends.cupy import launch
from quantmla_core.backends.cupy.attention import COMBINE_TYPES
from quantmla_core.backends.cupy.builds import COMBINE_THREADS
from quantmla_core.backends.cupy.pdl import pdl_unavailable_reason
from quantmla_core.backends.cupy.plans import _combine_kernel

LN2 = float(np.log(2.0))


def merged(o: torch.Tensor, ml: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 merge of partials ``o`` [rows, splits, d_c] with (m, l) ``ml`` [rows, splits, 2] (log2 units):
    out [rows, d_c] and lse [rows] (natural log); rows without any token give zeros and -inf."""
    o, m, l = o.double(), ml[..., 0].double(), ml[..., 1].double()
    big = m.max(dim=1, keepdim=True).values
    w = torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp2(m - big.clamp(min=-1e300)))
    den = (w * l).sum(dim=1)
    out = (w[..., None] * o).sum(dim=1) / torch.where(den > 0, den, torch.ones_like(den))[:, None]
    lse = torch.where(den > 0, LN2 * (big[:, 0] + torch.log2(den)), torch.full_like(den, -float("inf")))
    return out, lse


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("splits", [1, 7, 8, 9, 16, 17, 64, 100])
def test_combine_matches_a_float64_merge(splits, pdl):
    if pdl:
        why = pdl_unavailable_reason(torch.cuda.get_device_capability())
        if why:
            pytest.skip(why)
    fmt = qm.PackFormat.parse("C4R4")
    rows, dc = 37, fmt.latent_dim
    g = torch.Generator(device="cuda").manual_seed(1000 + splits)
    o = torch.randn((rows, splits, dc), device="cuda", generator=g)
    m = torch.randn((rows, splits), device="cuda", generator=g) * 4
    m[torch.rand((rows, splits), device="cuda", generator=g) < 0.2] = -float("inf")  # splits with no token
    m[3] = -float("inf")  # a row with none at all
    l = torch.rand((rows, splits), device="cuda", generator=g) * 50 + 0.5
    l[torch.isinf(m)] = 0.0
    ml = torch.stack([m, l], dim=-1).contiguous()
    out = torch.full((rows, dc), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((rows,), float("nan"), device="cuda")
    dev = torch.cuda.current_device()
    torch.cuda.synchronize()
    launch(_combine_kernel(fmt, dev), (rows,), (COMBINE_THREADS,),
           (o.data_ptr(), ml.data_ptr(), out.data_ptr(), lse.data_ptr(), splits), dev, types=COMBINE_TYPES, pdl=pdl)
    want, want_lse = merged(o, ml)
    torch.cuda.synchronize()
    assert torch.allclose(lse.double(), want_lse, rtol=1e-5, atol=1e-5, equal_nan=False)
    assert torch.allclose(out.double(), want, rtol=1e-2, atol=1e-3)  # one bf16 rounding
    assert torch.equal(out[3], torch.zeros_like(out[3]))
