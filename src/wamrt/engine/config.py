"""`EngineConfig`: the engine's switches, one per technique (the latency waterfall turns them on one by one), and
the checks of their values that need no device (`check_config`; `Engine` checks what depends on the GPU and the
model)."""

from __future__ import annotations

from dataclasses import dataclass

from .epilogues import EPILOGUES
from .fp8_fusion import FP8_QUANTIZE, TRITON_SITES
from .qkv_epilogue import HEAD_EPILOGUES

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
VAE_ENCODES = ("first-frame", "diffusers")
BUCKET_ATTENTION = ("lse", "mask")
CFG_ATTENTION = ("auto", "split", "mask", "lengths")


@dataclass(frozen=True)
class EngineConfig:
    # "gqa" = the reference's SDPA(enable_gqa) call; else an SDPA backend, or "fa4" (flash-attn-4, where installed)
    attention: str = "cudnn"
    reuse_reasoner: bool = True  # False: the Reasoner runs inside every forward (reference pattern)
    vae_frames: int = 1  # pixel frames encoded; chunk + 1 = what diffusers encodes
    # How a single frame is encoded: "first-frame" = 2D convolutions with the one kernel tap that meets data, fused
    # norms (engine/vae_encode.py; same function as diffusers' up to rounding), "diffusers" = its video encode.
    vae_encode: str = "first-frame"
    batch_cfg: bool = True  # both CFG branches (and all requests) in one Generator pass
    # How batched sequences with different prefix lengths attend: "split" = one unmasked call per
    # sequence on its valid keys; "mask" = one masked call for the batch; "lengths" = keys laid out
    # [Generator | prefix | zeros] and, on fa4, one call for the batch with each sequence's key count as data
    # (flash-attn-4's seqused_k; other backends: per-sequence calls on that layout). "auto": "lengths" on fa4
    # (H200, 4 steps: Edge 159.2 vs 163.9 ms, Nano 638.9 vs 647.7 ms with quack epilogues), else "split".
    cfg_attention: str = "auto"
    # > 0: every Reasoner prefix in a batch is left-padded up to a multiple of this many tokens and the
    # padding keys are masked by a mask tensor, so one captured graph serves every prompt length in the
    # bucket (a new instruction length otherwise costs a capture: 7-23 s at Nano). The price is a masked
    # attention kernel over a few padded keys. 0: exact lengths, unmasked per-sequence attention.
    prompt_bucket: int = 0
    compile: bool = True  # fuse + regional torch.compile of the Generator layer halves
    # torch.compile mode of those halves. "max-autotune-no-cudagraphs" lets Inductor time Triton GEMM
    # templates against cuBLAS and fuse SiLU*up / ReLU^2 / residual adds into a winning template's
    # epilogue (the "other kernels" share of the profile); minutes of autotuning at capture. Our own
    # graph capture replaces Inductor's cudagraphs, hence the -no-cudagraphs modes only.
    compile_mode: str = "default"
    # The Generator layer's tail after attention: "inductor" = cuBLAS GEMMs with Inductor's kernels between them;
    # "quack" = each GEMM in the form that measured faster per call site, on the H200 the MLP activation in the
    # up-projection's epilogue (engine/epilogues.py; needs quack-kernels, which comes with flash-attn-4, and a
    # Hopper / Blackwell GPU).
    epilogues: str = "inductor"
    # gen-fp8 models: "fused" = each fp8 GEMM's per-token input quantization inside the op before it (the norms, the
    # MLP activation; Triton kernels, engine/fp8_fusion.py); "inductor" = Inductor's kernels. No effect on bf16 models.
    fp8_quantize: str = "fused"
    # gen-fp8 models with fp8_quantize "fused": the GEMM call sites (of `fp8_fusion.GEMM_SITES`: qkv, out, up, down)
    # that run on our Triton TMA kernel (`ops.fp8_gemm`) instead of cuBLAS's rowwise-scaled GEMM; "qkv_heads": the
    # q/k/v GEMM with the head epilogue in it (`qkv_epilogue.fp8_qkv_heads_into`; needs head_epilogue "triton").
    fp8_triton_gemms: tuple[str, ...] = ()
    # gen-fp8, fused: the cuBLAS GEMMs with fast accumulation (`use_fast_accum`: the fp8 tensor cores' partial sums
    # not promoted to fp32 every 128 elements of K; what the Triton kernel does too). A GEMM's error against fp32
    # grows from 1.7e-3 to at most 2.8e-3 relative L2, against e4m3's ~2.6e-2; a whole fused layer stays within 5 %
    # of the precise modules' distance to bf16 (GPU test), and chunk distances to bf16 did not move (0.2193 vs
    # 0.2127, E7, four requests). H200, two runs in either order: Edge E7 54.3 / 55.3 vs 58.5 / 59.4 ms, E6 105.6 vs
    # 114.1 ms, Nano E7 199.2 vs 212.6 ms (bench/results/latency/2026-12-03-1ba1cea-fast-accum/). False: the
    # precise accumulation (rows "-precise-accum").
    fp8_fast_accum: bool = True
    # In the [Generator | prefix | zeros] layout (cfg_attention "lengths"): the step K/V buffers keep the model's K/V
    # heads and the attention kernel shares each across its query heads (flash-attn-4 does GQA itself), instead of
    # buffers with the heads repeated: K/V stores and buffers 2x (Edge) / 4x (Nano) smaller. SDPA backends would
    # repeat them per call (correct, slower). None (default): on where attention is fa4. H200, one run, quack
    # epilogues, 4 steps: Edge 154.3 vs 158.1 ms, Nano 625.5 vs 635.5 ms.
    gqa_buffers: bool | None = None
    # The Generator's per-head q/k norms, RoPE and K/V buffer stores: "triton" = one kernel per layer
    # (engine/qkv_epilogue.py), "inductor" = Inductor's kernels (four per layer at Edge), "auto" (default) = "triton"
    # where it runs (CUDA, Triton installed, bf16 / fp16), else "inductor". H200, one run, quack epilogues and
    # gqa_buffers, 4 steps: Edge 151.8 vs 154.3 ms, Nano 619.6 vs 625.5 ms; gen-fp8 Edge 116.0 vs 119.6 ms.
    head_epilogue: str = "auto"
    # cuBLASLt with no workspace: an engine built on CUDA sets CUBLASLT_WORKSPACE_SIZE=0 (KiB) for its process,
    # unless the environment already names a size (then that one holds: the way to time the other side). With
    # torch's default workspace, cuBLASLt runs every GEMM with more output tiles than one wave (at Edge E7 all four
    # Generator GEMMs of a layer) as a kernel it first clears 4 bytes of workspace for: a memset node before each,
    # 224 per E7 request. Without a workspace it picks the same 128x128 tile and 2x1 cluster with a static schedule
    # (nvjet "ssched"), no memset. H200, Edge E7, one lease, separate processes: memsets 238 -> 12, denoise-graph
    # nodes 890-899 -> 664, traced graph 44.9-47.1 -> 44.3-45.0 ms; back to back 54.65 / 54.20 / 54.33 -> 53.45 /
    # 53.97 / 53.87 ms, at 15 Hz 52.17 / 51.84 -> 51.06 ms (bench/results/latency/2026-12-03-f584574-pace-ws0/).
    # Process-wide and one way: the value is re-read at every cuBLASLt call but the workspace is allocated once,
    # so it is only ever lowered (to 0), never raised. False: the environment is left alone.
    workspace_free_gemms: bool = True
    # A policy request's last layer, after its K/V stores, runs its attention, output projection and MLP (and the
    # final norm and output projections) on the rows whose output is read: at every step not the observation's
    # latent frame (clean: its velocity is zero), at the last step the action rows alone (a reply is the action
    # chunk, and the solver's last update of a row reads only that row's velocity). Earlier layers cannot be cut:
    # the next layer's keys and values come from every row. Exact: the same function of the read rows, up to the
    # GEMMs' rounding at another row count. Analytically, of a tier-480 request (3,092 rows a branch, 340 of them
    # frame 0): 0.89 of a layer at the last step and 0.10 at each other one, ~0.8 % of Nano's 4 steps (36 layers),
    # ~1.0 % of Edge's (28), ~1.8 % at 2 steps; measured Nano 603.0 vs 607.7 ms (H200, 7a525e4). A world request
    # (WorldEngine) skips its leading clean latent frames there the same way (i2v: the image's frame, 1 of 9 at
    # 480x832x33, ~0.3 % of the denoise; video -> video: the conditioning frames); text -> image / video runs
    # every row. False: every row to the end (the comparison rows "-all-rows", `wamrt bench world --all-rows`).
    last_layer_read_rows: bool = True
    cuda_graph: bool = True  # the whole loop as one CUDA graph per shape bucket
    # One K/V step buffer for every layer, each layer's Reasoner prefixes copied into it before its pass (kept once
    # at the K/V heads; `kv_buffers.py`), instead of one buffer per layer: the buffers of a Nano batch of 8 at a
    # 512-token width take 2 GiB instead of 31 GiB, for one copy kernel per layer and step (the same values attended,
    # so the same results). False: per-layer buffers (the comparison rows "-kv-per-layer").
    shared_kv_buffer: bool = True
    # The VAE encode on a side stream and no host sync until the denoise is done (stage times from CUDA events,
    # engine/stage_clock.py): the requests' host work after the encode (tokens, noise, positions, the graph's
    # inputs) runs while the GPU encodes. False: the host waits after the encode and around the Reasoner prefill
    # (each stage's wall time exact; the comparison rows "-sync").
    overlap_encode: bool = True
    # The canvas's bucket pad, its conversion to [-1, 1] and the patchify inside the VAE encode's CUDA graph, the
    # unpadded uint8 content uploaded from pinned memory (`encode_canvases`); False: the host pads and the upload is
    # pageable, as before (the comparison rows "-host-canvas").
    canvas_on_device: bool = True
    kv_cache_size: int = 256  # Reasoner K/V entries kept (LRU) ...
    # ... and their bytes (with their padded copies, kept as many again; 0: no byte bound): a memory plan's budget
    kv_cache_bytes: int = 0
    graph_cache_size: int = 16  # captured buckets kept (LRU) ...
    graph_cache_bytes: int = 0  # ... and their static inputs' bytes (0: no byte bound; the pool and arena are shared)
    # With prompt_bucket: the widest prefix the deployment declares. Every batch's prefixes are padded to at
    # least this many tokens, so warm-up captures the graphs every shorter instruction (and every mix) replays;
    # a longer prompt widens its batch to its own bucket (a new graph). 0: the batch's own bucket.
    prompt_width: int = 0
    # With prompt_bucket: more prefix widths graphs are captured at (rungs, with prompt_width): a batch pads to the
    # narrowest rung that holds its longest prefix (its own bucket past the widest). A server declares the widest
    # instruction it accepts as the last rung, so that every request has a graph.
    prompt_widths: tuple[int, ...] = ()
    # With prompt_bucket: the batch sizes graphs are captured at; a batch replays the smallest captured one with as
    # many rows (spare rows hold copies of its last request). () : every batch size its own graph.
    batch_ladder: tuple[int, ...] = ()
    # A batch whose bucket has no graph (nor a compatible larger one): True = capture it now, on the request path
    # (7-35 s at Nano); False = run it on replays of smaller captured buckets, or uncaptured and uncompiled, while
    # a background thread captures the bucket (`graph_ladder.py`). Isolated requests and CFG-parallel ranks capture
    # on the request path either way.
    capture_on_request: bool = True
    # A request whose caption (the instruction with the template around it) has more tokens is refused with a
    # RequestError naming `prompt`, before its Reasoner prefill (0: no limit). A server sets it to its widest rung.
    max_prompt_tokens: int = 0
    # How padded prefix keys are kept out of the Generator attention (prompt buckets): "lse" = one unmasked
    # call over zero keys, then each output row rescaled by its log-sum-exp (a zero key adds exactly exp(0) = 1
    # to the softmax denominator and nothing to the numerator); "mask" = a masked kernel (H200, 4 steps: Edge
    # 227.8 vs 180.1 ms per request, Nano 788.7 vs 679.9 ms).
    bucket_attention: str = "lse"
    # Every request runs alone at its own shape: the VAE encode and the denoising loop at batch 1, its own
    # exact graph (never a larger compatible one). A GPU kernel's result for one row can depend on the batch's
    # shape and on the row's position in it (cuBLAS / cuDNN choose tiles and splits by shape); alone, a
    # request's actions are a function of the request only, bit for bit, whatever the batcher grouped it with:
    # what a paired gate needs (2026-12-01, H200: 16 lanes turned 19 of 200 self-vs-self episodes unpadded and
    # 26 of 200 with every batch padded to 16 rows). Host work (validation, canvases) stays batched.
    isolate_requests: bool = False


def check_config(config: EngineConfig) -> None:
    """A ValueError naming the field for a value no engine accepts."""
    for field, allowed in (("compile_mode", COMPILE_MODES), ("epilogues", EPILOGUES), ("fp8_quantize", FP8_QUANTIZE),
                           ("head_epilogue", ("auto", *HEAD_EPILOGUES)), ("vae_encode", VAE_ENCODES),
                           ("cfg_attention", CFG_ATTENTION), ("bucket_attention", BUCKET_ATTENTION)):
        if getattr(config, field) not in allowed:
            raise ValueError(f"{field} must be one of {allowed}, got {getattr(config, field)!r}")
    for site in config.fp8_triton_gemms:
        if site not in TRITON_SITES:
            raise ValueError(f"fp8_triton_gemms entries must be among {TRITON_SITES}, got {site!r}")
    if config.prompt_width < 0 or (config.prompt_width and not config.prompt_bucket):
        raise ValueError(f"prompt_width needs prompt_bucket > 0 and must be >= 0, got {config.prompt_width}")
    if config.prompt_bucket < 0:
        raise ValueError(f"prompt_bucket must be >= 0 tokens, got {config.prompt_bucket}")
    if config.prompt_bucket and not (config.reuse_reasoner and config.batch_cfg):
        raise ValueError("prompt_bucket needs reuse_reasoner=True and batch_cfg=True (the K/V-buffer loop)")
    for name in ("prompt_widths", "batch_ladder"):
        values = getattr(config, name)
        if values and not config.prompt_bucket:
            raise ValueError(f"{name} needs prompt_bucket > 0 (rungs are padded to), got {values}")
        if any(not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name} entries must be integers >= 1, got {values}")
    if any(w % max(config.prompt_bucket, 1) for w in config.prompt_widths):
        raise ValueError(f"prompt_widths must be multiples of prompt_bucket {config.prompt_bucket}, "
                         f"got {config.prompt_widths}")
    if config.max_prompt_tokens < 0:
        raise ValueError(f"max_prompt_tokens must be >= 0, got {config.max_prompt_tokens}")
    if config.kv_cache_bytes < 0:
        raise ValueError(f"kv_cache_bytes must be >= 0, got {config.kv_cache_bytes}")
