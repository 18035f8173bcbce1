"""Public API and CLI: `load_policy(...).infer`, `wamrt infer`, and typed errors for bad requests."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from wamrt import RequestError, load_policy
from wamrt.cli import main
from wamrt.sample import sample_observation


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("wamrt-cache")


@pytest.fixture(scope="module")
def policy(cache):
    mp = pytest.MonkeyPatch()
    mp.setenv("WAMRT_CACHE", str(cache))
    yield load_policy("tiny-droid", device="cpu")
    mp.undo()


def test_infer_returns_a_chunk_with_stage_timings(policy):
    chunk = policy.infer(sample_observation(), seed=7)
    assert chunk.actions.shape == (32, 8) and chunk.actions.dtype == np.float32
    assert np.isfinite(chunk.actions).all()
    for stage in ("preprocess", "vae_encode", "tokenize", "reasoner_prefill", "denoise", "postprocess", "total"):
        assert chunk.timings_ms[stage] >= 0, stage
    assert [k for k in chunk.timings_ms if k.startswith("denoise_step")] == [f"denoise_step{i}" for i in range(4)]
    again = policy.infer(sample_observation(), seed=7)
    assert np.array_equal(chunk.actions, again.actions), "same seed, same chunk"
    other = policy.infer(sample_observation(), seed=8)
    assert not np.array_equal(chunk.actions, other.actions)
    fewer = policy.infer(sample_observation(), seed=7, steps=2, guidance=1.0)
    assert fewer.actions.shape == (32, 8) and len([k for k in fewer.timings_ms if "step" in k]) == 2


def test_gripper_state_flows_through_the_clean_row(policy):
    """The state row is clean conditioning: changing the gripper changes the chunk."""
    obs = sample_observation()
    a = policy.infer(obs, seed=1).actions
    obs["observation/gripper_position"] = np.float32(0.9)
    b = policy.infer(obs, seed=1).actions
    assert np.abs(a - b).max() > 1e-4


def test_default_seed_stream_is_the_framework_servers(cache, monkeypatch):
    monkeypatch.setenv("WAMRT_CACHE", str(cache))
    fresh = load_policy("tiny-droid", device="cpu")
    seeds = [fresh.infer(sample_observation(), steps=1).seed for _ in range(3)]
    assert seeds == [1826701615, 1367864807, 1097657232]


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda o: o.pop("observation/joint_position"), "observation/joint_position"),
        (lambda o: o.pop("observation/gripper_position"), "observation/gripper_position"),
        (lambda o: o.__setitem__("observation/joint_position", [0.1] * 6), "observation/joint_position"),
        (lambda o: o.__setitem__("observation/joint_position", [np.nan] * 7), "observation/joint_position"),
        (lambda o: o.__setitem__("observation/gripper_position", np.inf), "observation/gripper_position"),
        (lambda o: o.pop("prompt"), "prompt"),
        (lambda o: o.__setitem__("prompt", 42), "prompt"),
        (lambda o: o.pop("observation/exterior_image_1_left"), "observation/exterior_image_1_left"),
        (lambda o: o.__setitem__("observation/wrist_image_left", np.zeros((360, 640), np.uint8)),
         "observation/wrist_image_left"),
        (lambda o: o.__setitem__("observation/wrist_image_left", np.zeros((360, 640, 4), np.uint8)),
         "observation/wrist_image_left"),
        (lambda o: o.__setitem__("observation/wrist_image_left", np.zeros((1, 1, 3), np.uint8)),
         "observation/wrist_image_left"),
        (lambda o: o.__setitem__("observation/image", np.zeros((0, 640, 3), np.uint8)), "observation/image"),
    ],
)
def test_bad_observations_raise_typed_errors(policy, mutate, field):
    obs = sample_observation()
    mutate(obs)
    with pytest.raises(RequestError) as err:
        policy.infer(obs, seed=0)
    assert err.value.field == field, str(err.value)


@pytest.mark.parametrize("override,field", [({"steps": 0}, "steps"), ({"guidance": float("nan")}, "guidance"),
                                             ({"shift": -1.0}, "shift"),
                                             ({"guidance_interval": (1001, 960)}, "guidance_interval")])
def test_bad_sampling_options(policy, override, field):
    with pytest.raises(RequestError, match=field):
        policy.infer(sample_observation(), seed=0, **override)


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(RequestError, match="no checkpoint at"):
        load_policy(tmp_path / "missing")


def test_cli_prints_a_chunk_and_timings(cache, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WAMRT_CACHE", str(cache))
    assert main(["infer", "--device", "cpu", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "action chunk [32, 8]" in out and "vae_encode" in out and "t+31" in out
    # Image files + JSON state, machine-readable output.
    from PIL import Image

    obs = sample_observation()
    paths = {}
    for arg, key in (("wrist", "observation/wrist_image_left"), ("exterior1", "observation/exterior_image_1_left"),
                     ("exterior2", "observation/exterior_image_2_left")):
        paths[arg] = tmp_path / f"{arg}.png"
        Image.fromarray(obs[key]).save(paths[arg])
    state = json.dumps({"joint_position": obs["observation/joint_position"].tolist(), "gripper_position": 0.1})
    argv = ["infer", "--device", "cpu", "--seed", "3", "--json", "--state", state, "--prompt", obs["prompt"]]
    for arg, p in paths.items():
        argv += [f"--{arg}", str(p)]
    assert main(argv) == 0
    reply = json.loads(capsys.readouterr().out)
    assert np.asarray(reply["actions"]).shape == (32, 8) and reply["seed"] == 3
    # Missing state -> exit 2 with the field named, no traceback.
    assert main(["infer", "--device", "cpu", "--image", str(paths["wrist"]), "--prompt", "go"]) == 2
    assert "observation/joint_position" in capsys.readouterr().err


def test_builtin_edge_policy_uses_json_prompt_and_interval(cache, monkeypatch):
    monkeypatch.setenv("WAMRT_CACHE", str(cache))
    edge = load_policy("tiny-droid-edge", device="cpu")
    assert edge.contract.prompt_format == "json" and edge.options.guidance_interval == (960, 1001)
    chunk = edge.infer(sample_observation(), seed=0)
    assert chunk.prompt.startswith("{") and json.loads(chunk.prompt)["fps"] == 15.0
    assert chunk.actions.shape == (32, 8)


def test_forward_and_inverse_dynamics_from_the_policy_object(policy):
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 255, (64, 80, 3), dtype=np.uint8) for _ in range(5)]
    fd = policy.forward_dynamics(frames[0], np.zeros((4, 10), np.float32), prompt="push", domain="droid_lerobot",
                                 resolution_tier=256, steps=1, decode=True)
    assert fd.actions is None and fd.video_latents.shape[2] == 2 and fd.frames.dtype == torch.uint8
    inv = policy.inverse_dynamics(frames, prompt="push", domain="droid_lerobot", resolution_tier=256, steps=1)
    assert inv.actions.shape == (4, 10) and np.isfinite(np.asarray(inv.actions)).all()
    with pytest.raises(RequestError, match="domain"):
        policy.inverse_dynamics(frames, prompt="push", domain="no-such-robot", resolution_tier=256, steps=1)


def test_random_weights_policy_by_name():
    from wamrt.pipeline.random_weights import VariableLengthTokenizer

    p = load_policy("random:tiny-edge", device="cpu")
    assert p.model.config.hidden_act == "relu2" and "random" in p.name
    assert isinstance(p.tokenizer, VariableLengthTokenizer)  # served: the token count follows the text
    chunk = p.infer(sample_observation(), seed=0, steps=1)
    assert chunk.actions.shape == (32, 8)
    with pytest.raises(Exception, match="unknown model size"):
        load_policy("random:gigantic", device="cpu")
