"""Form / JSON scalar fields -> typed values, or a typed 400 naming the field.

Form fields arrive as strings, JSON ones as numbers; booleans, fractions where an integer is meant, and
non-finite numbers are refused rather than coerced (`int(3.7)` would silently run 3 steps). Strings must be
plain decimal numbers: Python's `int("1_3")` is 13 and `float("1_3")` 13.0, which no client means."""

from __future__ import annotations

import math
import re
from typing import Any

from .errors import InvalidRequest

_INT = re.compile(r"\s*[+-]?\d{1,30}\s*")
_FLOAT = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def as_int(value: Any, name: str, lo: int, hi: int) -> int:
    bad = InvalidRequest(f"must be an integer in [{lo}, {hi}], got {_shown(value)}", field=name)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise bad
    if isinstance(value, str):
        if not _INT.fullmatch(value):
            raise bad
        out = int(value)
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise bad
        out = int(value)
    else:
        out = value
    if not lo <= out <= hi:
        raise bad
    return out


def as_float(value: Any, name: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    """A finite number in [lo, hi] (a decimal string, an int or a float)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InvalidRequest(f"must be a number, got {type(value).__name__}", field=name)
    if isinstance(value, str) and not _FLOAT.fullmatch(value):
        raise InvalidRequest(f"must be a decimal number, got {_shown(value)}", field=name)
    try:
        out = float(value)
    except (ValueError, OverflowError):  # an int too large for a float
        out = math.inf
    if not math.isfinite(out):
        raise InvalidRequest(f"must be finite, got {_shown(value)}", field=name)
    if not lo <= out <= hi:
        raise InvalidRequest(f"must be in [{lo:g}, {hi:g}], got {_shown(value)}", field=name)
    return out
