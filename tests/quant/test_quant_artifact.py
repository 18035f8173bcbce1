"""Artifacts: exact round trip, and refusal (typed error naming the file) of tampered, incomplete or
mismatched folders. Also `wamrt quantize` end to end."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from oracle.quant_models import policy_inputs, tiny_model

from wamrt.model import save_transformer
from wamrt.quant import (
    ArtifactIntegrityError,
    ArtifactMismatchError,
    ArtifactMissingFileError,
    RecipeError,
    is_artifact,
    load_artifact,
    quantize_main,
    quantize_model,
    set_kernel,
    write_artifact,
)
from wamrt.quant.manifest import write_manifest


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    model = tiny_model(seed=5)
    quantize_model(model, "gen-fp8+reasoner-w8", kernel="reference")
    out = write_artifact(model, "gen-fp8+reasoner-w8", tmp_path_factory.mktemp("art") / "q",
                         max_shard_bytes=200_000)  # force several shards
    return model, out


def copy_of(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def shard(folder: Path) -> Path:
    return sorted(folder.glob("model-*.safetensors"))[0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # compare fp8 bit patterns


def edit_json(path: Path, change) -> None:
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def test_layout(written):
    _, out = written
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "recipe.json", "manifest.json", "model.safetensors.index.json"} <= names
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 2
    manifest = json.loads((out / "manifest.json").read_text())["files"]
    assert set(manifest) == names - {"manifest.json"}
    meta = json.loads((out / "recipe.json").read_text())
    assert meta["recipe"]["name"] == "gen-fp8+reasoner-w8" and meta["fused"] and meta["calibration"] is None
    assert meta["modules"]["layers.0.self_attn.add_qkv_proj"] == "fp8-w8a8"
    assert meta["modules"]["layers.0.self_attn.to_q"] == "int8-w8a16"
    assert is_artifact(out) and not any(p.name.startswith(".") for p in out.parent.iterdir())


def test_round_trip_is_exact(written):
    model, out = written
    loaded = load_artifact(out, "cpu", torch.float32, kernel="reference")
    ref_state, new_state = model.state_dict(), loaded.state_dict()
    assert ref_state.keys() == new_state.keys()
    for k, v in ref_state.items():
        assert v.dtype == new_state[k].dtype, k
        assert torch.equal(bits(v), bits(new_state[k])), k
    ids, pos, tok = policy_inputs(model, 5)
    a, b = model(ids, pos, tok), loaded(ids, pos, tok)
    assert torch.equal(a.action, b.action) and torch.equal(a.vision, b.vision)


def test_bf16_round_trip_keeps_time_mlp_fp32(tmp_path):
    model = tiny_model(seed=6, dtype=torch.bfloat16)
    model.time_embedder.float()
    out = write_artifact(model, "gen-fp8", tmp_path / "bf16")  # quantizes the unquantized model in place
    loaded = load_artifact(out, "cpu", torch.bfloat16, kernel="reference")
    assert loaded.time_embedder.linear_1.weight.dtype == torch.float32
    assert loaded.layers[0].self_attn.add_qkv_proj.weight.dtype == torch.float8_e4m3fn
    ids, pos, tok = policy_inputs(model, 6)
    set_kernel(model, "reference")
    assert torch.equal(model(ids, pos, tok).action, loaded(ids, pos, tok).action)


def test_tampered_byte_is_refused(written, tmp_path):
    folder = copy_of(written[1], tmp_path)
    f = shard(folder)
    data = bytearray(f.read_bytes())
    data[-10] ^= 0x01  # inside the tensor data: safetensors itself would load it silently
    f.write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError, match=f.name) as e:
        load_artifact(folder)
    assert e.value.file == f


@pytest.mark.parametrize("victim", ["shard", "recipe.json", "config.json", "manifest.json"])
def test_missing_file_is_refused(written, tmp_path, victim):
    folder = copy_of(written[1], tmp_path)
    f = shard(folder) if victim == "shard" else folder / victim
    f.unlink()
    with pytest.raises(ArtifactMissingFileError, match=f.name) as e:
        load_artifact(folder)
    assert e.value.file == f


def test_unlisted_shard_is_refused(written, tmp_path):
    folder = copy_of(written[1], tmp_path)
    stray = folder / "model-00009-of-00009.safetensors"
    stray.write_bytes(shard(folder).read_bytes())
    with pytest.raises(ArtifactIntegrityError, match=stray.name):
        load_artifact(folder)


def test_recipe_mismatch_is_refused(written, tmp_path):
    """A consistent manifest over inconsistent files (e.g. hand-edited, then re-hashed)."""
    from wamrt.quant import RECIPES

    folder = copy_of(written[1], tmp_path)
    edit_json(folder / "recipe.json", lambda r: r.update(recipe=RECIPES["all-fp8"].to_dict()))
    write_manifest(folder)
    with pytest.raises(ArtifactMismatchError, match="recipe.json.*selects"):
        load_artifact(folder)
    with pytest.raises(ArtifactMismatchError, match="recipe.json.*expected 'gen-fp8'"):
        load_artifact(written[1], expect_recipe="gen-fp8")


def test_redefined_recipe_is_refused(written, tmp_path):
    folder = copy_of(written[1], tmp_path)
    edit_json(folder / "recipe.json", lambda r: r["recipe"]["rules"].pop())
    write_manifest(folder)
    with pytest.raises(ArtifactMismatchError, match="recipe.json.*differs from this wamrt"):
        load_artifact(folder)


def test_config_mismatch_is_refused(written, tmp_path):
    folder = copy_of(written[1], tmp_path)
    edit_json(folder / "config.json", lambda c: c.update(intermediate_size=96))
    write_manifest(folder)
    with pytest.raises(ArtifactMismatchError, match="config.json is not the one"):
        load_artifact(folder)
    # Also re-stamp recipe.json: the tensors themselves then disagree with the config.
    from wamrt.quant.manifest import sha256_file

    edit_json(folder / "recipe.json", lambda r: r.update(config_sha256=sha256_file(folder / "config.json")))
    write_manifest(folder)
    with pytest.raises(ArtifactMismatchError, match=r"model-\d+-of-\d+\.safetensors.*shape"):
        load_artifact(folder)


def test_writer_refusals(written, tmp_path):
    model, out = written
    with pytest.raises(RecipeError, match="quantized with 'gen-fp8\\+reasoner-w8'"):
        write_artifact(model, "gen-fp8", tmp_path / "x")
    with pytest.raises(FileExistsError):
        write_artifact(model, "gen-fp8+reasoner-w8", out)


def test_quantize_cli_end_to_end(tmp_path, capsys):
    model = tiny_model(seed=7)
    root = tmp_path / "pipeline"
    save_transformer(model, root / "transformer")
    (root / "vae").mkdir()
    (root / "vae" / "config.json").write_text("{}")
    (root / "wamrt.json").write_text("{}")
    out = tmp_path / "out"
    args = ["--model", str(root), "--recipe", "gen-fp8", "--out", str(out)]
    assert quantize_main([*args, "--dtype", "float32"]) == 0
    assert "no calibration data" in capsys.readouterr().out
    assert is_artifact(out / "transformer")
    assert (out / "vae" / "config.json").is_file() and (out / "wamrt.json").is_file()
    loaded = load_artifact(out / "transformer", "cpu", torch.float32, kernel="reference")
    expected = copy.deepcopy(model)
    quantize_model(expected, "gen-fp8", kernel="reference")
    ids, pos, tok = policy_inputs(model, 7)
    assert torch.equal(loaded(ids, pos, tok).action, expected(ids, pos, tok).action)
    # Refuses to overwrite without --force; unknown recipes are argparse errors.
    assert quantize_main(args) == 2
    with pytest.raises(SystemExit):
        quantize_main(["--model", str(root), "--recipe", "nope", "--out", str(tmp_path / "o2")])


def test_auto_kernel_is_resolved_for_the_target_device(written):
    from wamrt.quant import Fp8Linear

    loaded = load_artifact(written[1])  # kernel="auto" on CPU
    kernels = {m.kernel for m in loaded.modules() if isinstance(m, Fp8Linear)}
    assert kernels == {"reference"}
