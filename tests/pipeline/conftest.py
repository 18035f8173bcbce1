"""DROID golden fixtures for the request-building tests.

The folder is resolved by `oracle.fixtures` ($WAMRT_DROID_FIXTURES, else <repo>/../shared/fixtures/droid).
A missing folder fails every fixture test with a clear message; it is never a skip, because a skipped
parity suite reads as a green one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from oracle.fixtures import droid_fixture_dir, droid_requests
from PIL import Image
from safetensors.numpy import load_file


@dataclass
class DroidRequest:
    id: str
    dir: Path
    request: dict[str, Any]
    expected: dict[str, Any]

    @cached_property
    def tensors(self) -> dict[str, np.ndarray]:
        return load_file(str(self.dir / "tensors.safetensors"))

    @cached_property
    def observation(self) -> dict[str, Any]:
        """request.json as the server would receive it: images decoded under their observation keys."""
        obs = {k: v for k, v in self.request.items() if k != "images"}
        for key, name in self.request["images"].items():
            obs[key] = np.array(Image.open(self.dir / name).convert("RGB"))
        return obs

    @cached_property
    def canvas(self) -> np.ndarray:
        return np.array(Image.open(self.dir / "canvas.png").convert("RGB"))

    @cached_property
    def prompt_bytes(self) -> bytes:
        return (self.dir / "prompt.txt").read_bytes()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "droid_request" not in metafunc.fixturenames:
        return
    # With the fixtures missing, droid_requests() yields one placeholder id; the fixture_root
    # dependency then fails that test with the clear message.
    ids = [entry["id"] for entry in droid_requests()]
    metafunc.parametrize("droid_request", ids, indirect=True)


@pytest.fixture(scope="session")
def fixture_root() -> Path:
    return droid_fixture_dir()  # pytest.fail (never skip) with a clear message when missing


@pytest.fixture(scope="session")
def manifest(fixture_root: Path) -> dict[str, Any]:
    return json.loads((fixture_root / "manifest.json").read_text())


@pytest.fixture
def droid_request(
    request: pytest.FixtureRequest, fixture_root: Path, manifest: dict[str, Any]
) -> DroidRequest:
    entry = next(e for e in manifest["requests"] if e["id"] == request.param)
    folder = fixture_root / entry["path"]
    return DroidRequest(
        id=entry["id"],
        dir=folder,
        request=json.loads((folder / "request.json").read_text()),
        expected=json.loads((folder / "expected.json").read_text()),
    )


@pytest.fixture(scope="session")
def tokenizer_dir(fixture_root: Path, manifest: dict[str, Any]) -> Path:
    return fixture_root / manifest["tokenizer"]


def _assert_bitwise(actual: Any, expected: Any, what: str = "") -> None:
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != {e.dtype}"
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    if a.tobytes() != e.tobytes():
        if a.dtype.kind == "f":  # compare bit patterns so -0.0 / NaN differences are located too
            a, e = a.view(f"u{a.itemsize}"), e.view(f"u{e.itemsize}")
        first = np.argwhere(a != e)[0].tolist()
        raise AssertionError(f"{what}: not bit-exact; first differing index {first}")


@pytest.fixture(scope="session")
def assert_bitwise() -> Callable[..., None]:
    """Same dtype, same shape, same bytes (so -0.0 vs 0.0 and NaN payloads count)."""
    return _assert_bitwise
