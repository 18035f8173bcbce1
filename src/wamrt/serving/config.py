"""Server settings (`wamrt serve` flags map 1:1 onto these fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ServeConfigError
from .generation_settings import resolve_sampler, warmup_fields
from .limits import Limits

ATTENTION_CHOICES = ("cudnn", "flash", "efficient", "fa4")
EPILOGUE_CHOICES = ("inductor", "quack")
CHAT_DECODE = ("layers", "one-row")


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
    # World generation: width * height * frames (* images) of one job, at most (default: vLLM-Omni's Cosmos3
    # default video, 1280x720 x 189 frames); generation jobs queued or running at once (their own queue, so
    # video jobs never take the policy queue's slots).
    max_video_pixels: int = 1280 * 720 * 189
    max_generation_jobs: int = 4
    # CUDA servers: every denoising step of a generation job is captured as this many segments of consecutive
    # layers (at most one per layer), and a policy request waits for the segment in flight, not the whole step
    # (a 480p i2v step is ~190 ms on Nano; each segment adds a host sync, ~0.05 ms).
    generation_step_segments: int = 12
    # World-generation jobs run before /readyz turns 200 (JSON objects of /v1/videos/sync fields): a CUDA server
    # compiles and captures a job shape's graphs in its first job, which no policy request should wait for.
    generation_warmup: tuple[str, ...] = ()
    model_name: str = "tiny-droid"
    # The fast engine's EngineConfig.prompt_bucket (0: exact prompt lengths). On by default since it costs nothing
    # measurable (H200, 2026-12-02: E5-bucket / E5 = 0.98 at Edge, 0.99 at Nano) and spares every new instruction
    # mix a capture on the request path (7-23 s each at Nano).
    prompt_bucket: int = 64
    # EngineConfig.prompt_width: every batch's prefixes padded to at least this many tokens, so the warm-up
    # batches run at this width and capture the graphs every shorter instruction (and any mix) replays.
    prompt_width: int = 0
    # The longest instruction accepted, in tokens of the served tokenizer (>= 1); a longer one gets
    # invalid_request naming `prompt`, counted before any device work. `wamrt serve` captures its graphs at two
    # prefix widths (EngineConfig.prompt_widths): the caption around an instruction of 128 tokens and around one of
    # this many (`startup.prompt_rungs`), so every accepted instruction has a graph.
    max_prompt_tokens: int = 384
    # Filled in by `wamrt serve` from the memory plan and the tokenizer (empty: the engine's defaults): the batch sizes
    # graphs are captured at, the prefix width rungs, the prefix tokens accepted, the prefix caches' byte budget.
    batch_ladder: tuple[int, ...] = ()
    prompt_widths: tuple[int, ...] = ()
    max_prefix_tokens: int = 0
    kv_cache_bytes: int = 0
    # A batch whose graph is missing runs on other graphs or uncaptured while a background thread captures it
    # (EngineConfig.capture_on_request=False); True: it waits for the capture (--capture-on-request).
    capture_on_request: bool = False
    # Device memory the server plans into and holds to (GiB; None: the device's). Below the device's memory the
    # allocator is capped there (torch.cuda.set_per_process_memory_fraction), as on a smaller card.
    gpu_memory_gib: float | None = None
    batch_invariant: bool = False  # every request computed alone (EngineConfig.isolate_requests): bit-exact replays
    # The fast engine's kernels on CUDA (EngineConfig.attention / .epilogues). The fastest exact configuration measured
    # on the H200 is attention "fa4" + epilogues "quack" (both from the optional wamrt[kernels]; README, issue 14); the
    # defaults need nothing beyond PyTorch.
    attention: str = "cudnn"
    epilogues: str = "inductor"
    # World generation's sampler: auto (from the checkpoint folder) | unipc | distilled
    # (`generation_settings.resolve_sampler`).
    sampler: str = "auto"
    # Every policy reply held back this long after it is computed (the batch slot is free meanwhile): a small
    # CPU model answering at a large model's latency, for the real-time client's wall-clock runs (issue 41).
    added_latency_ms: float = 0.0
    # Per-request bounds (limits.py; docs/serving.md "Limits"). None = derived from the served model.
    max_generation_prompt_tokens: int = 1024  # a world generation prompt's tokens (chat template included)
    max_policy_steps: int | None = None  # None: 4 x the checkpoint's default steps (or --steps)
    max_image_pixels: int = 3840 * 2160  # one decoded picture: a view, a conditioning image or video frame
    max_step_ms: float | None = None  # world generation: estimated denoising step; None: 250 ms per segment
    max_job_s: float = 900.0  # world generation: estimated device time of one job
    # Connections (server.py / connections.py): the whole body, the request head, idle keep-alive, websocket
    # ping interval (= its timeout) and idle time, open connections, SIGTERM drain, a stalled engine for /readyz.
    body_timeout_s: float = 60.0
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    ws_ping_s: float = 20.0
    ws_idle_s: float = 600.0
    max_connections: int = 1024
    shutdown_grace_s: float = 10.0
    ready_stall_s: float = 60.0
    extra_metadata: dict[str, Any] = field(default_factory=dict)
    # The Reasoner's chat (`/v1/chat/completions`, prompt upsampling; serving/chat.py): requests decoded at once (rows
    # of one K/V cache, 0 = no chat), waiting requests before busy, the context (prompt + output tokens) of a row,
    # limits of one request, and the tokens an upsampling run may write.
    chat_max_batch: int = 4
    chat_decode: str = "one-row"  # `reasoner.fused.OneRowDecode` for one-row steps; "layers" (`--chat-decode`)
    chat_max_queue: int = 64
    chat_context: int = 8192
    chat_max_prompt_tokens: int = 6144
    chat_max_tokens: int = 2048
    chat_max_image_pixels: int = 4096 * 4096
    upsample_max_tokens: int = 1024

    def limits(self, default_steps: int | None = None) -> Limits:
        """The per-request bounds; `default_steps` (the checkpoint's) sizes the default --max-policy-steps."""
        steps = self.max_policy_steps or 4 * (self.steps or default_steps or 4)
        return Limits(body_bytes=self.max_frame_bytes, body_timeout_s=self.body_timeout_s,
                      image_pixels=self.max_image_pixels, instruction_tokens=self.max_prompt_tokens,
                      prompt_tokens=self.max_generation_prompt_tokens, policy_steps=steps)

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ServeConfigError("an empty key would accept an empty bearer token; omit the flag to serve "
                                   "without a key", flag="--api-key")
        for flag, value in (("--max-prompt-tokens", self.max_prompt_tokens),
                            ("--max-generation-prompt-tokens", self.max_generation_prompt_tokens),
                            ("--max-image-pixels", self.max_image_pixels), ("--max-connections", self.max_connections),
                            ("--max-policy-steps", self.max_policy_steps or 1)):
            if value < 1:
                raise ServeConfigError(f"must be >= 1, got {value}", flag=flag)
        for flag, seconds in (("--max-step-ms", self.max_step_ms or 1.0), ("--max-job-s", self.max_job_s),
                              ("--body-timeout-s", self.body_timeout_s), ("--header-timeout-s", self.header_timeout_s),
                              ("--keep-alive-s", self.keep_alive_s), ("--ws-ping-s", self.ws_ping_s),
                              ("--ws-idle-s", self.ws_idle_s), ("--shutdown-grace-s", self.shutdown_grace_s),
                              ("--ready-stall-s", self.ready_stall_s)):
            if not seconds > 0:
                raise ServeConfigError(f"must be > 0, got {seconds}", flag=flag)
        if self.max_video_pixels < 16 * 16:
            raise ServeConfigError(f"must be >= 256 pixels, got {self.max_video_pixels}", flag="--max-video-pixels")
        if self.max_generation_jobs < 1:
            raise ServeConfigError(f"must be >= 1, got {self.max_generation_jobs}", flag="--max-generation-jobs")
        for flag, value, low in (("--chat-max-batch", self.chat_max_batch, 0),
                                 ("--chat-context", self.chat_context, 16),
                                 ("--chat-max-prompt-tokens", self.chat_max_prompt_tokens, 1),
                                 ("--chat-max-tokens", self.chat_max_tokens, 1),
                                 ("--chat-max-image-pixels", self.chat_max_image_pixels, 16 * 16),
                                 ("--upsample-max-tokens", self.upsample_max_tokens, 16)):
            if value < low:
                raise ServeConfigError(f"must be >= {low}, got {value}", flag=flag)
        if self.chat_decode not in CHAT_DECODE:
            raise ServeConfigError(f"one of {', '.join(CHAT_DECODE)}, got {self.chat_decode!r}", flag="--chat-decode")
        if self.generation_step_segments < 1:
            raise ServeConfigError(f"must be >= 1, got {self.generation_step_segments}",
                                   flag="--generation-step-segments")
        for text in self.generation_warmup:
            try:
                warmup_fields(text)
            except ValueError as exc:
                raise ServeConfigError(str(exc), flag="--generation-warmup") from None
        # Checked here, not only in the engine: a typo should fail at startup naming the flag, before a
        # model is built (minutes at Nano), and on every path that makes a config (CLI, Ray replicas).
        if self.prompt_bucket < 0:
            raise ServeConfigError(f"must be >= 0 tokens, got {self.prompt_bucket}", flag="--prompt-bucket")
        if not 0 <= self.added_latency_ms < 60_000:
            raise ServeConfigError(f"must be in [0, 60000) ms, got {self.added_latency_ms}", flag="--added-latency-ms")
        if self.prompt_width < 0:
            raise ServeConfigError(f"must be >= 0 tokens, got {self.prompt_width}", flag="--prompt-width")
        if self.prompt_width and not self.prompt_bucket:
            raise ServeConfigError("needs --prompt-bucket > 0 (the width is a whole number of buckets)",
                                   flag="--prompt-width")
        if self.prompt_width % max(self.prompt_bucket, 1):
            up = -(-self.prompt_width // self.prompt_bucket) * self.prompt_bucket
            raise ServeConfigError(f"{self.prompt_width} is not a multiple of --prompt-bucket {self.prompt_bucket} "
                                   f"(a prefix is padded to whole buckets; use {up})", flag="--prompt-width")
        if self.gpu_memory_gib is not None and not 0 < self.gpu_memory_gib <= 4096:
            raise ServeConfigError(f"must be in (0, 4096] GiB, got {self.gpu_memory_gib}", flag="--gpu-memory")
        if self.attention not in ATTENTION_CHOICES:
            raise ServeConfigError(f"must be one of {', '.join(ATTENTION_CHOICES)}, got {self.attention!r}",
                                   flag="--attention")
        if self.epilogues not in EPILOGUE_CHOICES:
            raise ServeConfigError(f"must be one of {', '.join(EPILOGUE_CHOICES)}, got {self.epilogues!r}",
                                   flag="--epilogues")
        # Two small JSON reads of the checkpoint folder, so that a distilled sampler forced on a checkpoint without
        # a distilled schedule (or an unreadable one) fails naming --sampler before any model is built.
        resolve_sampler(self.sampler, self.model_name)

    def engine_settings(self, device: str) -> dict[str, Any]:
        """EngineConfig fields for the fast engine on `device` (CPU: no compile, no graphs; tests). Kernels the
        device cannot run fail here, naming the flag, before the engine touches the model."""
        cuda = device.startswith("cuda")
        if cuda:
            import torch

            from ..engine.epilogues import quack_available
            from ..ops.attention import fa4_available

            dev = torch.device(device)
            if self.attention == "fa4" and not fa4_available(dev):
                raise ServeConfigError("fa4 needs flash-attn-4 installed and a Hopper or Blackwell GPU",
                                       flag="--attention")
            if self.epilogues == "quack" and not quack_available(dev):
                raise ServeConfigError("quack needs quack-kernels installed (flash-attn-4 brings it) and a Hopper "
                                       "or Blackwell GPU", flag="--epilogues")
            base: dict[str, Any] = dict(attention=self.attention, epilogues=self.epilogues)
        else:
            for flag, value, default in (("--attention", self.attention, "cudnn"),
                                         ("--epilogues", self.epilogues, "inductor")):
                if value != default:
                    raise ServeConfigError(f"{value} runs on a CUDA GPU only (this engine is on {device})", flag=flag)
            base = dict(attention="auto", compile=False, cuda_graph=False)
        out = {**base, "prompt_bucket": self.prompt_bucket, "prompt_width": self.prompt_width,
               "isolate_requests": self.batch_invariant, "capture_on_request": self.capture_on_request}
        # what `wamrt serve` planned (left to the engine's defaults when nothing was)
        for name, value in (("batch_ladder", self.batch_ladder), ("prompt_widths", self.prompt_widths),
                            ("max_prompt_tokens", self.max_prefix_tokens), ("kv_cache_bytes", self.kv_cache_bytes)):
            if value:
                out[name] = value
        return out

    def sampler_defaults(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("steps", "guidance", "shift", "guidance_interval"):
            value = getattr(self, name)
            if value is not None:
                out[name] = tuple(value) if name == "guidance_interval" else value
        return out
