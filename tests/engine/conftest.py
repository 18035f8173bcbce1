"""Fixtures of the engine's CPU tests."""

from __future__ import annotations

import pytest

from wamrt import load_policy


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """tiny-droid on the CPU (fp32), built in a cache of the test module's own."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WAMRT_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield load_policy("tiny-droid", device="cpu")
    mp.undo()
