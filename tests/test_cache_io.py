"""Saving and loading a cache (``qm.save_cache`` / ``qm.load_cache``): every array comes back byte for byte with its
format and protection sizes, attention over the loaded cache equals attention over the saved one, and files that are
not a saved cache of a known format and layout version are refused naming what is wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core.testing import Case, allocate, build

pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402

DEVICES = ["cpu", "numpy"] + (["cuda"] if torch.cuda.is_available() else [])
CASES = [Case(qm.PackFormat.parse("C4R4"), (70, 1), heads=16, seed=51),
         Case(qm.PackFormat.parse("C2R4", latent_dim=256, rope_dim=32, page_size=16), (130, 5), heads=4, s_q=2, seed=52),
         Case(qm.PackFormat.parse("BF16"), (33,), heads=8, sink=0, local=0, seed=53)]


def _written(case: Case, device: str):
    batch = build(case)
    args = batch.to(device)
    cache = allocate(case, batch, device)
    qm.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
             positions=args["positions"], seq_lens=args["seq_lens"])
    return batch, args, cache


def _attend(cache, batch, args):
    return qm.attention(args["q_latent"], args["q_rope"], cache, block_table=args["block_table"],
                        seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"], softmax_scale=batch.softmax_scale)


def _host(x):
    return x if isinstance(x, np.ndarray) else x.float().cpu().numpy() if x.dtype != torch.uint8 else x.cpu().numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_round_trip_keeps_every_byte_and_the_attention(case, device, tmp_path):
    batch, args, cache = _written(case, device)
    path = tmp_path / "layer0.safetensors"
    qm.save_cache(cache, path)
    loaded = qm.load_cache(path, device=device)
    assert loaded.format == cache.format and (loaded.max_seqs, loaded.sink, loaded.local) == (
        cache.max_seqs, cache.sink, cache.local)
    assert loaded.device == cache.device
    for name in ("pages", "sink_buf", "local_buf"):
        a, b = getattr(loaded, name), getattr(cache, name)
        assert type(a) is type(b) and a.dtype == b.dtype and np.array_equal(_host(a), _host(b)), name
    out, lse = _attend(loaded, batch, args)
    want_out, want_lse = _attend(cache, batch, args)
    assert np.array_equal(_host(out), _host(want_out)) and np.array_equal(_host(lse), _host(want_lse))


def test_torch_cache_loads_as_numpy_with_float32_protection(tmp_path):
    _, _, cache = _written(CASES[0], "cpu")
    qm.save_cache(cache, tmp_path / "c.safetensors")
    loaded = qm.load_cache(tmp_path / "c.safetensors", device="numpy")
    assert loaded.is_numpy and loaded.sink_buf.dtype == np.float32
    assert np.array_equal(loaded.local_buf, cache.local_buf.float().numpy())  # bfloat16 -> float32 is exact


def _saved_file(tmp_path, cache) -> tuple:
    """(path, tensors, metadata) of ``cache`` saved under ``tmp_path``, for a test to change and save again."""
    from safetensors import safe_open

    path = tmp_path / "c.safetensors"
    qm.save_cache(cache, path)
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
    return path, load_file(path), meta


def _saved(tmp_path, **meta_changes):
    path, tensors, meta = _saved_file(tmp_path, _written(CASES[0], "cpu")[2])
    for k, v in meta_changes.items():
        if v is None:
            meta.pop(k)
        else:
            meta[k] = v
    return path, tensors, meta


@pytest.mark.parametrize("changes, match", [
    ({"kind": "something else"}, "expected a saved QuantMLA cache"),
    ({"format": json.dumps({**qm.PackFormat.parse("C4R4").to_dict(), "version": 99})}, "version: expected one of"),
    ({"format": json.dumps({**qm.PackFormat.parse("C4R4").to_dict(), "name": "C3R4"})}, "format name"),
    ({"format": None}, "lacks 'format'"),
    ({"sink": "four"}, "sink: expected a non-negative integer"),
])
def test_bad_metadata_is_refused_naming_it(changes, match, tmp_path):
    path, tensors, meta = _saved(tmp_path, **changes)
    save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match=match):
        qm.load_cache(path)


@pytest.mark.parametrize("name, bad, match", [
    ("pages", lambda t: t[:, :-128].contiguous(), r"pages: expected uint8 \[num_pages, 20352\]"),
    ("local_buf", lambda t: t.float(), "local_buf: expected the sink buffer's dtype"),
    ("sink_buf", lambda t: t[:1].contiguous(), r"sink_buf: expected bfloat16 or float32 \[2, 4, 576\]"),
])
def test_arrays_of_the_wrong_shape_or_dtype_are_refused(name, bad, match, tmp_path):
    path, tensors, meta = _saved(tmp_path)
    tensors[name] = bad(tensors[name])
    save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match=match):
        qm.load_cache(path)


def test_missing_array_is_named(tmp_path):
    path, tensors, meta = _saved(tmp_path)
    del tensors["local_buf"]
    save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match=r"lacks \['local_buf'\]"):
        qm.load_cache(path)


def _paged(device: str, layers: int = 2) -> tuple[qm.PagedMLACache, list[int]]:
    """A two-layer paged cache with three requests of different lengths, one freed and one forked (free pages and
    rows out of order)."""
    g = torch.Generator().manual_seed(7)
    paged = qm.PagedMLACache("C4R4", num_pages=12, max_seqs=4, sink=4, local=16, device=device, num_layers=layers)
    ids = [paged.add_request() for _ in range(3)]
    for s, n in zip(ids, (70, 130, 9)):
        plan = paged.reserve([(s, n)])
        for i in range(layers):
            lat, kr = torch.randn(n, 512, generator=g), torch.randn(n, 64, generator=g)
            if device == "numpy":
                lat, kr = lat.numpy(), kr.numpy()
            elif device == "cuda":  # the GPU backends take bfloat16 on the cache's device
                lat, kr = lat.cuda().bfloat16(), kr.cuda().bfloat16()
            paged.write(plan, lat, kr, layer=i)
    paged.free(ids[1])
    return paged, [ids[0], paged.fork(ids[0]), ids[2]]


@pytest.mark.parametrize("device", DEVICES)
def test_paged_cache_round_trip_keeps_layers_and_bookkeeping(device, tmp_path):
    paged, live = _paged(device)
    qm.save_cache(paged, tmp_path / "paged.safetensors")
    loaded = qm.load_cache(tmp_path / "paged.safetensors", device=device)
    assert isinstance(loaded, qm.PagedMLACache) and loaded.num_layers == 2
    assert loaded.allocator_state() == paged.allocator_state()
    for i in range(2):
        for name in ("pages", "sink_buf", "local_buf"):
            assert np.array_equal(_host(getattr(loaded.layer(i), name)), _host(getattr(paged.layer(i), name)))
    g = torch.Generator().manual_seed(8)
    q, r = torch.randn(3, 16, 512, generator=g), torch.randn(3, 16, 64, generator=g)
    if device == "numpy":
        q, r = q.numpy(), r.numpy()
    elif device == "cuda":
        q, r = q.cuda().bfloat16(), r.cuda().bfloat16()
    for i in range(2):
        a = loaded.attention(q, r, live, 0.05, layer=i)
        b = paged.attention(q, r, live, 0.05, layer=i)
        assert np.array_equal(_host(a[0]), _host(b[0])) and np.array_equal(_host(a[1]), _host(b[1]))
    # the loaded allocator goes on as the saved one would
    assert loaded.add_request() == paged.add_request() and loaded.num_free_pages == paged.num_free_pages


@pytest.mark.parametrize("edit, match", [
    (lambda st: st["free_pages"].pop(), "every page 0..11 must be free or owned by exactly one request"),
    (lambda st: st["lens"].update({"0": 500}), "request 0 holds 2 pages for 500 tokens"),
    (lambda st: st["free_rows"].append(0), "every request row 0..3 must be free or live exactly once"),
    (lambda st: st.pop("lens"), "state: expected free_pages, free_rows, pages and lens"),
])
def test_inconsistent_allocator_state_is_refused(edit, match, tmp_path):
    path, tensors, meta = _saved_file(tmp_path, _paged("cpu")[0])
    state = json.loads(meta["state"])
    edit(state)
    meta["state"] = json.dumps(state)
    save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match=match):
        qm.load_cache(path)
