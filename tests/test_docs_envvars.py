"""Every ``QUANTMLA_*`` variable the library reads is in the README (a knob nobody can find is a knob nobody can
turn, or knows is set). A name may be written in the README's shorthand, a row's first name followed by the others'
suffixes (```QUANTMLA_CUPY_V2_RG`, `_STAGES`, `_MINB```), or with a value (```QUANTMLA_BACKEND=<name>```)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("quantmla_core", "backends", "reference", "calibration")


def _names_read() -> set[str]:
    names: set[str] = set()
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            names.update(re.findall(r"\bQUANTMLA_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return names


def _documented(name: str, lines: list[str]) -> bool:
    parts = name.split("_")
    for line in lines:
        if f"`{name}`" in line or f"`{name}=" in line:
            return True
        for i in range(2, len(parts)):  # shorthand: `PREFIX_X`, `_SUFFIX` in one row
            prefix, suffix = "_".join(parts[:i]), "_" + "_".join(parts[i:])
            if f"`{prefix}_" in line and f"`{suffix}`" in line:
                return True
    return False


def test_every_variable_read_is_in_the_readme():
    lines = (ROOT / "README.md").read_text().splitlines()
    names = _names_read()
    assert len(names) > 30  # the scan found the knobs
    missing = sorted(n for n in names if not _documented(n, lines))
    assert not missing, f"QUANTMLA_* variables read by the library but not in README.md: {missing}"


def test_the_shorthand_rule():
    row = ["| `QUANTMLA_CUPY_V2_RG`, `_STAGES`, `_MINB` | ... |"]
    assert _documented("QUANTMLA_CUPY_V2_MINB", row) and _documented("QUANTMLA_CUPY_V2_RG", row)
    assert not _documented("QUANTMLA_CUPY_V3_MINB", row) and not _documented("QUANTMLA_CUPY_V2_TILE", row)
