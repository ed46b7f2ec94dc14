"""Invalid inputs: every case raises ValueError/TypeError naming the argument (DESIGN.md §4)."""

import dataclasses

import pytest
import torch

import quantmla_core as qm
from quantmla_core.testing import Case, allocate, build

CASE = Case(qm.PackFormat.parse("C4R4", latent_dim=256, rope_dim=32), (20, 70), heads=2, s_q=1, local=8)


@pytest.fixture
def setup():
    batch = build(CASE)
    args = batch.to("cpu")
    cache = allocate(CASE, batch, "cpu")
    qm.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
             positions=args["positions"], seq_lens=args["seq_lens"], backend="torch")
    return batch, args, cache


def _write(cache, args, **over):
    kw = dict(latent=args["latent"], k_rope=args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
              positions=args["positions"], seq_lens=args["seq_lens"], backend="torch")
    kw.update(over)
    qm.write(cache, kw.pop("latent"), kw.pop("k_rope"), **kw)


def _attend(cache, args, batch, **over):
    kw = dict(q_latent=args["q_latent"][:, 0], q_rope=args["q_rope"][:, 0], block_table=args["block_table"],
              seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"], softmax_scale=batch.softmax_scale,
              backend="torch")
    kw.update(over)
    return qm.attention(kw.pop("q_latent"), kw.pop("q_rope"), cache, **kw)


WRITE_BAD = [
    ("latent", lambda a: a["latent"][:, :100], ValueError, "latent: expected shape"),
    ("latent", lambda a: a["latent"].double(), TypeError, "latent: expected dtype"),
    ("latent", lambda a: a["latent"].numpy(), TypeError, "latent: expected a torch.Tensor"),
    ("k_rope", lambda a: a["k_rope"][:-1], ValueError, "k_rope: expected shape"),
    ("k_rope", lambda a: a["k_rope"].bfloat16(), TypeError, "k_rope: expected dtype"),
    ("slot_mapping", lambda a: a["slot_mapping"].float(), TypeError, "slot_mapping: expected an int32 or int64"),
    ("slot_mapping", lambda a: a["slot_mapping"][:-1], ValueError, "slot_mapping: expected shape"),
    ("slot_mapping", lambda a: a["slot_mapping"] + 10_000, ValueError, "slot_mapping: expected -1 or a slot index"),
    ("slot_mapping", lambda a: a["slot_mapping"] - 10_000, ValueError, "slot_mapping: expected -1 or a slot index"),
    ("seq_ids", lambda a: a["seq_ids"] + 5, ValueError, "seq_ids: expected a protection-buffer row"),
    ("positions", lambda a: a["positions"] + 1000, ValueError, "positions: expected 0 <= position"),
    ("positions", lambda a: a["positions"] - 1000, ValueError, "positions: expected 0 <= position"),
    ("seq_lens", lambda a: a["seq_lens"][:1], ValueError, "seq_lens: expected shape"),
    ("latent", lambda a: a["latent"].index_fill(0, torch.tensor([3]), float("nan")), ValueError, "latent: expected finite"),
]


@pytest.mark.parametrize("arg,make,exc,match", WRITE_BAD, ids=[m for _, _, _, m in WRITE_BAD])
def test_write_rejects(setup, arg, make, exc, match):
    batch, args, cache = setup
    before = cache.pages.clone()
    with pytest.raises(exc, match=match):
        _write(cache, args, **{arg: make(args)})
    assert torch.equal(before, cache.pages), "a rejected write touched the cache"


def test_write_rejects_non_cache(setup):
    batch, args, cache = setup
    with pytest.raises(TypeError, match="cache: expected an MLACache"):
        qm.write(cache.pages, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
                 positions=args["positions"], seq_lens=args["seq_lens"])


ATTN_BAD = [
    ("q_latent", lambda a: a["q_latent"][:, 0, :, :100], ValueError, "q_latent: expected shape"),
    ("q_latent", lambda a: a["q_latent"][0, 0], ValueError, "q_latent: expected shape"),
    ("q_latent", lambda a: a["q_latent"][:, 0].half(), TypeError, "q_latent: expected dtype"),
    ("q_rope", lambda a: a["q_rope"][:, 0, :1], ValueError, "q_rope: expected shape"),
    ("q_rope", lambda a: a["q_rope"][:, 0].bfloat16(), TypeError, "q_rope: expected dtype"),
    ("block_table", lambda a: a["block_table"][:1], ValueError, "block_table: expected shape"),
    ("block_table", lambda a: a["block_table"].float(), TypeError, "block_table: expected an int32 or int64"),
    ("block_table", lambda a: a["block_table"] + 1000, ValueError, r"block_table\[0\]: expected a page index"),
    ("block_table", lambda a: a["block_table"][:, :1], ValueError, "seq_lens: expected a length"),
    ("seq_lens", lambda a: a["attn_seq_lens"] * 0, ValueError, "seq_lens: expected a length"),
    ("seq_lens", lambda a: a["attn_seq_lens"][:1], ValueError, "seq_lens: expected shape"),
    ("seq_ids", lambda a: a["attn_seq_ids"] + 7, ValueError, "seq_ids: expected a protection-buffer row"),
    ("softmax_scale", lambda a: float("nan"), ValueError, "softmax_scale: expected a finite value"),
    ("softmax_scale", lambda a: -1.0, ValueError, "softmax_scale: expected a finite value"),
    ("softmax_scale", lambda a: 0.0, ValueError, "softmax_scale: expected a finite value > 0, got 0.0"),
    ("softmax_scale", lambda a: "0.1", TypeError, "softmax_scale: expected a float"),
    ("q_latent", lambda a: a["q_latent"][:, 0].index_fill(1, torch.tensor([0]), float("inf")), ValueError, "q_latent: expected finite"),
    ("backend", lambda a: "nope", ValueError, "backend: expected 'auto' or one of"),
]


@pytest.mark.parametrize("arg,make,exc,match", ATTN_BAD, ids=[f"{a}-{m}" for a, _, _, m in ATTN_BAD])
def test_attention_rejects(setup, arg, make, exc, match):
    batch, args, cache = setup
    with pytest.raises(exc, match=match):
        _attend(cache, args, batch, **{arg: make(args)})


def test_s_q_longer_than_sequence(setup):
    batch, args, cache = setup
    q = args["q_latent"].expand(-1, 30, -1, -1).contiguous()
    r = args["q_rope"].expand(-1, 30, -1, -1).contiguous()
    with pytest.raises(ValueError, match="seq_lens: expected a length >= S_q=30"):
        _attend(cache, args, batch, q_latent=q, q_rope=r)


def test_block_table_is_checked_on_the_pages_in_use_only(setup):
    """Entries past a row's last page (ceil(len / P)) may hold anything, as serving engines pad tables; entries in
    use must be page indices. Row lengths 20 and 70 with P = 64 use 1 and 2 pages; at 64 the second page is unused."""
    batch, args, cache = setup
    want = _attend(cache, args, batch)[0]
    padded = args["block_table"].clone()
    padded[0, 1:] = -1
    padded[1, 2:] = cache.num_pages + 7
    assert torch.equal(_attend(cache, args, batch, block_table=padded)[0], want)
    bad = args["block_table"].clone()
    bad[1, 1] = -1
    with pytest.raises(ValueError, match=rf"block_table\[1\]: expected a page index in \[0, {cache.num_pages}\), got -1 at index 1"):
        _attend(cache, args, batch, block_table=bad)
    one_page = args["attn_seq_lens"].clone()
    one_page[1] = 64
    _attend(cache, args, batch, block_table=bad, seq_lens=one_page)


def test_numpy_cache_rejects_tensors_and_vice_versa(setup):
    batch, args, cache = setup
    np_cache = allocate(CASE, batch, "numpy")
    with pytest.raises(TypeError, match="latent: expected a NumPy array"):
        _write(np_cache, args)


def test_backend_that_cannot_serve_names_reasons(setup):
    batch, args, cache = setup
    with pytest.raises(qm.NoBackendError, match="cupy"):
        _attend(cache, args, batch, backend="cupy")


WRITERS = ["torch", "numba", "reference", "triton"]


def _usable(backend: str) -> None:
    reason = qm.available_backends()[backend]
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")


@pytest.mark.parametrize("backend", WRITERS)
def test_validate_false_masks_bad_slots(setup, backend):
    """Without validation a bad slot is skipped: guard pages around the cache stay untouched."""
    _usable(backend)
    batch, args, _ = setup
    fmt = CASE.fmt
    backing = torch.full((batch.num_pages + 2, fmt.page_bytes), 0x3C, dtype=torch.uint8)
    cache = qm.MLACache(fmt, backing[1:-1], torch.zeros(2, 4, 288), torch.zeros(2, 8, 288), 2, 4, 8)
    slots = args["slot_mapping"].clone()
    slots[:3] = torch.tensor([-7, batch.num_pages * fmt.page_size, 10**9])
    _write(cache, args, slot_mapping=slots, validate=False, backend=backend)
    assert (backing[0] == 0x3C).all() and (backing[-1] == 0x3C).all()


def _guarded_write(batch, args, backend: str):
    """A write whose first two and last two tokens name request ids outside [0, 2), into buffers with guard rows."""
    fmt = CASE.fmt
    sink_back, local_back = torch.full((4, 4, 288), 7.0), torch.full((4, 8, 288), 7.0)
    cache = qm.MLACache(fmt, torch.zeros(batch.num_pages, fmt.page_bytes, dtype=torch.uint8), sink_back[1:-1],
                        local_back[1:-1], 2, 4, 8)
    seqs = args["seq_ids"].clone()
    seqs[:2] = torch.tensor([-1, 2])
    seqs[-2:] = torch.tensor([2, 10**6])
    _write(cache, args, seq_ids=seqs, validate=False, backend=backend)
    return sink_back, local_back


@pytest.mark.parametrize("backend", WRITERS)
def test_validate_false_skips_protection_rows_of_bad_seq_ids(setup, backend):
    """Without validation a token whose request id is outside [0, max_seqs) still gets its packed copy but touches
    no protection row: guard rows around the sink and local buffers stay untouched, and the rows in range hold
    what the reference writes there."""
    _usable(backend)
    batch, args, _ = setup
    got = _guarded_write(batch, args, backend)
    want = _guarded_write(batch, args, "reference")
    for back, ref_back in zip(got, want):
        assert (back[0] == 7.0).all() and (back[-1] == 7.0).all()
        assert torch.equal(back, ref_back)


def test_allocate_rejects_bad_arguments():
    fmt = qm.PackFormat.parse("C4R4")
    with pytest.raises(ValueError, match="num_pages"):
        qm.MLACache.allocate(fmt, 0, 1, device="cpu")
    with pytest.raises(ValueError, match="sink"):
        qm.MLACache.allocate(fmt, 1, 1, sink=-1, device="cpu")
    with pytest.raises(TypeError, match="fmt"):
        qm.MLACache.allocate("C4R4", 1, 1, device="cpu")
    with pytest.raises(ValueError, match="protect_dtype"):
        qm.MLACache.allocate(fmt, 1, 1, device="numpy", protect_dtype="bfloat16")
    with pytest.raises(ValueError, match="protect_dtype"):
        qm.MLACache.allocate(fmt, 1, 1, device="cpu", protect_dtype=torch.float16)


def test_torch_backend_checks_indices_without_validation(setup):
    """validate=False skips the API's syncing checks; the torch backend still refuses bad pages."""
    batch, args, cache = setup
    for bad_page in (cache.num_pages, -1):
        table = args["block_table"].clone()
        table[1, 1] = bad_page  # request 1 (70 tokens) uses two pages
        with pytest.raises(ValueError, match=rf"block_table\[1\]: expected page indices .*, got {bad_page}"):
            _attend(cache, args, batch, block_table=table, validate=False)
    for bad_id in (cache.max_seqs, -1):
        ids = args["attn_seq_ids"].clone()
        ids[0] = bad_id
        with pytest.raises(ValueError, match=rf"seq_ids\[0\]: expected a protection-buffer row .*, got {bad_id}"):
            _attend(cache, args, batch, seq_ids=ids, validate=False)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]: expected 1..192"):
        _attend(cache, args, batch, seq_lens=args["attn_seq_lens"] * 100, validate=False)


@pytest.mark.parametrize("pages", [lambda p: p[:0], lambda p: p[:, :-128], lambda p: p.reshape(-1)],
                         ids=["no pages", "short rows", "flat"])
def test_cache_pages_shape_is_checked(setup, pages):
    """A pool of no pages, or pages not [num_pages, page_bytes], is refused before any backend runs (CuPy v5
    reads page 0 for the codes of tokens it masks)."""
    batch, args, cache = setup
    bad = dataclasses.replace(cache, pages=pages(cache.pages))
    with pytest.raises(ValueError, match=r"cache.pages: expected shape \[num_pages >= 1, 10368\]"):
        _attend(bad, args, batch)
    with pytest.raises(ValueError, match=r"cache.pages: expected shape"):
        _write(bad, args)
