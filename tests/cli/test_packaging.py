"""What pyproject.toml promises a user who installs the package: one version source, the license text, the type
marker, a changelog entry for the version, and a diffusers range rather than one pin."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

import wamrt

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_has_one_source_and_a_changelog_entry():
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "wamrt._version.__version__"}
    version = Version(wamrt.__version__)  # a valid PEP 440 version
    assert f"({version})" in (ROOT / "CHANGELOG.md").read_text()


def test_license_and_type_marker_ship():
    assert PYPROJECT["project"]["license"] == "Apache-2.0" and PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["wamrt"]
    assert (Path(wamrt.__file__).parent / "py.typed").is_file()


def test_diffusers_is_a_range_that_admits_the_installed_version():
    from importlib.metadata import version

    spec = next(Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("diffusers"))
    assert not any(s.operator == "==" for s in spec.specifier)
    assert version("diffusers") in spec.specifier


def test_the_grid_and_the_serving_errors_load_without_the_web_stack():
    """`wamrt eval grid` reads the server's engine settings on a machine that may carry only the simulator's wheels:
    importing them must not pull in starlette / uvicorn (a GPU call lost its cells to that, 04235bf)."""
    import subprocess
    import sys

    blocker = (
        "import sys, importlib.abc\n"
        "class B(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('starlette', 'uvicorn', 'websockets'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, B())\n"
        "from wamrt.serving.config import ServeConfig\n"
        "from wamrt.serving.errors import as_serving_error\n"
        "import wamrt.cli.realtime\n"
        "print(sorted(ServeConfig().engine_settings('cuda')))\n"
    )
    out = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "attention" in out.stdout
