"""Loopback servers for the serving tests.

Two engines: `FakePolicy` (the real request validation of the DROID pipeline, a fixed sleep instead of
the model) keeps the protocol, batching and overload tests fast and deterministic; the session-scoped
`tiny_server` runs the real embedded tiny model (steps=1) for the end-to-end round trips.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from oracle.fake_policy import FakePolicy

from wamrt.sample import sample_observation
from wamrt.serving import ServeConfig, ServerThread


@pytest.fixture
def obs() -> dict[str, Any]:
    return sample_observation(0)


@pytest.fixture
def fake_server() -> Iterator[ServerThread]:
    with ServerThread(FakePolicy(), ServeConfig(max_batch=4, max_wait_ms=2.0)) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import os

    import wamrt

    os.environ.setdefault("WAMRT_CACHE", str(tmp_path_factory.mktemp("wamrt_cache")))
    return wamrt.load_policy("tiny-droid", device="cpu")


@pytest.fixture(scope="session")
def tiny_server(tiny_policy: Any) -> Iterator[ServerThread]:
    with ServerThread(tiny_policy, ServeConfig(steps=1, max_batch=4, max_wait_ms=20.0)) as server:
        yield server
