"""What the bench commands offer, as plain data (stdlib only): `wamrt --help` lists the rows and modes without
importing torch, and the benchmarks read the same tables."""

from __future__ import annotations

from typing import Any

# `wamrt bench latency`: row name -> (label, EngineConfig fields). Rows E0..E5 are cumulative; the rest are
# alternatives to E5 (each compares one change in one run).
ROWS: dict[str, tuple[str, dict]] = {
    "E0": ("eager reference: diffusers call pattern (Reasoner in every forward, SDPA enable_gqa, 33-frame VAE)",
           dict(attention="gqa", reuse_reasoner=False, vae_frames=33, batch_cfg=False, compile=False,
                cuda_graph=False, vae_encode="diffusers")),
    "E1": ("+ attention backend (K/V heads expanded, fastest SDPA kernel)",
           dict(reuse_reasoner=False, vae_frames=33, batch_cfg=False, compile=False, cuda_graph=False,
                vae_encode="diffusers")),
    "E2": ("+ Reasoner K/V once per prompt (LRU) + frame-0 VAE",
           dict(batch_cfg=False, compile=False, cuda_graph=False, vae_encode="diffusers")),
    "E3": ("+ both CFG branches in one Generator pass",
           dict(compile=False, cuda_graph=False, vae_encode="diffusers")),
    "E4": ("+ fused QKV / gate-up + regional torch.compile + frame-0 VAE as 2D convolutions", dict(cuda_graph=False)),
    "E5": ("+ whole denoise loop as one CUDA graph", dict()),
    # Alternative to E5 (not cumulative): the CFG branches' attention as one masked call.
    "E5-mask": ("E5 with one masked attention call for both CFG branches", dict(cfg_attention="mask")),
    # What a server pays for one graph per prompt-length bucket instead of one per exact length combination.
    "E5-bucket": ("E5 with prompts padded to 64-token buckets (zero keys, log-sum-exp rescale)",
                  dict(prompt_bucket=64)),
    "E5-bucket-mask": ("E5 with prompts padded to 64-token buckets (masked kernel)",
                       dict(prompt_bucket=64, bucket_attention="mask")),
    # Triton GEMM templates autotuned against cuBLAS, elementwise epilogues fused into the winners.
    "E5-autotune": ("E5 compiled with mode max-autotune-no-cudagraphs",
                    dict(compile_mode="max-autotune-no-cudagraphs")),
    # E5 on cuDNN attention whichever kernel measured fastest (the comparison row for a new attention kernel).
    "E5-cudnn": ("E5 with cuDNN attention", dict(attention="cudnn")),
    # The layer tail's GEMMs with their elementwise work in quack epilogues where that measured faster (on the H200:
    # the MLP activation; engine/epilogues.py SM90_SITES). Needs quack-kernels.
    "E5-quack": ("E5 with fused-epilogue GEMMs (quack)", dict(epilogues="quack")),
    # ... and the server's prompt buckets: both CFG branches in one attention call per layer (no per-branch calls,
    # no output gather); what `wamrt serve --epilogues quack` runs (its --prompt-bucket defaults to 64).
    "E5-quack-bucket": ("E5-quack with prompts padded to 64-token buckets (one attention call per layer)",
                        dict(epilogues="quack", prompt_bucket=64)),
    # ... and both CFG branches in one flash-attn-4 call per layer: keys laid out [Generator | prefix | zeros], each
    # branch's key count read by the kernel (no per-branch calls, no output gather). Needs flash-attn-4. The rows
    # below force fa4 and pin the two later defaults off or on, so each compares one change in one run; where the
    # probe picks fa4, E5-quack equals E5-quack-heads-gqa.
    "E5-quack-lengths": ("E5-quack with both CFG branches in one flash-attn-4 call (per-branch key lengths)",
                         dict(epilogues="quack", attention="fa4", cfg_attention="lengths", gqa_buffers=False,
                              head_epilogue="inductor")),
    # ... and step K/V buffers at the model's K/V heads, flash-attn-4 sharing them across query heads (gqa_buffers).
    "E5-quack-gqa": ("E5-quack-lengths with K/V buffers at the K/V heads (GQA in the attention kernel)",
                     dict(epilogues="quack", attention="fa4", cfg_attention="lengths", gqa_buffers=True,
                          head_epilogue="inductor")),
    # ... or the Generator's per-head norms, RoPE and K/V stores in one Triton kernel (engine/qkv_epilogue.py) ...
    "E5-quack-heads": ("E5-quack-lengths with the q/k/v head epilogue in one Triton kernel",
                       dict(epilogues="quack", attention="fa4", cfg_attention="lengths", gqa_buffers=False,
                            head_epilogue="triton")),
    # ... or both (the defaults on fa4).
    "E5-quack-heads-gqa": ("E5-quack-heads with K/V buffers at the K/V heads",
                           dict(epilogues="quack", attention="fa4", cfg_attention="lengths", head_epilogue="triton",
                                gqa_buffers=True)),
    # The defaults on fa4 with the host waiting after the VAE encode and around the Reasoner prefill, as before
    # EngineConfig.overlap_encode (the comparison row for it).
    "E5-quack-heads-gqa-sync": ("E5-quack-heads-gqa with the host waiting for the VAE encode",
                                dict(epilogues="quack", attention="fa4", cfg_attention="lengths",
                                     head_epilogue="triton", gqa_buffers=True, overlap_encode=False)),
    # The shipped defaults with every row through the last layer (EngineConfig.last_layer_read_rows off: the
    # comparison row for it).
    "E5-quack-all-rows": ("E5-quack with every row through the last layer",
                          dict(epilogues="quack", last_layer_read_rows=False)),
    # E5 with diffusers' own encode of the conditioning frame (the comparison row for the 2D first-frame encode).
    "E5-vae-diffusers": ("E5 with diffusers' VAE encode of frame 0", dict(vae_encode="diffusers")),
    # The engine `wamrt serve --model random:SIZE` builds with no tuning flags (serving/startup.py): 64-token buckets,
    # its two prefix widths (the caption around 128 and 384 instruction tokens: 256 and 512 under random:SIZE's
    # tokenizer) and its batch ladder; this workload's 125-token prompt pads to 256. The row a server's 1-lane p50 is
    # compared with (issue 40).
    "E5-serve": ("E5 as `wamrt serve` runs it by default (buckets of 64, widths 256 / 512, batch ladder 1-8)",
                 dict(prompt_bucket=64, prompt_widths=(256, 512), batch_ladder=(1, 2, 4, 8))),
    # The server's engine with one K/V step buffer per layer (before shared_kv_buffer): its comparison row.
    "E5-serve-kv-per-layer": ("E5-serve with one K/V step buffer per layer",
                              dict(prompt_bucket=64, prompt_widths=(256, 512), batch_ladder=(1, 2, 4, 8),
                                   shared_kv_buffer=False)),
}

# Opt-in rows: E5-autotune spends minutes autotuning at Nano, which the default waterfall run cannot afford.
DEFAULT_ROWS = [r for r in ROWS if r not in ("E5-bucket", "E5-bucket-mask", "E5-autotune", "E5-cudnn", "E5-quack",
                                             "E5-quack-bucket", "E5-quack-lengths", "E5-quack-gqa",
                                             "E5-quack-heads", "E5-quack-heads-gqa", "E5-quack-heads-gqa-sync",
                                             "E5-quack-all-rows", "E5-vae-diffusers", "E5-serve",
                                             "E5-serve-kv-per-layer")]

# `wamrt bench world`: the modes and their default shapes (diffusers' Cosmos3OmniPipeline defaults).
WORLD_MODES: dict[str, dict[str, Any]] = {"t2i": {"num_frames": 1, "size": (1024, 1024)},
                                    "i2v": {"num_frames": 33, "size": (480, 832)}}

# `wamrt bench world --modes t2v720,transfer` (bench/world_large.py): the peers' own workload.
LARGE_WORLD_MODES: dict[str, dict[str, Any]] = {"t2v720": {"num_frames": 189, "size": (720, 1280)},
                                                "transfer": {"num_frames": 93, "size": (480, 832)}}

# `wamrt bench kernels`: GEMM rows at tier 480 (Generator tokens, both CFG branches).
GENERATOR_TOKENS = 6186

# `wamrt bench load`: bounded on purpose (loopback only, these limits), so it cannot load someone else's server.
MAX_LANES = 64
MAX_SECONDS = 600.0
