"""Packaging: `pip install .` and `pip install -e .` in fresh venvs import every subpackage under the
``quantmla_core`` namespace and install no top-level ``backends`` or ``reference`` module."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["quantmla_core", "backends", "reference", "calibration", "pyproject.toml", "setup.py", "README.md"]

CHECK = r"""
import importlib, importlib.util, pkgutil, sys
import quantmla_core, quantmla_core.backends, quantmla_core.reference, quantmla_core.calibration
import quantmla_core.backends.torch, quantmla_core.backends.reference
for top in ("backends", "reference", "calibration"):
    assert importlib.util.find_spec(top) is None, f"top-level module {top!r} is importable"
names = [m.name for m in pkgutil.walk_packages(quantmla_core.backends.__path__, "quantmla_core.backends.") if m.ispkg]
for name in names:
    importlib.import_module(name)  # backend packages import without their optional dependencies
from importlib.resources import files
assert files("quantmla_core.backends.cupy").joinpath("kernels", "attention.cu").is_file(), "CUDA sources not installed"
assert files("quantmla_core.calibration").joinpath("data", "default.txt").is_file(), "calibration text not installed"
print("OK", quantmla_core.__file__, sorted(names))
"""


def _copy_sources(dst: Path) -> Path:
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists():
            shutil.copy2(src, dst / name)
    return dst


def _dependencies_dir(dst: Path) -> Path:
    """torch, numpy & co. from this interpreter, as links in a plain path entry: no .pth files run
    there and this environment's own (editable) install of the project is left out."""
    dst.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if "quantmla" in entry.name.lower() or entry.suffix == ".pth":
            continue
        (dst / entry.name).symlink_to(entry)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("editable", [False, True], ids=["install", "editable"])
def test_fresh_venv_install(tmp_path, editable):
    src = _copy_sources(tmp_path / "src")
    src.mkdir(exist_ok=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    cmd = [str(py), "-m", "pip", "install", "-q", "--no-deps"] + (["-e", str(src)] if editable else [str(src)])
    subprocess.run(cmd, check=True, cwd=tmp_path)
    env = dict(os.environ, PYTHONPATH=str(_dependencies_dir(tmp_path / "deps")))
    out = subprocess.run([str(py), "-c", CHECK], check=True, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.stdout.startswith("OK")
    assert str(src if editable else venv) in out.stdout
