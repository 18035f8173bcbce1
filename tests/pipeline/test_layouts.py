"""Every checkpoint layout a user has loads with no symlink and no flag: diffusers' `save_pretrained` pipeline folder,
the hub repository with a root weight index, a bare transformer folder with the tokenizer beside it, and a
`wamrt quantize` artifact of them; a config that disagrees with its weights is one line naming the file and field
(library and `wamrt infer`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from oracle.checkpoints import save_diffusers_pipeline, to_hub_layout
from safetensors import safe_open

from wamrt import load_policy
from wamrt.cli import main
from wamrt.model import CheckpointError
from wamrt.pipeline.layout import resolve_layout, scheduler_defaults
from wamrt.sample import sample_observation

SHIFT = 7.0  # the saved scheduler's flow_shift: not the DROID recipe's 5, so that honouring it shows


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return save_diffusers_pipeline(tmp_path_factory.mktemp("layouts") / "diffusers", shift=SHIFT)


@pytest.fixture(scope="module")
def hub(saved: Path, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("layouts") / "hub"
    shutil.copytree(saved, folder)
    return to_hub_layout(folder)


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / src.name))


def test_diffusers_folder_resolves(saved: Path) -> None:
    layout = resolve_layout(saved)
    assert layout.kind == "diffusers" and layout.tokenizer == saved / "text_tokenizer"
    assert layout.vae == saved / "vae" and layout.transformer == saved / "transformer"
    assert layout.transformer_index is not None and layout.transformer_index.parent == saved / "transformer"
    assert len(list((saved / "vae").glob("*.safetensors"))) > 1, "the VAE is sharded too"
    assert scheduler_defaults(layout).shift == SHIFT and layout.vision_encoder_shards == ()


def test_hub_layout_reads_the_root_index(hub: Path) -> None:
    layout = resolve_layout(hub)
    root_index = hub / "model.safetensors.index.json"
    assert layout.kind == "hub" and layout.transformer_index == root_index
    weights = layout.transformer_weights()
    assert weights and all(f.parent == hub / "transformer" for f in weights.values())
    with safe_open(str(hub / "vision_encoder" / "model.safetensors"), "pt") as f:
        vision_keys = set(f.keys())
    assert layout.vision_encoder_shards == (hub / "vision_encoder" / "model.safetensors",)
    assert set(layout.vision_encoder_weights()) == vision_keys and not vision_keys & set(weights)
    # With the transformer's own index present too, that one (what diffusers reads) says where its tensors are.
    index = json.loads(root_index.read_text())["weight_map"]
    assert {k for k, v in index.items() if v.startswith("transformer/")} == set(weights)


def test_same_weights_through_every_layout(saved: Path, hub: Path, tmp_path: Path) -> None:
    """The hub folder (root index only), the pipeline folder and the bare transformer folder (tokenizer and VAE
    beside it) give the same chunk for the same seed; a hub folder without text_tokenizer/ uses the root's files."""
    obs = sample_observation(0)
    reference = load_policy(saved, device="cpu")
    assert reference.options.shift == SHIFT  # from scheduler/scheduler_config.json
    expected = reference.infer(obs, seed=4, steps=1)
    assert np.isfinite(expected.actions).all()
    for folder in (hub, saved / "transformer"):
        policy = load_policy(folder, device="cpu")
        np.testing.assert_array_equal(policy.infer(obs, seed=4, steps=1).actions, expected.actions)
    assert resolve_layout(saved / "transformer").kind == "transformer"
    root_tokenizer = _copy(hub, tmp_path)
    shutil.rmtree(root_tokenizer / "text_tokenizer")
    assert resolve_layout(root_tokenizer).tokenizer == root_tokenizer


def test_quantized_artifact_of_a_saved_pipeline(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(saved), "--recipe", "gen-fp8", "--out", str(out),
                 "--dtype", "float32"]) == 0
    layout = resolve_layout(out)
    assert layout.kind == "quantized" and layout.tokenizer == out / "text_tokenizer"
    policy = load_policy(out, device="cpu")
    assert policy.quantization == "gen-fp8"
    assert np.isfinite(policy.infer(sample_observation(0), seed=1, steps=1).actions).all()


def _edit_json(path: Path, **changes: object) -> None:
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        cfg[key] = value(cfg) if callable(value) else value
    path.write_text(json.dumps(cfg))


MISMATCHES = {  # name -> (edit of a copy of the saved folder, the file the error names, the field it names)
    "vae_stats_vs_z_dim": (lambda d: _edit_json(d / "vae/config.json", latents_mean=lambda c: c["latents_mean"][:16]),
                           "vae/config.json", "latents_mean"),
    "vae_z_dim_vs_transformer": (lambda d: _edit_json(d / "transformer/config.json", latent_channel=16,
                                                      patch_latent_dim=64),
                                 "transformer/config.json", "latent_channel"),
    "action_dim": (lambda d: _edit_json(d / "transformer/config.json", action_dim=4),
                   "transformer/config.json", "action_dim"),
    "domain_count": (lambda d: _edit_json(d / "transformer/config.json", num_embodiment_domains=4),
                     "transformer/config.json", "num_embodiment_domains"),
    "vocabulary": (lambda d: _edit_json(d / "transformer/config.json", vocab_size=100),
                   "transformer/config.json", "vocab_size"),
    "tokenizer_missing": (lambda d: shutil.rmtree(d / "text_tokenizer"), "--tokenizer", "tokenizer"),
    "tensor_shape": (lambda d: _edit_json(d / "transformer/config.json", intermediate_size=96),
                     "diffusion_pytorch_model", "intermediate_size"),
    "hub_index_lists_a_missing_shard": (lambda d: (to_hub_layout(d), next((d / "transformer").glob(
        "*.safetensors")).unlink()), "model.safetensors.index.json", "weight_map"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_config_mismatch_is_one_line(saved: Path, tmp_path: Path, capsys, case: str) -> None:
    edit, file, field = MISMATCHES[case]
    folder = _copy(saved, tmp_path)
    edit(folder)
    capsys.readouterr()  # what building the folder printed
    with pytest.raises(CheckpointError) as err:
        load_policy(folder, device="cpu")
    text = str(err.value)
    assert file in text and "\n" not in text, text
    if case != "tensor_shape":  # a shape names the tensor; the field that made it is the config's
        assert err.value.field == field or f"{field}:" in text, text
    assert main(["infer", "--model", str(folder), "--device", "cpu", "--steps", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and file in lines[0] and "Traceback" not in lines[0], lines


def test_flags_override_and_name_themselves(saved: Path, tmp_path: Path, capsys) -> None:
    folder = _copy(saved, tmp_path)
    shutil.move(folder / "text_tokenizer", tmp_path / "tok")
    shutil.move(folder / "vae", tmp_path / "vae")
    assert main(["infer", "--model", str(folder), "--device", "cpu", "--steps", "1", "--json",
                 "--tokenizer", str(tmp_path / "tok"), "--vae", str(tmp_path / "vae")]) == 0
    assert np.asarray(json.loads(capsys.readouterr().out)["actions"]).shape == (32, 8)
    assert main(["infer", "--model", str(folder), "--device", "cpu", "--tokenizer", str(tmp_path / "tok")]) == 2
    assert "--vae" in capsys.readouterr().err
    assert main(["infer", "--model", str(folder), "--device", "cpu", "--tokenizer", str(tmp_path)]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_parallel_layouts_read_the_config_of_every_layout(saved: Path, hub: Path) -> None:
    # `wamrt serve --parallel` checks a world layout against the model's heads before any rank starts; it reads the
    # config through the same resolver as the loaders; a quantized random model once failed there (`random:nano@gen-fp8`
    # was looked up as a size named "nano@gen-fp8").
    from wamrt.model import get_config
    from wamrt.parallel.launch import ParallelSpec, model_config

    expected = json.loads((saved / "transformer" / "config.json").read_text())
    for folder in (saved, hub, saved / "transformer"):
        cfg = model_config(ParallelSpec(mode="ulysses", model=str(folder)))
        assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (expected["num_attention_heads"],
                                                                     expected["num_key_value_heads"])
    assert model_config(ParallelSpec(mode="cfg", model="random:tiny-qwen@gen-fp8")) == get_config("tiny-qwen")
