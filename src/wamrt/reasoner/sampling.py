"""Next-token choice and the text a decode loop streams: sampling settings, the sampler, and the incremental
detokenizer that cuts the text at a stop string.

The sampler follows the conventions the Qwen3-VL / cosmos-framework / vLLM stacks share, so a request written for
one of them means the same here: the repetition penalty divides positive and multiplies negative logits of every
token seen in the prompt or the output so far (CTRL / Hugging Face); then temperature, top-k, top-p (the smallest
set whose mass reaches p; at least one token) and a multinomial draw from a per-request seeded generator.
`temperature == 0` is greedy (argmax, no draw).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..pipeline.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()  # cut the text before the first of these (not included)
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's end-of-turn ids
    seed: int | None = None
    ignore_eos: bool = False  # run to max_tokens (parity tests, benchmarks)

    def __post_init__(self) -> None:
        checks = (("max_tokens", self.max_tokens >= 1, ">= 1"),
                  ("temperature", 0 <= self.temperature <= 100, "in [0, 100]"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1]"), ("top_k", self.top_k >= 0, ">= 0"),
                  ("repetition_penalty", 0 < self.repetition_penalty <= 10, "in (0, 10]"))
        for name, ok, want in checks:
            if not ok:
                raise RequestError(f"must be {want}, got {getattr(self, name)!r}", field=name)
        if len(self.stop) > 4 or any(not isinstance(s, str) or not s or len(s) > 256 for s in self.stop):
            raise RequestError("at most 4 non-empty strings of at most 256 characters", field="stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SequenceSampler:
    """One sequence's sampling state: its settings, its generator and (with a repetition penalty) the tokens seen."""

    params: SamplingParams
    vocab: int
    device: torch.device
    prompt_ids: Sequence[int] = ()
    generator: torch.Generator | None = field(init=False, default=None)
    seen: torch.Tensor | None = field(init=False, default=None)  # [V] bool

    def __post_init__(self) -> None:
        if not self.params.greedy:
            seed = self.params.seed if self.params.seed is not None else int(torch.randint(0, 2**62, ()).item())
            self.generator = torch.Generator(device=self.device).manual_seed(seed)
        if self.params.repetition_penalty != 1.0:
            self.seen = torch.zeros(self.vocab, dtype=torch.bool, device=self.device)
            ids = torch.tensor([i for i in self.prompt_ids if 0 <= i < self.vocab], dtype=torch.long,
                               device=self.device)
            self.seen[ids] = True

    def filtered(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] fp32 -> what the draw samples from: penalised, tempered, top-k / top-p cut to -inf."""
        p = self.params
        if self.seen is not None:
            penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(self.seen, penalised, logits)
        if p.greedy:
            return logits
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            ordered, order = torch.sort(logits, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p  # the mass before this token already reaches p
            logits = torch.empty_like(logits).scatter_(0, order, ordered.masked_fill(drop, float("-inf")))
        return logits

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] (fp32) -> the next token id, a 0-d long tensor on the logits' device (no host sync)."""
        logits = self.filtered(logits)
        if self.params.greedy:
            token = torch.argmax(logits)
        else:
            token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=self.generator)[0]
        if self.seen is not None:
            self.seen[token] = True
        return token


# A character is at most 4 UTF-8 bytes, so at most 4 tokens; text still unfinished after more is invalid bytes (what
# a random model writes), streamed as U+FFFD rather than decoded again and again.
MAX_UNFINISHED_TOKENS = 8


class TextStream:
    """Token ids -> text deltas, cut before the first stop string. Text that could still turn into a stop string
    (a suffix that is a prefix of one) or into a character (an unfinished UTF-8 sequence decodes to U+FFFD) is
    held back until it is decided.

    Incremental: each token decodes a window, not the whole sequence (decoding everything again at every step costs
    the decode thread O(length) per row and step: 0.34 ms at 2,048 tokens with a byte-level BPE, ~11 ms a step at
    32 rows, as long as the GPU's step). The window starts a chunk before the newest tokens, because a token's text
    can depend on the one before it (a SentencePiece leading space). Its text beyond the chunk's is new once it does
    not end in an unfinished character; an unfinished one waits for the next token. The result is the whole
    sequence's `decode(..., clean_up_tokenization_spaces=False)` (tests/reasoner/test_reasoner_decode.py)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already streamed
        self.text = ""
        self.stopped = False
        self._start = self._read = 0  # the window: ids[_start:] decoded; ids[_start:_read] already in `text`
        self._longest_stop = max((len(x) for x in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _new_text(self, final: bool) -> str:
        """The window's text beyond what `text` already holds ("" while it ends in an unfinished character, unless
        `final`); advances the window when it returns text."""
        window = self.ids[self._start:]
        known = len(self._decode(window[: self._read - self._start])) if self._read > self._start else 0
        now = self._decode(window)
        waiting = now.endswith("\ufffd") and len(self.ids) - self._read <= MAX_UNFINISHED_TOKENS
        if len(now) <= known or (waiting and not final):
            return ""
        self._start, self._read = self._read, len(self.ids)
        return now[known:]

    def push(self, token: int) -> str:
        """Add one generated token; return the text that is now final (possibly "")."""
        if self.stopped:
            return ""
        self.ids.append(int(token))
        if self.tokenizer is None:
            return ""
        return self._add(self._new_text(final=False))

    def finish(self) -> str:
        """The held-back rest, at the end of the sequence."""
        rest = self._add(self._new_text(final=True)) if not self.stopped and self.tokenizer is not None else ""
        return rest + self._emit(len(self.text))

    def _add(self, piece: str) -> str:
        old = len(self.text)
        self.text += piece
        # a stop string ending in the new piece starts at most longest - 1 characters before it
        search_from = max(0, old - self._longest_stop + 1)
        cut = min((at for x in self.stop if (at := self.text.find(x, search_from)) >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self._emit(len(self.text))
        hold = 0
        for x in self.stop:
            for n in range(min(len(x) - 1, len(self.text)), 0, -1):
                if self.text.endswith(x[:n]):
                    hold = max(hold, n)
                    break
        return self._emit(len(self.text) - hold)

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.sent)
        delta, self.sent = self.text[self.sent:upto], upto
        return delta
