"""Schedules vs diffusers' set_timesteps and vs the framework fixture bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wamrt.sampler import (
    diffusers_flow_schedule,
    flow_schedule,
    framework_flow_schedule,
    native_flow_schedule,
    schedule_from_sigmas,
)

STEPS = (1, 2, 3, 4, 8, 10)
SHIFTS = (1.0, 3.0, 5.0, 10.0)


@pytest.mark.parity
@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("steps", STEPS)
def test_diffusers_schedule_equals_set_timesteps(diffusers_unipc, steps: int, shift: float) -> None:
    ref = diffusers_unipc(shift)
    ref.set_timesteps(steps)
    ours = diffusers_flow_schedule(steps, shift)
    assert ours.sigmas.dtype == torch.float32 and ours.timesteps.dtype == torch.int64
    assert torch.equal(ours.sigmas, ref.sigmas), (ours.sigmas, ref.sigmas)
    assert torch.equal(ours.timesteps, ref.timesteps), (ours.timesteps, ref.timesteps)


@pytest.mark.parity
@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("steps", STEPS)
def test_native_schedule_equals_set_timesteps_with_sigmas(diffusers_unipc, steps: int, shift: float) -> None:
    ref = diffusers_unipc(shift)
    ref.set_timesteps(steps, sigmas=np.linspace(1 - 1 / 1000, 0, steps + 1)[:-1])
    ours = native_flow_schedule(steps, shift)
    assert torch.equal(ours.sigmas, ref.sigmas), (ours.sigmas, ref.sigmas)
    assert torch.equal(ours.timesteps, ref.timesteps), (ours.timesteps, ref.timesteps)


@pytest.mark.parity
@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("steps", STEPS)
def test_framework_schedule_through_diffusers_custom_sigmas(
    diffusers_unipc, steps: int, shift: float
) -> None:
    """The fixture README's recipe: flow_shift=1 plus the framework sigmas gives the same schedule."""
    fw = framework_flow_schedule(steps, shift)
    ref = diffusers_unipc(1.0)
    ref.set_timesteps(sigmas=fw.sigmas[:-1].double().numpy())
    assert torch.equal(ref.sigmas, fw.sigmas)
    assert torch.equal(ref.timesteps, fw.timesteps)
    assert torch.equal(schedule_from_sigmas(fw.sigmas[:-1]).sigmas, fw.sigmas)


def test_pinned_values() -> None:
    d = diffusers_flow_schedule(4, 5.0)
    assert d.timesteps.tolist() == [999, 937, 833, 625]
    assert d.sigmas[0].item() == np.float32(1 - 1e-6)
    assert diffusers_flow_schedule(2, 5.0).timesteps.tolist() == [999, 833]
    fw = framework_flow_schedule(4, 5.0)
    assert fw.timesteps.tolist() == [999, 937, 833, 624]
    want = np.array([0.9997998, 0.9372655, 0.8330554, 0.6246874, 0], dtype=np.float32)
    assert np.allclose(fw.sigmas.numpy(), want, rtol=1e-7, atol=0)
    assert framework_flow_schedule(2, 5.0).timesteps.tolist() == [999, 833]
    assert native_flow_schedule(4, 5.0).timesteps.tolist() == [999, 937, 833, 624]
    assert flow_schedule("framework", 4, 5.0).timesteps.tolist() == [999, 937, 833, 624]


def test_native_and_framework_differ_only_in_last_bits() -> None:
    """Same timesteps; the float32(0.999) start moves some sigmas by an ulp (4 steps, shift 5: the last)."""
    fw, nat = framework_flow_schedule(4, 5.0), native_flow_schedule(4, 5.0)
    assert torch.equal(fw.timesteps, nat.timesteps)
    assert not torch.equal(fw.sigmas, nat.sigmas)
    torch.testing.assert_close(fw.sigmas, nat.sigmas, rtol=1e-6, atol=0)


@pytest.mark.parity
def test_framework_schedule_bit_exact_against_fixtures(droid_requests) -> None:
    for req in droid_requests:
        r, t = req["request"], req["tensors"]
        ours = framework_flow_schedule(int(r["num_steps"]), float(r["shift"]))
        assert t["sigmas"].dtype == torch.float32 and t["timesteps"].dtype == torch.int64
        assert torch.equal(ours.sigmas, t["sigmas"]), (req["id"], ours.sigmas, t["sigmas"])
        assert torch.equal(ours.timesteps, t["timesteps"]), (req["id"], ours.timesteps, t["timesteps"])
        assert ours.timesteps.tolist() == req["expected"]["timesteps"]
        # The float64 sigmas in expected.json are the float32 values widened.
        assert ours.sigmas.double().tolist() == req["expected"]["sigmas"], req["id"]


def test_diffusers_custom_sigma_rules(diffusers_unipc) -> None:
    """What diffusers does with set_timesteps(sigmas=...): our docs and the fixture recipe rely on it."""
    base = np.array([0.9, 0.5], dtype=np.float64)
    shifted = diffusers_unipc(5.0)
    shifted.set_timesteps(7, sigmas=base)  # the step count is ignored: it is len(sigmas)
    assert shifted.num_inference_steps == 2 and shifted.sigmas[-1].item() == 0.0
    # flow_shift is applied to custom sigmas too (so pass flow_shift=1 to take sigmas as given)...
    assert torch.equal(shifted.sigmas, schedule_from_sigmas(base, 5.0).sigmas)
    assert not torch.equal(shifted.sigmas[:-1], torch.from_numpy(base).float())
    # ...and a plain list is rejected by its numpy arithmetic.
    with pytest.raises(TypeError):
        diffusers_unipc(5.0).set_timesteps(sigmas=[0.9, 0.5])
    # A first sigma within 1e-6 of 1 is nudged, as in the default schedule.
    assert torch.equal(
        schedule_from_sigmas([1.0, 0.5]).sigmas[:1], torch.tensor([1 - 1e-6], dtype=torch.float32)
    )


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_invalid_steps_rejected(bad) -> None:
    with pytest.raises(ValueError):
        framework_flow_schedule(bad, 5.0)
    with pytest.raises(ValueError):
        diffusers_flow_schedule(bad, 5.0)


def test_unknown_kind_rejected() -> None:
    with pytest.raises(ValueError):
        flow_schedule("karras", 4, 5.0)  # type: ignore[arg-type]
