from __future__ import annotations

import json
import shutil
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline
from transformers import BatchEncoding

from wamrt.pipeline.errors import RequestError
from wamrt.pipeline.prompts import SYSTEM_PROMPT_VIDEO, diffusers_action_json_prompt, droid_prompt
from wamrt.pipeline.tokens import CaptionTokenizer, _as_id_list, load_caption_tokenizer


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> CaptionTokenizer:
    return load_caption_tokenizer(tokenizer_dir)


def test_special_tokens_match_fixture(droid_request, tok: CaptionTokenizer) -> None:
    special = droid_request.expected["special_tokens"]
    assert tok.special.eos_id == special["eos_token_id"]
    assert tok.special.vision_start_id == special["start_of_generation"]
    assert tok.special.vision_end_id == special["end_of_generation"]


def test_token_ids_match_fixture(droid_request, tok: CaptionTokenizer, assert_bitwise) -> None:
    req, exp, t = droid_request.request, droid_request.expected, droid_request.tensors
    cond = tok.encode(droid_prompt(req["prompt"], json_format=req["format_prompt_as_json"]))
    uncond = tok.encode(exp["uncond_caption"])
    for name, branch in (("cond", cond), ("uncond", uncond)):
        assert_bitwise(np.array(branch.chat_template_ids, np.int64), t[f"{name}.chat_template_ids"], name)
        assert_bitwise(np.array(branch.text_ids, np.int64), t[f"{name}.text_ids"], name)
        assert branch.und_len == exp["pack"][name]["und_len"]
        assert len(branch.chat_template_ids) == exp["pack"][name]["chat_template_len"]
        assert branch.text_ids[-2:] == (tok.special.eos_id, tok.special.vision_start_id)


def _fake_diffusers_pipe(tokenizer: Any) -> types.SimpleNamespace:
    # Just the attributes `tokenize_prompt` reads in action mode.
    return types.SimpleNamespace(
        config=types.SimpleNamespace(default_use_system_prompt=True),
        text_tokenizer=tokenizer,
        llm_special_tokens={
            "start_of_generation": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
            "eos_token_id": tokenizer.eos_token_id,
        },
        _build_action_json_prompt=Cosmos3OmniPipeline._build_action_json_prompt,
        image_resolution_template="",
        video_resolution_template="",
        inverse_image_resolution_template="",
        inverse_video_resolution_template="",
    )


@pytest.mark.parity
@pytest.mark.parametrize("use_system_prompt", [False, True])
@pytest.mark.parametrize("view_point", ["concat_view", "ego_view", None])
def test_diffusers_action_tokens_are_diffusers_own(
    tok: CaptionTokenizer, use_system_prompt, view_point
) -> None:
    pipe = _fake_diffusers_pipe(tok.tokenizer)
    kwargs = {"num_frames": 33, "height": 544, "width": 736, "fps": 15.0}
    cond, uncond = Cosmos3OmniPipeline.tokenize_prompt(
        pipe,
        "pick up the cube",
        None,
        use_system_prompt=use_system_prompt,
        action_mode="policy",
        action_view_point=view_point,
        **kwargs,
    )
    system = SYSTEM_PROMPT_VIDEO if use_system_prompt else None
    caption = diffusers_action_json_prompt("pick up the cube", view_point=view_point, **kwargs)
    assert list(tok.encode(caption, system).text_ids) == cond
    assert list(tok.encode("", system).text_ids) == uncond


def test_id_list_normalisation() -> None:
    assert _as_id_list({"input_ids": [1, 2], "attention_mask": [1, 1]}) == [1, 2]
    assert _as_id_list(BatchEncoding({"input_ids": [3, 4]})) == [3, 4]
    assert _as_id_list({"input_ids": [[3, 4]]}) == [3, 4]  # a batch of one
    assert _as_id_list(torch.tensor([[5, 6]])) == [5, 6]
    assert _as_id_list(np.array([7, 8])) == [7, 8]
    with pytest.raises(RequestError):
        _as_id_list([[1], [2]])


class _FakeTokenizer:
    chat_template = "x"

    def __init__(self, vocab: dict[str, int], eos: int | None) -> None:
        self._vocab, self.eos_token_id = vocab, eos

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


def test_missing_special_tokens_raise_request_error() -> None:
    with pytest.raises(RequestError, match="eos"):
        CaptionTokenizer(_FakeTokenizer({"<|vision_start|>": 5}, eos=None))
    with pytest.raises(RequestError, match="vision_start"):
        CaptionTokenizer(_FakeTokenizer({"<|im_end|>": 4}, eos=4))
    no_template = _FakeTokenizer({"<|vision_start|>": 5}, eos=4)
    no_template.chat_template = None
    with pytest.raises(RequestError, match="chat template"):
        CaptionTokenizer(no_template)


def test_real_tokenizer_without_eos(tokenizer_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tokenizer_dir, tmp_path / "tok")
    cfg_path = tmp_path / "tok" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("eos_token")
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(RequestError, match="eos"):
        load_caption_tokenizer(tmp_path / "tok")


def test_missing_tokenizer_folder(tmp_path: Path) -> None:
    with pytest.raises(RequestError):
        load_caption_tokenizer(tmp_path / "absent")


def test_non_string_caption(tok: CaptionTokenizer) -> None:
    with pytest.raises(RequestError):
        tok.encode(None)  # type: ignore[arg-type]


def test_encode_is_cached_per_caption_and_still_rejects_a_non_string(tokenizer_dir: Path) -> None:
    """A caption's ids are computed once (a robot repeats its instruction; every request encodes "" too); the
    cached result equals a fresh encode, and a non-string prompt is still the typed error, not a TypeError."""
    tok = load_caption_tokenizer(tokenizer_dir)
    calls = []
    real = tok.tokenizer.apply_chat_template

    def counting(messages, **kwargs):
        calls.append(messages[-1]["content"])
        return real(messages, **kwargs)

    tok.tokenizer.apply_chat_template = counting
    first = tok.encode("pick up the cube")
    assert tok.encode("pick up the cube") == first and tok.encode("") == tok.encode("")
    assert calls == ["pick up the cube", ""]
    assert load_caption_tokenizer(tokenizer_dir).encode("pick up the cube") == first
    with pytest.raises(RequestError, match="must be a string"):
        tok.encode(["not", "a", "string"])
