"""World generation over several CPU processes (gloo): Ulysses sequence parallelism, CFG-parallel and both, through
the same `wamrt.parallel.start` front `wamrt serve --parallel ulysses|cfg,ulysses` uses, against the single-process
`WorldEngine` (itself tested against `run_world`, tests/engine/test_world_engine.py).

tiny-world: 4 query heads, 2 K/V heads, sound heads. Ulysses-2 splits both; Ulysses-4 repeats each K/V head twice
(the degree does not divide the K/V heads). The t2v request (5 frames at 32x48: 4 vision tokens, 9 sound frames)
leaves a rank without vision rows at degree 4 and pads every rank; the i2v one has a clean frame and an odd latent
width (patchify pads the edge tokens).

Tolerance (fp32): the parallel runs reorder fp32 sums only (GEMMs over a rank's rows instead of the whole
sequence, each CFG branch as its own pass where the single engine batches both), so the latents agree to a few
roundings: TOL relative to the largest latent (measured 0.4-1.2e-6). A wrong head slice, a row in the wrong place,
a dropped padding mask or a missed exchange is off by O(1) (measured 5e-2 for a missed zeroing of patchify's
padding slots alone).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from wamrt import load_policy
from wamrt.engine.world import WORLD_ENGINE_CONFIG, WorldEngine
from wamrt.parallel import ParallelSpec, start
from wamrt.parallel.ulysses import HeadSplit, SequenceLayout, chunk
from wamrt.parallel.world import WorldLayout
from wamrt.pipeline.sound import SoundDecoder, load_sound_tokenizer
from wamrt.serving.world_model import find_sound_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # the sound tokenizer's weight_norm
TOL = 2e-5
ECONF = dict(attention="auto", compile=False, cuda_graph=False)
PICTURE = (np.arange(40 * 70 * 3) % 251).astype(np.uint8).reshape(40, 70, 3)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("WAMRT_CACHE", str(tmp_path_factory.mktemp("cache")))  # inherited by the spawned workers
    policy = load_policy("tiny-world", device="cpu")
    sound = SoundDecoder(load_sound_tokenizer(find_sound_tokenizer("tiny-world")))
    single = WorldEngine(policy.model, policy.encoder, policy.tokenizer, replace(WORLD_ENGINE_CONFIG, **ECONF))
    yield single, sound
    mp.undo()


# Video transfer: one control with control guidance (a third, no-control pass), and two weighted controls (two
# attention passes per layer) with control guidance inside an interval.
SOURCE = np.stack([np.roll(PICTURE, 7 * k, axis=1) for k in range(5)])
TRANSFER = {"edge": {"controls": {"edge": True}, "control_guidance": 1.5},
            "edge_blur": {"controls": {"edge": True, "blur": {"control_weight": 0.5}}, "control_guidance": 2.0,
                          "control_guidance_interval": [900, 1000]}}


def _request(case: str, seed: int = 1, **over: Any) -> dict[str, Any]:
    kw = dict(prompt="a red ball rolls across a wooden table", negative_prompt="blurry", height=32, width=48,
              num_frames=5, steps=2, guidance=3.0, shift=10.0, generator=torch.Generator().manual_seed(seed))
    if case == "t2v":
        kw["enable_sound"] = True
    elif case == "i2v":
        kw["image"] = PICTURE
    elif case in TRANSFER:
        kw.update(control_source=SOURCE, **TRANSFER[case])
    return {**kw, **over}


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    err = float((got - want).abs().max())
    assert err <= TOL * float(want.abs().max()), err
    return err


def _compare(front, stack, cases=(("t2v", {}), ("i2v", {}))) -> None:
    single, sound = stack
    for case, over in cases:
        got = front.world_front.run(sound_decoder=sound, decode=False, **_request(case, **over))
        want = single.run(sound_decoder=sound, decode=False, **_request(case, **over))
        _close(got.video_latents, want.video_latents)
        assert (got.sound_latents is None) == (want.sound_latents is None)
        if want.sound_latents is not None:
            _close(got.sound_latents, want.sound_latents)


def _front(mode: str, gpus: int, **world_engine: Any):
    return start(ParallelSpec(mode, "tiny-world", gpus, "cpu", engine=ECONF, world_engine=world_engine))


class _Fronts:
    """At most one running front at a time (each is a process group of this process): tests of one layout share
    it, the next layout's first test closes it."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.front: Any = None

    def get(self, mode: str, gpus: int, **world_engine: Any):
        key = (mode, gpus, tuple(sorted(world_engine.items())))
        if key != self.key:
            self.close()
            self.front, self.key = _front(mode, gpus, **world_engine), key
        return self.front

    def close(self) -> None:
        if self.front is not None:
            self.front.close()
        self.front = self.key = None


@pytest.fixture(scope="module")
def fronts(stack):
    running = _Fronts()
    yield running
    running.close()


@pytest.fixture
def ulysses2(fronts):
    return fronts.get("ulysses", 2)


def test_ulysses_2_equals_single_process(stack, ulysses2):
    _compare(ulysses2, stack)
    assert ulysses2.world_front.metadata()["engine"]["parallel"] == "ulysses 2"


def test_ulysses_2_transfer_equals_single_process(stack, ulysses2):
    _compare(ulysses2, stack, [("edge", {}), ("edge_blur", {})])


def test_distilled_sampler_on_ulysses_2(stack, ulysses2):
    """The few-step sampler: its pre-drawn re-noising draws and the clean frame it re-anchors to (i2v) are sharded
    into each rank's rows like the state."""
    from wamrt.sampler import DistilledSchedule

    single, _ = stack
    for case in ("t2v", "i2v"):
        kw = {k: v for k, v in _request(case, 3).items() if k not in ("steps", "guidance", "shift", "negative_prompt",
                                                                       "enable_sound")}
        schedule = DistilledSchedule((1.0, 0.8333, 0.4125, 0.2), stochastic=True)
        got = ulysses2.world_front.run_distilled(schedule=schedule, decode=False, **kw)
        kw["generator"] = torch.Generator().manual_seed(3)
        want = single.run_distilled(schedule=schedule, decode=False, **kw)
        _close(got.video_latents, want.video_latents)


def test_a_stopped_request_frees_every_rank(stack, ulysses2):
    """Rank 0's on_step raising after the first step (a cancelled job): every rank leaves the loop, and the group
    serves the next request."""
    with pytest.raises(KeyError):
        ulysses2.world_front.run(sound_decoder=stack[1], decode=False, on_step=_stop_at_first, **_request("t2v"))
    _compare(ulysses2, stack, [("t2v", {"seed": 5})])


def _stop_at_first(i: int, n: int) -> None:
    raise KeyError("stop")


def test_served_ulysses_generates_and_answers_policy_requests(ulysses2):
    """`wamrt serve --parallel ulysses`: /v1/videos/sync generates over both ranks; /v1/policy/infer runs on rank 0."""
    import httpx

    from wamrt.client.wire import packb, unpackb
    from wamrt.sample import sample_observation
    from wamrt.serving import ServeConfig, ServerThread

    config = ServeConfig(model_name="tiny-world", steps=1, max_batch=1, max_video_pixels=64 * 48 * 9)
    cache = ulysses2.world_front.engine.kv_cache  # rank 0's world engine: its Reasoner cache counts the prompts
    seen = cache.hits + cache.misses
    with ServerThread(ulysses2, config) as server:
        form = {"prompt": "a robotic arm picks up a pear", "size": "64x48", "num_frames": "9", "fps": "16",
                "num_inference_steps": "2", "seed": "3", "generate_sound": "true"}
        r = httpx.post(server.http_url + "/v1/videos/sync", data=form, headers={"accept": "application/json"},
                       timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["video"]["shape"] == [9, 48, 64, 3] and body["metadata"]["sound"] is True
        assert cache.hits + cache.misses > seen  # generated on the parallel world engine
        r = httpx.post(server.http_url + "/v1/policy/infer", content=packb(sample_observation(0)),
                       headers={"content-type": "application/msgpack"}, timeout=60)
        assert r.status_code == 200 and unpackb(r.content)["actions"].shape[1] == 8
        assert server.service.policy.metadata()["engine"]["parallel"] == "ulysses"


@pytest.fixture
def cfg2(fronts):
    return fronts.get("cfg,ulysses", 2)


def test_cfg_parallel_world_equals_single_process(stack, cfg2):
    """cfg,ulysses on 2 ranks: CFG-parallel alone (cfg 2 × ulysses 1), the conditional pass on one rank and the
    unconditional one on the other; with guidance 1 the only pass runs on both."""
    _compare(cfg2, stack, [("t2v", {}), ("i2v", {}), ("t2v", {"guidance": 1.0})])
    assert cfg2.world_front.metadata()["engine"]["parallel"] == "cfg 2 × ulysses 1"


def test_cfg_parallel_transfer_equals_single_process(stack, cfg2):
    """Transfer's no-control pass runs beside the unconditional one; with guidance 1 beside nothing (the
    conditional and no-control passes on one rank each)."""
    _compare(cfg2, stack, [("edge", {}), ("edge_blur", {}), ("edge", {"guidance": 1.0})])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ulysses", "cfg,ulysses"])
def test_four_ranks_equal_single_process(stack, fronts, mode):
    """Ulysses-4 (K/V heads repeated: 2 K/V heads over 4 ranks) with prompt buckets off (exact prefix lengths:
    one attention call per CFG branch over its own keys), and CFG 2 × Ulysses 2 with the world engine's buckets."""
    front = fronts.get(mode, 4, **({"prompt_bucket": 0} if mode == "ulysses" else {}))
    _compare(front, stack, [("t2v", {}), ("i2v", {}), ("edge_blur", {})])


def test_world_layouts_that_do_not_divide_fail_in_one_line():
    for mode, gpus, words in (("cfg,ulysses", 3, "odd"), ("ulysses", 3, "must divide the model's 4 attention heads"),
                              ("cfg,ulysses", 6, "must divide the model's 4 attention heads")):
        with pytest.raises(ValueError, match=words) as err:
            _front(mode, gpus)
        assert "\n" not in str(err.value)
    assert WorldLayout.of("cfg", 2) == WorldLayout(2, 1) and WorldLayout.of("cfg,ulysses", 8) == WorldLayout(2, 4)
    with pytest.raises(ValueError, match="runs on 2 GPUs"):
        WorldLayout.of("cfg", 4)


def test_serve_refuses_a_layout_that_does_not_divide(capsys):
    from wamrt.cli import build_parser
    from wamrt.serving.server import run

    args = build_parser().parse_args(["serve", "--model", "tiny-world", "--device", "cpu", "--gpus", "3",
                                      "--parallel", "ulysses"])
    assert run(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == "wamrt serve: --parallel ulysses: Ulysses degree 3 must divide the model's 4 attention heads"


def test_head_split_repeats_kv_heads_when_the_degree_does_not_divide_them():
    nano = HeadSplit(32, 8, 16)  # Nano's heads at 16 ranks: each K/V head twice
    assert (nano.kv_total, nano.kv_repeat, nano.local_heads, nano.local_kv_heads) == (16, 2, 2, 1)
    assert HeadSplit(32, 8, 4).kv_repeat == 1 and HeadSplit(16, 8, 2).local_kv_heads == 4
    for heads, kv, degree in ((32, 8, 16), (4, 2, 4), (64, 8, 32), (32, 8, 2)):
        h = HeadSplit(heads, kv, degree)
        for rank in range(degree):
            for j in range(h.local_heads):  # query head -> the original K/V head it reads, through the local slice
                q = rank * h.local_heads + j
                local_kv = j // (h.local_heads // h.local_kv_heads)
                assert (rank * h.local_kv_heads + local_kv) // h.kv_repeat == q // (heads // kv)


def test_sequence_layout_covers_every_row_once_and_inverts():
    for segments, degree in (((4, 9), 4), ((3, 0, 7), 2), ((10,), 3), ((1, 1, 5), 4)):
        layouts = [SequenceLayout(segments, degree, r, torch.device("cpu")) for r in range(degree)]
        total = sum(segments)
        held = [lay.mine[:sum(chunk(n, degree, r)[1] - chunk(n, degree, r)[0] for n in segments)].tolist()
                for r, lay in enumerate(layouts)]
        assert sorted(p for h in held for p in h) == list(range(total))
        src, row = layouts[0].gather
        for p in range(total):  # gather finds each position where its rank holds it; scatter names it back
            assert held[src[p]][row[p]] == p and layouts[0].scatter[src[p], row[p]] == p
        for r, lay in enumerate(layouts):
            at = 0
            for s, n in enumerate(segments):  # each segment's chunk is where span says, in order
                a, b = chunk(n, degree, r)
                assert lay.span(s) == (at, b - a) and held[r][at:at + b - a] == list(range(sum(segments[:s]) + a,
                                                                                         sum(segments[:s]) + b))
                at += b - a
