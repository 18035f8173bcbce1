"""Form / JSON scalar fields -> typed values, or a typed 400 naming the field.

Form fields arrive as strings, JSON ones as numbers; booleans, fractions where an integer is meant, and
non-finite numbers are refused rather than coerced (`int(3.7)` would silently run 3 steps)."""

from __future__ import annotations

import math
from typing import Any

from .errors import InvalidRequest


def as_int(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InvalidRequest(f"must be an integer in [{lo}, {hi}], got {value!r}", field=name)
    try:
        out = int(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRequest(f"must be an integer in [{lo}, {hi}], got {value!r}", field=name) from exc
    if out != value and not isinstance(value, str) or not lo <= out <= hi:
        raise InvalidRequest(f"must be an integer in [{lo}, {hi}], got {value!r}", field=name)
    return out


def as_float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InvalidRequest(f"must be a number, got {type(value).__name__}", field=name)
    try:
        out = float(value)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"must be a number, got {value!r}", field=name) from exc
    if not math.isfinite(out):
        raise InvalidRequest(f"must be finite, got {value!r}", field=name)
    return out
