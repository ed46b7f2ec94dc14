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

import quantmla_core as qm
from quantmla_core import get_backend
from quantmla_core.backends.cupy import KERNEL_DIR, CupyBackend, define_options
from quantmla_core.backends.cupy.attention import attention_defines
from quantmla_core.backends.cupy.writer import writer_defines
from quantmla_core.dispatch import DeviceInfo, Problem, _import_reason
from quantmla_core.testing import Case, allocate, build, generate_cases

from conformance import check_attention_case, check_writer

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


def _compile(v: tuple) -> tuple[int, str]:
    arch, kernel, dc, dr, name, dtype = v
    fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr)
    defines = writer_defines(fmt, dtype) if kernel == "writer" else attention_defines(fmt, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [NVCC, "-ptx", f"-arch={arch}", "--std=c++17", f"-I{KERNEL_DIR}", *define_options(defines),
               "-o", os.path.join(tmp, "k.ptx"), str(KERNEL_DIR / f"{kernel}.cu")]
        r = subprocess.run(cmd, capture_output=True, text=True)
        ptx = open(os.path.join(tmp, "k.ptx")).read() if r.returncode == 0 else ""
    return r.returncode, (r.stderr + r.stdout) if r.returncode else ptx


@lru_cache(maxsize=1)
def _compiled() -> dict:
    with ThreadPoolExecutor(max_workers=2 * (os.cpu_count() or 2)) as pool:
        return dict(zip(VARIANTS, pool.map(_compile, VARIANTS)))


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
    given = set(writer_defines(fmt, "float32")) | set(attention_defines(fmt, "float32"))
    sources = list(KERNEL_DIR.glob("*.cu*"))
    defined_in_sources = {d for src in sources for d in re.findall(r"#define\s+(QMLA_[A-Z0-9_]+)", src.read_text())}
    for src in sources:
        used = set(re.findall(r"\bQMLA_[A-Z0-9_]+\b", src.read_text()))
        missing = used - given - defined_in_sources
        assert not missing, f"{src.name} uses {sorted(missing)} that no launcher passes"


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


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES + BIG, ids=str)
def test_attention_matches_reference(case, dtype):
    check_attention_case(case, "cupy", "cupy", "cuda", dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", CASES[::3], ids=str)
def test_cupy_write_torch_read_and_reverse(case):
    check_attention_case(case, "cupy", "torch", "cuda")
    check_attention_case(case, "torch", "cupy", "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", CASES[::2], ids=str)
def test_cross_with_triton(case):
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
