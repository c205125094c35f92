"""Maps the one import namespace, ``gridserve``, onto the repository's top-level folders.

It also generates the protobuf / gRPC modules from ``protos/`` (never committed) before the
packages are listed, so that wheels and installs contain ``gridserve.api.<role>.v1``.
"""

import importlib.util
import warnings
from pathlib import Path

from setuptools import find_packages, setup

ROOTS = {
    "gridserve": "gridserve",
    "gridserve.services": "services",
    "gridserve.shared": "shared",
    "gridserve.kernels": "kernels",
    "gridserve.demo": "demo",
    "gridserve.benchmarks": "benchmarks",
}


def _generate_protos() -> None:
    path = Path(__file__).resolve().parent / "gridserve" / "protos_build.py"
    spec = importlib.util.spec_from_file_location("_gridserve_protos_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.ensure_generated()
    except ImportError:
        warnings.warn("grpcio-tools is missing: run `python -m gridserve.protos_build` after installing",
                      stacklevel=1)


_generate_protos()
# A folder left out of a build context (the images leave out benchmarks/) is left out of the package.
ROOTS = {name: folder for name, folder in ROOTS.items() if (Path(__file__).resolve().parent / folder).is_dir()}
packages = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

# Non-Python files the packages read at run time (the C++ CPU kernels are compiled on first use;
# the gateway serves the web console's static files; `gridserve eval chat` reads its question set).
setup(packages=packages, package_dir=ROOTS, package_data={"gridserve.kernels.cpu_ops": ["*.cpp", "*.h"],
                                                     "gridserve.services.gateway": ["static/*"],
                                                     "gridserve.evals": ["*.jsonl"]})
