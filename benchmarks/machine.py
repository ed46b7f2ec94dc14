"""What a benchmark ran on: device, driver, library versions, command. Goes into every result."""

from __future__ import annotations

import importlib
import os
import platform
import shlex
import subprocess
import sys
from functools import lru_cache

import torch


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "?")
    except Exception:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


@lru_cache(maxsize=None)
def machine_info() -> dict:
    """Device name, driver, CPU, core count and versions of every relevant package."""
    info = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "triton": _version("triton"),
        "numba": _version("numba"),
        "cupy": _version("cupy"),
        "flashinfer": _version("flashinfer"),
        "transformers": _version("transformers"),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sm_count=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    driver=_driver(), cuda=torch.version.cuda)
    else:
        info["gpu"] = None
    return info


def command_line() -> str:
    """The command that produced a result, as typed."""
    return " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + sys.argv)
