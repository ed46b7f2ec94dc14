"""How the CuPy backend asks for its builds, on the CPU with stand-in ``cupy`` and NVRTC modules: the options of
``get_kernel`` (C++17, the kernel folder, the ``-D`` defines in a stable order), one build per key, the raised
shared-memory limit above 48 KB, the ``sm_90a`` path through ``compile_cubin``, and that path's options, error and
clean-up. The real builds are compiled by ``nvcc`` in ``test_cupy_backend.py`` and run on the GPU."""

from __future__ import annotations

import contextlib
import sys
from types import ModuleType, SimpleNamespace

import pytest

from quantmla_core.backends import cupy as C


class _Module:
    built: list = []

    def __init__(self, code=None, options=(), path=None):
        _Module.built.append((code, tuple(options), path))

    def get_function(self, name):
        return SimpleNamespace(name=name, max_dynamic_shared_size_bytes=None)


@pytest.fixture
def fake_cupy(monkeypatch):
    _Module.built = []
    fake = SimpleNamespace(cuda=SimpleNamespace(Device=lambda index: contextlib.nullcontext()), RawModule=_Module)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(C, "_MODULES", {})
    return _Module.built


def test_get_kernel_options_and_one_build_a_key(fake_cupy):
    fn = C.get_kernel("attention.cu", "qmla_attn", {"QMLA_B": 2, "QMLA_A": 1}, 0)
    (code, options, path), = fake_cupy
    assert code == C.kernel_source("attention.cu") and path is None
    assert options == ("--std=c++17", f"-I{C.KERNEL_DIR}", "-DQMLA_A=1", "-DQMLA_B=2")
    assert fn.name == "qmla_attn" and fn.max_dynamic_shared_size_bytes is None  # 48 KB or less: the default limit
    assert C.get_kernel("attention.cu", "qmla_attn", {"QMLA_A": 1, "QMLA_B": 2}, 0) is fn  # same key: no new build
    C.get_kernel("attention.cu", "qmla_attn", {"QMLA_A": 1, "QMLA_B": 3}, 0)
    C.get_kernel("attention.cu", "qmla_attn", {"QMLA_A": 1, "QMLA_B": 2}, 1)  # another device
    assert len(fake_cupy) == 3


def test_get_kernel_raises_the_shared_memory_limit_above_48_kb(fake_cupy):
    assert C.get_kernel("attention.cu", "qmla_attn", {}, 0, smem=48 * 1024).max_dynamic_shared_size_bytes is None
    assert C.get_kernel("attention.cu", "qmla_attn", {}, 1, smem=48 * 1024 + 16).max_dynamic_shared_size_bytes == 49168


def test_get_kernel_builds_arch_targets_through_compile_cubin(fake_cupy, monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(C, "compile_cubin",
                        lambda code, options, arch: asked.append((options, arch)) or tmp_path / "k.cubin")
    C.get_kernel("attention_v6.cu", "qmla_attn_v6", {"QMLA_X": 1}, 0, arch="sm_90a")
    assert asked == [(("--std=c++17", f"-I{C.KERNEL_DIR}", "-DQMLA_X=1"), "sm_90a")]
    assert fake_cupy == [(None, (), str(tmp_path / "k.cubin"))]


class _NVRTCError(Exception):
    pass


@pytest.fixture
def fake_nvrtc(monkeypatch):
    calls = []
    nv = ModuleType("cupy_backends.cuda.libs.nvrtc")
    nv.NVRTCError = _NVRTCError
    nv.fail = False
    nv.createProgram = lambda code, name, headers, includes: calls.append(("create", name)) or "prog"
    def compile_program(prog, opts):
        calls.append(("compile", tuple(opts)))
        if nv.fail:
            raise _NVRTCError("NVRTC_ERROR_COMPILATION (6)")
    nv.compileProgram = compile_program
    nv.getProgramLog = lambda prog: "kernel.cu(3): error: identifier undefined"
    nv.getCUBIN = lambda prog: b"\x7fELF cubin"
    nv.destroyProgram = lambda prog: calls.append(("destroy", prog))
    libs = ModuleType("cupy_backends.cuda.libs")
    libs.nvrtc = nv
    for name, mod in (("cupy_backends", ModuleType("cupy_backends")), ("cupy_backends.cuda", ModuleType("c")),
                      ("cupy_backends.cuda.libs", libs), ("cupy_backends.cuda.libs.nvrtc", nv)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(C, "_CUBIN_DIR", [])
    return nv, calls


def test_compile_cubin_adds_cupys_options_and_writes_the_cubin(fake_nvrtc, monkeypatch, tmp_path):
    """The target last, CuPy's own options (-ftz, device code by default) before it; the cubin written to a
    per-process folder that goes at exit (CuPy's compiler cannot name the "a" targets)."""
    nv, calls = fake_nvrtc
    exits = []
    monkeypatch.setattr(C.atexit, "register", lambda fn, *args: exits.append((fn, args)))
    monkeypatch.setattr(C.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    path = C.compile_cubin("__global__ void k() {}", ("-DQMLA_X=1",), "sm_90a")
    assert calls == [("create", "qmla_kernel.cu"),
                     ("compile", ("-DQMLA_X=1", "-ftz=true", "--device-as-default-execution-space", "-arch=sm_90a")),
                     ("destroy", "prog")]
    assert exits == [(C.shutil.rmtree, (tmp_path, True))]  # the folder goes at exit
    assert path.parent == tmp_path and path.read_bytes() == b"\x7fELF cubin"
    assert C.compile_cubin("__global__ void k() {}", ("-DQMLA_X=2",), "sm_90a") != path  # options are in the name


def test_compile_cubin_failure_names_the_target_and_carries_nvrtcs_log(fake_nvrtc):
    nv, calls = fake_nvrtc
    nv.fail = True
    with pytest.raises(RuntimeError, match=r"NVRTC build for sm_90a failed \(NVRTC_ERROR_COMPILATION \(6\)\):\n"
                                           r"kernel.cu\(3\): error: identifier undefined"):
        C.compile_cubin("bad", (), "sm_90a")
    assert calls[-1] == ("destroy", "prog")  # the program is destroyed on failure too
