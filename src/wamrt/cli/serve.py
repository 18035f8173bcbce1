"""`wamrt serve` flags. Standard library only, like every parser of `wamrt` (see `wamrt.cli`): the server itself
(`wamrt.serving.server.run`) is imported when the command runs. Defaults and choices repeat `ServeConfig`'s;
tests/serving/test_cli_parsers.py holds the two together."""

from __future__ import annotations

import argparse

ATTENTION_CHOICES = ("cudnn", "flash", "efficient", "fa4")  # serving.config.ATTENTION_CHOICES
EPILOGUE_CHOICES = ("inductor", "quack")  # serving.config.EPILOGUE_CHOICES
SAMPLER_CHOICES = ("auto", "unipc", "distilled")  # serving.generation_settings.SAMPLER_CHOICES
MAX_VIDEO_PIXELS = 1280 * 720 * 189
MAX_GENERATION_JOBS = 4
GENERATION_STEP_SEGMENTS = 12
PROMPT_BUCKET = 64
PARALLEL_CHOICES = ("none", "cfg", "tp", "ulysses", "cfg,ulysses")  # "none" + parallel.launch.MODES
MAX_PROMPT_TOKENS = 384  # serving.config.ServeConfig.max_prompt_tokens


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="tiny-droid",
                    help="checkpoint folder or built-in name (default: the embedded tiny-droid)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the checkpoint's own)")
    ap.add_argument("--vae", default=None, help="VAE folder (default: the checkpoint's vae/)")
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    ap.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8000, help="TCP port of HTTP and the websocket")
    ap.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' or 'Api-Key' (probes stay open)")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="requests per infer_batch call (default: on a GPU the largest of 8, 4, 2, 1 the memory plan "
                         "fits; else 8)")
    ap.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                    help="device memory to plan into and hold to (default: the device's); below it the allocator is "
                         "capped there, as on a smaller card. The plan is made before the weights load and a part "
                         "that does not fit fails startup, naming what to change; see docs/deployment.md")
    ap.add_argument("--plan-only", action="store_true",
                    help="print the memory plan (or the part that does not fit) and exit, loading nothing")
    ap.add_argument("--max-prompt-tokens", type=int, default=MAX_PROMPT_TOKENS, metavar="TOKENS",
                    help="the longest instruction accepted, in tokens (longer: invalid_request naming prompt); graphs "
                         f"are captured for instructions up to this long (default {MAX_PROMPT_TOKENS})")
    ap.add_argument("--capture-on-request", action="store_true",
                    help="a batch whose CUDA graph is missing waits for its capture (7-35 s at Nano) instead of "
                         "running on other graphs or uncaptured while it is captured in the background")
    ap.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a batch waits for companions")
    ap.add_argument("--max-queue", type=int, default=64, help="waiting requests before 'busy' (HTTP 429)")
    ap.add_argument("--max-frame-mb", type=float, default=64.0, help="largest websocket frame / HTTP body, MiB")
    ap.add_argument("--steps", type=int, default=None, help="sampler steps (default: the policy's, 4)")
    ap.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the policy's)")
    ap.add_argument("--shift", type=float, default=None, help="flow shift of the sampler (default: the policy's)")
    ap.add_argument("--guidance-interval", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                    help="apply CFG only on steps LO..HI (default: every step)")
    ap.add_argument("--max-video-pixels", type=int, default=None, metavar="N",
                    help="world generation: largest width x height x frames (x images) of one job; larger ones get "
                         "400 (default: on a GPU the most the memory plan fits, else "
                         f"{MAX_VIDEO_PIXELS} = 1280x720 x 189 frames)")
    ap.add_argument("--max-generation-jobs", type=int, default=MAX_GENERATION_JOBS, metavar="N",
                    help="world-generation jobs queued or running at once (their own queue; over it: busy, 429)")
    ap.add_argument("--generation-step-segments", type=int, default=GENERATION_STEP_SEGMENTS, metavar="N",
                    help="CUDA servers: split every denoising step of a generation job into N graphs of consecutive "
                         "layers (at most one per layer), so a policy request waits for 1/N of a step, not a whole "
                         f"step (default {GENERATION_STEP_SEGMENTS}); see docs/serving.md")
    ap.add_argument("--generation-warmup", action="append", default=[], metavar="FIELDS",
                    help="a world-generation job run before /readyz turns 200, so that a GPU server compiles and "
                         "captures its shape before robots connect: a JSON object of /v1/videos/sync fields, e.g. "
                         "'{\"size\": \"832x480\", \"num_frames\": \"33\", \"input_reference\": \"@sample\"}' "
                         "(@sample = a built-in picture, @PATH = a file; prompt optional); repeat for more shapes "
                         "(default: none)")
    ap.add_argument("--sampler", choices=SAMPLER_CHOICES, default="auto",
                    help="world generation's sampler: auto = the checkpoint's (the distilled few-step sampler when "
                         "the checkpoint folder declares a distilled schedule, else UniPC with CFG); unipc; distilled "
                         "(refused at startup on a checkpoint without a distilled schedule); see docs/serving.md")
    chat = ap.add_argument_group("Reasoner chat (/v1/chat/completions) and prompt upsampling; see docs/reasoner.md")
    chat.add_argument("--chat-max-batch", type=int, default=4, metavar="N",
                      help="chat requests decoded together (rows of one K/V cache, allocated at the first request; "
                           "0 = no chat)")
    chat.add_argument("--chat-decode", choices=["layers", "one-row"], default="one-row",
                      help="how a step decoding one request runs: one-row = the one-row GEMV stack on the model's own "
                           "matrices (norms and adds inside the GEMVs, programmatic dependent launch; x1.89 the layers "
                           "on an H100 in `wamrt bench decode`); layers = the model's layers in CUDA graphs (also "
                           "what a model the stack cannot run gets, with a log line); see docs/reasoner.md")
    chat.add_argument("--chat-max-queue", type=int, default=64, metavar="N", help="waiting chat requests before busy")
    chat.add_argument("--chat-context", type=int, default=8192, metavar="TOKENS",
                      help="prompt + output tokens of one request (the K/V cache rows are this long)")
    chat.add_argument("--chat-max-prompt-tokens", type=int, default=6144, metavar="TOKENS",
                      help="longest prompt (text and media tokens)")
    chat.add_argument("--chat-max-tokens", type=int, default=2048, metavar="TOKENS",
                      help="cap (and default) of a request's max_tokens")
    chat.add_argument("--chat-max-image-pixels", type=int, default=4096 * 4096, metavar="N",
                      help="decoded pixels of one image, or of one video over all its frames")
    chat.add_argument("--upsample-max-tokens", type=int, default=1024, metavar="TOKENS",
                      help="tokens the Reasoner may write for one upsample_prompt caption")
    ap.add_argument("--safety", default=None, metavar="FILE",
                    help="action safety envelope (JSON or TOML; default: none)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests before /readyz says ready")
    ap.add_argument("--engine", choices=["auto", "eager", "fast"], default="auto",
                    help="fast = the batching engine (fused, compiled, CUDA graphs on a GPU); eager = reference path; "
                         "auto = fast on CUDA, eager on CPU")
    ap.add_argument("--prompt-bucket", type=int, default=PROMPT_BUCKET, metavar="TOKENS",
                    help="fast engine: pad instruction prefixes to a multiple of TOKENS (zero keys, removed exactly) "
                         "so one CUDA graph serves every instruction length in the bucket and any mix of them in a "
                         f"batch (default {PROMPT_BUCKET}); 0 = exact lengths (a capture per new length "
                         "combination); see docs/serving.md")
    ap.add_argument("--prompt-width", type=int, default=0, metavar="TOKENS",
                    help="with --prompt-bucket: pad every batch's instruction prefixes to at least TOKENS (a multiple "
                         "of the bucket), so warm-up captures the graphs every instruction up to TOKENS replays and "
                         "no mix of lanes captures later; a longer one widens its batch (a new capture); "
                         "0 (the default) = each batch's own bucket; see docs/serving.md")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="fast engine: compute every request alone at its own fixed shape (VAE encode and "
                         "denoising loop at batch 1; host work still batched), so its actions do not depend on "
                         "which requests share its batch or where it sits in it, and a rollout replays bit for "
                         "bit (paired gates); GPU work is no longer shared across requests")
    ap.add_argument("--attention", choices=ATTENTION_CHOICES, default="cudnn",
                    help="fast engine on CUDA: the Generator attention kernel; fa4 = flash-attn-4 (optional install; "
                         "the fastest measured on the H200, see docs/performance.md)")
    ap.add_argument("--epilogues", choices=EPILOGUE_CHOICES, default="inductor",
                    help="fast engine on CUDA: quack = the MLP activation inside the up-projection GEMM's epilogue "
                         "(quack-kernels, which flash-attn-4 brings; Nano -14 ms per request on the H200); "
                         "inductor = cuBLAS GEMMs and compiled elementwise kernels")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs of this host behind one engine (with --parallel)")
    ap.add_argument("--parallel", choices=PARALLEL_CHOICES, default="none",
                    help="policy requests: cfg = one CFG branch per GPU (2 GPUs, full model each); tp = every layer "
                         "split across --gpus GPUs (models too large for one GPU). World generation: ulysses = each "
                         "video's sequence split across --gpus GPUs; cfg,ulysses = 2 CFG branches x --gpus/2 sequence "
                         "shares (policy requests on GPU 0); see docs/deployment.md")
    ap.add_argument("--ray", action="store_true",
                    help="serve on Ray Serve: --replicas engine replicas (each owning --gpus GPUs) behind one endpoint")
    ap.add_argument("--replicas", type=int, default=1, help="Ray replicas (with --ray)")
    ap.add_argument("--max-replicas", type=int, default=None,
                    help="with --ray: autoscale between --replicas and this on ongoing requests per replica "
                         "(default: no autoscaling)")
    add_limit_arguments(ap)
    ap.add_argument("--added-latency-ms", type=float, default=0.0, metavar="MS",
                    help="hold every policy reply back this long (a small model at a large one's latency)")
    ap.add_argument("--log-level", default="info", type=str.lower,
                    choices=["debug", "info", "warning", "error", "critical"], help="server and access log level")
    ap.add_argument("--log-format", default="text", choices=["text", "json"],
                    help="json: one JSON object per line (ts, level, logger, message; request lines add surface, "
                         "request_id, model, batch_size, latency_ms, outcome, status)")


# Request and connection bounds (serving/limits.py, connections.py; docs/serving.md "Limits and threat model"):
# flag -> (ServeConfig field, type, default, help). None = derived from the served model.
LIMIT_FLAGS: dict[str, tuple[str, type, float | int | None, str]] = {
    "--max-generation-prompt-tokens": ("max_generation_prompt_tokens", int, 1024,
                                       "a world generation prompt's or negative prompt's tokens (chat template "
                                       "included)"),
    "--max-policy-steps": ("max_policy_steps", int, None, "denoising steps one policy / dynamics request may ask for "
                           "(default: 4 x the checkpoint's, or --steps)"),
    "--max-image-pixels": ("max_image_pixels", int, 3840 * 2160,
                           "one decoded picture: a view, a conditioning image or video frame"),
    "--max-step-ms": ("max_step_ms", float, None, "world generation: the estimated time of one denoising step "
                      "(default: 250 ms, x --generation-step-segments on CUDA)"),
    "--max-job-s": ("max_job_s", float, 900.0, "world generation: the estimated device time of one job"),
    "--body-timeout-s": ("body_timeout_s", float, 60.0, "a request body must arrive within this (else 408)"),
    "--header-timeout-s": ("header_timeout_s", float, 10.0, "a request head must arrive within this (else closed)"),
    "--keep-alive-s": ("keep_alive_s", float, 5.0, "an idle keep-alive connection is closed after this"),
    "--ws-ping-s": ("ws_ping_s", float, 20.0, "websocket ping interval; a pong later than this closes the socket"),
    "--ws-idle-s": ("ws_idle_s", float, 600.0, "a websocket without a message for this long is closed (1001)"),
    "--max-connections": ("max_connections", int, 1024,
                          "open connections, HTTP and websocket (past it: 429 and closed)"),
    "--shutdown-grace-s": ("shutdown_grace_s", float, 10.0,
                           "SIGTERM: accepted work finishes and the process exits within this"),
    "--ready-stall-s": ("ready_stall_s", float, 60.0,
                        "/readyz turns 503 while a batch or a generation segment has held the engine this long"),
}


def add_limit_arguments(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("limits", "per-request and connection bounds; see docs/serving.md")
    for flag, (dest, kind, default, text) in LIMIT_FLAGS.items():
        group.add_argument(flag, dest=dest, type=kind, default=default,
                           help=f"{text} (default {'derived' if default is None else default})")
