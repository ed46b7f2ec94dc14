"""CuPy backend: CUDA sources compile for sm_90 and sm_80 (CPU, with nvcc), the backend
registers cleanly, and, on a GPU with CuPy, full conformance against the reference."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
import pytest
import torch
from conformance import check_attention_case, check_writer
from quantmla_core.backends.cupy import KERNEL_DIR, CupyBackend, define_options
from quantmla_core.backends.cupy.builds import (
    attention_defines,
    protected_ctas,
    protected_defines,
    v2_default_stages,
    v2_defines,
    v2_smem_bytes,
    v3_defines,
    v4_defines,
    v5_defines,
    v6_defines,
)
from quantmla_core.backends.cupy.variants import VARIANT_ENV, select_variant, v2_unsupported_reasons
from quantmla_core.backends.cupy.writer import writer_defines

import quantmla_core as qm
from quantmla_core import get_backend
from quantmla_core.dispatch import DeviceInfo, Problem, _import_reason
from quantmla_core.testing import Case, allocate, build, capture_graph, generate_cases, stub_cache, stub_cupy_launcher

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None)
CAP = CupyBackend.capabilities
FORMATS = [n for n in ("C4R4", "C2R4", "C4R8", "C8R8", "C2R2", "BF16")]
DIMS = [(dc, dr) for dc, dr in ((512, 64), (256, 32)) if dc in CAP.latent_dims and dr in CAP.rope_dims]
ARCHS = ("sm_90", "sm_80")


# ------------------------------------------------------------------ CPU: sources compile
def _variants() -> list[tuple[str, str, int, int, str, str]]:
    """(arch, kernel, d_c, d_r, format, dtype): sm_90 for every format/dims and both kernels;
    sm_80 for every format with the dims alternating (keeps the CPU test under a minute on two
    cores); the value dtype alternates so each kernel is built for float32 and bfloat16."""
    out = []
    for arch in ARCHS:
        for i, name in enumerate(FORMATS):
            for j, (dc, dr) in enumerate(DIMS):
                if arch != "sm_90" and (i + j) % 2:
                    continue
                for k, kernel in enumerate(("writer", "attention")):
                    dtype = ("float32", "bfloat16")[(i + j + k + (arch == "sm_80")) % 2]
                    out.append((arch, kernel, dc, dr, name, dtype))
    return out


VARIANTS = _variants()


def compile_all(builds: list, compile_one) -> dict:
    """``compile_one`` over every build, in parallel (nvcc runs are independent): {build: its result}."""
    with ThreadPoolExecutor(max_workers=2 * (os.cpu_count() or 2)) as pool:
        return dict(zip(builds, pool.map(compile_one, builds)))


def _nvcc_ptx(source: str, defines: dict[str, int], arch: str = "sm_90") -> tuple[int, str]:
    """(nvcc's return code, the PTX or else nvcc's messages) of ``kernels/<source>``."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [NVCC, "-ptx", f"-arch={arch}", "--std=c++17", f"-I{KERNEL_DIR}", *define_options(defines),
               "-o", os.path.join(tmp, "k.ptx"), str(KERNEL_DIR / source)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        ptx = open(os.path.join(tmp, "k.ptx")).read() if r.returncode == 0 else ""
    return r.returncode, (r.stderr + r.stdout) if r.returncode else ptx


def _compile(v: tuple) -> tuple[int, str]:
    arch, kernel, dc, dr, name, dtype = v
    fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr)
    defines = writer_defines(fmt, dtype) if kernel == "writer" else attention_defines(fmt, dtype)
    return _nvcc_ptx(f"{kernel}.cu", defines, arch)


@lru_cache(maxsize=1)
def _compiled() -> dict:
    return compile_all(VARIANTS, _compile)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_source_compiles_to_ptx(variant):
    rc, text = _compiled()[variant]
    assert rc == 0, f"nvcc failed for {variant}:\n{text[-4000:]}"
    kernel = variant[1]
    names = ("qmla_write",) if kernel == "writer" else ("qmla_attn", "qmla_combine")
    for n in names:
        assert f".entry {n}(" in text, f"kernel {n} missing from PTX"
    if kernel == "attention":
        assert "mma.sync.aligned.m16n8k16" in text and "ldmatrix" in text


def test_sources_take_layout_from_packformat():
    """The .cu files must not retype layout numbers: every QMLA_* they use comes from the launcher."""
    import re

    fmt = qm.PackFormat.parse("C4R4")
    given = (set(writer_defines(fmt, "float32")) | set(attention_defines(fmt, "float32")) | set(v2_defines(fmt, 2))
             | set(v3_defines(fmt)) | set(v4_defines(fmt)) | set(v5_defines(fmt)) | set(v6_defines(fmt))
             | set(protected_defines(fmt)))
    sources = list(KERNEL_DIR.glob("*.cu*"))
    defined_in_sources = {d for src in sources for d in re.findall(r"#define\s+(QMLA_[A-Z0-9_]+)", src.read_text())}
    for src in sources:
        used = set(re.findall(r"\bQMLA_[A-Z0-9_]+\b", src.read_text()))
        missing = used - given - defined_in_sources
        assert not missing, f"{src.name} uses {sorted(missing)} that no launcher passes"


# ------------------------------------------------------------------ CPU: attention v2 compiles, registers, no spills
#: (arch, format, d_c, d_r, group size, page size, row groups per CTA): a representative subset
#: (the CPU test budget); the fragment model (tests/test_cupy_fragments.py) covers every v2
#: format x dims x group size and page sizes 16..128 on the CPU.
V2_VARIANTS = [
    # (arch, format, d_c, d_r, group, page, row groups[, "noprot": the build for caches without sink/local])
    ("sm_90", "C4R4", 512, 64, 64, 64, 1),
    ("sm_90", "C4R4", 512, 64, 64, 64, 2),
    ("sm_90", "C2R4", 512, 64, 64, 64, 1),
    ("sm_90", "C2R4", 512, 64, 128, 128, 2),
    ("sm_90", "C4R4", 256, 32, 128, 64, 1),
    ("sm_90", "C2R4", 256, 32, 64, 16, 2),
    ("sm_90", "C4R4", 512, 64, 64, 16, 1),
    ("sm_80", "C4R4", 512, 64, 64, 64, 1),
    ("sm_80", "C2R4", 256, 32, 64, 32, 1),
    ("sm_90", "C4R4", 512, 64, 64, 64, 1, "noprot"),
    ("sm_90", "C2R4", 256, 32, 64, 16, 2, "noprot"),
    # QUANTMLA_CUPY_V2_PROTECTED=separate (the default): the packed-only build (mode 1)
    ("sm_90", "C4R4", 512, 64, 64, 64, 1, "mode1"),
    ("sm_90", "C4R4", 512, 64, 64, 64, 2, "mode1"),
    ("sm_90", "C2R4", 256, 32, 64, 16, 2, "mode1"),
    ("sm_80", "C4R4", 512, 64, 64, 32, 1, "mode1"),
    # QUANTMLA_CUPY_V2_TILE=64 (3 copy stages)
    ("sm_90", "C4R4", 512, 64, 64, 64, 1, "t64"),
    ("sm_90", "C4R4", 512, 64, 64, 64, 2, "t64"),
    ("sm_90", "C2R4", 512, 64, 64, 16, 1, "t64"),
    ("sm_90", "C4R4", 512, 64, 64, 128, 1, "t64", "noprot"),
    ("sm_80", "C2R4", 256, 32, 128, 64, 1, "t64"),
    ("sm_90", "C4R4", 512, 64, 64, 64, 1, "t64", "mode1"),
]


def _compile_v2(v: tuple) -> tuple[int, str]:
    arch, name, dc, dr, gs, page, rg = v[:7]
    fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr, group_size=gs, page_size=page)
    mode = 1 if "mode1" in v[7:] else 0
    tile = 64 if "t64" in v[7:] else 32
    defines = v2_defines(fmt, rg, stages=v2_default_stages(tile), no_protection="noprot" in v[7:], prot_mode=mode,
                         tile=tile)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [NVCC, "-cubin", f"-arch={arch}", "--std=c++17", "-Xptxas", "-v", f"-I{KERNEL_DIR}",
               *define_options(defines), "-o", os.path.join(tmp, "k.cubin"),
               str(KERNEL_DIR / "attention_v2.cu")]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return r.returncode, r.stderr + r.stdout


@lru_cache(maxsize=1)
def _compiled_v2() -> dict:
    return compile_all(V2_VARIANTS, _compile_v2)


def compile_cubin_and_ptx(source: str, arch: str, defines: dict[str, int]) -> tuple[int, str, str]:
    """nvcc of ``kernels/<source>`` for ``arch`` with ``defines``: (return code of the cubin build,
    its ptxas -v report and messages, the PTX text or "" where that build failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        base = [NVCC, f"-arch={arch}", "--std=c++17", f"-I{KERNEL_DIR}", *define_options(defines)]
        src = str(KERNEL_DIR / source)
        r = subprocess.run([*base, "-cubin", "-Xptxas", "-v", "-o", os.path.join(tmp, "k.cubin"), src],
                           capture_output=True, text=True, check=False)
        p = subprocess.run([*base, "-ptx", "-o", os.path.join(tmp, "k.ptx"), src], capture_output=True, text=True,
                           check=False)
        ptx = open(os.path.join(tmp, "k.ptx")).read() if p.returncode == 0 else ""
    return r.returncode, r.stderr + r.stdout, ptx


def ptxas_usage(text: str) -> dict:
    """registers, spill stores/loads (bytes) and stack frame of the one entry ptxas reports."""
    import re

    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert regs and spill, f"no ptxas -v report in:\n{text[-2000:]}"
    return {"registers": int(regs.group(1)), "stack": int(spill.group(1)), "spill_stores": int(spill.group(2)),
            "spill_loads": int(spill.group(3))}


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("variant", V2_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_v2_compiles_without_spills(variant):
    rc, text = _compiled_v2()[variant]
    assert rc == 0, f"nvcc failed for v2 {variant}:\n{text[-4000:]}"
    assert "qmla_attn_v2" in text
    use = ptxas_usage(text)
    print(f"v2 {variant}: {use}")
    assert use["spill_stores"] == 0 and use["spill_loads"] == 0 and use["stack"] == 0, f"v2 {variant} spills: {use}"
    assert use["registers"] <= 255


def test_v2_selection_is_per_call_and_falls_back(monkeypatch):
    c4, c8, bf = qm.PackFormat.parse("C4R4"), qm.PackFormat.parse("C8R8"), qm.PackFormat.parse("BF16")
    monkeypatch.delenv(VARIANT_ENV, raising=False)  # auto, short contexts: v2 where it serves, v1 with the reason
    assert select_variant(c4, "bfloat16")[0] == "v2"
    v, why = select_variant(c8, "bfloat16")
    assert v == "v1" and "C8R8" in why
    monkeypatch.setenv(VARIANT_ENV, "v2")
    assert select_variant(c4, "bfloat16") == ("v2", None)
    assert select_variant(qm.PackFormat.parse("C2R4", 256, 32, group_size=128), "bfloat16") == ("v2", None)
    for fmt, dtype in ((c4, "float32"), (c8, "bfloat16"), (bf, "bfloat16"), (qm.PackFormat.parse("C4R8"), "bfloat16")):
        v, why = select_variant(fmt, dtype)
        assert v == "v1" and why, (fmt, dtype)
        assert v2_unsupported_reasons(fmt, dtype)
    assert select_variant(c4, "bfloat16", (7, 5))[0] == "v1"
    monkeypatch.setenv(VARIANT_ENV, "V1")
    assert select_variant(c4, "bfloat16") == ("v1", None)
    monkeypatch.setenv(VARIANT_ENV, "v9")
    with pytest.raises(ValueError, match=VARIANT_ENV):
        select_variant(c4, "bfloat16")


def test_v2_plan_and_smem():
    from quantmla_core.backends.cupy.knobs import V2_MIN_TILES_PER_SPLIT
    from quantmla_core.backends.cupy.plans import plan_splits_v2

    for batch, chunks, tokens in ((8, 1, 4096), (32, 1, 32768), (1, 4, 1 << 20), (128, 4, 32768), (1, 1, 1)):
        splits, per = plan_splits_v2(batch, chunks, tokens, 264)
        tiles = -(-tokens // 32)
        assert splits * per >= tiles and (splits - 1) * per < tiles
        assert splits == 1 or per >= V2_MIN_TILES_PER_SPLIT
    assert plan_splits_v2(8, 1, 4096, 264)[0] <= 16  # B=8 L=4K: no splits of a few tiles
    # H=16 B=32 L=32K on 2 CTAs/SM x 132: one full round (the old "4 CTAs/SM" rule gave 544 CTAs, 3 rounds)
    assert plan_splits_v2(32, 1, 32768, 264) == (8, 128)
    # 4 stages of one tile's raw page sections (32 x 317 B) and flags (32 B), + the score exchange
    assert v2_smem_bytes(qm.PackFormat.parse("C4R4"), 1) == 4 * 32 * (317 + 1) + 16384


def test_v2_min_tiles_knob_reaches_the_split_plan(monkeypatch):
    from quantmla_core.backends.cupy.knobs import V2_MIN_TILES_PER_SPLIT, V2Knobs
    from quantmla_core.backends.cupy.plans import plan_splits_v2

    monkeypatch.delenv("QUANTMLA_CUPY_V2_MIN_TILES", raising=False)
    assert V2Knobs.from_env().min_tiles == V2_MIN_TILES_PER_SPLIT
    monkeypatch.setenv("QUANTMLA_CUPY_V2_MIN_TILES", "2")
    assert V2Knobs.from_env().min_tiles == 2
    # B=8 L=4K: 16 splits of 8 tiles by default, more and shorter ones when allowed
    assert plan_splits_v2(8, 1, 4096, 264) == (16, 8)
    splits, per = plan_splits_v2(8, 1, 4096, 264, min_tiles=2)
    assert splits > 16 and per < 8
    monkeypatch.setenv("QUANTMLA_CUPY_V2_MIN_TILES", "3")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V2_MIN_TILES"):
        V2Knobs.from_env()


def test_min_tiles_knob_reaches_every_variant(monkeypatch):
    """``QUANTMLA_CUPY_V2_MIN_TILES`` is the split floor of every variant's plan: each of its values reaches each
    variant's knobs, and anything else is refused by every one of them."""
    from quantmla_core.backends.cupy import knobs as K

    kinds = (K.V2Knobs, K.V3Knobs, K.V4Knobs, K.V5Knobs, K.V6Knobs)
    for value in K.MIN_TILES_CHOICES:
        monkeypatch.setenv("QUANTMLA_CUPY_V2_MIN_TILES", str(value))
        assert [kind.from_env().min_tiles for kind in kinds] == [value] * len(kinds)
    for bad in ("0", "3", "32", "x"):
        monkeypatch.setenv("QUANTMLA_CUPY_V2_MIN_TILES", bad)
        for kind in kinds:
            with pytest.raises(ValueError, match=r"QUANTMLA_CUPY_V2_MIN_TILES: expected one of \(1, 2, 4, 8, 16\)"):
                kind.from_env()


def test_v2_tuning_knobs_reach_the_defines(monkeypatch):
    from quantmla_core.backends.cupy.builds import v2_defines

    fmt = qm.PackFormat.parse("C4R4")
    assert v2_defines(fmt)["QMLA_V2_LAZY_RESCALE"] == 0
    assert v2_defines(fmt, lazy_rescale=True)["QMLA_V2_LAZY_RESCALE"] == 1
    assert v2_defines(fmt, 2, 3, 5)["QMLA_V2_RG"] == 2 and v2_defines(fmt, 2, 3, 5)["QMLA_V2_STAGES"] == 5
    assert v2_defines(fmt)["QMLA_V2_NO_PROTECTION"] == 0 and v2_defines(fmt, no_protection=True)["QMLA_V2_NO_PROTECTION"] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_capture_outputs_share_one_allocation(dtype):
    """While a CUDA graph is captured, out, lse and the partials are views of one allocation, so
    the partials the graph's kernels write on every replay live as long as the outputs."""
    from quantmla_core.backends.cupy.attention import outputs_and_partials

    shape, floats = (3, 2, 16, 512), 3 * 2 * 16 * 5 * 514
    out, lse, ws = outputs_and_partials(shape, dtype, floats, torch.device("cpu"), 0, capturing=True)
    assert out.shape == shape and out.dtype == dtype and lse.shape == shape[:-1] and lse.dtype == torch.float32
    assert ws.dtype == torch.float32 and ws.numel() >= floats
    base = out.untyped_storage().data_ptr()
    assert lse.untyped_storage().data_ptr() == base and ws.untyped_storage().data_ptr() == base
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (out, lse, ws))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "views overlap"
    assert all(t.data_ptr() % 256 == base % 256 for t in (out, lse, ws))  # 256-byte aligned offsets
    out.fill_(1.0), lse.fill_(2.0), ws.fill_(3.0)  # writable, disjoint
    assert (out == 1).all() and (lse == 2).all() and (ws[:floats] == 3).all()


def test_kernel_inputs_are_not_copied_under_capture():
    from quantmla_core.backends.cupy.attention import _kernel_input

    t32 = torch.arange(6, dtype=torch.int32)
    assert _kernel_input("block_table", t32, torch.int32, capturing=True) is t32  # no copy
    assert _kernel_input("seq_lens", t32, torch.int64, capturing=False).dtype == torch.int64
    with pytest.raises(ValueError, match="seq_lens: under CUDA-graph capture .* torch.int64 .* got torch.int32"):
        _kernel_input("seq_lens", t32, torch.int64, capturing=True)
    with pytest.raises(ValueError, match="block_table: .*non-contiguous"):
        _kernel_input("block_table", torch.zeros((4, 4), dtype=torch.int32).t(), torch.int32, capturing=True)
    # rows are read with 16-byte loads: a contiguous view 2 bytes into its storage is copied (eagerly)
    # or refused (under capture)
    q = torch.randn(2 * 576 + 1).to(torch.bfloat16)[1:].view(2, 576)
    assert q.is_contiguous() and q.data_ptr() % 16
    got = _kernel_input("q_latent", q, torch.bfloat16, capturing=False)
    assert got.data_ptr() % 16 == 0 and torch.equal(got, q)
    with pytest.raises(ValueError, match="q_latent: .*misaligned"):
        _kernel_input("q_latent", q, torch.bfloat16, capturing=True)


def test_occupancy_from_resources():
    from quantmla_core.backends.cupy import occupancy_from_resources

    assert occupancy_from_resources(255, 128, 57088) == 2  # v2 C4R4 RG=1: register-bound
    assert occupancy_from_resources(255, 256, 73472) == 1  # RG=2
    assert occupancy_from_resources(168, 128, 57088) == 3  # __launch_bounds__(128, 3)
    assert occupancy_from_resources(32, 128, 100 * 1024) == 2  # shared-memory-bound
    assert occupancy_from_resources(16, 1024, 0) == 2  # thread-bound


# ------------------------------------------------------------------ registration
def test_backend_registered_and_lazy():
    b = get_backend("cupy")
    assert isinstance(b, CupyBackend)
    assert b.capabilities.devices == frozenset({"cuda"})
    assert b.capabilities.min_capability == (8, 0)
    reason = b.unavailable_reason()
    if _import_reason(("cupy",)) is not None:
        assert reason and "cupy" in reason
        assert qm.available_backends()["cupy"] == reason


def test_reasons_without_cupy_or_for_unsupported_problems():
    b = get_backend("cupy")
    fmt = qm.PackFormat.parse("C4R4")
    cpu = Problem("attention", fmt, DeviceInfo("cpu", "cpu"))
    assert b.not_supported_reasons(cpu)  # never serves CPU (or is unavailable)
    old = Problem("attention", fmt, DeviceInfo("cuda", "old", (7, 5), 40))
    reasons = b.not_supported_reasons(old)
    assert reasons
    if b.unavailable_reason() is None:
        assert any("compute capability" in r for r in reasons)
        g32 = Problem("attention", qm.PackFormat.parse("C4R4", group_size=32), DeviceInfo("cuda", "x", (9, 0), 132))
        assert any("group_size" in r for r in b.not_supported_reasons(g32))


# ------------------------------------------------------------------ GPU conformance
def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    return get_backend("cupy").unavailable_reason()


GPU_REASON = _gpu_reason()
gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"CuPy backend needs a GPU and CuPy: {GPU_REASON}")
CASES = generate_cases(CAP, quick=False)
BIG = [
    Case(qm.PackFormat.parse("C4R4"), (1000, 4097, 300, 64), heads=16, s_q=1, sink=4, local=128, seed=900),
    Case(qm.PackFormat.parse("C2R4"), (2500, 33), heads=128, s_q=2, sink=4, local=128, seed=901),
    Case(qm.PackFormat.parse("C4R4", 256, 32), (777, 129), heads=20, s_q=16, sink=4, local=128, seed=902),
    Case(qm.PackFormat.parse("BF16"), (3000, 5), heads=16, s_q=3, sink=4, local=128, seed=903),
    Case(qm.PackFormat.parse("C8R8"), (1500,), heads=64, s_q=1, sink=0, local=0, seed=904),
]


def _triton_reason() -> str | None:
    r = get_backend("triton").unavailable_reason()
    return r if GPU_REASON is None else GPU_REASON


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_writer_matches_reference(case):
    check_writer(case, "cupy", "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", CASES[::2], ids=str)
def test_writer_bf16_inputs(case):
    check_writer(case, "cupy", "cuda", "bfloat16")


ATTN_VARIANTS = ("v1", "v2")
#: extra cases for the v2 kernel (bf16 queries, C4R4/C2R4): page sizes, group 128, RoPE 32,
#: H=128 (two row groups per CTA), odd row-group counts, S_q=16, splits with protected tokens
#: in the middle of a split, no protection, one long request.
V2_CASES = [
    Case(qm.PackFormat.parse("C2R4", page_size=16), (17, 31, 100), heads=16, s_q=1, sink=4, local=16, seed=950),
    Case(qm.PackFormat.parse("C2R4", page_size=128), (129, 300), heads=8, s_q=2, sink=4, local=128, seed=951),
    Case(qm.PackFormat.parse("C2R4", group_size=128), (513, 70), heads=16, s_q=1, sink=4, local=128, seed=952),
    Case(qm.PackFormat.parse("C4R4", 256, 32, group_size=128), (300, 1), heads=32, s_q=1, sink=4, local=128, seed=953),
    Case(qm.PackFormat.parse("C2R4", 256, 32), (257, 65), heads=48, s_q=1, sink=4, local=128, seed=954),
    Case(qm.PackFormat.parse("C4R4"), (2049, 33, 700), heads=128, s_q=1, sink=4, local=128, seed=955),
    Case(qm.PackFormat.parse("C4R4"), (900, 16), heads=16, s_q=16, sink=4, local=128, seed=956),
    Case(qm.PackFormat.parse("C2R4"), (5000,), heads=16, s_q=1, sink=0, local=0, seed=957),
    Case(qm.PackFormat.parse("C4R4", page_size=32), (40, 33), heads=1, s_q=3, sink=36, local=0, seed=958),
]


def _use_variant(monkeypatch, variant: str) -> None:
    monkeypatch.setenv(VARIANT_ENV, variant)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ATTN_VARIANTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES + BIG, ids=str)
def test_attention_matches_reference(case, dtype, variant, monkeypatch):
    _use_variant(monkeypatch, variant)
    check_attention_case(case, "cupy", "cupy", "cuda", dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rg", ["", "1", "2"])
@pytest.mark.parametrize("case", V2_CASES + BIG[:3], ids=str)
def test_attention_v2_matches_reference(case, rg, monkeypatch):
    """v2 must really run here (bf16 queries, a v2 format), at both row-group settings."""
    _use_variant(monkeypatch, "v2")
    if rg:
        monkeypatch.setenv("QUANTMLA_CUPY_V2_RG", rg)
    assert select_variant(case.fmt, "bfloat16", torch.cuda.get_device_capability()) == ("v2", None)
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rg", ["", "2"])
@pytest.mark.parametrize("case", V2_CASES + BIG[:3], ids=str)
def test_attention_v2_tile64_matches_reference(case, rg, monkeypatch):
    """64-token tiles (``QUANTMLA_CUPY_V2_TILE=64``, 3 copy stages) on every v2 case."""
    _use_variant(monkeypatch, "v2")
    monkeypatch.setenv("QUANTMLA_CUPY_V2_TILE", "64")
    if rg:
        monkeypatch.setenv("QUANTMLA_CUPY_V2_RG", rg)
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", V2_CASES[5:7] + BIG[:1], ids=str)
def test_attention_v2_min_blocks_3(case, monkeypatch):
    """The 168-register build (``__launch_bounds__(128, 3)``, spills) stays correct."""
    _use_variant(monkeypatch, "v2")
    monkeypatch.setenv("QUANTMLA_CUPY_V2_MINB", "3")
    monkeypatch.setenv("QUANTMLA_CUPY_V2_RG", "1")
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ATTN_VARIANTS)
@pytest.mark.parametrize("case", CASES[::3], ids=str)
def test_cupy_write_torch_read_and_reverse(case, variant, monkeypatch):
    _use_variant(monkeypatch, variant)
    check_attention_case(case, "cupy", "torch", "cuda")
    check_attention_case(case, "torch", "cupy", "cuda")
    check_attention_case(case, "torch", "cupy", "cuda", "bfloat16")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ATTN_VARIANTS)
@pytest.mark.parametrize("case", CASES[::2], ids=str)
def test_cross_with_triton(case, variant, monkeypatch):
    _use_variant(monkeypatch, variant)
    why = _triton_reason()
    if why is not None:
        pytest.skip(f"triton backend unavailable: {why}")
    if get_backend("triton").not_supported_reasons(
        Problem("attention", case.fmt, DeviceInfo.of(torch.zeros(1, device="cuda")), "float32", "bfloat16", case.heads, case.s_q)
    ):
        pytest.skip("triton does not serve this case")
    check_attention_case(case, "cupy", "triton", "cuda")
    check_attention_case(case, "triton", "cupy", "cuda")


@pytest.mark.gpu
@gpu
def test_bad_slots_are_masked():
    """Slots -1 and past the cache are skipped: no byte outside the named slots changes."""
    case = Case(qm.PackFormat.parse("C4R4"), (70,), seed=7)
    batch = build(case)
    args = batch.to("cuda")
    cache = allocate(case, batch, "cuda")
    slots = args["slot_mapping"].clone()
    total = cache.num_pages * case.fmt.page_size
    slots[::3] = -1
    slots[1::3] = total + 5
    qm.write(cache, args["latent"], args["k_rope"], slot_mapping=slots, seq_ids=args["seq_ids"],
             positions=args["positions"], seq_lens=args["seq_lens"], backend="cupy")
    torch.cuda.synchronize()
    pages = cache.pages.cpu().numpy()
    good = slots.cpu().numpy()
    good = good[(good >= 0) & (good < total)]
    touched = np.zeros(cache.num_pages, bool)
    touched[good // case.fmt.page_size] = True
    assert (pages[~touched] == 0xA5).all(), "a masked token wrote into a page it does not own"


# ------------------------------------------------------------------ CPU: the v2 launch matches the kernel's signature
def _kernel_params(source: str, kernel: str) -> list[str]:
    import re

    text = (KERNEL_DIR / source).read_text()
    m = re.search(kernel + r"\((.*?)\)\s*\{", text, re.DOTALL)
    assert m, f"{kernel} not found in {source}"
    return [" ".join(p.split()) for p in m.group(1).split(",")]


def _run_v2_stubbed(monkeypatch, h: int, s_q: int, prot: bool, env: dict[str, str], variant: str = "v2",
                    pages_per: int = 5, length: int = 300, lens: torch.Tensor | None = None,
                    ids: torch.Tensor | None = None, fmt_name: str = "C4R4", nvrtc: tuple[int, int] = (13, 0),
                    capturing: bool = False, pdl_reason: str | None = "stubbed: no CUDA driver"):
    """One v2 (or ``variant``) attention call on the CPU with compilation and launches stubbed, over
    3 requests of ``length`` tokens and ``pages_per`` pages each (``lens``/``ids``: the seq_lens /
    seq_ids tensors to pass, default int64) of a ``fmt_name`` cache, NVRTC reporting ``nvrtc``, as if
    under CUDA-graph capture where ``capturing``, with PDL refused for ``pdl_reason`` (None: allowed). Returns the
    launches (kernel, grid, block, args, shared bytes), the kernels asked for, the format and B."""
    from quantmla_core.backends.cupy import attention as A

    kernels, launches = stub_cupy_launcher(monkeypatch, nvrtc=nvrtc, pdl_reason=pdl_reason)
    if capturing:
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setenv(VARIANT_ENV, variant)
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    fmt = qm.PackFormat.parse(fmt_name)
    b = 3
    n_sink, n_local = (4, 128) if prot else (0, 0)

    cache = stub_cache(fmt, b, pages_per, n_sink, n_local)
    q = torch.zeros((b, s_q, h, 512), dtype=torch.bfloat16)
    r = torch.zeros((b, s_q, h, 64), dtype=torch.bfloat16)
    table = torch.arange(b * pages_per, dtype=torch.int32).view(b, pages_per)
    lens = torch.full((b,), length) if lens is None else lens
    ids = torch.arange(b) if ids is None else ids
    out, lse = A.attention(q, r, cache, table, lens, ids, 0.05)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.shape == (b, s_q, h)
    return launches, kernels, fmt, b


@pytest.mark.parametrize("h,s_q,rg_env,prot", [(16, 1, "", True), (128, 1, "", True), (20, 16, "1", True), (3, 2, "", False)])
def test_v2_launch_arguments_match_kernel_signature(monkeypatch, h, s_q, rg_env, prot):
    """Run the v2 launcher on the CPU with the CUDA calls stubbed: the argument list must match
    qmla_attn_v2's parameters in number and type, and the grid/block/shared sizes the plan
    (inline protected tokens; the default separate mode: tests/test_cupy_protected.py)."""
    # with rg_env the lazy-rescale knob is set too: it must reach the compile defines
    env = {"QUANTMLA_CUPY_V2_RG": rg_env, "QUANTMLA_CUPY_V2_LAZY_RESCALE": "1"} if rg_env else {}
    env["QUANTMLA_CUPY_V2_PROTECTED"] = "inline"
    launches, kernels, fmt, b = _run_v2_stubbed(monkeypatch, h, s_q, prot, env)
    assert [k for k in kernels] == [("attention_v2.cu", "qmla_attn_v2"), ("attention.cu", "qmla_combine")]
    (attn, grid, block, args, smem), (_comb, cgrid, cblock, cargs, _) = launches
    params = _kernel_params("attention_v2.cu", "qmla_attn_v2")
    assert len(args) == len(params), (len(args), params)
    for a, p in zip(args, params):
        if "*" in p:
            assert isinstance(a, np.uint64), p
        elif p.startswith("int "):
            assert isinstance(a, np.int32), p
        elif p.startswith("float "):
            assert isinstance(a, np.float32), p
        else:
            raise AssertionError(f"unexpected parameter {p}")
    rows = s_q * h
    rg = attn.defines["QMLA_V2_RG"]
    assert rg == (int(rg_env) if rg_env else (2 if ((rows + 15) // 16) % 2 == 0 else 1))
    assert attn.defines["QMLA_V2_LAZY_RESCALE"] == (1 if rg_env else 0)
    # a cache without sink/local tokens gets the build without the protected-tile path
    assert attn.defines["QMLA_V2_NO_PROTECTION"] == (0 if prot else 1)
    chunks = -(-rows // (16 * rg))
    assert grid[0] == b * chunks and block == (128 * rg,)
    assert smem == attn.smem == v2_smem_bytes(fmt, rg) and attn.defines["QMLA_V2_SMEM"] == smem
    splits = int(args[params.index("int num_splits")])
    per = int(args[params.index("int tiles_per_split")])
    assert grid[1] == splits and splits * per * 32 >= 5 * fmt.page_size  # 5 pages per request (_run_v2_stubbed)
    assert len(cargs) == len(_kernel_params("attention.cu", "qmla_combine")) and cgrid == (b * rows,)
    assert int(cargs[-1]) == splits
    # the combine's block is the kernel's QMLA_COMBINE_THREADS (its launch bounds; a thread per 4 channels)
    import re

    from quantmla_core.backends.cupy.builds import COMBINE_THREADS

    kernel_threads = re.search(r"#define QMLA_COMBINE_THREADS (\d+)", (KERNEL_DIR / "attention.cu").read_text())
    assert cblock == (COMBINE_THREADS,) and int(kernel_threads.group(1)) == COMBINE_THREADS


@pytest.mark.parametrize("h", [16, 128])
def test_v2_tile_knob_reaches_defines_smem_and_splits(monkeypatch, h):
    """QUANTMLA_CUPY_V2_TILE=64: the kernel is built for 64-token tiles with 3 copy stages, the
    launch asks for that build's shared memory, and the splits count 64-token tiles."""
    launches, _kernels, fmt, _b = _run_v2_stubbed(monkeypatch, h, 1, True, {"QUANTMLA_CUPY_V2_TILE": "64"})
    (attn, grid, _block, args, smem), _ = launches.of("qmla_attn_v2")
    params = _kernel_params("attention_v2.cu", "qmla_attn_v2")
    rg = attn.defines["QMLA_V2_RG"]
    assert attn.defines["QMLA_V2_T"] == 64 and attn.defines["QMLA_V2_STAGES"] == v2_default_stages(64) == 3
    assert smem == v2_smem_bytes(fmt, rg, 3, 64) == attn.defines["QMLA_V2_SMEM"]
    assert smem < v2_smem_bytes(fmt, rg, 4, 64)  # 4 stages of 64 tokens would not leave room for 2 CTAs per SM
    splits, per = grid[1], int(args[params.index("int tiles_per_split")])  # num_splits adds the protected partials
    assert splits * per * 64 >= 5 * fmt.page_size and (splits - 1) * per * 64 < 5 * fmt.page_size
    monkeypatch.setenv("QUANTMLA_CUPY_V2_TILE", "48")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V2_TILE"):
        _run_v2_stubbed(monkeypatch, h, 1, True, {})


@pytest.mark.parametrize("tile", ["32", "64"])
@pytest.mark.parametrize("prot", [True, False])
def test_v2_separate_protected_launches(monkeypatch, prot, tile):
    """QUANTMLA_CUPY_V2_PROTECTED=separate (the default): the packed-only split kernel (mode 1) keeps
    the tile and launch-bound knobs, the protected kernel its 32-token tiles (a sink CTA and one
    CTA per local-window tile, the last partials), and one combine covers them all. A cache
    without sink/local tokens gets one split kernel (mode 0, no protected path)."""
    launches, kernels, fmt, b = _run_v2_stubbed(monkeypatch, 16, 1, prot, {"QUANTMLA_CUPY_V2_MINB": "3",
                                                                          "QUANTMLA_CUPY_V2_TILE": tile})
    params = _kernel_params("attention_v2.cu", "qmla_attn_v2")
    if not prot:
        assert len(launches) == 2 and launches[0][0].defines["QMLA_V2_PROT_MODE"] == 0
        return
    (packed, pgrid, _, pargs, _), (protk, qgrid, _, qargs, _), (_c, cgrid, _, cargs, _) = launches
    assert packed.defines["QMLA_V2_PROT_MODE"] == 1 and protk.kernel == "qmla_attn_protected"
    assert packed.defines["QMLA_V2_MINB"] == 3 and packed.defines["QMLA_V2_T"] == int(tile)
    splits = pgrid[1]
    # the sink CTA and one CTA per 32-token tile a 128-token local window can touch (5)
    assert qgrid == (pgrid[0], 6) and protected_ctas(4, 128) == 6 and protected_ctas(4, 0) == 1
    assert protected_ctas(36, 16) == 2 + 2 and protected_ctas(0, 0) == 0
    slots = int(pargs[params.index("int num_splits")])
    assert slots == splits + 6 and int(qargs[params.index("int num_splits")]) == slots and int(cargs[-1]) == slots
    assert pargs == qargs  # one argument list for both kernels


def test_v2_protected_only_mode_is_gone():
    """Mode 2 (v2's protected-only build) was replaced by kernels/protected.cu."""
    with pytest.raises(ValueError, match="prot_mode"):
        v2_defines(qm.PackFormat.parse("C4R4"), prot_mode=2)


@pytest.mark.parametrize("variant,dtype", [("v1", torch.bfloat16), ("v1", torch.float32), ("v2", torch.float32)])
def test_v1_launch_arguments_match_kernel_signature(monkeypatch, variant, dtype):
    """v1 (and v2's float32 fallback) through the same stubs: v1's kernel and argument list."""
    from quantmla_core.backends.cupy import attention as A
    from quantmla_core.testing import patch_cupy_launcher

    launches = []
    monkeypatch.setenv(VARIANT_ENV, variant)
    patch_cupy_launcher(
        monkeypatch, get_kernel=lambda source, kernel, defines, dev, smem=0: (source, kernel),
        launch=lambda fn, grid, block, args, dev, smem=0, stream=None, types=None, pdl=False:
        launches.append((fn, grid, block, args if types is None else tuple(map(lambda t, a: t(a), types, args)))),
        external_stream=lambda dev: None, device_info=lambda dev: (132, (9, 0)), nvrtc_version=lambda: (13, 0),
        resident_ctas=lambda fn, threads, smem, dev, sms: 2 * sms,
        _workspace=lambda dev, n: torch.zeros(n, dtype=torch.float32))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: torch.zeros(*a, **k))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cache = stub_cache(qm.PackFormat.parse("C4R4"), 2, 2)
    q, r = torch.zeros((2, 1, 16, 512), dtype=dtype), torch.zeros((2, 1, 16, 64), dtype=dtype)
    A.attention(q, r, cache, torch.zeros((2, 2), dtype=torch.int32), torch.full((2,), 100), torch.arange(2), 0.05)
    (fn, _grid, block, args), (cfn, _, _, _cargs) = launches
    assert fn == ("attention.cu", "qmla_attn") and cfn == ("attention.cu", "qmla_combine")
    assert len(args) == len(_kernel_params("attention.cu", "qmla_attn")) and block == (128,)


# ------------------------------------------------------------------ CUDA graphs (GPU)
@gpu
@pytest.mark.parametrize("backend,name,dtype,env", [
    ("cupy", "C4R4", "bfloat16", {}), ("cupy", "C8R8", "float32", {}), ("triton", "C4R4", "bfloat16", {}),
    ("cupy", "C4R4", "bfloat16", {"QUANTMLA_CUPY_ATTENTION": "v3", "QUANTMLA_CUPY_PROTECTED_STREAM": "1"}),
    ("cupy", "C2R4", "bfloat16", {"QUANTMLA_CUPY_ATTENTION": "v6"}),
    ("cupy", "C4R4", "bfloat16", {"QUANTMLA_CUPY_ATTENTION": "v6", "QUANTMLA_CUPY_V6_BALANCE": "1"}),
], ids=["cupy-v2", "cupy-v1", "triton-v2", "cupy-v3-side-stream", "cupy-v6-protected-tiles", "cupy-v6-balanced"])
def test_cuda_graph_capture_and_replay(backend, name, dtype, env, monkeypatch):
    """A captured attention call replays bit-identically to the eager call, also after the memory
    the capture freed has been reused, and follows new queries copied into its static inputs
    (v3 with its protected launch on a second stream: captured as a fork and a join; v6, at 128 heads,
    with the sink and local tokens as its own tiles, and with a balanced plan, whose piece table the warm-up uploads)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    v6 = env.get("QUANTMLA_CUPY_ATTENTION") == "v6"
    if v6 and tuple(torch.cuda.get_device_capability()) != (9, 0):
        pytest.skip("v6 is an sm_90a kernel: compute capability 9.0 only")
    case = Case(qm.PackFormat.parse(name), (300, 1000, 77), heads=128 if v6 else 16, seed=23)
    batch = build(case)
    args = batch.to("cuda", dtype)
    cache = allocate(case, batch, "cuda")
    qm.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
             positions=args["positions"], seq_lens=args["seq_lens"], backend=backend)
    # index arrays in the kernels' own dtypes: a converted copy could not outlive the capture
    kw = dict(block_table=args["block_table"].to(torch.int32).contiguous(),
              seq_lens=args["attn_seq_lens"].to(torch.int64).contiguous(),
              seq_ids=args["attn_seq_ids"].to(torch.int64).contiguous(),
              softmax_scale=batch.softmax_scale, backend=backend, validate=False)
    q, r = args["q_latent"].clone(), args["q_rope"].clone()
    want, want_lse = qm.attention(q, r, cache, **kw)
    graph, (out, lse) = capture_graph(lambda: qm.attention(q, r, cache, **kw))  # warmed up off the capture stream
    junk = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(8)]  # reuse freed memory
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    q.mul_(0.5)
    r.mul_(0.5)
    graph.replay()
    want2, want2_lse = qm.attention(q, r, cache, **kw)
    torch.cuda.synchronize()
    assert torch.equal(out, want2) and torch.equal(lse, want2_lse)
    assert not torch.equal(want2, want)
    del junk


# ------------------------------------------------------------------ index width (int32 / int64)
@pytest.mark.parametrize("variant", ["v2", "v3", "v4"])
@pytest.mark.parametrize("lens_dtype,ids_dtype", [(torch.int32, torch.int32), (torch.int64, torch.int64),
                                                  (torch.int32, torch.int64)])
def test_index_width_follows_the_inputs(monkeypatch, variant, lens_dtype, ids_dtype):
    """int32 seq_lens and seq_ids get kernels built for int32 and reach them without a copy; any
    int64 among them gets the int64 build, and the other is converted. Split and protected-only
    launches agree, and the launch argument is the tensor the kernel reads."""
    lens, ids = torch.full((3,), 300, dtype=lens_dtype), torch.arange(3, dtype=ids_dtype)
    launches, _kernels, _fmt, _b = _run_v2_stubbed(monkeypatch, 16, 1, True, {}, variant, lens=lens, ids=ids)
    int32 = lens_dtype == ids_dtype == torch.int32
    split = launches.of(f"qmla_attn_{variant}")[0]
    # v4 attends to the protected tiles in its own launch; v2/v3 add the protected-only kernel
    prot = () if variant == "v4" else (launches.of("qmla_attn_protected")[0],)
    for fn, _grid, _block, args, _smem in (split, *prot):
        assert fn.defines["QMLA_INDEX64"] == (0 if int32 else 1)
        params = _kernel_params(fn.source, fn.kernel)
        lens_arg = int(args[[i for i, p in enumerate(params) if p.endswith(" seq_lens")][0]])
        ids_arg = int(args[[i for i, p in enumerate(params) if p.endswith(" seq_ids")][0]])
        assert (lens_arg == lens.data_ptr()) == (int32 or lens_dtype == torch.int64)
        assert (ids_arg == ids.data_ptr()) == (int32 or ids_dtype == torch.int64)
        assert "qmla_index_t* __restrict__ seq_lens" in " ".join(params)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("source", ["attention_v2.cu", "attention_v3.cu", "attention_v4.cu", "protected.cu",
                                    "attention.cu"])
def test_int32_index_builds_compile(source):
    fmt = qm.PackFormat.parse("C4R4")
    defines = {"attention_v2.cu": lambda: v2_defines(fmt, 1, index64=False),
               "attention_v3.cu": lambda: v3_defines(fmt, index64=False),
               "attention_v4.cu": lambda: v4_defines(fmt, index64=False),
               "protected.cu": lambda: protected_defines(fmt, index64=False),
               "attention.cu": lambda: attention_defines(fmt, "bfloat16", index64=False)}[source]()
    rc, text = _nvcc_ptx(source, defines)
    assert rc == 0, text[-3000:]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["v2", "v3", "v4"])
@pytest.mark.parametrize("case", V2_CASES[:4], ids=str)
def test_int32_indices_match_int64(case, variant, monkeypatch):
    """The int32 build (seq_lens and seq_ids both int32) gives the same bits as the int64 one, and
    both match the reference."""
    _use_variant(monkeypatch, variant)
    batch = build(case)
    args = batch.to("cuda", "bfloat16")
    cache = allocate(case, batch, "cuda")
    qm.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
             positions=args["positions"], seq_lens=args["seq_lens"], backend="cupy")
    outs = []
    for dtype in (torch.int64, torch.int32):
        out, lse = qm.attention(args["q_latent"], args["q_rope"], cache, block_table=args["block_table"],
                                seq_lens=args["attn_seq_lens"].to(dtype), seq_ids=args["attn_seq_ids"].to(dtype),
                                softmax_scale=batch.softmax_scale, backend="cupy")
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")
