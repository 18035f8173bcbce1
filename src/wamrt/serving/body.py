"""HTTP request bodies, bounded while they stream, and form bodies parsed in memory.

`read_body` counts bytes as they arrive, chunked or not (a declared `Content-Length` over the limit is refused
before reading; a chunked body is cut the moment it passes it), under one deadline for the whole body, so a
client trickling a POST cannot hold a connection and a handler forever. A client that hangs up mid-body is
`Cancelled` (499, not a server error).

`parse_fields` turns a JSON, url-encoded or multipart body into a dict of fields (uploaded files as bytes).
It runs in the parse pool, on bytes `read_body` already bounded, so nothing is spooled to disk: starlette's
parser writes file parts to temporary files as they stream, before any limit applies to the whole body.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qsl

from starlette.requests import ClientDisconnect, Request

from .errors import Cancelled, InvalidRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType
from .limits import Limits, loads_json

MAX_FILES = 4  # file parts of one form (an image / video reference, an audio reference)
MAX_FIELDS = 64  # text fields of one form


async def read_body(request: Request, limits: Limits) -> bytes:
    """The whole body, or PayloadTooLarge past `limits.body_bytes`, RequestTimeout past
    `limits.body_timeout_s`, Cancelled when the client leaves."""
    limit = limits.body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the {limit}-byte limit (--max-frame-mb)")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"body exceeds the {limit}-byte limit (--max-frame-mb)")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(f"the body did not arrive within {limits.body_timeout_s:g} s (--body-timeout-s)") \
            from None
    except ClientDisconnect:
        raise Cancelled("client disconnected while sending the body") from None
    return b"".join(chunks)


def parse_fields(body: bytes, content_type: str | None, limits: Limits, *, repeated: tuple[str, ...] = (),
                 max_files: int = MAX_FILES) -> dict[str, Any]:
    """A form or JSON object body -> {field: str | bytes | JSON value}; a field named in `repeated` is a list of
    its values in order (the others: the last one). Call it off the event loop."""
    from python_multipart.multipart import parse_options_header

    ctype, params = parse_options_header(content_type or "")
    if ctype == b"application/json":
        fields = loads_json(body, limits=limits)
        if not isinstance(fields, dict):
            raise InvalidRequest("request must be a JSON object")
        return fields
    if ctype == b"application/x-www-form-urlencoded":
        try:
            pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, max_num_fields=MAX_FIELDS,
                              strict_parsing=False)
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidRequest(f"malformed form body ({type(exc).__name__}; at most {MAX_FIELDS} fields)") \
                from None
        out: dict[str, Any] = {}
        for key, value in pairs:
            _put(out, key, value, repeated)
        return out
    if ctype != b"multipart/form-data":
        raise UnsupportedMediaType("send multipart/form-data, application/x-www-form-urlencoded or application/json")
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidRequest("multipart/form-data needs a boundary parameter", field="content-type")
    return _Multipart(boundary, params.get(b"charset", b"utf-8").decode("latin-1"), repeated, max_files).parse(body)


def _put(fields: dict[str, Any], key: str, value: Any, repeated: tuple[str, ...]) -> None:
    if key in repeated:
        fields.setdefault(key, []).append(value)
    else:
        fields[key] = value


class _Multipart:
    """python-multipart's streaming parser fed one in-memory body: parts collected as bytes, with the
    file / field counts bounded as parts begin."""

    def __init__(self, boundary: bytes, charset: str, repeated: tuple[str, ...], max_files: int) -> None:
        import codecs

        try:
            charset = codecs.lookup(charset).name
        except LookupError:
            charset = "utf-8"
        self.boundary, self.charset, self.repeated, self.max_files = boundary, charset, repeated, max_files
        self.fields: dict[str, Any] = {}
        self.files = self.texts = 0
        self._header_name = self._header_value = b""
        self._disposition = b""
        self._data = bytearray()

    def parse(self, body: bytes) -> dict[str, Any]:
        from python_multipart.exceptions import FormParserError
        from python_multipart.multipart import MultipartParser

        callbacks = {"on_part_begin": self._begin, "on_part_data": self._part_data, "on_part_end": self._end,
                     "on_header_field": self._header_field, "on_header_value": self._header_value_data,
                     "on_header_end": self._header_end}
        try:
            parser = MultipartParser(self.boundary, callbacks)  # type: ignore[arg-type]
            parser.write(body)
            parser.finalize()
        except FormParserError as exc:
            raise InvalidRequest(f"malformed multipart body ({type(exc).__name__})") from None
        return self.fields

    def _begin(self) -> None:
        self._disposition, self._data = b"", bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_data(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = self._header_value = b""

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        self._data += data[start:end]

    def _end(self) -> None:
        from python_multipart.multipart import parse_options_header

        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise InvalidRequest("a multipart part has no name (Content-Disposition: form-data; name=...)")
        name = options[b"name"].decode(self.charset, "replace")
        if b"filename" in options:
            self.files += 1
            if self.files > self.max_files:
                raise InvalidRequest(f"more than {self.max_files} files in one form", field=name)
            _put(self.fields, name, bytes(self._data), self.repeated)
        else:
            self.texts += 1
            if self.texts > MAX_FIELDS:
                raise InvalidRequest(f"more than {MAX_FIELDS} fields in one form", field=name)
            _put(self.fields, name, self._data.decode(self.charset, "replace"), self.repeated)
        self._data = bytearray()
