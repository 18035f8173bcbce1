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
