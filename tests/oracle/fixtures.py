"""Where the framework DROID golden fixtures live (../shared/fixtures/droid beside the checkout)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def droid_fixture_dir() -> Path:
    root = Path(os.environ.get("WAMRT_DROID_FIXTURES", REPO.parent / "shared" / "fixtures" / "droid"))
    if not (root / "manifest.json").is_file():
        pytest.fail(f"DROID fixtures not found at {root} (set WAMRT_DROID_FIXTURES)", pytrace=False)
    return root


def droid_requests() -> list[dict]:
    root = Path(os.environ.get("WAMRT_DROID_FIXTURES", REPO.parent / "shared" / "fixtures" / "droid"))
    manifest = root / "manifest.json"
    if not manifest.is_file():
        return [{"id": "missing-fixtures"}]  # the test body then fails through droid_fixture_dir()
    return json.loads(manifest.read_text())["requests"]
