"""``python -m quantmla_core.info``: every registered backend, whether it is usable, and why not."""

from __future__ import annotations

import importlib.metadata
import platform

import numpy as np
import torch

from . import __version__
from .dispatch import PRIORITY, DeviceInfo, available_backends, get_backend


def _installed(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def report() -> str:
    optional = {n: _installed(d) for n, d in (("triton", "triton"), ("numba", "numba"), ("transformers", "transformers"),
                                               ("safetensors", "safetensors"))}
    cupy = next((v for v in (_installed(d) for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy")) if v != "-"), "-")
    lines = [
        f"quantmla_core {__version__}  python {platform.python_version()}  torch {torch.__version__}  numpy {np.__version__}",
        "optional: " + "  ".join(f"{k} {v}" for k, v in {**optional, "cupy": cupy}.items()),
    ]
    devices = ["cpu", "numpy"]
    if torch.cuda.is_available():
        info = DeviceInfo.of(torch.device("cuda"))
        lines.append(f"GPU: {info.name} (capability {info.capability}, {info.sm_count} SMs) -> device kind {info.kind!r}")
        devices.insert(0, info.kind)
    else:
        lines.append("GPU: none visible to torch")
    lines.append("")
    lines.append(f"{'backend':<10} {'status':<12} devices / reason")
    for name, reason in available_backends().items():
        cap = get_backend(name).capabilities
        status = "available" if reason is None else "unavailable"
        detail = ", ".join(sorted(cap.devices)) if reason is None else reason
        lines.append(f"{name:<10} {status:<12} {detail}")
    lines.append("")
    for dev in devices:
        lines.append(f"auto priority for {dev}: {' -> '.join(PRIORITY[dev])}")
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
