"""The memory plan (`engine/memory_plan.py`, `serving/memory.py`) on the CPU: the weights it counts before loading
are the bytes the loaded model holds; a plan that does not fit names the part and what to change; the largest batch
that fits is chosen; shared K/V step buffers plan a fraction of per-layer ones."""

from __future__ import annotations

import pytest
import torch

from wamrt.engine.memory_plan import GIB, MemoryPlanError, ModelMemory, ServingMemory, plan_serving, policy_parts
from wamrt.model import get_config

NANO = ModelMemory(get_config("nano"), transformer_bytes=int(27.14 * GIB), vae_bytes=int(1.31 * GIB))


def held_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("spec", ["random:tiny-qwen", "random:tiny-qwen@gen-fp8+reasoner-w8",
                                  "random:tiny-edge@gen-fp8", "tiny-droid"])
def test_weights_counted_before_loading_are_what_the_loaded_model_holds(spec, tmp_path, monkeypatch):
    """From the meta device (random models, recipes applied) or the safetensors headers (a checkpoint folder), in
    bf16: exactly the bytes of the transformer and the VAE once loaded."""
    from wamrt import load_policy
    from wamrt.serving.memory import model_memory

    monkeypatch.setenv("WAMRT_CACHE", str(tmp_path))
    planned = model_memory(spec)
    policy = load_policy(spec, device="cpu", dtype=torch.bfloat16)
    assert planned.transformer_bytes == held_bytes(policy.model) > 0
    assert planned.vae_bytes == held_bytes(policy.encoder.vae) > 0
    assert planned.recipe == (spec.partition("@")[2] or None)


def test_a_plan_that_does_not_fit_names_the_part_and_what_to_change():
    with pytest.raises(MemoryPlanError) as err:  # Nano's bf16 weights alone are over a 24 GiB card
        plan_serving(NANO, ServingMemory(), capacity=24 * GIB)
    assert err.value.part == "weights" and "wamrt quantize --recipe" in str(err.value)
    assert err.value.flag == "--model" and "\n" not in str(err.value)
    with pytest.raises(MemoryPlanError) as err:  # an explicit batch of 8 on 40 GiB
        plan_serving(NANO, ServingMemory(max_batch=8), capacity=40 * GIB)
    assert err.value.flag == "--max-batch" and "asked: 8" in str(err.value)
    with pytest.raises(MemoryPlanError) as err:  # a generation job too large for what the policy leaves
        plan_serving(NANO, ServingMemory(max_batch=8, max_video_pixels=1280 * 720 * 189), capacity=80 * GIB)
    assert err.value.part == "generation" and err.value.flag == "--max-video-pixels"
    fits = int(str(err.value).split("(")[-1].split(" fits")[0])
    plan = plan_serving(NANO, ServingMemory(max_batch=8, max_video_pixels=fits), capacity=80 * GIB)
    assert plan.total <= plan.capacity and plan.settings["max_video_pixels"] == fits


def test_the_largest_batch_that_fits_is_chosen_and_generation_gets_what_is_left():
    batches = {}
    for card in (48, 80, 141):
        plan = plan_serving(NANO, ServingMemory(), capacity=card * GIB, device_total=141 * GIB)
        batches[card] = plan.settings["max_batch"]
        assert plan.total <= plan.capacity == card * GIB
        assert plan.part("generation").nbytes > 0 and plan.settings["max_video_pixels"] > 0
        assert plan.settings["ladder"] == [b for b in (1, 2, 4, 8) if b <= batches[card]]
        assert plan.capped == (card < 141) and (plan.as_dict()["gpu_memory_cap_gib"] == card) == (card < 141)
        assert plan.part("headroom").nbytes == int(0.03 * card * GIB)
    assert batches[80] == batches[141] == 8 and batches[48] < 8
    # an explicit generation size is planned first: the batch shrinks to make room
    with_video = plan_serving(NANO, ServingMemory(max_video_pixels=480 * 832 * 33), capacity=80 * GIB)
    assert with_video.settings["max_batch"] < 8 and with_video.settings["max_video_pixels"] == 480 * 832 * 33


def test_shared_kv_buffers_plan_a_fraction_of_per_layer_ones():
    def arena(shared: bool) -> int:
        parts = policy_parts(NANO, ServingMemory(shared_kv_buffer=shared), 8)
        return next(p.nbytes for p in parts if p.name == "step_kv_arena")

    assert arena(False) > 10 * arena(True) and arena(True) < 4 * GIB  # one buffer pair + prefixes, not 36 pairs
    with pytest.raises(MemoryPlanError, match="max-batch"):  # per-layer buffers: batch 8 misses even 141 GiB
        plan_serving(NANO, ServingMemory(max_batch=8, shared_kv_buffer=False), capacity=141 * GIB)


@pytest.mark.parametrize("device,index", [("cuda", 3), ("cuda:1", 1)])
def test_the_memory_cap_names_a_device_index(device, index, monkeypatch):
    # `--device cuda` (the default) once reached torch.cuda.set_per_process_memory_fraction as torch.device("cuda"),
    # which torch refuses: the capped server died at startup on the H200 (load-plan at 81a6a07).
    from wamrt.serving.memory import cap_device

    calls = []

    def set_fraction(fraction, dev):
        if not isinstance(dev, int):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{dev}")
        calls.append((fraction, dev))

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    plan = plan_serving(NANO, ServingMemory(), capacity=80 * GIB, device_total=140 * GIB)
    assert plan.capped
    assert cap_device(plan, device) == pytest.approx(80.0)
    assert calls == [(pytest.approx(80 / 140), index)]
    assert cap_device(plan, "cpu") is None and len(calls) == 1
