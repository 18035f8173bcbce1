"""Typed errors for malformed requests (bad images, state, prompts, tokenizer assets)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the runtime refuses to run; `field` names the offending input when there is one."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message if field is None else f"{field}: {message}")
        self.field, self.message = field, message
