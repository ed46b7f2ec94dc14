"""``torch.ops.quantmla.write`` / ``attention`` (``quantmla_core.torch_ops``): PyTorch's own operator checks, and a
decode step under ``torch.compile(fullgraph=True)`` giving bit for bit what the eager public API gives, on fresh random
data over poisoned pages, checked against the float64 reference."""

from __future__ import annotations

import copy

import pytest
import torch

import quantmla_core as qm
from quantmla_core import torch_ops
from quantmla_core.testing import Case, allocate, build, check_attention

from conformance import reference_outputs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
#: (case, backend): CPU backends that run at test speed, and auto on a GPU
CASES = [
    (Case(qm.PackFormat.parse("C4R4"), (70, 1), heads=16, s_q=1, seed=41), "numba"),
    (Case(qm.PackFormat.parse("C2R4", latent_dim=256, rope_dim=32), (130, 5), heads=4, s_q=2, seed=42), "torch"),
    (Case(qm.PackFormat.parse("BF16", page_size=16), (33,), heads=8, s_q=1, sink=0, local=0, seed=43), "numba"),
]


def _inputs(case: Case, device: str):
    batch = build(case)
    args = batch.to(device, "float32")
    return batch, args, allocate(case, batch, device)


def _step(api, cache, args, scale: float, backend: str):
    """One decode step, write then attend, through ``api``: ``torch_ops`` (the operators) or ``qm`` (the eager API;
    both take the same arguments)."""
    api.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
              positions=args["positions"], seq_lens=args["seq_lens"], backend=backend)
    return api.attention(args["q_latent"], args["q_rope"], cache, block_table=args["block_table"],
                         seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"], softmax_scale=scale,
                         backend=backend)


def _compiled_step(cache, args, scale: float, backend: str):
    return _step(torch_ops, cache, args, scale, backend)


@pytest.mark.parametrize("name, kw", [("C4R4", {}), ("C2R4", {"latent_dim": 256, "rope_dim": 32}), ("BF16", {}),
                                      ("C4R8", {"group_size": 32, "page_size": 16}), ("C8R8", {"page_size": 128})])
def test_format_spec_round_trips(name, kw):
    fmt = qm.PackFormat.parse(name, **kw)
    spec = torch_ops.format_spec(fmt)
    assert torch_ops.parse_format_spec(spec) == fmt and spec.startswith(f"{fmt.name}/{fmt.latent_dim}/")


@pytest.mark.parametrize("spec", ["C4R4", "C4R4/512/64/64/64", "C4R4/512/64/sixty-four/64/1"])
def test_bad_format_spec_names_the_form(spec):
    with pytest.raises(ValueError, match="NAME/d_c/d_r/group/page/version"):
        torch_ops.parse_format_spec(spec)


def test_numpy_cache_is_refused_naming_the_argument():
    cache = qm.MLACache.allocate(qm.PackFormat.parse("C4R4"), 2, 1, device="numpy")
    with pytest.raises(TypeError, match="cache: expected an MLACache of torch tensors, got an MLACache of NumPy"):
        torch_ops.attention(torch.zeros(1, 1, 512), torch.zeros(1, 1, 64), cache, block_table=torch.zeros(1, 2),
                            seq_lens=torch.ones(1), seq_ids=torch.zeros(1), softmax_scale=0.1)


@pytest.mark.parametrize("case, backend", CASES[:2], ids=lambda v: str(v) if isinstance(v, Case) else v)
def test_operators_pass_torch_opcheck(case, backend):
    """Schema, fake (meta) implementations, declared mutations and AOT dispatch, by ``torch.library.opcheck``."""
    batch, args, cache = _inputs(case, "cpu")
    spec = torch_ops.format_spec(case.fmt)
    write_args = (cache.pages, cache.sink_buf, cache.local_buf, args["latent"], args["k_rope"], args["slot_mapping"],
                  args["seq_ids"], args["positions"], args["seq_lens"], spec, backend)
    torch.library.opcheck(torch.ops.quantmla.write.default, write_args)
    attn_args = (args["q_latent"], args["q_rope"], cache.pages, cache.sink_buf, cache.local_buf, args["block_table"],
                 args["attn_seq_lens"], args["attn_seq_ids"], batch.softmax_scale, spec, backend)
    torch.library.opcheck(torch.ops.quantmla.attention.default, attn_args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, backend", CASES, ids=lambda v: str(v) if isinstance(v, Case) else v)
def test_compiled_step_matches_eager_api_and_reference(case, backend, device):
    """A write + attention step compiled with ``fullgraph=True`` (no graph break allowed) writes the same bytes and
    returns the same outputs as the eager API, within the reference's tolerance."""
    backend = "auto" if device == "cuda" else backend
    batch, args, cache = _inputs(case, device)
    eager_cache = copy.deepcopy(cache)
    want_out, want_lse = _step(qm, eager_cache, args, batch.softmax_scale, backend)
    torch._dynamo.reset()
    step = torch.compile(_compiled_step, backend="aot_eager", fullgraph=True)
    out, lse = step(cache, args, batch.softmax_scale, backend)
    assert torch.equal(cache.pages, eager_cache.pages) and torch.equal(cache.local_buf, eager_cache.local_buf)
    assert torch.equal(cache.sink_buf, eager_cache.sink_buf)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    ref_out, ref_lse = reference_outputs(batch, args, cache)
    check_attention(out, lse, ref_out, ref_lse, "float32")


def test_inductor_keeps_the_operators_and_their_results():
    """The default compiler (Inductor, which generates C++ on a CPU) around the operators: same results as eager."""
    case, backend = CASES[0]
    batch, args, cache = _inputs(case, "cpu")
    eager_cache = copy.deepcopy(cache)
    want_out, want_lse = _step(qm, eager_cache, args, batch.softmax_scale, backend)
    torch._dynamo.reset()
    out, lse = torch.compile(_compiled_step, fullgraph=True)(cache, args, batch.softmax_scale, backend)
    assert torch.equal(cache.pages, eager_cache.pages) and torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_attention_without_lse_returns_out_only():
    case, backend = CASES[0]
    batch, args, cache = _inputs(case, "cpu")
    qm.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
             positions=args["positions"], seq_lens=args["seq_lens"], backend=backend)
    out = torch_ops.attention(args["q_latent"], args["q_rope"], cache, block_table=args["block_table"],
                              seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"],
                              softmax_scale=batch.softmax_scale, backend=backend, return_lse=False)
    assert isinstance(out, torch.Tensor) and out.shape == args["q_latent"].shape


def test_outputs_carved_from_one_allocation_come_back_apart(monkeypatch):
    """Under CUDA-graph capture the CuPy backend returns out and lse as views of one allocation (its scratch with
    them); PyTorch refuses an operator whose outputs alias, so the operator hands back lse as its own tensor."""
    def carving_attention(q_latent, q_rope, cache, **kw):
        buf = torch.empty(q_latent.numel() + q_latent.shape[:-1].numel())
        out, lse = buf[:q_latent.numel()].view(q_latent.shape), buf[q_latent.numel():].view(q_latent.shape[:-1])
        out.copy_(q_latent)
        lse.fill_(0.5)
        return out, lse

    monkeypatch.setattr(torch_ops, "_attention", carving_attention)
    cache = qm.MLACache.allocate(qm.PackFormat.parse("C4R4"), 2, 2, device="cpu")
    q = torch.randn(2, 4, 512)
    out, lse = torch_ops.attention(q, torch.randn(2, 4, 64), cache, block_table=torch.zeros(2, 1, dtype=torch.int32),
                                   seq_lens=torch.ones(2, dtype=torch.int32), seq_ids=torch.arange(2), softmax_scale=0.1)
    assert torch.equal(out, q) and torch.equal(lse, torch.full((2, 4), 0.5))
    assert out.untyped_storage().data_ptr() != lse.untyped_storage().data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("case", [CASES[0][0], Case(qm.PackFormat.parse("C2R4"), (300, 1000, 77), heads=128, seed=44)],
                         ids=["H16", "H128"])
def test_reduce_overhead_mode_captures_the_operator_in_a_cuda_graph(case):
    """``torch.compile(mode="reduce-overhead")`` records the attention operator into a CUDA graph (on the CuPy
    backend: its capture path, which carves out and lse from one allocation) and replays the eager result; the
    warm-up runs before it leave no allocation but the outputs (no reused workspace, no kept plan: H128 runs v6)."""
    batch = build(case)
    args = batch.to("cuda", "bfloat16")
    cache = allocate(case, batch, "cuda")
    qm.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
             positions=args["positions"], seq_lens=args["seq_lens"])
    # index tensors in the dtypes the kernels take: a capture cannot keep a converted copy
    index = dict(block_table=args["block_table"].int().contiguous(), seq_lens=args["attn_seq_lens"].long(),
                 seq_ids=args["attn_seq_ids"].long())
    want_out, want_lse = qm.attention(args["q_latent"], args["q_rope"], cache, softmax_scale=batch.softmax_scale,
                                      **index)

    def attend(q, r):
        return torch_ops.attention(q, r, cache, softmax_scale=batch.softmax_scale, **index)

    torch._dynamo.reset()
    step = torch.compile(attend, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        out, lse = step(args["q_latent"], args["q_rope"])
    torch.cuda.synchronize()
    assert torch.equal(out.clone(), want_out) and torch.equal(lse.clone(), want_lse)
