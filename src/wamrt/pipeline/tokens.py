"""Caption -> Reasoner token ids: chat template, then [eos, <|vision_start|>] (no BOS).

Both the framework (`tokenize_caption` + packer) and diffusers (`tokenize_prompt`) build the text
split this way; they differ only in the optional system message, which the DROID server never sends.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wamrt.pipeline.errors import RequestError

VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
# Captions whose token ids a CaptionTokenizer keeps (a few hundred tokens each: ~6 MB at most).
ENCODE_CACHE_SIZE = 256


@dataclass(frozen=True)
class SpecialTokens:
    eos_id: int
    vision_start_id: int  # "start_of_generation": the last text token, right before the vision block
    vision_end_id: int | None


@dataclass(frozen=True)
class TokenizedCaption:
    caption: str
    chat_template_ids: tuple[int, ...]  # [U - 2]
    text_ids: tuple[int, ...]  # [U] = chat_template_ids + (eos, vision_start)

    @property
    def und_len(self) -> int:
        return len(self.text_ids)


def _token_id(tokenizer: Any, token: str) -> int | None:
    # convert_tokens_to_ids returns None or the unk id for an unknown token depending on the backend;
    # the vocabulary is the unambiguous test.
    vocab = tokenizer.get_vocab()
    return int(vocab[token]) if token in vocab else None


def _as_id_list(encoded: Any) -> list[int]:
    """Normalise what apply_chat_template returns (list, BatchEncoding/dict, array, tensor) to list[int]."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if isinstance(encoded, Sequence) and len(encoded) == 1 and isinstance(encoded[0], Sequence):
        encoded = encoded[0]  # a batch of one
    if any(isinstance(i, (list, tuple, np.ndarray)) for i in encoded):
        raise RequestError("chat template returned a batch, expected one conversation", field="tokenizer")
    return [int(i) for i in encoded]


class CaptionTokenizer:
    """Wraps a Hugging Face tokenizer that carries the checkpoint's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise RequestError("tokenizer has no eos token", field="tokenizer")
        vision_start = _token_id(tokenizer, VISION_START_TOKEN)
        if vision_start is None:
            raise RequestError(f"tokenizer has no {VISION_START_TOKEN} token", field="tokenizer")
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestError("tokenizer has no chat template", field="tokenizer")
        self.tokenizer = tokenizer
        self.special = SpecialTokens(int(eos), vision_start, _token_id(tokenizer, VISION_END_TOKEN))
        # A robot sends one instruction request after request, and every request also encodes the empty
        # unconditional caption: rendering the chat template (jinja) and encoding cost ~0.5 ms each on a free core,
        # sequential per request in a batch's admission. The result is immutable, so it is cached per caption.
        self._encoded = functools.lru_cache(maxsize=ENCODE_CACHE_SIZE)(self._encode)

    @classmethod
    def from_pretrained(cls, local_dir: str | Path) -> CaptionTokenizer:
        """Load from a local folder only; a missing folder is a RequestError, never a download."""
        from transformers import AutoTokenizer

        path = Path(local_dir)
        if not path.is_dir():
            raise RequestError(f"no tokenizer folder at {path}", field="tokenizer")
        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True))

    def chat_template_ids(self, caption: str, system_prompt: str | None = None) -> list[int]:
        if not isinstance(caption, str):
            raise RequestError(f"must be a string, got {type(caption).__name__}", field="prompt")
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        messages.append({"role": "user", "content": caption})
        encoded = self.tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            add_generation_prompt=True,
            add_vision_id=False,  # passed by both reference implementations; plain text ignores it
            return_dict=False,
        )
        return _as_id_list(encoded)

    def encode(self, caption: str, system_prompt: str | None = None) -> TokenizedCaption:
        """Token ids of one CFG branch (the unconditional branch uses caption "")."""
        if not isinstance(caption, str) or not (system_prompt is None or isinstance(system_prompt, str)):
            return self._encode(caption, system_prompt)  # the typed error, before the cache hashes the key
        return self._encoded(caption, system_prompt)

    def _encode(self, caption: str, system_prompt: str | None) -> TokenizedCaption:
        ids = self.chat_template_ids(caption, system_prompt)
        text = (*ids, self.special.eos_id, self.special.vision_start_id)
        return TokenizedCaption(caption, tuple(ids), text)


def as_caption_tokenizer(tokenizer: Any) -> Any:
    """A Hugging Face tokenizer wrapped as a CaptionTokenizer; a CaptionTokenizer or a stand-in with `encode`
    (the random-weight models' tokenizers) as it is."""
    if not isinstance(tokenizer, CaptionTokenizer) and hasattr(tokenizer, "apply_chat_template"):
        return CaptionTokenizer(tokenizer)
    return tokenizer


def load_caption_tokenizer(local_dir: str | Path) -> CaptionTokenizer:
    return CaptionTokenizer.from_pretrained(local_dir)
