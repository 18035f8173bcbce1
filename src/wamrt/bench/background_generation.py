"""`wamrt bench load --background-generation FIELDS`: world-generation jobs running while the lanes measure.

One thread submits the same vLLM-Omni multipart request to the server's `/v1/videos/sync` back to back for as
long as the lanes run, so the row's policy latencies are those of a device shared with a long video job
(`DeviceGate`, docs/serving.md): compare it with the same row without background generation (`--baseline`).
Each job's wall time and the reply's `X-Timing` header (the server's queue / model / paused ms and the job's
longest device segment) are recorded.

Stdlib HTTP on purpose: the wheels carried to the GPU machine hold no HTTP client library (httpx is a dev
extra), and a raw connection lets the thread hang up on a job still running when the lanes stop (the server
then cancels it at its next step, so it does not run on into the next row).
"""

from __future__ import annotations

import argparse
import http.client
import json
import mimetypes
import select
import ssl
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..serving.generation_settings import SAMPLE_REFERENCE as SAMPLE
from ..serving.generation_settings import reference_upload

SYNC_PATH = "/v1/videos/sync"
EXAMPLE = '{"prompt": "a robot arm", "size": "832x480", "num_frames": "33", "input_reference": "@sample"}'


def parse_fields(text: str) -> dict[str, Any]:
    """argparse `type` of --background-generation: a JSON object of multipart fields. A value "@sample" is
    the built-in picture, "@PATH" a file (curl's -F convention); objects and lists (extra_params) are sent as
    JSON text, booleans as true / false, numbers as written."""
    try:
        fields = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}); expected an object such as {EXAMPLE}") from None
    if not isinstance(fields, dict) or not fields:
        raise argparse.ArgumentTypeError(f"must be a non-empty JSON object of form fields, such as {EXAMPLE}")
    for key, value in fields.items():
        if not key or any(c in key for c in '"\r\n'):
            raise argparse.ArgumentTypeError(f"bad field name {key!r}")
        if value is None:
            raise argparse.ArgumentTypeError(f"field {key!r} is null; leave it out instead")
        if isinstance(value, str) and value.startswith("@") and value != SAMPLE and not Path(value[1:]).is_file():
            raise argparse.ArgumentTypeError(f"field {key!r}: {value[1:]!r} is not a file ({SAMPLE} = the built-in "
                                             "picture)")
    return fields


def encode_form(fields: dict[str, Any]) -> tuple[bytes, str]:
    """(multipart/form-data body, its Content-Type) of the fields, as a vLLM-Omni client would send them."""
    boundary = uuid.uuid4().hex
    parts = []
    for key, value in fields.items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"'
        if isinstance(value, str) and value.startswith("@"):
            name, blob = reference_upload(value)
            ctype = mimetypes.guess_type(name)[0] or "application/octet-stream"
            parts.append(f'{head}; filename="{name}"\r\nContent-Type: {ctype}\r\n\r\n'.encode() + blob + b"\r\n")
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, dict | list):
            text = json.dumps(value)
        else:
            text = str(value)
        parts.append(f"{head}\r\n\r\n{text}\r\n".encode())
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def _error_text(status: int, body: bytes) -> str:
    """`HTTP 400 invalid_request (size): ...` from the server's typed error body, else its first bytes."""
    try:
        err = json.loads(body)
        field = f" ({err['field']})" if err.get("field") else ""
        return f"HTTP {status} {err.get('code')}{field}: {err.get('message')}"
    except (ValueError, TypeError, AttributeError, KeyError):
        return f"HTTP {status}: {body[:200]!r}"


class BackgroundGeneration:
    """Back-to-back /v1/videos/sync jobs on a thread: `warm_up(n)` first (alone), then `start()` ... `stop()`."""

    def __init__(self, url: str, fields: dict[str, Any], api_key: str | None = None) -> None:
        parsed = urlparse(url)  # the lanes' ws:// (wss://) URL, already checked to be loopback
        self.secure = parsed.scheme in ("wss", "https")
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or (443 if self.secure else 80)
        self.fields = fields
        self.body, content_type = encode_form(fields)  # the same request every time: encode once
        self.headers = {"Content-Type": content_type, "Accept": "video/mp4"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.jobs: list[dict[str, Any]] = []  # completed while the lanes ran
        self.warmup_s: list[float] = []
        self.failed = 0
        self.first_error: str | None = None
        self.cancelled = 0  # in flight when the lanes stopped: hung up on, so the server cancels it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- one job -----------------------------------------------------------------------------------------
    def _post(self, deadline: float) -> tuple[int, dict[str, str], bytes] | None:
        """POST the job and wait for its reply; None when stopped (or past `deadline`) first: the connection is
        closed, which the server takes as a hang-up and cancels the job."""
        conn: http.client.HTTPConnection
        if self.secure:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=30, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("POST", SYNC_PATH, body=self.body, headers=self.headers)
            # The reply only starts when the job is done (seconds to minutes): wait for it here, not blocked in
            # getresponse(), so that a stop can hang up.
            while not select.select([conn.sock], [], [], 0.1)[0]:
                if self._stop.is_set() or time.monotonic() > deadline:
                    return None
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def _record_failure(self, text: str) -> None:
        self.failed += 1
        if self.first_error is None:
            self.first_error = text

    def warm_up(self, n: int, timeout: float = 600.0) -> None:
        """Run `n` jobs alone before the lanes start (unmeasured): a GPU server's first job of a shape compiles and
        captures its graphs inside one device segment, tens of seconds no measured policy request should wait.
        A failed warm-up job (a bad field, a server that cannot generate) ends the run: raises ValueError."""
        for _ in range(n):
            t0 = time.monotonic()
            try:
                reply = self._post(t0 + timeout)
            except OSError as exc:
                raise ValueError(f"--background-generation: warm-up job failed: {type(exc).__name__}: {exc}") from exc
            if reply is None:
                raise ValueError(f"--background-generation: warm-up job did not finish within {timeout:.0f} s")
            if reply[0] != 200:
                raise ValueError(f"--background-generation: warm-up job failed: {_error_text(reply[0], reply[2])}")
            self.warmup_s.append(time.monotonic() - t0)

    # --- the thread -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="bench-background-generation", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop submitting; a job still running is hung up on (the server cancels it at its next step)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                reply = self._post(float("inf"))
            except OSError as exc:  # refused / reset: counted, and retried after a pause instead of spinning
                self._record_failure(f"{type(exc).__name__}: {exc}")
                self._stop.wait(1.0)
                continue
            if reply is None:
                self.cancelled += 1
                return
            status, headers, body = reply
            wall = time.monotonic() - t0
            if status != 200:
                self._record_failure(_error_text(status, body))
                self._stop.wait(0.5)  # busy or refused: do not hammer the server the lanes are measuring
                continue
            try:
                timing = json.loads(headers.get("x-timing", "null"))
                stages = json.loads(headers.get("x-stage-durations", "null"))
            except ValueError:
                timing = stages = None
            self.jobs.append({"wall_s": wall, "bytes": len(body), "timing": timing, "stages_s": stages,
                              "inference_time_s": float(headers.get("x-inference-time-s", "nan"))})

    # --- result ---------------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The row's `background_generation` object."""

        def timing_values(key: str) -> list[float]:
            return [j["timing"][key] for j in self.jobs if isinstance(j["timing"], dict) and key in j["timing"]]

        def median(values: list[float]) -> float | None:
            return statistics.median(values) if values else None

        segments = timing_values("segment_max_ms")
        longest = max((j for j in self.jobs if isinstance(j["timing"], dict) and "segment_max_ms" in j["timing"]),
                      key=lambda j: j["timing"]["segment_max_ms"], default=None)
        return {"endpoint": SYNC_PATH, "fields": self.fields, "warmup_jobs": len(self.warmup_s),
                "warmup_s": self.warmup_s, "jobs_completed": len(self.jobs), "jobs_failed": self.failed,
                "first_error": self.first_error, "jobs_cancelled_at_end": self.cancelled,
                "job_p50_s": median([j["wall_s"] for j in self.jobs]),
                "paused_ms_p50": median(timing_values("paused_ms")), "model_ms_p50": median(timing_values("model_ms")),
                # the longest device segment of any completed job: how long a policy request could have waited
                "segment_max_ms": max(segments) if segments else None,
                # where it began and ended in its job ("start -> prepared", "step 3 -> step 4 segment", ...)
                "segment_max_span": None if longest is None else longest["timing"].get("segment_max_span"),
                "jobs": self.jobs}
