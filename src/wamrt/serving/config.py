"""Server settings (`wamrt serve` flags map 1:1 onto these fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch: int = 8
    max_wait_ms: float = 5.0
    max_queue: int = 64
    max_frame_bytes: int = 64 * 2**20  # vLLM-Omni's inbound websocket limit; HTTP bodies too
    # Sampler defaults applied to every request (a request's `params` win); None = the policy's own.
    steps: int | None = None
    guidance: float | None = None
    shift: float | None = None
    guidance_interval: tuple[int, int] | None = None
    safety_file: str | None = None
    warmup_requests: int = 1
    max_jobs: int = 256  # /v1/videos records kept (oldest finished ones are evicted first)
    model_name: str = "tiny-droid"
    prompt_bucket: int = 0  # the fast engine's EngineConfig.prompt_bucket (0: exact prompt lengths)
    batch_invariant: bool = False  # every batch padded to max_batch rows (EngineConfig.pad_batch): bit-exact replays
    extra_metadata: dict[str, Any] = field(default_factory=dict)

    def engine_settings(self, device: str) -> dict[str, Any]:
        """EngineConfig fields for the fast engine on `device` (CPU: no compile, no graphs; tests)."""
        base: dict[str, Any] = {} if device.startswith("cuda") else dict(attention="auto", compile=False,
                                                                         cuda_graph=False)
        return {**base, "prompt_bucket": self.prompt_bucket,
                "pad_batch": self.max_batch if self.batch_invariant else 0}

    def sampler_defaults(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("steps", "guidance", "shift", "guidance_interval"):
            value = getattr(self, name)
            if value is not None:
                out[name] = tuple(value) if name == "guidance_interval" else value
        return out
