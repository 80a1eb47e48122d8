"""Package discovery for the wheel and the sdist (the rest of the metadata is in pyproject.toml).

The repository keeps the design card's layout: ``kernels/`` and ``modules/`` sit at the top level but install as
``tritonlm.kernels`` and ``tritonlm.modules``. setuptools' own discovery cannot follow that mapping, so the packages
are found here: every folder holding an ``__init__.py`` under ``tritonlm/``, ``kernels/`` and ``modules/`` becomes a
package under its ``tritonlm.`` name. A new package folder needs no edit anywhere.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent

# installed package name -> the folder it is built from
PACKAGE_ROOTS = {"tritonlm": "tritonlm", "tritonlm.kernels": "kernels", "tritonlm.modules": "modules"}


def discover_packages() -> list[str]:
    """Every folder with an ``__init__.py`` under the package roots, under its installed dotted name."""
    packages = []
    for name, folder in PACKAGE_ROOTS.items():
        base = ROOT / folder
        for init in sorted(base.rglob("__init__.py")):
            rel = init.parent.relative_to(base)
            if "__pycache__" in rel.parts:
                continue
            packages.append(".".join((name, *rel.parts)))
    return packages


setup(
    packages=discover_packages(),
    package_dir=PACKAGE_ROOTS,
    # files a module reads at run time: the GPU launch tables measured by the sweep (kernels/tuned/<gpu>.json)
    package_data={"tritonlm.kernels.tuned": ["*.json"]},
)
