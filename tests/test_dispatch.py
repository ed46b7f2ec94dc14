"""Dispatcher: declarations, reasons, auto priority per hardware, override, no side effects."""

import subprocess
import sys

import pytest

import quantmla_core as qm
from quantmla_core.dispatch import Backend, Capabilities, DeviceInfo, Problem, declared_reasons, select_backend

C4R4 = qm.PackFormat.parse("C4R4")
CUDA = DeviceInfo("cuda", "NVIDIA H200", (9, 0), 132)
ROCM = DeviceInfo("rocm", "AMD Instinct MI300X", (9, 4), 304)
CPU = DeviceInfo("cpu", "cpu")
NUMPY = DeviceInfo("numpy", "numpy")


def _problem(device, fmt=C4R4, **kw):
    return Problem("attention", fmt, device, **kw)


def _usable(name, problem):
    return not qm.get_backend(name).not_supported_reasons(problem)


@pytest.mark.parametrize("device,order", [(CUDA, ["cupy", "triton", "torch"]), (ROCM, ["triton", "torch"]),
                                          (CPU, ["numba", "torch", "reference"]), (NUMPY, ["numba", "reference"])])
def test_auto_picks_first_usable_in_priority(device, order):
    problem = _problem(device)
    expected = next(n for n in order if _usable(n, problem))
    assert select_backend(problem, env={}).name == expected


A100 = DeviceInfo("cuda", "NVIDIA A100", (8, 0), 108)


@pytest.mark.parametrize("fmt_name,heads,q_len,dtype,device,first", [
    ("BF16", 128, 1, "bfloat16", CUDA, "triton"), ("BF16", 32, 2, "bfloat16", CUDA, "triton"),
    ("BF16", 32, 1, "bfloat16", CUDA, "cupy"),
    ("BF16", 128, 1, "float32", CUDA, "triton"), ("BF16", 128, 1, "bfloat16", A100, "triton"),
    ("BF16", 32, 2, "float32", A100, "triton"), ("BF16", 16, 1, "float32", CUDA, "cupy"),
    ("BF16", 63, 1, "float32", A100, "cupy"), ("C4R4", 128, 1, "float32", CUDA, "cupy"),
    ("C2R4", 16, 4, "bfloat16", A100, "cupy")])
def test_cuda_order_follows_the_measurements(monkeypatch, fmt_name, heads, q_len, dtype, device, first):
    """Triton before CuPy for BF16 pages from 64 query rows (on sm_90 with bfloat16 queries: Triton's kernel v4
    against CuPy's, measured faster); CuPy first otherwise. Writes keep the plain order."""
    from quantmla_core import dispatch
    from quantmla_core.dispatch import auto_order

    monkeypatch.setattr(dispatch, "triton_v4_missing", lambda fmt: None)

    fmt = qm.PackFormat.parse(fmt_name)
    order = auto_order(Problem("attention", fmt, device, dtype, num_heads=heads, q_len=q_len))
    assert order[0] == first and sorted(order) == ["cupy", "torch", "triton"] and order[-1] == "torch"
    assert auto_order(Problem("write", fmt, device, dtype, num_heads=heads, q_len=q_len))[0] == "cupy"
    assert auto_order(_problem(ROCM, fmt, num_heads=heads, q_len=q_len)) == ("triton", "torch")


@pytest.mark.parametrize("missing,first", [(None, "triton"), ("no Gluon in this triton", "cupy")])
def test_bf16_pages_on_sm90_go_to_cupy_where_triton_has_no_kernel_v4(monkeypatch, missing, first):
    """With bfloat16 queries on sm_90, BF16 pages go to Triton where its kernel v4 builds, else to CuPy's v4 (Triton's
    v3 measured 3.4-3.6x FlashInfer there, CuPy's v4 1.54-1.88x)."""
    from quantmla_core import dispatch

    monkeypatch.setattr(dispatch, "triton_v4_missing", lambda fmt: missing)
    problem = Problem("attention", qm.PackFormat.parse("BF16"), CUDA, "bfloat16", num_heads=128, q_len=1)
    assert dispatch.auto_order(problem)[0] == first


@pytest.mark.parametrize("fmt_name,heads,q_len,batch,tokens,dtype,device,missing,first", [
    ("C4R4", 16, 2, 32, 32768, "bfloat16", CUDA, None, "triton"),
    ("C2R4", 16, 2, 128, 32768, "bfloat16", CUDA, None, "triton"),
    ("C4R4", 8, 4, 16, 65536, "bfloat16", CUDA, None, "triton"),
    ("C4R4", 16, 2, 8, 32768, "bfloat16", CUDA, None, "cupy"),
    ("C4R4", 16, 2, 32, 8192, "bfloat16", CUDA, None, "cupy"),
    ("C4R4", 16, 1, 32, 32768, "bfloat16", CUDA, None, "cupy"),
    ("C4R4", 17, 1, 32, 32768, "bfloat16", CUDA, None, "triton"),
    ("C4R4", 11, 3, 32, 32768, "bfloat16", CUDA, None, "cupy"),
    ("C4R4", 16, 2, 32, 32768, "float32", CUDA, None, "cupy"),
    ("C4R4", 16, 2, 32, 32768, "bfloat16", A100, None, "cupy"),
    ("C4R4", 16, 2, 32, 32768, "bfloat16", CUDA, "no Gluon in this triton", "cupy"),
    ("BF16", 16, 2, 32, 32768, "bfloat16", CUDA, None, "cupy")])
def test_wide_rows_of_large_packed_calls_go_to_triton_first(monkeypatch, fmt_name, heads, q_len, batch, tokens,
                                                            dtype, device, missing, first):
    """17 to 32 query rows a request over packed pages, bfloat16 queries on sm_90: Triton first where the block
    tables hold 2^20 tokens in all and its Gluon kernels serve the format (its kernel v5 measured faster there,
    CuPy below); CuPy first at other row counts, dtypes, GPUs, page formats. Writes keep CuPy first."""
    from quantmla_core import dispatch

    monkeypatch.setattr(dispatch, "triton_v4_missing", lambda fmt: missing)
    monkeypatch.setattr(dispatch, "WIDE_ROWS", (17, 32))
    monkeypatch.setattr(dispatch, "WIDE_TRITON_FIRST_TOKENS", 1 << 20)
    fmt = qm.PackFormat.parse(fmt_name)
    problem = Problem("attention", fmt, device, dtype, num_heads=heads, q_len=q_len, batch=batch, table_tokens=tokens)
    order = dispatch.auto_order(problem)
    assert order[0] == first and sorted(order) == ["cupy", "torch", "triton"] and order[-1] == "torch"
    assert dispatch.auto_order(Problem("write", fmt, device, dtype, num_heads=heads, q_len=q_len, batch=batch,
                                       table_tokens=tokens))[0] == "cupy"


def test_memoised_decisions_keep_only_whether_a_call_is_large(monkeypatch):
    """Problems that differ in batch and table tokens but fall on the same side of the threshold share one memo key
    (a decode loop's batch changes every step); the two sides do not."""
    from quantmla_core import dispatch

    monkeypatch.setattr(dispatch, "WIDE_TRITON_FIRST_TOKENS", 1 << 20)
    def key(batch, tokens):
        return dispatch._memo_key(Problem("attention", C4R4, CUDA, "bfloat16", num_heads=16, q_len=2, batch=batch,
                                          table_tokens=tokens), "auto")

    assert key(32, 32768) == key(128, 65536) != key(31, 32768) == key(8, 4096) == key(1, 0)


def test_memoised_decisions_are_bounded_and_answer_as_asked(monkeypatch):
    """Decisions are kept per memo key (the same backend object back for a repeated question) and their store never
    grows past its bound."""
    from quantmla_core import dispatch

    asked = []
    select = dispatch._select

    def counting_select(problem, backend):
        asked.append(problem)
        return select(problem, backend)

    monkeypatch.setattr(dispatch, "_select", counting_select)
    monkeypatch.setattr(dispatch, "_DECISIONS", {})
    monkeypatch.setattr(dispatch, "_DECISIONS_MAX", 2)
    problems = [Problem("attention", C4R4, CPU, num_heads=h) for h in (1, 2, 3, 4)]
    for n, p in enumerate(problems, 1):
        first = select_backend(p, env={})
        assert select_backend(p, env={}) is first and len(asked) == n  # the repeat answered from the store
        assert len(dispatch._DECISIONS) <= 2


def test_attention_asks_with_its_batch_and_table_tokens(monkeypatch):
    """``qm.attention`` describes its call to the dispatcher with the batch and the block table's tokens a request."""
    from quantmla_core import api
    from quantmla_core.testing import Case, allocate, build

    seen = []

    def spy(problem, backend="auto", env=None):
        seen.append(problem)
        return select_backend(problem, backend, env)

    monkeypatch.setattr(api, "select_backend", spy)
    case = Case(qm.PackFormat.parse("C4R4", latent_dim=256, rope_dim=32, page_size=16), (20, 70, 5), heads=2,
                s_q=1, local=8)
    batch = build(case)
    args = batch.to("cpu")
    cache = allocate(case, batch, "cpu")
    qm.attention(args["q_latent"][:, 0], args["q_rope"][:, 0], cache, block_table=args["block_table"],
                 seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"], softmax_scale=batch.softmax_scale,
                 backend="torch")
    width = int(args["block_table"].shape[1])
    assert width >= 5 and (seen[-1].op, seen[-1].num_heads, seen[-1].q_len) == ("attention", 2, 1)
    assert (seen[-1].batch, seen[-1].table_tokens) == (3, 16 * width)


def test_triton_v4_missing_says_why_or_none():
    """None for what v4 serves where Gluon builds; else the reason (Gluon, dims, page size)."""
    pytest.importorskip("triton")
    from quantmla_core import dispatch
    from quantmla_core.backends.triton.attention_v4_loaders import GLUON_IMPORT_ERROR

    assert dispatch.triton_v4_missing(qm.PackFormat.parse("BF16")) == GLUON_IMPORT_ERROR
    assert dispatch.triton_v4_missing(qm.PackFormat.parse("BF16", latent_dim=256, rope_dim=32)) == (
        "kernel v4 is built for (d_c, d_r) = (512, 64), got (256, 32)")
    assert dispatch.triton_v4_missing(qm.PackFormat.parse("BF16", page_size=32)) == (
        "kernel v4 reads 64-token pages, got page_size=32")


def test_bf16_pages_of_other_dims_on_sm90_stay_with_cupy():
    """d_c 256 BF16 pages on sm_90 with bfloat16 queries: Triton's v4 does not serve them (v3 would run), so CuPy's
    v4 stays first."""
    from quantmla_core.dispatch import auto_order

    fmt = qm.PackFormat.parse("BF16", latent_dim=256, rope_dim=32)
    assert auto_order(Problem("attention", fmt, CUDA, "bfloat16", num_heads=128, q_len=1))[0] == "cupy"


def test_cuda_falls_back_to_torch_without_gpu_packages():
    """On this CPU-only machine's view of a fake GPU, torch is always usable for CUDA."""
    problem = _problem(CUDA)
    assert _usable("torch", problem)
    assert select_backend(problem, env={}).name in ("triton", "cupy", "torch")


def test_numpy_never_goes_to_torch():
    assert "numpy" not in qm.get_backend("torch").capabilities.devices
    reasons = qm.get_backend("torch").not_supported_reasons(_problem(NUMPY))
    assert any("device 'numpy'" in r for r in reasons)


def test_env_override_and_explicit_errors():
    problem = _problem(CPU)
    assert select_backend(problem, env={"QUANTMLA_BACKEND": "reference"}).name == "reference"
    with pytest.raises(qm.NoBackendError) as err:
        select_backend(_problem(NUMPY), backend="torch", env={})
    assert "torch" in err.value.reasons and "device 'numpy'" in str(err.value)
    with pytest.raises(ValueError, match="backend: expected 'auto' or one of"):
        select_backend(problem, backend="bogus", env={})


def test_auto_error_lists_every_candidate():
    exotic = DeviceInfo("npu", "some accelerator")
    with pytest.raises(qm.NoBackendError) as err:
        select_backend(_problem(exotic), env={})
    assert set(err.value.reasons) == {"torch"}
    assert "device 'npu'" in err.value.reasons["torch"][0]


def test_declared_reasons_are_specific():
    cap = Capabilities(devices=frozenset({"cuda"}), content_bits=frozenset({4}), rope_bits=frozenset({4}),
                       latent_dims=frozenset({512}), page_sizes=frozenset({64}), dtypes=frozenset({"bfloat16"}),
                       max_heads=64, max_q_len=4, min_capability=(9, 0))
    fmt = qm.PackFormat.parse("C2R8", latent_dim=256, page_size=16)
    p = Problem("attention", fmt, DeviceInfo("cuda", "A100", (8, 0), 108), "float32", "bfloat16", 128, 8)
    reasons = declared_reasons(cap, p)
    for fragment in ["content bits 2", "rope bits 8", "latent_dim 256", "page_size 16", "dtype float32",
                     "128 heads", "S_q=8", "compute capability (8, 0)"]:
        assert any(fragment in r for r in reasons), fragment
    assert declared_reasons(cap, Problem("attention", C4R4, CUDA, "bfloat16", "bfloat16", 16, 1)) == []


def test_unavailable_backend_reports_missing_package():
    class Ghost(Backend):
        name = "ghost"
        capabilities = Capabilities(devices=frozenset({"cpu"}))
        requires = ("a_package_that_does_not_exist_xyz",)

    reasons = Ghost().not_supported_reasons(_problem(CPU))
    assert len(reasons) == 1 and "a_package_that_does_not_exist_xyz" in reasons[0]


def test_selection_has_no_side_effects():
    before = dict(qm.dispatch.PRIORITY), dict(qm.dispatch._REGISTRY)
    for dev in (CUDA, ROCM, CPU, NUMPY):
        try:
            select_backend(_problem(dev), env={})
        except qm.NoBackendError:
            pass
    assert (dict(qm.dispatch.PRIORITY), dict(qm.dispatch._REGISTRY)) == before


def test_available_backends_lists_all_with_reasons():
    avail = qm.available_backends()
    assert set(avail) == {"triton", "cupy", "numba", "torch", "reference"}
    assert avail["torch"] is None and avail["reference"] is None
    assert all(v is None or isinstance(v, str) and v for v in avail.values())


def test_available_backends_for_a_device_says_which_do_not_serve_it():
    numpy_dev = qm.available_backends(qm.dispatch.DeviceInfo("numpy", "numpy"))
    assert numpy_dev["reference"] is None
    assert numpy_dev["torch"] == "does not serve device 'numpy'"
    assert qm.available_backends(qm.dispatch.DeviceInfo("cpu", "cpu"))["torch"] is None


def test_info_command_lists_every_backend():
    out = subprocess.run([sys.executable, "-m", "quantmla_core.info"], capture_output=True, text=True, check=True).stdout
    for name in ("triton", "cupy", "numba", "torch", "reference"):
        assert name in out
    assert "available" in out


def test_device_info_of_arrays():
    import numpy as np
    import torch

    assert DeviceInfo.of(np.zeros(1)).kind == "numpy"
    assert DeviceInfo.of(torch.zeros(1)).kind == "cpu"
