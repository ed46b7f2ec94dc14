"""What ``qm.attention`` hands a backend: [B, H, d] queries as they are to a backend that takes them
(``Backend.takes_3d_queries``), 4-D views to the others, and ``want_lse=False`` when the caller drops lse."""

from __future__ import annotations

import pytest
import torch

import quantmla_core as qm

B, H, PAGES = 3, 16, 8


@pytest.mark.parametrize("return_lse", [True, False])
@pytest.mark.parametrize("takes_3d", [False, True])
def test_api_hands_the_backend(monkeypatch, takes_3d, return_lse):
    import quantmla_core.api as api

    cache = qm.MLACache.allocate(qm.PackFormat.parse("C4R4"), B * PAGES, B, 4, 128, device="cpu")
    seen = []

    class Impl:
        takes_3d_queries = takes_3d

        @staticmethod
        def attention(q, r, *rest, **kw):
            seen.append((tuple(q.shape), tuple(r.shape), kw))
            lse = torch.zeros(q.shape[:-1]) if kw.get("want_lse", True) else None
            return torch.zeros(q.shape), lse

    monkeypatch.setattr(api, "select_backend", lambda problem, backend: Impl)
    table = torch.arange(B * PAGES, dtype=torch.int32).view(B, PAGES)
    lens, ids = torch.full((B,), 300, dtype=torch.int32), torch.arange(B, dtype=torch.int32)
    q, r = torch.randn((B, H, 512)), torch.randn((B, H, 64))
    got = qm.attention(q, r, cache, block_table=table, seq_lens=lens, seq_ids=ids, softmax_scale=0.1,
                       return_lse=return_lse, validate=False)
    shapes = ((B, H, 512), (B, H, 64)) if takes_3d else ((B, 1, H, 512), (B, 1, H, 64))
    assert seen == [shapes + ({} if return_lse else {"want_lse": False},)]
    if return_lse:
        out, lse = got
        assert out.shape == (B, H, 512) and lse.shape == (B, H)
    else:
        assert got.shape == (B, H, 512)
