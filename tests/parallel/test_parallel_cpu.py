"""CFG-parallel and tensor parallel on the CPU: 2 processes (this one is rank 0, one spawned worker)
over gloo, through the same `wamrt.parallel.start` front the server and the benchmark use.

Tolerances (fp32): CFG-parallel runs each branch as its own Generator pass where the single-process
engine batches both branches into one pass (same math, different GEMM row blocking); tensor parallel
sums every row-parallel projection as two partial sums plus an all-reduce. Both only reorder fp32
additions, so the actions agree to a few fp32 roundings of their size: TOL relative to the largest action (at
least 1). Measured 1-5e-6, and up to 3.1e-5 on actions of up to 3.9 (tiny-droid-edge, 2 steps) on a 2-core machine
with each of the two processes on its default threads, where the same checkout passed and failed on reruns: how
the CPU GEMMs block their sums depends on the threads they get. A missing or doubled all-reduce is off by O(1).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from wamrt import load_policy
from wamrt.engine import Engine, EngineConfig
from wamrt.parallel import ParallelSpec, start
from wamrt.sample import sample_observation

TOL = 2e-5
ECONF = dict(attention="auto", compile=False, cuda_graph=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("WAMRT_CACHE", str(tmp_path_factory.mktemp("cache")))  # inherited by the spawned worker
    yield
    mp.undo()


def _single(name: str) -> Engine:
    return Engine.from_policy(load_policy(name, device="cpu"), EngineConfig(**ECONF))


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    return float(np.abs(got - want).max()) <= TOL * max(1.0, float(np.abs(want).max()))


def _compare(front, single, cases) -> None:
    for kwargs in cases:
        obs = [sample_observation(0), sample_observation(1)]
        got = front.infer_batch(obs, seeds=[3, 4], **kwargs)
        want = single.infer_batch(obs, seeds=[3, 4], **kwargs)
        for g, w in zip(got, want, strict=True):
            assert g.actions.shape == (32, 8)
            assert _close(g.actions, w.actions), (kwargs, float(np.abs(g.actions - w.actions).max()))


CASES = [dict(steps=2),  # CFG every step + the order-2 solver
         dict(steps=3, guidance_interval=(960, 1001)),  # guided and unguided steps mixed
         dict(steps=2, guidance=1.0)]  # no CFG at all: rank 0 broadcasts the conditional branch


def test_cfg_parallel_equals_single_process(cache):
    single = _single("tiny-droid")
    with start(ParallelSpec("cfg", "tiny-droid", 2, "cpu", engine=ECONF)) as front:
        _compare(front, single, CASES)
        assert front.metadata()["engine"]["parallel"] == "cfg"
        # seed stream: a request without a seed gets the single engine's default sequence
        got = front.infer(sample_observation(5), steps=1)
        want = single.infer(sample_observation(5), steps=1)
        assert got.seed == want.seed and _close(got.actions, want.actions)


@pytest.mark.parametrize("name", ["tiny-droid", "tiny-droid-edge"])  # Qwen (SiLU) and Edge (ReLU², norms)
def test_tensor_parallel_equals_single_process(cache, name):
    single = _single(name)
    with start(ParallelSpec("tp", name, 2, "cpu", engine=ECONF)) as front:
        _compare(front, single, CASES[:2])
        local = front.policy.model
        assert local.config.num_attention_heads * 2 == local.tp.full_config.num_attention_heads


def test_shard_model_halves_every_layer_and_builds_on_meta():
    from wamrt.model import Cosmos3Transformer, get_config
    from wamrt.parallel.tp import RowParallelLinear, random_sharded, shard_model

    cfg = get_config("tiny-qwen")
    full = Cosmos3Transformer(cfg)
    part = random_sharded("tiny-qwen", 1, 2, torch.device("cpu"), torch.float32)
    layer_full = sum(p.numel() for p in full.layers.parameters())
    layer_part = sum(p.numel() for p in part.layers.parameters())
    norms = sum(p.numel() for n, p in full.layers.named_parameters() if "norm" in n)
    assert layer_part - norms == (layer_full - norms) // 2  # every projection halved, norms replicated
    assert isinstance(part.layers[0].self_attn.to_out, RowParallelLinear)
    assert isinstance(part.layers[0].mlp_moe_gen.down_proj, RowParallelLinear)
    with pytest.raises(ValueError, match="divisible"):
        shard_model(Cosmos3Transformer(cfg), 0, 3)


def test_load_sharded_reads_only_the_slices(tmp_path):
    from wamrt.model import Cosmos3Transformer, get_config, init_random_, save_transformer
    from wamrt.parallel.tp import load_sharded, shard_model

    full = init_random_(Cosmos3Transformer(get_config("tiny-edge")), seed=3)
    save_transformer(full, tmp_path, max_shard_bytes=200_000)  # several files + an index
    for rank in (0, 1):
        got = load_sharded(tmp_path, rank, 2, torch.device("cpu"), torch.float32)
        want = shard_model(init_random_(Cosmos3Transformer(get_config("tiny-edge")), seed=3), rank, 2)
        want_params = dict(want.named_parameters())
        for n, p in got.named_parameters():
            torch.testing.assert_close(p, want_params[n], rtol=0, atol=0, msg=n)


def test_cfg_parallel_with_prompt_buckets_equals_single_process(cache):
    """Each rank pads only its own branch (cond on rank 0, uncond on rank 1) to the bucket; the graph key
    comes from both lengths, and the actions stay the exact single-process engine's."""
    single = _single("tiny-droid")
    with start(ParallelSpec("cfg", "tiny-droid", 2, "cpu", engine={**ECONF, "prompt_bucket": 16})) as front:
        _compare(front, single, CASES[:2])
        assert front.metadata()["engine"]["prompt_bucket"] == 16
        engine = front.engine  # rank 0's
        engine._lengths = (13, 5)
        assert engine._bucket_lengths([], []) == (16, 16)


@pytest.fixture(scope="module")
def saved_elsewhere(tmp_path_factory) -> tuple[str, str]:
    """A diffusers `save_pretrained` folder whose tokenizer was moved out of it: (folder, tokenizer folder)."""
    from oracle.checkpoints import save_diffusers_pipeline

    root = tmp_path_factory.mktemp("saved")
    folder = save_diffusers_pipeline(root / "diffusers")
    return str(folder), str(shutil.move(folder / "text_tokenizer", root / "tok"))


@pytest.mark.parametrize("mode", ["cfg", "tp"])  # cfg: load_policy on every rank; tp: every rank reads its slices
def test_saved_folder_with_the_tokenizer_passed_equals_single_process(cache, saved_elsewhere, mode):
    folder, tok = saved_elsewhere
    single = Engine.from_policy(load_policy(folder, device="cpu", tokenizer=tok), EngineConfig(**ECONF))
    assert single.options.shift == 7.0  # the saved scheduler's flow_shift: every rank reads the same layout
    with start(ParallelSpec(mode, folder, 2, "cpu", engine=ECONF, tokenizer_dir=tok)) as front:
        _compare(front, single, CASES[:1])
        assert front.policy.options.shift == single.options.shift
        if mode == "tp":
            local = front.policy.model
            assert local.config.num_attention_heads * 2 == local.tp.full_config.num_attention_heads


@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")
def test_serve_parallel_with_tokenizer_answers_openpi_client(cache, saved_elsewhere, tmp_path):
    """`wamrt serve --parallel cfg --tokenizer DIR` (refused before the flags reached the ranks) answers the
    official openpi client."""
    import subprocess
    import sys

    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from wamrt.cli.demo import _wait_ready
    from wamrt.net import free_port

    folder, tok = saved_elsewhere
    port, log = free_port(), tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "wamrt.cli", "serve", "--model", folder, "--tokenizer", tok,
                             "--parallel", "cfg", "--gpus", "2", "--device", "cpu", "--port", str(port),
                             "--steps", "1", "--warmup", "0"], stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        try:
            _wait_ready(port, proc, timeout_s=240.0)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}:\n{log.read_text()}") from exc
        client = WebsocketClientPolicy(f"ws://127.0.0.1:{port}")
        meta = client.get_server_metadata()
        assert meta["policy"]["engine"]["parallel"] == "cfg" and meta["model"] == folder
        out = client.infer(sample_observation(0))
        assert out["actions"].shape == (32, 8) and np.isfinite(out["actions"]).all()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_folder_that_cannot_serve_fails_before_any_rank_starts(saved_elsewhere, tmp_path):
    from wamrt.model import CheckpointError

    folder, _ = saved_elsewhere
    with pytest.raises(CheckpointError, match="--tokenizer"):
        start(ParallelSpec("cfg", folder, 2, "cpu"))
    with pytest.raises(CheckpointError, match="--tokenizer"):
        start(ParallelSpec("tp", folder, 2, "cpu", tokenizer_dir=str(tmp_path)))
