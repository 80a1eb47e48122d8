"""What a built wheel carries: every package folder of the checkout under its ``tritonlm.`` name, every module file,
the run-time data files, and nothing under a top-level ``kernels`` / ``modules`` name.

The wheel is built from a copy of the three package roots (plus the build files), so no build state of the
checkout's editable install can leak into it; ``.ci/run`` then installs a wheel and the sdist for real
(``.ci/install_smoke.py``).
"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# source folder -> installed package name (the design card's layout)
ROOTS = {"tritonlm": "tritonlm", "kernels": "tritonlm.kernels", "modules": "tritonlm.modules"}
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE")


def _installed_path(folder: str, rel: Path) -> str:
    return "/".join((*ROOTS[folder].split("."), *rel.parts))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``(wheel file names, expected package dirs, expected module files)`` of a wheel built from a copy of the
    checkout that also holds a tuned launch table (package data the launchers read at run time)."""
    pytest.importorskip("setuptools", reason="the dev extra's setuptools builds the wheel without network")
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ROOTS:
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for name in BUILD_FILES:
        if (ROOT / name).is_file():  # (setup.py holds the package discovery; a checkout without it is the bug)
            shutil.copy2(ROOT / name, src / name)
    table = src / "kernels" / "tuned" / "packaging-test-gpu.json"
    table.write_text('{"version": 1, "gpu": "packaging test", "kernels": {}}\n')

    out = tmp_path_factory.mktemp("wheel")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          str(src), "-w", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    (wheel,) = out.glob("tritonlm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    packages, modules = set(), set()
    for folder in ROOTS:
        for path in (src / folder).rglob("*.py"):
            rel = path.parent.relative_to(src / folder)
            if (path.parent / "__init__.py").is_file():
                modules.add(_installed_path(folder, rel) + "/" + path.name)
        for init in (src / folder).rglob("__init__.py"):
            packages.add(_installed_path(folder, init.parent.relative_to(src / folder)))
    return names, packages, modules


def test_every_package_folder_is_in_the_wheel(built):
    names, packages, _ = built
    in_wheel = {name.rsplit("/", 1)[0] for name in names if name.endswith("/__init__.py")}
    assert packages - in_wheel == set(), "package folders missing from the wheel"
    assert "tritonlm/kernels/gated_delta" in in_wheel  # the package a hand-written list once left out


def test_every_module_file_is_in_the_wheel(built):
    names, _, modules = built
    assert modules - names == set()


def test_tuned_tables_are_package_data(built):
    names, _, _ = built
    assert "tritonlm/kernels/tuned/packaging-test-gpu.json" in names


def test_no_top_level_kernels_or_modules(built):
    names, _, _ = built
    tops = {name.split("/", 1)[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"tritonlm"}, tops
