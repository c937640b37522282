"""The package as installed: every module imports, and CI tests the wheel, not the source tree.

``make test-wheel`` (what CI runs) builds the wheel, installs it into a fresh
virtual environment and runs the suite with ``DPFUNC_TEST_INSTALLED=1`` from a
copy of the tests that holds no ``dpfunc/`` source. An editable install would
supply a subpackage missing from the wheel out of the source tree, so
``test_installed_copy_is_under_test`` makes sure that the run really used the
installed copy.
"""

import importlib
import os
import pkgutil
import sysconfig
from pathlib import Path

import pytest

import dpfunc

PACKAGE_DIR = Path(dpfunc.__file__).resolve().parent


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages([str(PACKAGE_DIR)], prefix="dpfunc.")]
    assert "dpfunc.ghost" in names and "dpfunc.ghost.runtime" in names
    for name in names:
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().is_relative_to(PACKAGE_DIR), name


def test_every_source_file_is_a_module():
    """No .py file in the package directory is left out of the import walk (no missing __init__)."""
    files = {p.relative_to(PACKAGE_DIR) for p in PACKAGE_DIR.rglob("*.py")}
    for path in files:
        for parent in list(path.parents)[:-1]:  # each enclosing subdirectory is a package
            assert (PACKAGE_DIR / parent / "__init__.py").exists(), path


def test_installed_copy_is_under_test():
    if os.environ.get("DPFUNC_TEST_INSTALLED") != "1":
        pytest.skip("development run against the editable source tree (make test)")
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert PACKAGE_DIR.is_relative_to(site), (
        f"dpfunc was imported from {PACKAGE_DIR}, not from the installed wheel in {site}"
    )
    assert not (Path.cwd() / "dpfunc").exists(), "the source tree is on the working directory"
