"""The DROID golden fixtures: NVIDIA's own sampler trajectory, reproduced from its velocities."""

from __future__ import annotations

import torch

from wamrt.sampler import cfg_combine, denoise, framework_flow_schedule, guidance_active, unipc_plan


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_unipc_reproduces_action_latents(droid_requests, droid_tolerances) -> None:
    atol = float(droid_tolerances["latent_atol"])
    for req in droid_requests:
        r, t = req["request"], req["tensors"]
        plan = unipc_plan(framework_flow_schedule(int(r["num_steps"]), float(r["shift"])))
        latents, v = t["action_latents"], t["action_v"]  # [steps + 1, 33, 64], [steps, 33, 64]
        assert latents.shape[0] == plan.steps + 1 and v.shape[0] == plan.steps
        assert torch.equal(latents[0], t["action_init"])
        trajectory: list[torch.Tensor] = []
        out = denoise(plan, latents[0].clone(), lambda i, _x, v=v: v[i], trajectory)
        for k, state in enumerate(trajectory):
            err = _max_abs(state, latents[k + 1])
            assert err <= atol, f"{req['id']} step {k}: max |diff| {err:.3g} > {atol}"
        assert _max_abs(out, t["action_model_out"]) <= atol, req["id"]


def test_cfg_and_interval_match_fixture(droid_requests, droid_tolerances) -> None:
    atol = float(droid_tolerances["velocity_atol"])
    for req in droid_requests:
        r, t = req["request"], req["tensors"]
        timesteps = framework_flow_schedule(int(r["num_steps"]), float(r["shift"])).timesteps
        active = guidance_active(timesteps, r["guidance_interval"])
        assert active == t["cfg_active"].tolist() == req["expected"]["cfg_active"], req["id"]
        for k, on in enumerate(active):
            cond, uncond = t["action_v_cond"][k], t["action_v_uncond"][k]
            want = t["action_v"][k]
            got = cfg_combine(cond, uncond, float(r["guidance"])) if on else cond
            assert _max_abs(got, want) <= atol, (req["id"], k)
            # Same op order as the framework in fp32: expected to be exact.
            assert torch.equal(got, want), (req["id"], k, _max_abs(got, want))
