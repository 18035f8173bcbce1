"""wamrt.train: train-time packing = inference-time packing, the loss, the sampling convention, the checkpoint."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from wamrt.pipeline.droid import prepare_droid
from wamrt.train.data import demo_set_from_episodes, episode_from_observations
from wamrt.train.trainer import PolicyTrainer, TrainConfig

PROMPT = "put the blue cube on the green pad"


def _obs(rng: np.random.Generator, joints: np.ndarray, gripper: float, prompt: str = PROMPT) -> dict:
    # Smooth random images (a blurred noise field), so the VAE latents vary but stay well conditioned.
    def img(h: int, w: int) -> np.ndarray:
        small = rng.integers(0, 256, (h // 16, w // 16, 3)).astype(np.uint8)
        return np.kron(small, np.ones((16, 16, 1), np.uint8))

    return {"observation/wrist_image_left": img(256, 448), "observation/exterior_image_1_left": img(128, 224),
            "observation/exterior_image_2_left": img(128, 224),
            "observation/joint_position": joints.astype(np.float32),
            "observation/gripper_position": np.float32(gripper),
            "prompt": prompt}


def _toy_episodes(n_episodes: int = 3, length: int = 4, seed: int = 0):
    """Each episode: one scene, one state s; every action = s + 0.25 on the joints, gripper closed."""
    rng = np.random.default_rng(seed)
    eps, obs0 = [], []
    for e in range(n_episodes):
        joints = rng.uniform(-1, 1, 7)
        obs = _obs(rng, joints, 0.0, PROMPT if e % 2 == 0 else "put the red cube on the green pad")
        actions = np.tile(np.concatenate([joints + 0.25, [1.0]]), (length, 1))
        eps.append(episode_from_observations([obs] * length, actions))
        obs0.append((obs, actions[0]))
    return eps, obs0


def _trainer(tmp_path, **kw) -> PolicyTrainer:
    eps, _ = _toy_episodes()
    cfg = TrainConfig(size="tiny-qwen", batch=kw.pop("batch", 6), lr=kw.pop("lr", 3e-3), warmup=10,
                      aug_shift_px=0, aug_colour=0.0, log_every=1000,
                      **kw)
    tr = PolicyTrainer(cfg, demo_set_from_episodes(eps), tmp_path / "ckpt", device="cpu")
    tr.cache_latents()
    return tr


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: more threads only oversubscribe a shared CI box
    yield
    torch.set_num_threads(n)


def test_train_time_packing_equals_inference_packing(tmp_path):
    """The most important property: training builds exactly the request the server builds."""
    eps, obs0 = _toy_episodes(n_episodes=2, length=3)
    tr = _trainer(tmp_path)
    for i, (obs, _) in enumerate(obs0):
        prep = prepare_droid(obs, model=tr.model, encoder=tr.encoder, tokenizer=tr.tokenizer, contract=tr.contract,
                             seed=123, device=tr.device)
        inp = prep.inputs
        idx = np.array([int(np.flatnonzero(tr.ds.episode_start == tr.ds.episode_start[i * 4])[0])])
        # without the latent cache: the training encoder path on the stored canvas
        cache, tr._latent_cache = tr._latent_cache, None
        batch = tr.clean_batch(idx, augment_images=False)
        tr._latent_cache = cache
        # the stored training canvas is byte for byte the one prepare_droid pads and encodes
        from wamrt.pipeline.canvas import pad_to_bucket

        assert np.array_equal(tr.ds.canvas[idx[0]], pad_to_bucket(prep.canvas, tr.contract.tier).pixels)
        # same latent up to conv batch-size numerics (the VAE sees 9 frames per sample here, 1 at inference)
        torch.testing.assert_close(batch["vision"][:, :, :1], inp.vision[:, :, :1], rtol=0, atol=2e-5)
        torch.testing.assert_close(tr.clean_batch(idx)["vision"][:, :, :1], inp.vision[:, :, :1], rtol=0, atol=2e-5)
        assert batch["vision"].shape == inp.vision.shape
        torch.testing.assert_close(batch["action"][:, 0], inp.action[:, 0], rtol=0, atol=0)  # clean state row
        assert batch["action"].shape == inp.action.shape
        assert batch["prompts"] == [obs["prompt"]]
        lay = tr.layouts[obs["prompt"]]
        for mine, theirs in ((tr.branches[obs["prompt"]], inp.cond), (tr.branches[""], inp.uncond)):
            assert torch.equal(mine.input_ids, theirs.input_ids)
            assert torch.equal(mine.positions, theirs.positions)
        assert torch.equal(lay.vision_noisy, inp.vision_noisy) and torch.equal(lay.action_noisy, inp.action_noisy)
        assert lay.domain_id == int(inp.domain_ids[0]) and lay.raw_action_dim == inp.raw_action_dim

    # The batched training forward (per-sample branches, padded Reasoner K/V) equals the inference call.
    from wamrt.pipeline.denoise import _prefill

    tr.model.eval()
    obs = obs0[0][0]
    prep = prepare_droid(obs, model=tr.model, encoder=tr.encoder, tokenizer=tr.tokenizer, contract=tr.contract,
                         seed=5, device=tr.device)
    inp = prep.inputs
    from wamrt.model.transformer import GeneratorTokens

    sigma = torch.tensor([0.833, 0.833])
    with torch.no_grad():
        x_v, x_a = inp.vision.expand(2, -1, -1, -1, -1), inp.action.expand(2, -1, -1)
        out = tr.velocity([obs["prompt"], ""], sigma, x_v, x_a)
        for b, br in enumerate((inp.cond, inp.uncond)):
            kv, rope = _prefill(tr.model, br)
            tok = GeneratorTokens(timesteps=sigma[:1] * 1000, vision=inp.vision, vision_noisy=inp.vision_noisy,
                                  action=inp.action, action_noisy=inp.action_noisy, domain_ids=inp.domain_ids)
            ref = tr.model.generator_step(tok, rope, kv)
            torch.testing.assert_close(out.action[b:b + 1], ref.action, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out.vision[b:b + 1], ref.vision, rtol=1e-4, atol=1e-5)


def test_training_step_finite_and_decreasing(tmp_path):
    tr = _trainer(tmp_path, text_dropout=0.0)
    idx = np.arange(len(tr.ds))[:6]
    batch = tr.clean_batch(idx)

    def fixed_loss() -> float:
        tr.gen.manual_seed(99)
        with torch.no_grad():
            return float(tr.loss(batch)["loss"])

    before = fixed_loss()
    for _ in range(25):
        m = tr.train_step(0.0)
        assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
    after = fixed_loss()
    assert after < 0.5 * before, (before, after)


def test_sampling_convention_toy_and_checkpoint_serves(tmp_path, monkeypatch):
    """A hundred steps on a trivially learnable mapping: the chunk sampled by the SERVED path (UniPC,
    shift 5, 4 steps, guidance 3) gets far closer to the target than the untrained model's. A wrong sign or
    time convention (v = x0 - noise, or t <-> 1 - t) would make it worse, not better."""
    import wamrt

    _, obs0 = _toy_episodes()
    # Raw radians: the toy's offsets from the state are constant, so normalized targets would be trivial.
    tr = _trainer(tmp_path, ema=0.95, batch=4, normalization="none")

    def chunk_error(folder) -> float:
        pol = wamrt.load_policy(folder)
        errs = [np.abs(pol.infer(obs, seed=s).actions - target[None]).mean() for s, (obs, target) in enumerate(obs0)]
        return float(np.mean(errs))

    tr.save()
    untrained = chunk_error(tr.out)
    state = tr.state
    for _ in range(100):  # ~35 s on one core; 150 steps at lr 5e-3 reach 0.28 from 0.95
        tr.train_step(state.step / 100)
    folder = tr.save()
    trained = chunk_error(folder)
    assert trained < 0.5 * untrained, (untrained, trained)  # measured: 0.95 -> 0.33

    # The checkpoint is a complete policy folder: the embedded-name route loads it and it serves.
    monkeypatch.setenv("WAMRT_PANDA_DROID", str(folder))
    pol = wamrt.load_policy("panda-droid")
    assert pol.contract.tier == "256"
    chunk = pol.infer(obs0[0][0])
    assert chunk.actions.shape == (32, 8) and np.isfinite(chunk.actions).all()


def test_frame0_augmented_future_frames_from_the_clean_cache(tmp_path):
    """Default augmentation path: one VAE encode per sample (frame 0, augmented); the future frames are the
    clean cached latents, exactly; --aug-future re-encodes all of them augmented."""
    eps, _ = _toy_episodes()
    cfg = TrainConfig(size="tiny-qwen", batch=4, aug_shift_px=6, aug_colour=0.1, log_every=1000)
    tr = PolicyTrainer(cfg, demo_set_from_episodes(eps), tmp_path / "ckpt", device="cpu")
    tr.cache_latents()
    idx = np.arange(4)
    clean = tr.clean_batch(idx, augment_images=False)["vision"]
    calls = []
    encode = tr.encode_frames
    tr.encode_frames = lambda px: calls.append(px.shape[1]) or encode(px)
    aug = tr.clean_batch(idx)["vision"]
    assert calls == [1] and aug.shape == clean.shape
    assert torch.equal(aug[:, :, 1:], clean[:, :, 1:])
    assert (aug[:, :, 0] - clean[:, :, 0]).abs().max() > 1e-3  # frame 0 really was augmented
    tr.cfg.aug_future = True
    calls.clear()
    every = tr.clean_batch(idx)["vision"]
    assert calls == [clean.shape[2]] and not torch.equal(every[:, :, 1:], clean[:, :, 1:])


def test_held_out_episodes_are_never_sampled_and_their_loss_is_fixed(tmp_path):
    eps, _ = _toy_episodes(n_episodes=4, length=4)
    cfg = TrainConfig(size="tiny-qwen", batch=6, lr=3e-3, warmup=10, aug_shift_px=0, aug_colour=0.0,
                      val_episodes=1, val_batch=3, log_every=1000)
    tr = PolicyTrainer(cfg, demo_set_from_episodes(eps), tmp_path / "ckpt", device="cpu")
    tr.cache_latents()
    assert list(tr.train_idx) == list(range(12)) and set(tr.val_idx) <= {12, 13, 14, 15} and len(tr.val_idx) == 3
    drawn = torch.cat([tr.sample_batch()[0] for _ in range(50)])
    assert int(drawn.max()) < 12  # the held-out episode never reaches the optimiser
    first, again = tr.val_loss(), tr.val_loss()
    assert first == again and np.isfinite(first["val_action"])  # same noise and sigmas every call
    for _ in range(5):
        tr.train_step(0.0)
    assert tr.val_loss() != first and tr.model.training
    with pytest.raises(ValueError, match="val_episodes"):
        PolicyTrainer(TrainConfig(size="tiny-qwen", val_episodes=4), demo_set_from_episodes(eps), tmp_path / "b",
                      device="cpu")


def test_held_out_dagger_episodes_are_spread_never_sampled_and_reported(tmp_path):
    """`val_dagger_episodes`: DAgger episodes spread over those recorded stay out of training (and out of the repeated
    DAgger pool), and their loss is a fixed number of its own in `val_loss`."""
    from wamrt.train.data import demo_set_from_episodes

    eps, observations = _moving_episodes()
    daggers = [_dagger_episode(observations[0], seed=s) for s in range(5)]
    ds = demo_set_from_episodes([*eps, *daggers])
    n = sum(len(a["actions"]) for a, _ in eps)
    cfg = TrainConfig(size="tiny-qwen", batch=8, aug_shift_px=0, aug_colour=0.0, log_every=1000, prefix_max=14,
                      dagger_repeat=3, val_dagger_episodes=2, val_batch=4)
    tr = PolicyTrainer(cfg, ds, tmp_path / "ckpt", device="cpu")
    held = set(range(n, n + 3)) | set(range(n + 12, n + 15))  # the first and the last of 5 episodes of 3 requests
    assert set(tr.val_dagger_idx) <= held and len(tr.val_dagger_idx) == 4
    assert not held & set(tr.train_idx.tolist()) and not held & set(tr.train_idx_t.tolist())
    assert set(range(n)) | set(range(n + 3, n + 12)) == set(tr.train_idx.tolist())
    tr.cache_latents()
    first = tr.val_loss()
    assert first is not None and set(first) == {"val_dagger_action"} and np.isfinite(first["val_dagger_action"])
    assert tr.val_loss() == first
    tr.cfg.max_steps, tr.cfg.minutes = 1, 10.0
    tr.train()
    assert "val dagger" in tr.log_path.read_text().splitlines()[-2]  # the step-1 line, before "done"
    with pytest.raises(ValueError, match="val_dagger_episodes"):
        PolicyTrainer(TrainConfig(size="tiny-qwen", val_dagger_episodes=5), ds, tmp_path / "b", device="cpu")
    with pytest.raises(ValueError, match="val_dagger_episodes"):
        PolicyTrainer(TrainConfig(size="tiny-qwen", val_dagger_episodes=1), demo_set_from_episodes(eps),
                      tmp_path / "c", device="cpu")


def test_keep_best_saves_the_ema_weights_with_the_lowest_held_out_loss(tmp_path):
    """keep_best scores the EMA weights on the held-out batch before training and at every log step, and the saved
    checkpoint holds the weights of the lowest score, not the last ones; a snapshot still holds its own minute's."""
    from wamrt.model.checkpoint import load_transformer

    eps, _ = _toy_episodes(n_episodes=4, length=4)
    cfg = TrainConfig(size="tiny-qwen", batch=6, lr=3e-2, warmup=1, aug_shift_px=0, aug_colour=0.0, ema=0.5,
                      val_episodes=1, val_batch=3, log_every=1, max_steps=6, minutes=10.0, keep_best=True)
    tr = PolicyTrainer(cfg, demo_set_from_episodes(eps), tmp_path / "ckpt", device="cpu")
    tr.cache_latents()
    live = [q.detach().clone() for q in tr.model.parameters()]
    assert tr.ema_val_loss() == tr.val_loss()  # the EMA starts as the live weights
    assert all(torch.equal(a, b) for a, b in zip(live, tr.model.parameters()))  # scoring the EMA restores them
    scripted = iter([5.0, 3.0, 1.0, 2.0, 4.0, 6.0, 7.0])  # held-out scores at steps 0..6: the best is step 2
    ema_at: dict[int, list[torch.Tensor]] = {}

    def scored() -> dict[str, float]:
        ema_at[tr.state.step] = [e.clone() for e in tr.ema]
        return {"val_action": next(scripted)}

    tr.ema_val_loss = scored
    tr.train()
    assert sorted(ema_at) == list(range(7))  # the start, then every step
    assert tr.best["step"] == 2 and tr.best["value"] == 1.0
    assert "ema val action 1.00000 (best)" in tr.log_path.read_text()
    out = tr.save()
    saved = load_transformer(out / "transformer", device="cpu", dtype=torch.float32)
    for p, w in zip(saved.parameters(), ema_at[2], strict=True):
        torch.testing.assert_close(p, w.to(torch.bfloat16).float())
    assert any(not torch.equal(w, last) for w, last in zip(ema_at[2], tr.ema, strict=True))  # step 2 is not the last
    meta = json.loads((out / "wamrt.json").read_text())["train"]
    assert meta["kept_best"] == {"step": 2, "metric": "val_action", "value": 1.0}
    snap = tr.save(folder=tmp_path / "snap")  # a snapshot is the current EMA, whatever the best
    current = load_transformer(snap / "transformer", device="cpu", dtype=torch.float32)
    for p, w in zip(current.parameters(), tr.ema, strict=True):
        torch.testing.assert_close(p, w.to(torch.bfloat16).float())
    assert "kept_best" not in json.loads((snap / "wamrt.json").read_text())["train"]
    with pytest.raises(ValueError, match="keep_best"):
        PolicyTrainer(TrainConfig(size="tiny-qwen", keep_best=True), demo_set_from_episodes(eps), tmp_path / "b",
                      device="cpu")


def test_normalized_training_targets_are_what_the_served_contract_undoes(tmp_path):
    """Train-time normalization is the exact inverse of the served denormalization: the chunk rows of a
    training batch, passed through the checkpoint's `actions_out` with the frame's raw state, are the expert's
    actions; the saved wamrt.json gives load_policy the same statistics."""
    import json

    import wamrt
    from wamrt.pipeline.denoise import DenoiseResult
    from wamrt.pipeline.droid import droid_actions

    eps, _ = _moving_episodes(length=5)
    tr = PolicyTrainer(TrainConfig(size="tiny-qwen", batch=4, aug_shift_px=0, aug_colour=0.0, log_every=1000),
                       demo_set_from_episodes(eps), tmp_path / "ckpt", device="cpu")
    norm = tr.contract.normalization
    assert norm is not None and norm.relative == (True,) * 7 + (False,)
    idx = np.array([0, 3, 7, 12])
    rows = tr.clean_batch(idx, augment_images=False)["action"][:, 1:, :8].numpy()
    for b, i in enumerate(idx):
        stop = tr.ds.episode_end[i]
        steps = np.minimum(i + np.arange(32), stop - 1)
        raw = droid_actions(DenoiseResult(None, torch.from_numpy(np.pad(rows[b], ((1, 0), (0, 56))))[None]),
                            tr.contract, tr.ds.state[i])
        np.testing.assert_allclose(raw, tr.ds.actions[steps], rtol=0, atol=2e-6)
    # statistics come from the training frames: the normalized targets are centred and unit-scale there
    every = tr.clean_batch(np.arange(len(tr.ds)), augment_images=False)["action"][:, 1:, :8]
    assert every.mean(0).abs().max() < 1e-4 and (every.std(0, unbiased=False) - 1).abs().max() < 1e-3
    folder = tr.save()
    saved = json.loads((folder / "wamrt.json").read_text())["action_normalization"]
    assert saved["relative"] == [True] * 7 + [False] and len(saved["action_std"]) == 32
    assert wamrt.load_policy(folder).contract.normalization == norm


def test_prompt_batches_use_one_instruction_and_no_key_mask(tmp_path):
    """One instruction per batch: the Generator attends to one unpadded prefix (no key mask), and the
    unconditional prompt replaces a whole batch at the text-dropout rate."""
    tr = _trainer(tmp_path, text_dropout=0.3)
    seen, empty = set(), 0
    for _ in range(60):
        idx, prompts, dropped = tr.sample_batch()
        assert dropped and len(set(prompts)) == 1 and len(prompts) == tr.cfg.batch
        if prompts[0] == "":
            empty += 1
        else:
            assert {tr.ds.prompt[i] for i in idx.tolist()} == {prompts[0]}  # frames of that instruction
        seen.add(prompts[0])
    assert seen == {"", PROMPT, "put the red cube on the green pad"} and 6 <= empty <= 35
    masks = []
    original = tr.model.attention
    tr.model.attention = lambda q, k, v, *, causal, key_mask: masks.append(key_mask) or original(
        q, k, v, causal=causal, key_mask=key_mask)
    tr.train_step(0.0)
    assert masks and all(m is None for m in masks)


def test_init_from_continues_a_checkpoint(tmp_path):
    """A second job starts where the first stopped: the saved (EMA, bf16) weights, the same VAE and the same
    normalization statistics, so the continued model keeps the first one's output space."""
    from wamrt.pipeline.policy import load_policy

    eps, _ = _toy_episodes()
    cfg = TrainConfig(size="tiny-qwen", batch=4, aug_shift_px=0, aug_colour=0.0, log_every=1000)
    first = PolicyTrainer(cfg, demo_set_from_episodes(eps), tmp_path / "a", device="cpu")
    for _ in range(3):
        first.train_step(0.0)
    saved = first.save()
    cfg2 = TrainConfig(size="tiny-qwen", batch=4, aug_shift_px=0, aug_colour=0.0, log_every=1000, seed=5,
                       init_from=str(saved))
    second = PolicyTrainer(cfg2, demo_set_from_episodes(eps[:2]), tmp_path / "b", device="cpu")
    ref = load_policy(saved).model.float()
    for (name, p), q in zip(second.model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach()), name
    assert second.contract.normalization == first.contract.normalization  # not refitted on the new demos
    assert (tmp_path / "b" / "vae" / "config.json").read_bytes() == (saved / "vae" / "config.json").read_bytes()
    with pytest.raises(ValueError, match="not a trained checkpoint"):
        PolicyTrainer(TrainConfig(size="tiny-qwen", init_from=str(tmp_path)), demo_set_from_episodes(eps),
                      tmp_path / "c", device="cpu")


def test_open_loop_reproduces_the_served_request(tmp_path):
    """wamrt.train.openloop rebuilds each request from the stored canvas and state row: its chunk is the one
    Policy.infer returns for the original observation with the same seed."""
    import wamrt
    from wamrt.train.openloop import open_loop_chunks

    _, obs0 = _toy_episodes()
    tr = _trainer(tmp_path)  # the same toy episodes, 4 frames each
    folder = tr.save()
    policy = wamrt.load_policy(folder, device="cpu")
    frames = np.array([0, 4])  # frame 0 of the first two episodes
    chunks = open_loop_chunks(policy, tr.ds, frames, seed=11)
    for n, (obs, _) in enumerate(obs0[:2]):
        np.testing.assert_allclose(chunks[n], policy.infer(obs, seed=11 + n).actions, rtol=0, atol=1e-4)


def _moving_episodes(n_episodes: int = 3, length: int = 6, seed: int = 3):
    """Actions that move away from the state by a different offset per frame, gripper flipping; also each
    episode's observation (every frame of an episode shows the same one)."""
    rng = np.random.default_rng(seed)
    eps, observations = [], []
    for e in range(n_episodes):
        joints = rng.uniform(-1, 1, 7)
        obs = _obs(rng, joints, 0.2 * e)
        actions = np.concatenate([joints + rng.normal(0, 0.1, (length, 7)), rng.integers(0, 2, (length, 1))], axis=1)
        eps.append(episode_from_observations([obs] * length, actions))
        observations.append(obs)
    return eps, observations


def test_prefix_training_packing_equals_served_prefix_packing(tmp_path):
    """--prefix-max: a sample with prefix length d is packed as a served request whose `action_prefix` holds the same
    d ground-truth rows (clean mode): the same clean rows after the state row (normalized alike), the same
    generated-row mask, the same velocities; those rows are out of the loss; the checkpoint says it was trained so,
    and a loaded policy then reads prefixes as clean rows by default."""
    import json

    import wamrt
    from wamrt.model.transformer import GeneratorTokens
    from wamrt.pipeline.denoise import _prefill
    from wamrt.train.samples import prefix_action_noisy

    eps, observations = _moving_episodes()
    tr = PolicyTrainer(TrainConfig(size="tiny-qwen", batch=4, aug_shift_px=0, aug_colour=0.0, log_every=1000,
                                   prefix_max=14), demo_set_from_episodes(eps), tmp_path / "ckpt", device="cpu")
    tr.cache_latents()
    tr.model.eval()
    i, d, obs = 7, 4, observations[1]  # episode 1, frame 1: its next 4 actions are the committed rows
    prefix = tr.ds.actions[i:i + d]  # robot space: the expert's actions, as a reply's rows are
    prep = prepare_droid(dict(obs, action_prefix=prefix, action_prefix_mode="clean"), model=tr.model,
                         encoder=tr.encoder, tokenizer=tr.tokenizer, contract=tr.contract, seed=11, device=tr.device)
    inp = prep.inputs
    batch = tr.clean_batch(np.array([i]), augment_images=False)
    a0 = batch["action"]
    torch.testing.assert_close(inp.action[:, 0], a0[:, 0], rtol=0, atol=0)  # the state row
    torch.testing.assert_close(inp.action[:, 1:1 + d], a0[:, 1:1 + d], rtol=0, atol=2e-6)  # the committed rows
    train_noisy = prefix_action_noisy(torch.tensor([d]), a0.shape[1], tr.contract.history)
    assert torch.equal(train_noisy, inp.action_noisy)
    torch.testing.assert_close(batch["vision"][:, :, :1], inp.vision[:, :, :1], rtol=0, atol=2e-5)

    sigma = torch.tensor([0.833])
    with torch.no_grad():
        out = tr.velocity([obs["prompt"]], sigma, inp.vision, inp.action, train_noisy)
        kv, rope = _prefill(tr.model, inp.cond)
        ref = tr.model.generator_step(GeneratorTokens(
            timesteps=sigma * 1000, vision=inp.vision, vision_noisy=inp.vision_noisy, action=inp.action,
            action_noisy=inp.action_noisy, domain_ids=inp.domain_ids), rope, kv)
    torch.testing.assert_close(out.action, ref.action, rtol=1e-4, atol=1e-5)
    assert float(out.action[:, : 1 + d].abs().max()) == 0.0  # clean rows: zero velocity

    # The committed rows are out of the loss: garbage velocities there change nothing, elsewhere they do.
    velocity = tr.velocity

    def spoiled(rows):
        def run(*args, **kw):
            o = velocity(*args, **kw)
            o.action[:, rows] += 100.0
            return o
        return run

    def loss(rows, d_batch):
        tr.velocity = spoiled(rows) if rows is not None else velocity
        tr.gen.manual_seed(5)
        with torch.no_grad():
            return float(tr.loss({**batch, "prefix_rows": torch.tensor([d_batch])}, text_dropout=False)["action"])

    base = loss(None, d)
    assert loss(slice(1, 1 + d), d) == base and loss(slice(1 + d, 2 + d), d) > base + 1.0
    assert loss(slice(1, 1 + d), 0) > base + 1.0
    tr.velocity = velocity

    drawn = torch.cat([tr.prefix_rows(64, tr.gen) for _ in range(20)])
    assert int(drawn.min()) == 0 and int(drawn.max()) == 14 and 0.1 < float((drawn == 0).float().mean()) < 0.4
    for _ in range(3):
        assert np.isfinite(tr.train_step(0.0)["loss"])
    folder = tr.save()
    meta = json.loads((folder / "wamrt.json").read_text())
    assert meta["trained_with_action_prefix"] is True and meta["action_prefix"]["max_rows"] == 14
    pol = wamrt.load_policy(folder, device="cpu")
    assert pol.contract.trained_with_action_prefix
    got = pol.infer(dict(obs, action_prefix=prefix), seed=1, steps=2)
    assert got.prefix_mode == "clean" and np.abs(got.actions[:d] - prefix).max() <= 1e-5


def test_perturbed_prefix_rows_and_their_return():
    """--prefix-noise: each prefixed sample's d prefix rows are the ground truth plus one joint offset, the rows
    after them are to return from it (e-folding over K rows), the state row, the gripper column and samples
    without a prefix are untouched."""
    from wamrt.train.samples import perturb_prefix

    b, rows, width, history = 3, 33, 10, 1
    a0 = torch.randn(b, rows, width, generator=torch.Generator().manual_seed(0))
    d = torch.tensor([4, 0, 14])
    a_in, target = perturb_prefix(a0, d, history, 7, 0.3, 4.0, torch.Generator().manual_seed(1))
    off_in, off_t = a_in - a0, target - a0
    z = off_in[0, 1]
    assert float(z[:7].abs().min()) > 0 and float(z[7:].abs().max()) == 0  # joints only
    torch.testing.assert_close(off_in[0, 1:5], z.expand(4, width))  # the 4 prefix rows share the offset
    assert float(off_in[0, 5:].abs().max()) == 0 and float(off_in[:, 0].abs().max()) == 0  # nothing else moves
    assert float(off_in[1].abs().max()) == 0 and float(off_t[1].abs().max()) == 0  # no prefix: untouched
    k = torch.arange(rows - 5, dtype=a0.dtype)
    torch.testing.assert_close(off_t[0, 5:], z[None] * torch.exp(-(k + 1) / 4.0)[:, None])  # the return
    assert float(off_t[0, :5].abs().max()) == 0  # targets of the state and prefix rows (out of the loss) unchanged
    assert float(off_in[2, 15:].abs().max()) == 0 and float(off_in[2, 14, :7].abs().min()) > 0  # d = 14: rows 1-14
    _, at_once = perturb_prefix(a0, d, history, 7, 0.3, 0.0, torch.Generator().manual_seed(1))
    assert torch.equal(at_once, a0)  # K = 0: the targets are the ground truth, a jump back


def test_prefix_noise_trains_on_perturbed_rows_and_says_so(tmp_path):
    """With prefix_noise the loss sees perturbed prefix rows (so it differs from the ground-truth loss on the same
    draw), the held-out loss does not (comparable across runs), and wamrt.json records the setting."""
    import json

    eps, _ = _moving_episodes()
    cfg = dict(size="tiny-qwen", batch=4, aug_shift_px=0, aug_colour=0.0, log_every=1000, prefix_max=14,
               val_episodes=1)
    tr = PolicyTrainer(TrainConfig(**cfg, prefix_noise=0.5), demo_set_from_episodes(eps), tmp_path / "ckpt",
                       device="cpu")
    tr.cache_latents()
    batch = tr.clean_batch(np.array([3, 7, 9, 12]), augment_images=False)

    def loss(**kw):
        tr.gen.manual_seed(5)
        with torch.no_grad():
            return float(tr.loss({**batch, "prefix_rows": torch.tensor([3, 0, 6, 10])}, text_dropout=False,
                                 **kw)["action"])

    assert loss() != loss(perturbed=False) and loss() == loss()
    plain = PolicyTrainer(TrainConfig(**cfg), demo_set_from_episodes(eps), tmp_path / "plain", device="cpu")
    plain.cache_latents()
    plain.model.load_state_dict(tr.model.state_dict())
    assert tr.val_loss() == plain.val_loss()
    with pytest.raises(ValueError, match="prefix_noise"):
        PolicyTrainer(TrainConfig(**cfg, prefix_noise=-1.0), demo_set_from_episodes(eps), tmp_path / "bad",
                      device="cpu")
    meta = json.loads((tr.save() / "wamrt.json").read_text())
    assert meta["action_prefix"]["noise"] == 0.5 and meta["action_prefix"]["noise_return_rows"] == 4.0


def test_prefix_open_loop_compares_no_prefix_expert_and_own_rows(tmp_path):
    """wamrt.train.openloop's prefix comparison: frames with an earlier request in their episode, the committed rows
    taken from that request's chunk `stride` rows on, errors on rows d..d+7 against the expert's."""
    import wamrt
    from wamrt.train.data import chunk_indices
    from wamrt.train.openloop import open_loop_chunks, prefix_open_loop, progress_ratio

    eps, _ = _moving_episodes()
    tr = PolicyTrainer(TrainConfig(size="tiny-qwen", batch=4, aug_shift_px=0, aug_colour=0.0, log_every=1000,
                                   prefix_max=14), demo_set_from_episodes(eps), tmp_path / "ckpt", device="cpu")
    folder = tr.save()
    d, stride = 3, 2
    res = prefix_open_loop(folder, tr.ds, d, stride=stride, device="cpu")
    assert res["frames"] == 3 * 2 and res["rows"] == [3, 10]  # frames 2 and 4 of each 6-frame episode
    policy = wamrt.load_policy(folder, device="cpu")
    frames = np.array([0, 2, 4, 6, 8, 10, 12, 14, 16])
    later = np.array([f % 6 != 0 for f in frames])
    plain = open_loop_chunks(policy, tr.ds, frames, seed=0)
    targets = tr.ds.actions[chunk_indices(tr.ds, frames, policy.contract.chunk)]
    own = plain[np.flatnonzero(later) - 1][:, stride:stride + d]
    assert res["own_prefix_joint_abs_err_rad_mean"] == pytest.approx(
        float(np.abs(own[..., :7] - targets[later][:, :d, :7]).mean()), rel=1e-5)
    assert res["none_joint_abs_err_rad_mean"] == pytest.approx(
        float(np.abs(plain[later][:, d:d + 8, :7] - targets[later][:, d:d + 8, :7]).mean()), rel=1e-5)
    assert len(res["own_joint_abs_err_rad_per_row"]) == 8
    assert res["expert_joint_abs_err_rad_mean"] != res["own_joint_abs_err_rad_mean"]
    assert res["none_progress_ratio"] == pytest.approx(progress_ratio(plain[later], targets[later], d, 8), rel=1e-5)


def test_progress_ratio_is_the_share_of_the_experts_displacement() -> None:
    """`openloop.progress_ratio`: chunks that move as the expert 1, half as far 0.5, backwards -1; motion across the
    expert's direction counts nothing, and jitter inside the window (recorded action noise) does not count."""
    from wamrt.train.openloop import progress_ratio

    rng = np.random.default_rng(0)
    targets = np.cumsum(rng.normal(0, 0.05, (5, 32, 8)), axis=1).astype(np.float32)
    start = targets[:, 2:3]
    assert progress_ratio(targets, targets, 2, 8) == pytest.approx(1.0)
    assert progress_ratio(start + 0.5 * (targets - start), targets, 2, 8) == pytest.approx(0.5)
    assert progress_ratio(start - (targets - start), targets, 2, 8) == pytest.approx(-1.0)
    jittered = targets.copy()
    jittered[:, 3:9] += rng.normal(0, 0.3, (5, 6, 8))  # rows strictly inside the window 2..9
    assert progress_ratio(jittered, targets, 2, 8) == pytest.approx(1.0)
    de = targets[:, 9, :7] - targets[:, 2, :7]
    across = np.zeros_like(targets)  # row 9 turned by 90 degrees in the joint pairs (0, 1), (2, 3), (4, 5)
    across[:, 9, [0, 1, 2, 3, 4, 5]] = np.stack([-de[:, 1], de[:, 0], -de[:, 3], de[:, 2], -de[:, 5], de[:, 4]], 1)
    assert progress_ratio(across, targets, 2, 8) == pytest.approx(0.0, abs=1e-6)


def _dagger_episode(obs: dict, length: int = 3, prefix: int = 2, seed: int = 9, unseen: list[bool] | None = None):
    """A DAgger episode built by hand: `length` requests of one observation, each with its own chunk (and, given
    `unseen`, the recorder's grasp_unseen marks)."""
    from wamrt.client.realtime import JOINT_KEY

    rng = np.random.default_rng(seed)
    arrays, meta = episode_from_observations([obs] * length, np.zeros((length, 8), np.float32))
    joints = np.asarray(obs[JOINT_KEY], np.float32)
    chunk = np.concatenate([joints + rng.normal(0, 0.2, (length, 32, 7)), rng.integers(0, 2, (length, 32, 1))],
                           axis=2).astype(np.float32)
    arrays.update(chunk=chunk, prefix_rows=np.full(length, prefix, np.int64), actions=chunk[:, 0].copy())
    if unseen is not None:
        arrays["grasp_unseen"] = np.asarray(unseen, bool)
    return arrays, meta


def test_trainer_takes_a_dagger_frames_chunk_and_prefix_and_no_future_frames(tmp_path):
    from wamrt.train.data import demo_set_from_episodes

    eps, observations = _moving_episodes()
    dagger = _dagger_episode(observations[0])
    ds = demo_set_from_episodes([*eps, dagger])
    n = sum(len(a["actions"]) for a, _ in eps)
    assert ds.chunk_row is not None and ds.chunk_row[:n].max() == -1 and ds.chunk_row[n:].tolist() == [0, 1, 2]
    tr = PolicyTrainer(TrainConfig(size="tiny-qwen", batch=4, aug_shift_px=0, aug_colour=0.0, log_every=1000,
                                   prefix_max=14, prefix_noise=0.5), ds, tmp_path / "ckpt", device="cpu")
    tr.cache_latents()
    idx = np.array([1, n + 1, 4, n + 2])
    batch = tr.clean_batch(idx, augment_images=False)
    assert batch["fixed_prefix"].tolist() == [-1, 2, -1, 2] and batch["vision_weight"].tolist() == [1, 0, 1, 0]
    # the DAgger frame's rows are its recorded chunk, normalized as the served contract normalizes actions
    plain = tr.clean_batch(np.array([1]), augment_images=False)["action"]
    torch.testing.assert_close(batch["action"][:1], plain)  # an expert frame is as before
    recorded = torch.from_numpy(dagger[0]["chunk"][1].copy())
    recorded[:, -1] = 1.0 - recorded[:, -1]
    norm = tr._norm
    assert norm is not None
    expect = (recorded - tr.raw_state[n + 1][None] * norm["relative"] - norm["action_mean"]) / norm["action_std"]
    torch.testing.assert_close(batch["action"][1, tr.contract.history:, :8], expect)
    # no future frames: frame 0 stands in for them, and they are out of the vision loss
    assert torch.equal(batch["vision"][1, :, 1:], batch["vision"][1, :, :1].expand_as(batch["vision"][1, :, 1:]))

    # its prefix is the recorded one (clean rows, out of the loss) and is never perturbed; the vision loss ignores it
    velocity = tr.velocity

    def loss(rows=None, sample=None, vision=False):
        def spoiled(*args, **kw):
            o = velocity(*args, **kw)
            if rows is not None:
                o.action[sample, rows] += 100.0
            if vision:
                o.vision[sample] += 100.0
            return o
        tr.velocity = spoiled
        tr.gen.manual_seed(5)
        with torch.no_grad():
            out = tr.loss({**batch, "prefix_rows": torch.tensor([5, 5, 5, 5])}, text_dropout=False)
        tr.velocity = velocity
        return float(out["action"]), float(out["vision"])

    base_a, base_v = loss()
    assert loss(slice(1, 3), 1)[0] == base_a  # rows 1..2 of the DAgger sample: its prefix, clean
    assert loss(slice(3, 4), 1)[0] > base_a + 1.0  # the row after it is generated
    assert loss(slice(3, 6), 0)[0] == base_a  # the expert sample drew 5 rows: rows 1..5 clean
    assert loss(sample=1, vision=True)[1] == base_v and loss(sample=0, vision=True)[1] > base_v + 1.0
    for _ in range(2):
        assert np.isfinite(tr.train_step(0.0)["loss"])
    assert tr.save().joinpath("wamrt.json").read_text().count('"dagger_frames": 3') == 1

    # --dagger-repeat K: a DAgger frame is drawn K times as often as an expert frame
    heavy = PolicyTrainer(TrainConfig(size="tiny-qwen", batch=4, aug_shift_px=0, aug_colour=0.0, log_every=1000,
                                      dagger_repeat=4), ds, tmp_path / "heavy", device="cpu")
    drawn = heavy.train_idx_t.tolist()
    assert all(drawn.count(i) == 4 for i in range(n, n + 3)) and all(drawn.count(i) == 1 for i in range(n))
    assert sum(len(p) for p in heavy.prompt_pools) == len(drawn)

    # --dagger-d0-repeat K0: DAgger frames without a prefix (recorded at d = 0) drawn K0 times instead
    at_d0 = _dagger_episode(observations[0], prefix=0, seed=10)
    mixed = demo_set_from_episodes([*eps, dagger, at_d0])
    assert mixed.fixed_prefix is not None and mixed.fixed_prefix[n:].tolist() == [2, 2, 2, 0, 0, 0]
    weighted = PolicyTrainer(TrainConfig(size="tiny-qwen", batch=4, aug_shift_px=0, aug_colour=0.0, log_every=1000,
                                         dagger_repeat=4, dagger_d0_repeat=2), mixed, tmp_path / "d0", device="cpu")
    drawn = weighted.train_idx_t.tolist()
    assert [drawn.count(i) for i in range(n, n + 6)] == [4, 4, 4, 2, 2, 2]
    with pytest.raises(ValueError, match="dagger_d0_repeat"):
        PolicyTrainer(TrainConfig(size="tiny-qwen", dagger_d0_repeat=0), mixed, tmp_path / "bad", device="cpu")


def test_gripper_disagreements_are_read_from_the_replies_and_drawn_again(tmp_path):
    """`gripper_disagrees`: over the rows after the prefix the arm runs, the reply's gripper against the label's; the
    recorded replies give it at load time, and --dagger-disagree-repeat K draws those requests K times as often again
    (a grasp_unseen one, whose gripper is out of the loss, is not drawn again)."""
    from wamrt.eval.dagger import RUN_ROWS, gripper_disagrees
    from wamrt.train.data import load_demo_set

    label = np.zeros((4, 32, 8), np.float32)
    label[:, 2 + RUN_ROWS // 2:, 7] = 1.0  # closes halfway through the run rows after a 2-row prefix: mean 0.5
    label[1, :, 7] = 1.0
    reply = label.copy()
    reply[1, 2:2 + RUN_ROWS, 7] = 0.0  # the reply stays open where the label closes
    reply[2, :] = np.nan  # no reply reached the lane
    reply[3, 2:2 + RUN_ROWS, 7] = 1.0  # the reply closes where the label is at 0.5, "open"
    reply[3, 10 + RUN_ROWS:, 7] = 0.0  # ... and differs only after the run rows at prefix 10
    prefix = np.array([2, 2, 2, 10])
    assert gripper_disagrees(label, reply, prefix).tolist() == [False, True, False, False]
    assert gripper_disagrees(label, reply, np.array([2, 2, 2, 2])).tolist() == [False, True, False, True]

    eps, observations = _moving_episodes()
    arrays, meta = _dagger_episode(observations[0], length=4, prefix=2, unseen=[False, True, False, False])
    arrays["chunk"] = label
    arrays["prefix_rows"] = np.array([2, 2, 2, 2])
    ep_files = []
    for i, (a, m) in enumerate([*eps, (arrays | {"reply": reply}, meta)]):
        ep_files.append(tmp_path / f"ep{i}.npz")
        np.savez(ep_files[-1], meta=np.array(json.dumps(m)), **a)
    ds = load_demo_set(ep_files)
    assert ds.grip_disagrees is not None and ds.grip_disagrees.tolist() == [False, True, False, True]
    n = sum(len(a["actions"]) for a, _ in eps)
    tr = PolicyTrainer(TrainConfig(size="tiny-qwen", batch=4, aug_shift_px=0, aug_colour=0.0, log_every=1000,
                                   dagger_repeat=2, dagger_disagree_repeat=3), ds, tmp_path / "ckpt", device="cpu")
    drawn = tr.train_idx_t.tolist()
    assert [drawn.count(i) for i in range(n, n + 4)] == [2, 2, 2, 6]  # request 1 is grasp_unseen
    assert all(drawn.count(i) == 1 for i in range(n))
    with pytest.raises(ValueError, match="dagger_disagree_repeat"):
        PolicyTrainer(TrainConfig(size="tiny-qwen", dagger_disagree_repeat=0), ds, tmp_path / "bad", device="cpu")


def _action_loss_rise(tr, batch, prefix_rows: int, sample: int, row: int, column: Any = slice(None)) -> float:
    """How much the action loss rises when the velocity of `sample`'s generated row `row` (after the state row),
    at `column`, is off by 100: 0 where that entry is out of the loss. Same sigmas and noise both times."""
    velocity, h = tr.velocity, tr.contract.history
    d = torch.full((len(batch["prompts"]),), prefix_rows)

    def run(spoil: bool) -> float:
        def spoiled(*args, **kw):
            o = velocity(*args, **kw)
            if spoil:
                o.action[sample, h + row, column] += 100.0
            return o
        tr.velocity = spoiled
        tr.gen.manual_seed(3)
        with torch.no_grad():
            out = tr.loss({**batch, "prefix_rows": d}, text_dropout=False)
        tr.velocity = velocity
        return float(out["action"])

    return run(True) - run(False)


def test_an_unseen_grasps_gripper_column_stays_out_of_the_loss_after_its_prefix(tmp_path):
    """A DAgger chunk marked grasp_unseen (eval/dagger.py) teaches its joints but not its gripper after the prefix;
    an unmarked chunk, an expert frame, and the marked chunk with --learn-unseen-grasps learn the gripper."""
    from wamrt.train.data import demo_set_from_episodes

    eps, observations = _moving_episodes()
    dagger = _dagger_episode(observations[0], unseen=[False, True, False])
    old = _dagger_episode(observations[0], seed=11)  # recorded before the mark existed: no grasp_unseen array
    ds = demo_set_from_episodes([*eps, dagger, old])
    n = sum(len(a["actions"]) for a, _ in eps)
    assert ds.grasp_unseen is not None and ds.grasp_unseen.tolist() == [False, True, False, False, False, False]

    def cost(mask: bool, sample: int, column: int, row: int) -> float:
        tr = PolicyTrainer(TrainConfig(size="tiny-qwen", batch=4, aug_shift_px=0, aug_colour=0.0, log_every=1000,
                                       prefix_max=14, mask_unseen_grasps=mask), ds, tmp_path / f"m{mask}",
                           device="cpu")
        tr.cache_latents()
        batch = tr.clean_batch(np.array([1, n, n + 1, n + 4]), augment_images=False)
        return _action_loss_rise(tr, batch, 3, sample, row, column)

    gripper, joint = 7, 2
    assert cost(True, 2, gripper, 5) == 0.0  # the marked chunk, after its 2-row prefix
    assert cost(True, 2, joint, 5) > 1.0  # its joints are still learnt
    for sample in (0, 1, 3):  # an expert frame, an unmarked chunk, a chunk from before the mark
        assert cost(True, sample, gripper, 5) > 1.0
    assert cost(False, 2, gripper, 5) > 1.0  # --learn-unseen-grasps


def test_gripper_weight_weighs_the_gripper_column(tmp_path):
    """--gripper-weight W: an error in the gripper column costs W times what the same error in a joint column costs,
    before and after a prefix, and a marked unseen grasp's gripper stays out of the loss whatever W is."""
    from wamrt.train.data import demo_set_from_episodes

    eps, observations = _moving_episodes()
    ds = demo_set_from_episodes([*eps, _dagger_episode(observations[0], unseen=[True, True, True])])
    n = sum(len(a["actions"]) for a, _ in eps)

    def cost(weight: float, column: int, prefix: int, sample: int = 0) -> float:
        tr = PolicyTrainer(TrainConfig(size="tiny-qwen", batch=2, aug_shift_px=0, aug_colour=0.0, log_every=1000,
                                       gripper_loss_weight=weight), ds, tmp_path / f"g{weight}", device="cpu")
        tr.cache_latents()
        batch = tr.clean_batch(np.array([1, n + 1]), augment_images=False)
        return _action_loss_rise(tr, batch, prefix, sample, 5, column)

    gripper, joint = 7, 2
    for prefix in (0, 3):  # same weights and noise at both W: the ratio of ratios is W, whatever the errors are
        plain = cost(1.0, gripper, prefix) / cost(1.0, joint, prefix)
        assert cost(3.0, gripper, prefix) / cost(3.0, joint, prefix) == pytest.approx(3 * plain, rel=1e-3)
    assert cost(3.0, gripper, 2, sample=1) == 0.0 and cost(3.0, joint, 2, sample=1) > 1.0
    with pytest.raises(ValueError, match="gripper_loss_weight"):
        PolicyTrainer(TrainConfig(size="tiny-qwen", gripper_loss_weight=0.0), ds, tmp_path / "bad", device="cpu")


def test_seam_weight_weighs_the_rows_right_after_a_prefix(tmp_path):
    """--seam-weight W: an error on one of the first --seam-rows generated rows after a prefix costs W times what the
    same error on a later row costs; samples without a prefix have no seam."""
    from wamrt.train.data import demo_set_from_episodes

    eps, _ = _moving_episodes()
    ds = demo_set_from_episodes(eps)

    def cost(weight: float, row: int, prefix: int) -> float:
        tr = PolicyTrainer(TrainConfig(size="tiny-qwen", batch=2, aug_shift_px=0, aug_colour=0.0, log_every=1000,
                                       seam_weight=weight, seam_rows=2), ds, tmp_path / f"s{weight}", device="cpu")
        tr.cache_latents()
        batch = tr.clean_batch(np.array([1, 7]), augment_images=False)
        return _action_loss_rise(tr, batch, prefix, 0, row)

    # prefix 3: rows 3 and 4 are the seam, row 10 is not
    plain_seam, plain_later = cost(1.0, 3, 3), cost(1.0, 10, 3)
    assert plain_seam == pytest.approx(plain_later, rel=0.05)
    seam, later = cost(4.0, 4, 3), cost(4.0, 10, 3)
    assert seam == pytest.approx(4 * later, rel=0.05)
    assert cost(4.0, 0, 0) == pytest.approx(cost(4.0, 10, 0), rel=0.05)  # no prefix, no seam
    with pytest.raises(ValueError, match="seam_weight"):
        PolicyTrainer(TrainConfig(size="tiny-qwen", seam_weight=0.0), ds, tmp_path / "bad", device="cpu")
