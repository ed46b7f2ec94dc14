"""CuPy backend: the combine launched with programmatic dependent launch (``backends/cupy/pdl.py``).

CPU: the ctypes structures against ``cuda.h`` (compiled with the machine's C compiler), the call into the driver
with a fake ``cuLaunchKernelEx``, ``QUANTMLA_CUPY_PDL``'s rule, which launches of a stubbed call ask for PDL, and the
kernels' ``griddepcontrol`` instructions in their PTX. GPU: PDL on and off give the same bits, eagerly and as CUDA
graphs, at H16 (v5) and H128 (v6).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile

import pytest
import torch
from conformance import Case
from test_cupy_backend import NVCC, _nvcc_ptx, _run_v2_stubbed, gpu

import quantmla_core as qm
from quantmla_core.backends.cupy import knobs, pdl
from quantmla_core.backends.cupy.builds import attention_defines
from quantmla_core.backends.cupy.variants import VARIANT_ENV
from quantmla_core.testing import allocate, build, capture_graph, stub_cache, stub_cupy_launcher

MERGE_ENV = "QUANTMLA_CUPY_V6_MERGE"
CUDA_H = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include", "cuda.h")
CC = shutil.which("cc") or shutil.which("gcc")

_LAYOUT_PROGRAM = r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
int main(void) {
    printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu %d\n", sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, blockDimX),
           offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),
           offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs), sizeof(CUlaunchAttribute),
           offsetof(CUlaunchAttribute, value), sizeof(CUlaunchAttributeValue),
           (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
    return 0;
}
"""


@pytest.mark.skipif(not os.path.exists(CUDA_H) or CC is None, reason=f"needs {CUDA_H} and a C compiler")
def test_launch_structures_match_cuda_h():
    """The ctypes ``CUlaunchConfig`` and ``CUlaunchAttribute`` have cuda.h's sizes and field offsets, and the
    attribute id is cuda.h's."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "layout.c"), os.path.join(tmp, "layout")
        with open(src, "w") as f:
            f.write(_LAYOUT_PROGRAM)
        subprocess.run([CC, f"-I{os.path.dirname(CUDA_H)}", src, "-o", exe], check=True, capture_output=True)
        got = [int(x) for x in subprocess.run([exe], check=True, capture_output=True, text=True).stdout.split()]
    C, A = pdl.LaunchConfig, pdl.LaunchAttribute
    ours = [ctypes.sizeof(C), C.blockDimX.offset, C.sharedMemBytes.offset, C.hStream.offset, C.attrs.offset,
            C.numAttrs.offset, ctypes.sizeof(A), A.value.offset, A.value.size, pdl.PROGRAMMATIC_STREAM_SERIALIZATION]
    assert ours == got


class FakeLaunch:
    """A stand-in ``cuLaunchKernelEx`` that records what it was given and returns ``result``."""

    def __init__(self, result: int = 0):
        self.result, self.calls = result, []

    def __call__(self, config_ref, function, params, extra):
        c = config_ref._obj
        attr = c.attrs[0]
        self.calls.append(((c.gridDimX, c.gridDimY, c.gridDimZ), (c.blockDimX, c.blockDimY, c.blockDimZ),
                           c.sharedMemBytes, c.hStream, c.numAttrs, attr.id, attr.value[0], function, params, extra))
        return self.result


def test_launch_with_pdl_fills_the_config(monkeypatch):
    fake = FakeLaunch()
    monkeypatch.setattr(pdl, "_driver", lambda: (fake, None))
    pdl.launch_with_pdl(0x1234, (7, 2, 1), (128, 1, 1), 4096, 0xABC0, 0x5678)
    assert fake.calls == [((7, 2, 1), (128, 1, 1), 4096, 0xABC0, 1, pdl.PROGRAMMATIC_STREAM_SERIALIZATION, 1,
                           0x1234, 0x5678, None)]


def test_launch_with_pdl_reports_the_driver_result(monkeypatch):
    monkeypatch.setattr(pdl, "_driver", lambda: (FakeLaunch(result=98), None))
    with pytest.raises(RuntimeError, match="CUresult 98"):
        pdl.launch_with_pdl(1, (1, 1, 1), (32, 1, 1), 0, 0, 0)
    monkeypatch.setattr(pdl, "_driver", lambda: (None, "no driver here"))
    with pytest.raises(RuntimeError, match="no driver here"):
        pdl.launch_with_pdl(1, (1, 1, 1), (32, 1, 1), 0, 0, 0)


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), None])
def test_pdl_needs_compute_capability_9(capability):
    assert "compute capability 9.0" in pdl.pdl_unavailable_reason(capability)


@pytest.mark.parametrize("env,reason,one_wave,want", [
    (None, None, True, True), ("auto", None, True, True), (None, None, False, False), ("auto", None, False, False),
    ("1", None, True, True), ("1", None, False, True), ("0", None, True, False),
    (None, "old driver", True, False), ("auto", "old driver", True, False), ("0", "old driver", True, False),
])
def test_combine_pdl_rule(monkeypatch, env, reason, one_wave, want):
    monkeypatch.setattr(knobs, "pdl_unavailable_reason", lambda capability: reason)
    if env is None:
        monkeypatch.delenv(knobs.PDL_ENV, raising=False)
    else:
        monkeypatch.setenv(knobs.PDL_ENV, env)
    assert knobs.combine_pdl((9, 0), one_wave) is want


def test_combine_pdl_refuses_where_unavailable(monkeypatch):
    monkeypatch.setattr(knobs, "pdl_unavailable_reason", lambda capability: "old driver")
    monkeypatch.setenv(knobs.PDL_ENV, "1")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_PDL=1: old driver"):
        knobs.combine_pdl((9, 0), True)
    monkeypatch.setenv(knobs.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_PDL"):
        knobs.combine_pdl((9, 0), True)


@pytest.mark.parametrize("variant,h", [("v5", 16), ("v6", 128), ("v3", 16), ("v2", 16)])
def test_only_the_combine_asks_for_pdl(monkeypatch, variant, h):
    """Where PDL is allowed the combine asks for it and no other launch does; refused, none does (v6 with its
    combine: merging clusters launch none)."""
    env = {MERGE_ENV: "0"}
    launches = _run_v2_stubbed(monkeypatch, h, 1, True, env, variant, pdl_reason=None)[0]
    assert launches.pdl == [rec[0].kernel == "qmla_combine" for rec in launches]
    assert launches.pdl[-1]
    launches = _run_v2_stubbed(monkeypatch, h, 1, True, env, variant)[0]
    assert not any(launches.pdl)


def test_no_pdl_after_the_side_stream(monkeypatch):
    """After the protected kernel's second stream joins, the combine waits for an event: a plain launch."""
    launches = _run_v2_stubbed(monkeypatch, 16, 1, True, {"QUANTMLA_CUPY_PROTECTED_STREAM": "1"}, "v3",
                               pdl_reason=None)[0]
    assert "side" in launches.streams and not any(launches.pdl)
    launches = _run_v2_stubbed(monkeypatch, 16, 1, True, {"QUANTMLA_CUPY_PROTECTED_STREAM": "0"}, "v3",
                               pdl_reason=None)[0]
    assert "side" not in launches.streams and launches.pdl[-1]


@pytest.mark.parametrize("resident,want", [(10_000, True), (1, False)], ids=["one-wave", "two-waves"])
def test_pdl_only_after_a_split_kernel_of_one_wave(monkeypatch, resident, want):
    """Unset, PDL goes to the combine only where every CTA of the split kernel runs at once on the GPU."""
    from quantmla_core.backends.cupy import attention as A
    from quantmla_core.testing import patch_cupy_launcher

    _kernels, launches = stub_cupy_launcher(monkeypatch, pdl_reason=None)
    patch_cupy_launcher(monkeypatch, resident_ctas=lambda fn, threads, smem, dev, sms: resident)
    monkeypatch.setenv(VARIANT_ENV, "v6")
    monkeypatch.setenv(MERGE_ENV, "0")  # v6 with its combine
    monkeypatch.delenv(knobs.PDL_ENV, raising=False)
    q, r = torch.randn((3, 128, 512)).bfloat16(), torch.randn((3, 128, 64)).bfloat16()
    A.attention(q, r, stub_cache(qm.PackFormat.parse("C4R4"), 3, 5), torch.arange(15, dtype=torch.int32).view(3, 5),
                torch.full((3,), 300), torch.arange(3), 0.05)
    grid = launches.of("qmla_attn_v6")[0][1]
    assert (grid[0] * grid[1] <= resident) is want
    assert launches.pdl[-1] is want


def test_knob_is_read_when_a_kept_call_is_reused(monkeypatch):
    """``QUANTMLA_CUPY_PDL`` is read when a call is prepared; a kept call for the same index tensors is prepared
    again when it changes."""
    from quantmla_core.backends.cupy import attention as A

    _kernels, launches = stub_cupy_launcher(monkeypatch, pdl_reason=None)
    monkeypatch.setenv(VARIANT_ENV, "v5")
    cache = stub_cache(qm.PackFormat.parse("C4R4"), 3, 5)
    prepared = []
    real_prepare = A.prepare
    monkeypatch.setattr(A, "prepare", lambda *a, **k: prepared.append(1) or real_prepare(*a, **k))
    q, r = torch.randn((3, 16, 512)).bfloat16(), torch.randn((3, 16, 64)).bfloat16()
    table, lens, ids = torch.arange(15, dtype=torch.int32).view(3, 5), torch.full((3,), 300), torch.arange(3)
    for env, want in ((None, True), (None, True), ("0", False), ("0", False), ("auto", True)):
        if env is None:
            monkeypatch.delenv(knobs.PDL_ENV, raising=False)
        else:
            monkeypatch.setenv(knobs.PDL_ENV, env)
        A.attention(q, r, cache, table, lens, ids, 0.05)
        assert launches.pdl[-1] is want
    assert len(prepared) == 3  # each change of the variable prepared the call again; each repeat reused it


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("arch,wait", [("sm_90", True), ("sm_80", False)])
def test_combine_waits_for_the_split_kernel_on_sm90(arch, wait):
    """The combine's PTX waits for the kernel before it (griddepcontrol.wait) on sm_90, and has no such
    instruction where the GPU has none."""
    rc, ptx = _nvcc_ptx("attention.cu", attention_defines(qm.PackFormat.parse("C4R4"), "bfloat16"), arch)
    assert rc == 0, ptx[-3000:]
    combine = ptx[ptx.index(".entry qmla_combine("):]
    assert ("griddepcontrol.wait" in combine) is wait
    assert "griddepcontrol.launch_dependents" not in combine


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("source", ["v5", "v6"])
def test_split_kernels_trigger_no_early_launch(source):
    """v5 and v6 (sm_90a) trigger no dependent launch of their own: a trigger after the tile loops started the
    combine's CTAs on the few SMs the split kernel's last CTAs left free, and was slower on an H100 (stop 61)."""
    if source == "v5":
        from test_cupy_v5 import V5_BUILDS, _compiled_v5
        rc, text, ptx = _compiled_v5()[V5_BUILDS[0]]
    else:
        from test_cupy_v6 import V6_BUILDS, _compiled_v6
        rc, text, ptx = _compiled_v6()[V6_BUILDS[0]]
    assert rc == 0, text[-3000:]
    assert "wgmma.mma_async" in ptx and "griddepcontrol" not in ptx


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name,heads,lens", [("C4R4", 16, (3000, 77, 9000)), ("C2R4", 128, (5000, 300, 64))])
def test_pdl_gives_the_same_bits(monkeypatch, name, heads, lens):
    """The combine with PDL (the default on sm_90) writes what it writes without, eagerly and replayed as a CUDA
    graph after the split kernel's partials change (new queries)."""
    if tuple(torch.cuda.get_device_capability()) != (9, 0):
        pytest.skip("v5 and v6 are sm_90a kernels: compute capability 9.0 only")
    why = pdl.pdl_unavailable_reason((9, 0))
    if why:
        pytest.skip(why)
    case = Case(qm.PackFormat.parse(name), lens, heads=heads, seed=71)
    batch = build(case)
    args = batch.to("cuda", "bfloat16")
    cache = allocate(case, batch, "cuda")
    qm.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
             positions=args["positions"], seq_lens=args["seq_lens"], backend="cupy")
    kw = dict(block_table=args["block_table"].to(torch.int32).contiguous(),
              seq_lens=args["attn_seq_lens"].to(torch.int64).contiguous(),
              seq_ids=args["attn_seq_ids"].to(torch.int64).contiguous(),
              softmax_scale=batch.softmax_scale, backend="cupy", validate=False)
    q, r = args["q_latent"].clone(), args["q_rope"].clone()
    monkeypatch.setenv(knobs.PDL_ENV, "0")
    plain = qm.attention(q, r, cache, **kw)
    monkeypatch.setenv(knobs.PDL_ENV, "1")
    with_pdl = qm.attention(q, r, cache, **kw)
    torch.cuda.synchronize()
    assert torch.equal(with_pdl[0], plain[0]) and torch.equal(with_pdl[1], plain[1])
    graph, (out, lse) = capture_graph(lambda: qm.attention(q, r, cache, **kw))
    q.mul_(-0.5)
    graph.replay()
    monkeypatch.setenv(knobs.PDL_ENV, "0")
    want, want_lse = qm.attention(q, r, cache, **kw)
    torch.cuda.synchronize()
    assert not torch.equal(want, plain[0])
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
