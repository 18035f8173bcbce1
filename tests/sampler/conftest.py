"""Shared fixtures for the sampler tests: the DROID golden fixtures and the diffusers oracle."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from oracle.fixtures import droid_fixture_dir
from safetensors.torch import load_file


@pytest.fixture(scope="session")
def droid_dir() -> Path:
    return droid_fixture_dir()  # fails (never skips) with a clear message when the fixtures are missing


@pytest.fixture(scope="session")
def droid_requests(droid_dir: Path) -> list[dict[str, Any]]:
    """One dict per manifest request: id, request.json, expected.json and the tensors."""
    manifest = json.loads((droid_dir / "manifest.json").read_text())
    out = []
    for entry in manifest["requests"]:
        folder = droid_dir / entry["path"]
        out.append(
            {
                "id": entry["id"],
                "request": json.loads((folder / "request.json").read_text()),
                "expected": json.loads((folder / "expected.json").read_text()),
                "tensors": load_file(str(folder / "tensors.safetensors")),
            }
        )
    if not out:
        pytest.fail(f"{droid_dir / 'manifest.json'} lists no requests")
    return out


@pytest.fixture(scope="session")
def droid_tolerances(droid_dir: Path) -> dict[str, Any]:
    return json.loads((droid_dir / "tolerances.json").read_text())["recommended"]


@pytest.fixture(scope="session")
def diffusers_unipc() -> Callable[[float], Any]:
    """Factory for the oracle: diffusers' flow UniPC in the configuration Cosmos 3 uses."""
    from oracle.scheduler import reference_unipc

    return reference_unipc
