"""The chat Reasoner loads from the folders users have, read through `pipeline.layout.resolve_layout`: diffusers'
own `save_pretrained` pipeline (lm_head in transformer/'s shards, the tokenizer in text_tokenizer/), the hub
repository (a root index over transformer/ and vision_encoder/, keys bare or prefixed), and a folder whose tokenizer
lives elsewhere (`tokenizer=`, as `--tokenizer`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from oracle.checkpoints import save_diffusers_pipeline, to_hub_layout
from safetensors import safe_open

from wamrt import load_policy
from wamrt.cli import main
from wamrt.reasoner import SamplingParams, reasoner_of

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return save_diffusers_pipeline(tmp_path_factory.mktemp("reasoner") / "diffusers")


@pytest.fixture(scope="module")
def hub(saved: Path, tmp_path_factory) -> Path:
    return to_hub_layout(Path(shutil.copytree(saved, tmp_path_factory.mktemp("reasoner") / "hub")))


def _saved_lm_head(folder: Path) -> torch.Tensor:
    index = json.loads(next(folder.glob("transformer/*.safetensors.index.json")).read_text())["weight_map"]
    with safe_open(str(folder / "transformer" / index["lm_head.weight"]), "pt") as f:
        return f.get_tensor("lm_head.weight")


def test_diffusers_folder_serves_text(saved: Path) -> None:
    reasoner, why = reasoner_of(load_policy(saved, device="cpu"), str(saved))
    assert reasoner is not None, why
    assert reasoner.text_only and reasoner.describe()["chat"] is True
    torch.testing.assert_close(reasoner.lm.lm_head.weight, _saved_lm_head(saved), rtol=0, atol=0)
    assert len(reasoner.complete(HELLO, GREEDY).tokens) == GREEDY.max_tokens


def test_hub_folder_serves_text_and_images_with_the_same_head(saved: Path, hub: Path, tmp_path: Path) -> None:
    reference = reasoner_of(load_policy(saved, device="cpu"), str(saved))[0].complete(HELLO, GREEDY).tokens
    reasoner, why = reasoner_of(load_policy(hub, device="cpu"), str(hub))
    assert reasoner is not None, why
    assert not reasoner.text_only, "vision_encoder/ listed by the root index loads"
    assert reasoner.complete(HELLO, GREEDY).tokens == reference
    # NVIDIA's loader strips `transformer.` / `vision_encoder.` prefixes from the root index's keys: so do we.
    prefixed = Path(shutil.copytree(hub, tmp_path / "prefixed"))
    index_file = prefixed / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {f"{rel.split('/')[0]}.{key}": rel for key, rel in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    reasoner, why = reasoner_of(load_policy(prefixed, device="cpu"), str(prefixed))
    assert reasoner is not None and not reasoner.text_only, why
    assert reasoner.complete(HELLO, GREEDY).tokens == reference


def test_tokenizer_elsewhere_and_an_engine_without_a_layout(saved: Path, tmp_path: Path, capsys) -> None:
    folder = Path(shutil.copytree(saved, tmp_path / "no-tokenizer"))
    shutil.move(folder / "text_tokenizer", tmp_path / "tok")
    policy = load_policy(folder, device="cpu", tokenizer=tmp_path / "tok")
    reasoner, why = reasoner_of(policy, str(folder))
    assert reasoner is not None, why
    # A served engine carries no layout: the folder is resolved again, with the same override.
    engine = SimpleNamespace(model=policy.model, tokenizer=policy.tokenizer, name=str(folder))
    again, why = reasoner_of(engine, str(folder), tokenizer=tmp_path / "tok")
    assert again is not None, why
    assert again.complete(HELLO, GREEDY).tokens == reasoner.complete(HELLO, GREEDY).tokens
    broken, why = reasoner_of(engine, str(folder), tokenizer=tmp_path / "missing")
    assert broken is None and "--tokenizer" in why
    random, why = reasoner_of(SimpleNamespace(model=policy.model, tokenizer=policy.tokenizer, name="random:tiny"),
                              "random:tiny")
    assert random is None and "no checkpoint folder" in why
    # `wamrt chat --tokenizer DIR` on the same folder: one greedy answer, and without the flag one line naming it.
    chat = ["chat", "--model", str(folder), "--device", "cpu", "--prompt", "hello", "--max-tokens", "3",
            "--temperature", "0"]
    assert main([*chat, "--tokenizer", str(tmp_path / "tok")]) == 0
    assert "Reasoner, text only" in capsys.readouterr().err
    assert main(chat) == 2
    assert "--tokenizer" in capsys.readouterr().err
