"""Fixtures of the quantization tests (helpers live in oracle/quant_models.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["tiny-qwen", "tiny-edge"])
def flavour(request) -> str:
    return request.param
