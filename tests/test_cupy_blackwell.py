"""CuPy on Blackwell, offline: every kernel ``auto`` picks on a B200 (sm_100) or an RTX 50 (sm_120) builds for that GPU
with nvcc and ptxas, and none of them is an sm_90a ``wgmma`` build (an sm_90a-only instruction that later GPUs do not
run). No GPU needed; the builds take a few seconds."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

import pytest

import quantmla_core as qm
from quantmla_core.backends.cupy import KERNEL_DIR, define_options
from quantmla_core.backends.cupy import builds as ca
from quantmla_core.backends.cupy.variants import select_variant
from quantmla_core.backends.cupy.writer import writer_defines

NVCC = shutil.which("nvcc")
BLACKWELL = {"sm_100": (10, 0), "sm_120": (12, 0)}
#: (format, query rows, block-table tokens, batch): short and long contexts at 16 and 128 heads
CALLS = [(name, rows, tokens, 32) for name in ("C4R4", "C2R4", "C8R8", "BF16") for rows in (16, 128)
         for tokens in (4096, 131072)]


def _build(variant: str, fmt) -> tuple[str, dict[str, int]]:
    """(source, defines) of the launch of ``variant`` for ``fmt`` with bfloat16 queries; v4 as its mma build."""
    return {"v1": lambda: ("attention.cu", ca.attention_defines(fmt, "bfloat16")),
            "v2": lambda: ("attention_v2.cu", ca.v2_defines(fmt)),
            "v3": lambda: ("attention_v3.cu", ca.v3_defines(fmt)),
            "v4": lambda: ("attention_v4.cu", ca.v4_defines(fmt, wgmma=False))}[variant]()


def selected(capability: tuple[int, int]) -> set[tuple[str, str]]:
    """{(variant, format)} auto runs over :data:`CALLS` on a GPU of ``capability``."""
    out = set()
    for name, rows, tokens, batch in CALLS:
        variant, _ = select_variant(qm.PackFormat.parse(name), "bfloat16", capability, max_tokens=tokens, rows=rows,
                                       batch=batch)
        out.add((variant, name))
    return out


def _cubin(arch: str, source: str, defines: dict[str, int]) -> tuple[int, str, str]:
    """(return code, messages, the PTX) of ``kernels/<source>`` compiled for ``arch``: nvcc to PTX, then ``ptxas -v``
    on that PTX (registers, spills; an instruction the target lacks fails here)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = os.path.join(tmp, "k.ptx")
        r = subprocess.run([NVCC, "-ptx", f"-arch={arch}", "--std=c++17", f"-I{KERNEL_DIR}", *define_options(defines),
                            "-o", ptx_path, str(KERNEL_DIR / source)], capture_output=True, text=True)
        if r.returncode:
            return r.returncode, r.stderr + r.stdout, ""
        ptx = open(ptx_path).read()
        ptxas = os.path.join(os.path.dirname(NVCC), "ptxas")
        r = subprocess.run([ptxas, "-v", f"-arch={arch}", ptx_path, "-o", os.path.join(tmp, "k.cubin")],
                           capture_output=True, text=True)
    return r.returncode, r.stderr + r.stdout, ptx


def test_auto_never_picks_a_wgmma_build_on_blackwell():
    for capability in BLACKWELL.values():
        variants = {v for v, _ in selected(capability)}
        assert variants and not variants & {"v5", "v6"}, (capability, variants)
        assert not ca.v4_uses_wgmma("auto", capability)
    assert {v for v, _ in selected((9, 0))} & {"v5", "v6"}  # the control: the H200 runs them


def test_rtx50_gets_no_kernel_over_its_99_kb():
    """sm_120 gives a block 99 KB: v4 (176 KB over BF16 pages) is not picked there, as on sm_86."""
    assert "v4" not in {v for v, _ in selected((12, 0))}
    assert "v4" in {v for v, _ in selected((10, 0))}


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("arch", sorted(BLACKWELL))
def test_selected_kernels_build_for_blackwell(arch):
    fmt = qm.PackFormat.parse("C4R4")
    builds = [_build(v, qm.PackFormat.parse(name)) for v, name in sorted(selected(BLACKWELL[arch]))]
    builds += [("writer.cu", writer_defines(fmt, "bfloat16")), ("protected.cu", ca.protected_defines(fmt))]
    unique = {(source, tuple(sorted(defines.items()))): (source, defines) for source, defines in builds}
    for source, defines in unique.values():
        rc, messages, ptx = _cubin(arch, source, defines)
        assert rc == 0, f"{source} for {arch}:\n{messages[-3000:]}"
        assert re.search(r"Used \d+ registers", messages), messages[-2000:]
        assert "wgmma" not in ptx and ".target sm_90a" not in ptx, source
