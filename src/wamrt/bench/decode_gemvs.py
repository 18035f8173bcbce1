"""The batch-1 step's matrices read by the Triton GEMV alone (`wamrt bench decode`'s `gemvs_alone`).

Why: the one-row stack's step (4.098 ms on the H200 at 9456251) sits 0.48 ms above a copy's rate over its 15.14 GB.
Whether that gap is the GEMVs' own read rate or what runs between them (attention, the kernels' boundaries) decides
the next lever, and the step's profile cannot tell once its kernels overlap under PDL. Here each kind of matrix
(q/k/v, o, gate/up, down, lm_head) is read by `ops.gemv`'s kernel for every layer in a row, each matrix once as a
step reads it (no layer's matrix is still in L2 when it is read again), captured in one CUDA graph per kind and
timed over replays. The sum over kinds is the step's GEMV time with nothing between them but launch gaps; the step's
time minus it is the rest.

Off the kernel (CPU, other dtypes) the matrices are read by F.linear, eagerly, so the CPU tests run the same loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..ops.gemv import gemv_op, gemv_problem
from ..reasoner.fused import gate_up_weights, qkv_weights
from .stats import device_ms


def step_matrices(lm: Any) -> dict[str, list[torch.Tensor]]:
    """The weight matrices a batch-1 decode step of `lm` (a `ReasonerLM`) reads, by kind, in layer order; q/k/v and
    gate/up fused (`engine.fuse.fuse_reasoner`) or not."""
    layers = lm.transformer.layers
    kinds = {"qkv": [w for layer in layers for w in qkv_weights(layer.self_attn)],
             "o": [layer.self_attn.to_out.weight for layer in layers],
             "gate_up": [w for layer in layers for w in gate_up_weights(layer.mlp)],
             "down": [layer.mlp.down_proj.weight for layer in layers]}
    kinds["lm_head"] = [lm.lm_head.weight]
    return kinds


def gemvs_alone(lm: Any, reps: int = 20) -> dict[str, Any]:
    """Per kind: milliseconds a step's matrices of that kind take read back to back (median of `reps`), their bytes
    and bytes/s; `ms`, `bytes_per_s` over all kinds, and whether the Triton kernel (in CUDA graphs) read them."""
    device = lm.lm_head.weight.device
    kinds: dict[str, Any] = {}
    kernel = True
    with torch.no_grad():
        for kind, weights in step_matrices(lm).items():
            inputs = {w.shape[1]: torch.randn(1, w.shape[1], device=device, dtype=w.dtype) for w in weights}
            on_kernel = all(gemv_problem(inputs[w.shape[1]], w) is None for w in weights)
            kernel = kernel and on_kernel
            read = gemv_op if on_kernel else F.linear

            def run(weights=weights, inputs=inputs, read=read) -> None:
                for w in weights:
                    read(inputs[w.shape[1]], w)

            call = run
            if on_kernel:
                run()  # autotunes outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                call = graph.replay
            ms = float(np.median(device_ms(call, reps, device)))
            nbytes = sum(w.numel() * w.element_size() for w in weights)
            kinds[kind] = {"matrices": len(weights), "bytes": nbytes, "ms": ms, "bytes_per_s": nbytes / (ms / 1e3)}
    total_ms = sum(k["ms"] for k in kinds.values())
    total_bytes = sum(k["bytes"] for k in kinds.values())
    return {"triton_in_graphs": kernel, "ms": total_ms, "bytes": total_bytes,
            "bytes_per_s": total_bytes / (total_ms / 1e3), "kinds": kinds}


def describe(alone: dict[str, Any], step_ms: float | None = None) -> str:
    """One line: the GEMVs alone against the best step."""
    kinds = ", ".join(f"{k} {v['ms']:.3f} ms ({v['bytes_per_s'] / 1e12:.2f} TB/s)" for k, v in alone["kinds"].items())
    rest = "" if step_ms is None else f"; the best step {step_ms:.3f} ms: {step_ms - alone['ms']:.3f} ms besides them"
    return f"GEMVs alone: {alone['ms']:.3f} ms a step at {alone['bytes_per_s'] / 1e12:.2f} TB/s ({kinds}){rest}"


__all__ = ["describe", "gemvs_alone", "step_matrices"]
