"""Where a batch-1 decode step's time goes: the kernels one CUDA-graph step replays, by kind, against the step's
wall time (`wamrt bench decode --profile-steps N`).

The floor of a step is its weight reads. What a step spends above it is one of three things, and each has its own
cure: GEMVs that read below the card's bandwidth (another kernel, or one matrix where there are two), kernels that
are not GEMVs (attention, norms, RoPE, the cache write, sampling: fewer and fused), or time the GPU sits idle
between kernels or between steps (the host's work per step: launches, the token's round trip). The profile sums
each kernel kind's device time per step and gives the idle rest as `idle_ms_per_step` (the step less the union of
the kernels' intervals: under programmatic dependent launch they overlap, `overlap_ms_per_step`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

# Kernel kinds by name, first match wins (cuBLAS, cuDNN and Inductor's names on Hopper).
KINDS = (
    ("attention", ("fmha", "flash", "attention", "sdpa", "cudnn_generated")),
    ("gemv/gemm", ("gemv", "gemm", "nvjet", "cutlass", "xmma", "splitk")),
    ("triton (fused elementwise, norms)", ("triton",)),
    ("copy", ("memcpy", "memset", "copy")),
    ("index/scatter", ("index", "scatter", "gather")),
    ("reduce/argmax", ("reduce", "argmax", "max")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def _device_events(prof: Any) -> list[Any]:
    from torch.autograd import DeviceType

    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]


def profile_decode(reasoner: Any, prompt: Any, *, steps: int = 20, fused: bool = True,
                   fused_mode: str | None = None, lookahead: bool = False, attention: str = "sdpa", top: int = 15,
                   one_row: bool = False, attention_prep: bool = True, merge_in_split: bool = False,
                   pdl: bool = False) -> dict[str, Any]:
    """Batch-1 decode with CUDA graphs and the fused layers: `steps` steps under the profiler, after the ones that
    capture."""
    from torch.profiler import ProfilerActivity, profile

    from ..reasoner.engine import DecodeBatch
    from ..reasoner.sampling import SamplingParams

    dev = reasoner.lm.device
    cuda = dev.type == "cuda"  # elsewhere (the CPU test): eager steps, no device events
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    db = DecodeBatch(reasoner, 1, cuda_graphs=cuda, fused=fused and cuda, fused_mode=fused_mode, lookahead=lookahead,
                     decode_attention=attention, one_row=one_row and cuda,
                     attention_prep=attention_prep, merge_in_split=merge_in_split, pdl=pdl)
    db.admit(prompt, params)
    for _ in range(4):  # captures (and compiles) the step's bucket
        db.step()
    if cuda:
        torch.cuda.synchronize(dev)
    wall = []
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            db.step()
            wall.append(1e3 * (time.perf_counter() - t0))
        if cuda:
            torch.cuda.synchronize(dev)
    events = _device_events(prof)
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        us = e.time_range.elapsed_us()
        by_kind[kernel_kind(e.name)] += us
        by_name[e.name][0] += 1
        by_name[e.name][1] += us
    kernel_ms = sum(by_kind.values()) / 1e3 / steps
    # Under PDL a kernel starts during the one before it and waits inside: kernel times overlap, and their sum is no
    # longer the time the device was busy. The union of the kernels' intervals is.
    busy_ms = _union_us([(e.time_range.start, e.time_range.end) for e in events]) / 1e3 / steps
    step_ms = sorted(wall)[len(wall) // 2]
    names = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "steps": steps, "fused": fused, "fused_mode": fused_mode or "default", "lookahead": lookahead,
        "attention": attention,
        "step_ms_p50": step_ms,
        "device_events": len(events), "kernels_per_step": len(events) / steps,
        "busy_ms_per_step": busy_ms, "idle_ms_per_step": step_ms - busy_ms,
        "overlap_ms_per_step": kernel_ms - busy_ms, "pdl": pdl,
        "by_kind_ms_per_step": {k: v / 1e3 / steps for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "kind": kernel_kind(n), "calls_per_step": c / steps,
                         "us_per_step": us / steps} for n, (c, us) in names],
    }


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def describe(p: dict[str, Any]) -> str:
    ahead = (" +lookahead" if p["lookahead"] else "") + (" +split attention" if p["attention"] == "split" else "")
    lines = [f"profile, batch 1, graph+fused ({p['fused_mode']}){ahead}: step {p['step_ms_p50']:.2f} ms = kernels "
             f"{p['busy_ms_per_step']:.2f} ms ({p['kernels_per_step']:.0f} a step) "
             f"+ idle {p['idle_ms_per_step']:.2f} ms"
             + (f" (kernels overlapping {p['overlap_ms_per_step']:.2f} ms: the kinds below include their waits)"
                if p.get("overlap_ms_per_step", 0) > 0.005 else "")]
    lines += [f"  {k}: {v:.3f} ms" for k, v in p["by_kind_ms_per_step"].items()]
    lines += [f"  {k['us_per_step']:8.1f} us  x{k['calls_per_step']:5.1f}  {k['kind']:<12} {k['name'][:100]}"
              for k in p["top_kernels"]]
    return "\n".join(lines)
