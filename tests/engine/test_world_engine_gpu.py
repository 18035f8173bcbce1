"""WorldEngine on the GPU: Nano layer shapes (8 of its 36 layers, random bf16 weights), image -> video.

bf16 runs that differ only in GEMM batching already differ by rounding, so each path is judged against an
fp32 run of the same weights (the function being computed): the engine must be no further from it than the
eager bf16 reference (`run_world`, `run_world_distilled`) is. A replay of the captured steps must equal the run
that captured them bit for bit, and the compiled engine without graphs too, and so must a server's engine
that captures every step as several segments (`step_segments`). Skipped without CUDA.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NOT_WORSE_THAN_BF16 = 1.25  # engine-vs-fp32 error / reference-vs-fp32 error
HEIGHT, WIDTH, FRAMES, STEPS = 256, 448, 9, 6


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _stack(tmp_path):
    from transformers import AutoTokenizer

    from wamrt.pipeline.builtin import write_tokenizer
    from wamrt.pipeline.random_weights import random_transformer, random_vae
    from wamrt.pipeline.tokens import CaptionTokenizer
    from wamrt.pipeline.vae import FrameEncoder

    dev = torch.device("cuda")
    model = random_transformer("nano", dev, torch.bfloat16, layers=8)
    encoder = FrameEncoder(random_vae(dev, torch.bfloat16))
    write_tokenizer(tmp_path / "tok", level="words")
    return model, encoder, CaptionTokenizer(AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True))


def _check_engine_path(tmp_path, reference_fn: Callable, engine_method: str, seed: int, n_steps: int,
                       config=None, segments: bool = True, **request) -> None:
    """fp32 truth and the bf16 reference through `reference_fn(model, encoder, tokenizer, ...)`; then the engine's
    `engine_method` (under `config`, default `WORLD_ENGINE_CONFIG`) compiled without graphs, with graphs (capture),
    and replayed with an on_step callback; with `segments`, also a server's segmented engine."""
    from wamrt.bench.world import conditioning_image
    from wamrt.engine.world import WORLD_ENGINE_CONFIG, WorldEngine
    from wamrt.pipeline.vae import FrameEncoder

    model, encoder, tokenizer = _stack(tmp_path)
    request = dict(prompt="a robot arm lifts a red cube", image=conditioning_image(300, 500), num_frames=FRAMES,
                   height=HEIGHT, width=WIDTH, decode=False, **request)

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    model32 = copy.deepcopy(model).float()
    truth = reference_fn(model32, FrameEncoder(copy.deepcopy(encoder.vae).float()), tokenizer, generator=gen(),
                         **request).video_latents
    del model32
    torch.cuda.empty_cache()
    reference = reference_fn(model, encoder, tokenizer, generator=gen(), **request).video_latents

    config = config or WORLD_ENGINE_CONFIG
    eager = WorldEngine(model, encoder, tokenizer, replace(config, cuda_graph=False))
    compiled = getattr(eager, engine_method)(generator=gen(), **request).video_latents
    del eager
    engine = WorldEngine(model, encoder, tokenizer, config)  # compiled, graphs, 64-token prompt buckets
    run = getattr(engine, engine_method)
    first = run(generator=gen(), **request).video_latents  # captures
    steps_seen: list[int] = []
    replay = run(generator=gen(), on_step=lambda i, n: steps_seen.append(i), **request).video_latents
    assert engine.graphs.captures == 1 and steps_seen == list(range(n_steps))
    assert torch.equal(first, replay), "a replay must equal the run that captured it bit for bit"
    assert torch.equal(replay, compiled), "graph replay == the compiled engine without graphs"
    del engine, run
    if segments:
        _check_segments(model, encoder, tokenizer, engine_method, gen, n_steps, replay, request)

    ref_err, eng_err = rel_l2(reference, truth), rel_l2(replay, truth)
    print(f"{engine_method}: rel L2 vs fp32: reference {ref_err:.3e}, engine {eng_err:.3e}; engine vs reference "
          f"{rel_l2(replay, reference):.3e}")
    assert eng_err <= NOT_WORSE_THAN_BF16 * ref_err + 1e-4


def _check_segments(model, encoder, tokenizer, engine_method: str, gen: Callable, n_steps: int,
                    replay: torch.Tensor, request: dict) -> None:
    from wamrt.engine.world import WorldEngine

    # A server's engine: every step captured as 3 segments of layers, the host called between them.
    segmented = WorldEngine(model, encoder, tokenizer, step_segments=3)
    pauses: list[int] = []
    # The capture hands the host back after every warm-up step and recorded segment, then the replay.
    getattr(segmented, engine_method)(generator=gen(), on_segment=lambda: pauses.append(0), **request)
    assert len(pauses) >= 3 * n_steps + 2
    pauses.clear()
    split = getattr(segmented, engine_method)(generator=gen(), on_segment=lambda: pauses.append(1),
                                              **request).video_latents
    assert len(pauses) == 2 * n_steps
    assert torch.equal(split, replay), "segmented steps == whole steps, bit for bit"


def test_world_engine_vs_reference_and_fp32_truth_and_replay_bitwise(tmp_path):
    from wamrt.pipeline.world import run_world

    _check_engine_path(tmp_path, run_world, "run", 7, STEPS, steps=STEPS, guidance=6.0, shift=10.0)


def test_world_engine_distilled_replay_bitwise_and_near_the_reference(tmp_path):
    """The distilled few-step sampler on the fast path (conditional branch only; the re-noising draws and the
    clean-frame anchor as graph inputs)."""
    from wamrt.pipeline.world_distilled import run_world_distilled
    from wamrt.sampler import DistilledSchedule

    schedule = DistilledSchedule((1.0, 0.8333, 0.4125, 0.2))
    _check_engine_path(tmp_path, run_world_distilled, "run_distilled", 3, schedule.steps, schedule=schedule)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="flash-attn-4 and quack need a Hopper or Blackwell GPU")
def test_world_engine_fa4_gqa_buffers_and_quack_epilogues_near_the_reference(tmp_path):
    """The kernels `wamrt bench world --attention measure --epilogues quack` picks on the H200: flash-attn-4 over
    step K/V buffers at the model's K/V heads (both CFG branches in one call) and the MLP activation in quack's GEMM
    epilogues. Skipped where either library is not installed (both optional)."""
    from wamrt.engine.epilogues import quack_available
    from wamrt.engine.world import WORLD_ENGINE_CONFIG
    from wamrt.ops.attention import fa4_available
    from wamrt.pipeline.world import run_world

    dev = torch.device("cuda")
    if not (fa4_available(dev) and quack_available(dev)):
        pytest.skip("flash-attn-4 or quack-kernels not installed")
    config = replace(WORLD_ENGINE_CONFIG, attention="fa4", epilogues="quack")
    _check_engine_path(tmp_path, run_world, "run", 7, STEPS, config=config, segments=False, steps=STEPS,
                       guidance=6.0, shift=10.0)
