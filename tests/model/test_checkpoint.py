"""Checkpoint loading from the diffusers folder layout, and its error messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from oracle.transformer import build_reference
from safetensors.torch import load_file, save_file
from test_parity_diffusers import make_request, our_inputs

from wamrt.model import (
    CheckpointError,
    Cosmos3Transformer,
    get_config,
    init_random_,
    load_transformer,
    save_transformer,
)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    cfg = get_config("tiny-edge")
    ref = build_reference(cfg, seed=21)
    folder = tmp_path_factory.mktemp("ckpt") / "transformer"
    ref.save_pretrained(folder, max_shard_size="300KB")
    return cfg, ref, folder


def copy_of(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(folder, dst)
    return dst


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*-of-*.safetensors"))


def test_sharded_diffusers_checkpoint_loads_with_identical_outputs(sharded):
    cfg, ref, folder = sharded
    assert len(shards(folder)) >= 3, "the fixture should really be sharded"
    ours = load_transformer(folder, dtype=torch.float32)
    assert ours.config == cfg
    ref_state = ref.state_dict()
    for k, v in ours.state_dict().items():
        assert torch.equal(v, ref_state[k]), k
    req = make_request(cfg, "policy", sound=False, seed=4)
    ids, pos, tok = our_inputs(ours, req)
    direct = Cosmos3Transformer(cfg).eval()
    direct.load_state_dict({k: v for k, v in ref_state.items() if k != "lm_head.weight"})
    assert torch.equal(ours(ids, pos, tok).action, direct(ids, pos, tok).action)


def test_pipeline_root_and_model_prefix_are_accepted(sharded, tmp_path):
    _, ref, folder = sharded
    root = tmp_path / "pipeline"
    tdir = root / "transformer"
    tdir.mkdir(parents=True)
    shutil.copy(folder / "config.json", tdir / "config.json")
    state = {"model." + k: v.contiguous() for k, v in ref.state_dict().items()}
    save_file(state, str(tdir / "diffusion_pytorch_model.safetensors"))
    ours = load_transformer(root, dtype=torch.float32)
    assert torch.equal(ours.proj_in.weight, ref.proj_in.weight)


def test_bf16_load_keeps_time_embedder_fp32(sharded):
    _, ref, folder = sharded
    ours = load_transformer(folder)  # bf16 default
    assert ours.proj_in.weight.dtype == torch.bfloat16
    assert ours.layers[0].self_attn.add_q_proj.weight.dtype == torch.bfloat16
    assert ours.time_embedder.linear_1.weight.dtype == torch.float32
    assert torch.equal(ours.time_embedder.linear_2.weight, ref.time_embedder.linear_2.weight)
    assert not any(p.is_meta for p in ours.parameters())


def test_truncated_shard_is_named(sharded, tmp_path):
    folder = copy_of(sharded[2], tmp_path)
    victim = shards(folder)[1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=victim.name):
        load_transformer(folder, dtype=torch.float32)


def test_missing_shard_is_named(sharded, tmp_path):
    folder = copy_of(sharded[2], tmp_path)
    victim = shards(folder)[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"missing.*{victim.name}"):
        load_transformer(folder, dtype=torch.float32)


def _rewrite_shard(folder: Path, edit) -> tuple[Path, str]:
    victim = shards(folder)[0]
    state = load_file(str(victim))
    key = sorted(state)[0]
    new_state, index_edit = edit(state, key)
    save_file(new_state, str(victim))
    if index_edit:
        index_path = next(folder.glob("*.index.json"))
        index = json.loads(index_path.read_text())
        index_edit(index["weight_map"], key)
        index_path.write_text(json.dumps(index))
    return victim, key


def test_renamed_key_is_named(sharded, tmp_path):
    folder = copy_of(sharded[2], tmp_path)

    def rename(state, key):
        state[key + "_renamed"] = state.pop(key)

        def fix(wm, k):
            wm[k + "_renamed"] = wm.pop(k)

        return state, fix

    victim, key = _rewrite_shard(folder, rename)
    with pytest.raises(CheckpointError, match=rf"{victim.name}.*unexpected tensor '{key}_renamed'"):
        load_transformer(folder, dtype=torch.float32)


def test_key_missing_from_checkpoint_is_named(sharded, tmp_path):
    folder = copy_of(sharded[2], tmp_path)

    def drop(state, key):
        state.pop(key)
        return state, lambda wm, k: wm.pop(k)

    _, key = _rewrite_shard(folder, drop)
    with pytest.raises(CheckpointError, match=f"missing tensors: .*{key}"):
        load_transformer(folder, dtype=torch.float32)


def test_misshaped_tensor_is_named(sharded, tmp_path):
    folder = copy_of(sharded[2], tmp_path)

    def reshape(state, key):
        state[key] = torch.zeros(*state[key].shape[:-1], state[key].shape[-1] + 1)
        return state, None

    victim, key = _rewrite_shard(folder, reshape)
    with pytest.raises(CheckpointError, match=rf"{victim.name}.*'{key}' has shape"):
        load_transformer(folder, dtype=torch.float32)


def test_integer_tensor_is_named(sharded, tmp_path):
    folder = copy_of(sharded[2], tmp_path)

    def to_int(state, key):
        state[key] = state[key].to(torch.int32)
        return state, None

    victim, key = _rewrite_shard(folder, to_int)
    with pytest.raises(CheckpointError, match=rf"{victim.name}.*'{key}' has dtype torch.int32"):
        load_transformer(folder, dtype=torch.float32)


def test_missing_config_or_weights(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_transformer(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no config.json with safetensors"):
        load_transformer(tmp_path)


def test_bad_config_is_reported(sharded, tmp_path):
    folder = copy_of(sharded[2], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json.*hidden_act"):
        load_transformer(folder)


@pytest.mark.parametrize("shard_bytes", [None, 200_000])
def test_our_writer_round_trips(tmp_path, shard_bytes):
    model = init_random_(Cosmos3Transformer(get_config("tiny-qwen")), seed=3)
    save_transformer(model, tmp_path, max_shard_bytes=shard_bytes)
    back = load_transformer(tmp_path, dtype=torch.float32)
    for k, v in model.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
