"""``benchmarks/run_h200_kernels.sh``, the device calls' driver, checked on the CPU: it parses, every mode its header
documents has a branch, and its shell helpers return (stop 61's review once made ``smi_stop`` call itself, which the
next device call would have met only at its end)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "run_h200_kernels.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="bash not found")


def test_script_parses():
    r = subprocess.run([BASH, "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


def test_every_documented_mode_has_a_branch():
    """The header's ``bash benchmarks/run_h200_kernels.sh MODE`` lines name modes the script runs (``time`` is its
    final ``else``)."""
    text = SCRIPT.read_text()
    documented = set(re.findall(r"^#   (?:\S+=\S+ )*bash benchmarks/run_h200_kernels\.sh ([a-z0-9_]+)", text, re.M))
    branches = set(re.findall(r'"\$MODE" = ([a-z0-9_]+) \]', text))
    assert documented and documented - branches == {"time"}


def test_smi_helpers_return():
    """``smi_log`` / ``smi_stop`` as defined in the script: stopping a logger (here a sleeping process) kills it and
    returns."""
    text = SCRIPT.read_text()
    helpers = re.search(r"^smi_log\(\) \{.*?^smi_stop\(\) \{[^\n]*\}\n", text, re.M | re.S)
    assert helpers, "smi_log and smi_stop are defined one after the other"
    program = helpers.group(0) + 'sleep 30 & SMI=$!\nsmi_stop\nwait "$SMI" 2>/dev/null\necho stopped\n'
    r = subprocess.run([BASH, "-c", program], capture_output=True, text=True, timeout=20, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "stopped", r.stderr[-2000:]
