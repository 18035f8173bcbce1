"""Oracle 1: the whole DROID request path vs NVIDIA's framework server goldens (tiny models, fp32).

Every request in the fixture manifest runs through `run_droid` with the fixture's model, VAE and
tokenizer; prompt, token ids and positions must be exact, and every step of the trajectory and the
final [32, 8] chunk within the tolerances the fixture README recommends.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from wamrt.pipeline import DroidContract, SamplingOptions, load_policy, run_droid

pytestmark = pytest.mark.parity


@lru_cache(maxsize=4)
def _policy(root: str, flavour: str, fmt: str):
    manifest = json.loads((Path(root) / "manifest.json").read_text())
    return load_policy(Path(root) / manifest["models"][flavour]["path"], device="cpu", dtype=torch.float32,
                       tokenizer=Path(root) / manifest["tokenizer"], vae=Path(root) / manifest["vae"],
                       prompt_format=fmt)


@pytest.fixture
def outcome(droid_request, fixture_root):
    req = droid_request.request
    fmt = "json" if req["format_prompt_as_json"] else "plain"
    policy = _policy(str(fixture_root), req["flavour"], fmt)
    gi = req["guidance_interval"]
    opts = SamplingOptions(steps=req["num_steps"], guidance=req["guidance"], shift=req["shift"],
                           guidance_interval=tuple(gi) if gi else None)
    chunk, prep, result = run_droid(droid_request.observation, model=policy.model, encoder=policy.encoder,
                                    tokenizer=policy.tokenizer, contract=DroidContract(prompt_format=fmt),
                                    options=opts, seed=req["seed"], record=True)
    return droid_request, chunk, prep, result


def test_request_tensors_exact(outcome):
    fx, chunk, prep, _ = outcome
    t = fx.tensors
    assert prep.prompt.encode() == fx.prompt_bytes
    assert chunk.prompt == prep.prompt
    for branch, b in (("cond", prep.inputs.cond), ("uncond", prep.inputs.uncond)):
        assert b.input_ids[0].tolist() == t[f"{branch}.text_ids"].tolist(), branch
        assert np.array_equal(b.positions[0].numpy(), t[f"{branch}.position_ids"]), f"{branch} positions"
    assert list(prep.image_size) == fx.expected["image_size"]
    assert np.array_equal(prep.canvas, fx.canvas)
    assert np.array_equal(prep.inputs.action[0].numpy(), t["action_init"])
    noise = t["noise_vision"]
    assert np.array_equal(prep.inputs.vision[0, :, 1:].numpy(), noise[0, :, 1:])
    assert np.abs(prep.inputs.vision[0, :, :1].numpy() - t["cond_latent"][0]).max() <= 1e-5
    # Masks: frame 0 and state row clean, the rest noisy.
    assert prep.inputs.vision_noisy[0].tolist() == (t["cond.vision_condition_mask"][:, 0, 0] == 0).tolist()
    assert prep.inputs.action_noisy[0].tolist() == (t["cond.action_condition_mask"][:, 0] == 0).tolist()


def test_trajectory_and_chunk_within_fixture_tolerances(outcome, fixture_root):
    fx, chunk, _, result = outcome
    tol = json.loads((fixture_root / "tolerances.json").read_text())["recommended"]
    t, tr = fx.tensors, result.trace
    cfg_active = t["cfg_active"].tolist()
    for i in range(len(cfg_active)):
        for name in ("action_v_cond", "action_v"):
            err = np.abs(tr[name][i][0].numpy() - t[name][i]).max()
            assert err <= tol["velocity_atol"], (name, i, err)
        if cfg_active[i]:
            err = np.abs(tr["action_v_uncond"][i][0].numpy() - t["action_v_uncond"][i]).max()
            assert err <= tol["velocity_atol"], ("action_v_uncond", i, err)
        else:
            assert tr["action_v_uncond"][i] is None, f"no uncond pass may run at step {i}"
        err = np.abs(tr["action"][i][0].numpy() - t["action_latents"][i + 1]).max()
        assert err <= tol["latent_atol"], ("action_latents", i, err)
        vis = tr["vision"][i][0][:4][:, [1, 8]].numpy()
        assert np.abs(vis - t["vision_latents_slice"][i + 1]).max() <= tol["latent_atol"], ("vision", i)
        vv = tr["vision_v"][i][0][:4][:, [1, 8]].numpy()
        assert np.abs(vv - t["vision_v_slice"][i]).max() <= tol["velocity_atol"], ("vision_v", i)
        full = tr["vision"][i][0].double()  # [C, T, H, W]
        stats = torch.stack([full.sum((0, 2, 3)), (full**2).sum((0, 2, 3)), full.amin((0, 2, 3)),
                             full.amax((0, 2, 3))], dim=-1).numpy()
        ref = t["vision_latents_stats"][i + 1]
        assert (np.abs(stats - ref) / (np.abs(ref) + 1)).max() <= tol["vision_stats_rel"], ("stats", i)
    err = np.abs(chunk.actions - t["action_chunk"]).max()
    assert chunk.actions.shape == (32, 8) and chunk.actions.dtype == np.float32
    assert err <= tol["action_chunk_atol"], err
    assert np.allclose(chunk.actions, np.asarray(fx.expected["action_chunk"], dtype=np.float32),
                       atol=tol["action_chunk_atol"], rtol=0)
