"""Package layout: the repository's top-level folders install under the ``quantmla_core`` namespace.

``backends/`` -> ``quantmla_core.backends``, ``reference/`` -> ``quantmla_core.reference``,
``calibration/`` -> ``quantmla_core.calibration``. Nothing installs a top-level ``backends``
or ``reference`` module. Metadata lives in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDERS = {
    "quantmla_core": "quantmla_core",
    "quantmla_core.backends": "backends",
    "quantmla_core.reference": "reference",
    "quantmla_core.calibration": "calibration",
}

packages = []
for name, folder in FOLDERS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(package_dir=FOLDERS, packages=packages)
