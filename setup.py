"""Package discovery from the tree, so a new subpackage cannot be left out of a wheel.

The repository keeps three top-level folders (fxpar/, passes/, cost/); an install maps them to one import package:
passes/ is fxpar.passes and cost/ is fxpar.cost. pyproject.toml holds everything else.
"""
from setuptools import find_packages, setup

ROOTS = {"fxpar": "fxpar", "fxpar.passes": "passes", "fxpar.cost": "cost"}  # import name -> folder


def _packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return sorted(found)


setup(packages=_packages(), package_dir=ROOTS)
