"""CuPy protected-only kernel (``kernels/protected.cu``): the sink and local-window tokens of v3 and
of v2's separate mode, as bfloat16 flash-decoding partials merged by the combine.

CPU: the source compiles for sm_90 and sm_80 without spills, and the launches it gets (stubbed)
match its signature and the partial slots. GPU: conformance against the reference for v3 and
v2's separate mode (it replaced v2's protected-only build, QMLA_V2_PROT_MODE 2, after measuring
8-23 % less GPU time per v3 call: benchmarks/RESULTS.md, stop 13).
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest
from conformance import check_attention_case
from quantmla_core.backends.cupy import KERNEL_DIR, define_options
from quantmla_core.backends.cupy.builds import protected_ctas, protected_defines, protected_smem_bytes
from quantmla_core.backends.cupy.variants import VARIANT_ENV
from test_cupy_backend import BIG, NVCC, V2_CASES, _kernel_params, _run_v2_stubbed, gpu, ptxas_usage

import quantmla_core as qm

PROTECTED_BUILDS = [(arch, dc, dr) for arch in ("sm_90", "sm_80") for dc, dr in ((512, 64), (256, 32))]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("arch,dc,dr", PROTECTED_BUILDS, ids=lambda v: str(v))
def test_protected_kernel_compiles_without_spills(arch, dc, dr):
    fmt = qm.PackFormat.parse("C4R4", latent_dim=dc, rope_dim=dr)
    defines = protected_defines(fmt)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [NVCC, "-cubin", f"-arch={arch}", "--std=c++17", "-Xptxas", "-v", f"-I{KERNEL_DIR}",
               *define_options(defines), "-o", os.path.join(tmp, "k.cubin"), str(KERNEL_DIR / "protected.cu")]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"nvcc failed:\n{(r.stderr + r.stdout)[-4000:]}"
    usage = ptxas_usage(r.stderr + r.stdout)
    assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, usage


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
def test_protected_kernel_checks_its_shared_memory_size():
    """A launcher whose size disagrees with the kernel's layout does not compile."""
    fmt = qm.PackFormat.parse("C4R4")
    defines = {**protected_defines(fmt), "QMLA_PROT_SMEM_EXPECTED": protected_smem_bytes(fmt) - 16}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [NVCC, "-ptx", "-arch=sm_90", "--std=c++17", f"-I{KERNEL_DIR}", *define_options(defines),
               "-o", os.path.join(tmp, "k.ptx"), str(KERNEL_DIR / "protected.cu")]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert r.returncode != 0 and "protected_smem_bytes" in r.stderr + r.stdout


@pytest.mark.parametrize("h,s_q", [(16, 1), (128, 1), (20, 3)])
def test_v2_separate_mode_launches_the_protected_kernel(monkeypatch, h, s_q):
    """v2's separate mode: the packed-only split kernel (mode 1), the protected kernel over every
    16-row chunk with the sink CTA and the local window's 5 tiles as the last 6 partials, then one
    combine over all of them."""
    launches, _kernels, fmt, b = _run_v2_stubbed(monkeypatch, h, s_q, True, {"QUANTMLA_CUPY_V2_PROTECTED": "separate"})
    params = _kernel_params("attention_v2.cu", "qmla_attn_v2")
    assert _kernel_params("protected.cu", "qmla_attn_protected") == params
    (packed, pgrid, _, pargs, _), (protk, qgrid, qblock, qargs, qsmem), (_c, _cg, _, cargs, _) = launches
    assert packed.defines["QMLA_V2_PROT_MODE"] == 1
    assert (protk.source, protk.kernel) == ("protected.cu", "qmla_attn_protected")
    assert qgrid == (b * (-(-(s_q * h) // 16)), protected_ctas(4, 128)) and qblock == (128,)
    assert qsmem == protected_smem_bytes(fmt) and qargs == pargs
    slots = int(pargs[params.index("int num_splits")])
    assert slots == pgrid[1] + 6 and int(cargs[-1]) == slots


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["v3", "v2-separate"])
@pytest.mark.parametrize("case", V2_CASES + BIG[:3], ids=str)
def test_protected_tokens_match_reference(case, variant, monkeypatch):
    """Every protected-token layout of the conformance cases (sink and window longer and shorter
    than the request, several queries with causal limits)."""
    monkeypatch.setenv(VARIANT_ENV, variant.split("-")[0])
    if variant == "v2-separate":
        monkeypatch.setenv("QUANTMLA_CUPY_V2_PROTECTED", "separate")
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")
