"""Maps the one import namespace, ``gridserve``, onto the repository's top-level folders."""

from setuptools import find_packages, setup

ROOTS = {
    "gridserve": "gridserve",
    "gridserve.services": "services",
    "gridserve.shared": "shared",
    "gridserve.kernels": "kernels",
}

packages = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=ROOTS)
