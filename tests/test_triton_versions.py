"""Which triton releases the Triton backend runs on: the version floor it declares (``MIN_TRITON``) and a check of the
kernels' source for a construct older compilers reject. Every launch was compiled under triton 3.2 to 3.9 offline
(benchmarks/RESULTS.md, "Stop 42"); CI has only the pinned release, so these tests hold what that run found."""

from __future__ import annotations

import ast
import pathlib

import pytest

import quantmla_core as qm
import quantmla_core.backends.triton as triton_backend
from quantmla_core.backends.triton import MIN_TRITON, interpreter_loop_reason, triton_version_reason
from quantmla_core.dispatch import DeviceInfo, NoBackendError, Problem, select_backend

KERNEL_DIR = pathlib.Path(triton_backend.__file__).parent


@pytest.mark.parametrize("version", ["3.3.0", "3.3.1", "3.6.0", "3.7.1", "3.10.0", "4.0.0", "3.3.0+git1a2b3c4"])
def test_supported_versions_have_no_reason(version):
    assert triton_version_reason(version) is None


@pytest.mark.parametrize("version", ["3.2.0", "3.0.0", "2.3.1", "3.1.0+rocm6.2"])
def test_older_versions_are_refused_with_the_floor(version):
    reason = triton_version_reason(version)
    assert reason is not None and version in reason and "3.3" in reason


def test_unparsable_version_is_refused():
    assert "not of the form" in triton_version_reason("nightly")


def test_pyproject_extra_states_the_floor():
    pyproject = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("not a source checkout")
    want = f'triton = ["triton>={MIN_TRITON[0]}.{MIN_TRITON[1]}"]'
    assert want in pyproject.read_text()


def test_old_triton_makes_the_backend_unavailable_and_auto_says_why(monkeypatch):
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton, "__version__", "3.2.0")
    backend = qm.get_backend("triton")
    assert "triton 3.2.0 is older than 3.3" in backend.unavailable_reason()
    problem = Problem("attention", qm.PackFormat.parse("C4R4"), DeviceInfo("cuda"), num_heads=16, q_len=1)
    with pytest.raises(NoBackendError, match="older than 3.3"):
        select_backend(problem, backend="triton", env={})


def chained_boolean_ops(source: str) -> list[str]:
    """``A and B and C`` (one boolean operation of three or more operands) inside ``triton.jit`` functions of
    ``source``: triton 3.3 and older refuse them ("chained boolean operators are not supported")."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in fn.decorator_list):
            found += [f"{fn.name}:{n.lineno}: {ast.unparse(n)}" for n in ast.walk(fn)
                      if isinstance(n, ast.BoolOp) and len(n.values) > 2]
    return found


def test_chained_boolean_check_catches_one():
    src = "import triton\n@triton.jit\ndef k(A, B, C):\n    X = 1 if (A and B and C) else 0\n    Y = 1 if ((A and B) and C) else 0\n"
    assert chained_boolean_ops(src) == ["k:4: A and B and C"]


def test_kernels_have_no_chained_boolean_ops():
    sources = sorted(KERNEL_DIR.glob("*.py"))
    assert any(p.name == "attention_v2_kernel.py" for p in sources)
    found = [f"{p.name}:{hit}" for p in sources for hit in chained_boolean_ops(p.read_text())]
    assert not found, found


@pytest.mark.parametrize("triton_version, numpy_version", [("3.6.0", "2.4.6"), ("3.3.1", "2.4.0"), ("3.6.0", "3.0.0")])
def test_old_interpreter_with_strict_numpy_is_refused(triton_version, numpy_version):
    reason = interpreter_loop_reason(triton_version, numpy_version)
    assert reason is not None and triton_version in reason and numpy_version in reason and "triton>=3.7" in reason


@pytest.mark.parametrize("triton_version, numpy_version", [("3.7.0", "2.4.6"), ("3.7.1", "2.4.6"), ("3.6.0", "2.3.5"),
                                                           ("3.9.0", "3.1.0"), ("dev", "2.4.6")])
def test_fixed_interpreter_or_lenient_numpy_has_no_reason(triton_version, numpy_version):
    assert interpreter_loop_reason(triton_version, numpy_version) is None


def test_auto_on_cpu_skips_triton_attention_under_an_old_interpreter_and_says_why(monkeypatch):
    triton = pytest.importorskip("triton")
    np = pytest.importorskip("numpy")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(np, "__version__", "2.4.6")
    fmt = qm.PackFormat.parse("C4R4")
    attention = Problem("attention", fmt, DeviceInfo("cpu"), num_heads=16, q_len=1)
    with pytest.raises(NoBackendError, match="interpreter of triton 3.6.0 cannot run the attention kernels"):
        select_backend(attention, backend="triton", env={})
    assert select_backend(attention, backend="auto", env={}).name != "triton"
    writer = Problem("write", fmt, DeviceInfo("cpu"), num_heads=16, q_len=1)
    assert select_backend(writer, backend="triton", env={}).name == "triton"  # the writer has no such loop
