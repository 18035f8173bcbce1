"""The Reasoner's decode loop: prompts prefilled once into rows of a static K/V cache, then one token per live row
per step (a CUDA graph on GPU, eager on CPU), each row sampled with its own settings and generator, its text
streamed and cut at a stop string.

`DecodeBatch` is the loop's state and its two moves, `admit` (prefill one prompt into a free row) and `step`: a
server admits requests between steps (continuous batching) and gives the device to policy work between any two
moves; `Reasoner.generate` is the plain driver (admit all, step until done).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..pipeline.errors import RequestError
from .lm import DeepStack, KVCache, ReasonerLM
from .prompt import PreparedPrompt, prepare_prompt
from .sampling import SamplingParams, SequenceSampler, TextStream
from .vision import VisionTower

END_OF_TURN = ("<|im_end|>", "<|endoftext|>")
MIN_SPAN = 128  # smallest K/V span a step reads (spans are powers of two: few graphs, little waste)


@dataclass
class TokenEvent:
    seq: DecodeSeq
    token: int
    text: str  # text that became final with this token (the held-back rest comes with the last event)
    finish_reason: str | None = None  # "stop" | "length" on the sequence's last token


@dataclass(eq=False)
class DecodeSeq:
    """One prompt being decoded in row `row`."""

    prompt: PreparedPrompt
    params: SamplingParams
    sampler: SequenceSampler
    stream: TextStream
    row: int
    max_tokens: int
    tag: Any = None  # the caller's handle (a serving job)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def index(self) -> int:
        """Cache position of the last sampled token (fed at the next step)."""
        return self.prompt.length + len(self.tokens) - 1

    @property
    def text(self) -> str:
        return self.stream.text


class _Step:
    """A step queued on the device: its sequences in order, their sampled tokens there, and (on CUDA) the tokens'
    copy to pinned host memory, queued right behind them so that reading it waits for this step only."""

    def __init__(self, seqs: tuple[DecodeSeq, ...], picks: torch.Tensor) -> None:
        self.seqs, self.picks = seqs, picks
        self._where = {id(s): j for j, s in enumerate(seqs)}
        self._host, self._ready = picks, None
        if picks.is_cuda:
            self._host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True)
            self._host.copy_(picks, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def has(self, seq: DecodeSeq) -> bool:
        return id(seq) in self._where

    def position(self, seq: DecodeSeq) -> int:
        return self._where.get(id(seq), -1)

    def host_tokens(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


class DecodeBatch:
    """`rows` sequences at most, each up to `max_len` tokens (prompt and output) in the cache."""

    def __init__(self, reasoner: Reasoner, rows: int, *, cuda_graphs: bool | None = None,
                 fused: bool = False, fused_mode: str | None = None, lookahead: bool = False,
                 decode_attention: str = "auto", one_row: bool = False, attention_prep: bool = True,
                 merge_in_split: bool = False, pdl: bool = True) -> None:
        self.reasoner, self.lm = reasoner, reasoner.lm
        # `ReasonerLM.decode_step(attention=)`. auto: the split-key kernel where it runs (0.75 ms off a batch-1 Nano
        # step on the H100, bench/results/decode/2026-12-06-dfeffd6-nano-h100/), SDPA elsewhere (CPU, other dtypes)
        if decode_attention == "auto":
            decode_attention = "split" if self._split_kernel_runs() else "sdpa"
        self.decode_attention = decode_attention
        # lookahead: the next step launched before this one's tokens are read (`step`). A server decides per step
        # (`step(lookahead=...)`): not while policy work waits for the device, which would find a step still running.
        self.lookahead = lookahead
        self._inflight: _Step | None = None
        # +1: the last cache position is the graphs' scratch space, never a sequence's; a whole number of MIN_SPAN
        # positions, so every span a step reads is one too (attention kernels want aligned key masks).
        length = -(-(reasoner.max_len + 1) // MIN_SPAN) * MIN_SPAN
        # merge_in_split: the split kernel's last program per K/V head merges the splits (`KVCache.arrivals`), instead
        # of a merge kernel. Off: the last program merges alone after an atomic round trip, and that made a batch-1
        # Nano step 0.06 ms slower without PDL (H200, bench/results/decode/2026-12-06-9456251-nano-h200-pdl/) and
        # 0.10 ms slower with it (H100, bench/results/decode/2026-12-07-d0bd6bc-nano-h100-glue/).
        self.cache = KVCache.empty(self.lm.transformer, rows, length, merge_in_split=merge_in_split)
        self.rows: list[DecodeSeq | None] = [None] * rows
        use_graphs = self.lm.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        # fused: the layers' small kernels compiled into two regions (`fused.FusedDecodeLayer`, `fused_mode` its
        # compile mode); off by default: each row count's first step compiles for seconds (`wamrt bench decode`)
        # one_row: a one-row step's norms, residual adds and SiLU * up inside its GEMVs (`fused.OneRowDecode`; with
        # `fused` its steps of more rows compiled, else the model's layers); attention_prep: its q/k norms and RoPE
        # inside the split attention kernel; pdl: its kernels launched with programmatic dependent launch
        self.layer_fn = None
        if one_row:
            from .fused import OneRowDecode

            problem = OneRowDecode.problem(self.lm)
            if problem:
                raise ValueError(problem)
            self.layer_fn = OneRowDecode(fused_mode if fused else None, attention_prep=attention_prep, pdl=pdl,
                                         compile_rows=fused)
        elif fused:
            from .fused import FusedDecodeLayer

            self.layer_fn = FusedDecodeLayer(fused_mode)
        self.graphs = None
        self.captures_on_step = 0  # buckets first met by a step (captured there, on the request path)
        if use_graphs:
            from .graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.lm, self.cache, self.layer_fn, decode_attention)

    def _split_kernel_runs(self) -> bool:
        from ..ops.decode_attention import decode_attention_problem

        c, dev, dtype = self.lm.config, self.lm.device, self.lm.dtype
        probe = torch.empty(1, 1, 1, c.head_dim, device=dev, dtype=dtype)
        return decode_attention_problem(probe, probe) is None

    def graph_buckets(self) -> list[tuple[int, int]]:
        """Every (rows, span) bucket a step can use, shortest spans first (most chats are short): what a server
        captures ahead of its requests (`precapture`); none without graphs."""
        if self.graphs is None:
            return []
        rows = sorted({_bucket(n, 1, len(self.rows)) for n in range(1, len(self.rows) + 1)})
        spans, span = [], MIN_SPAN
        while True:
            spans.append(min(span, self.cache.length))
            if span >= self.cache.length:
                break
            span *= 2
        return [(r, s) for s in spans for r in rows]

    def precapture(self, rows: int, span: int) -> bool:
        """Capture one bucket's graph now, unless it exists; True when it captured."""
        if self.graphs is None or (rows, span) in self.graphs.entries:
            return False
        self.graphs.capture(rows, span)
        return True

    @property
    def live(self) -> list[DecodeSeq]:
        return [s for s in self.rows if s is not None]

    @property
    def free_rows(self) -> int:
        return self.rows.count(None)

    def admit(self, prompt: PreparedPrompt, params: SamplingParams, tag: Any = None) -> TokenEvent:
        """Prefill `prompt` into the lowest free row and sample its first token."""
        row = self.rows.index(None) if None in self.rows else -1
        if row < 0:
            raise RuntimeError("no free row")
        room = self.reasoner.max_len - prompt.length
        if room < 1:
            raise RequestError(f"the prompt is {prompt.length} tokens; the context holds {self.reasoner.max_len}",
                               field="messages")
        lm = self.lm
        seq = DecodeSeq(prompt, params, SequenceSampler(params, lm.vocab_size, lm.device, prompt.ids),
                        TextStream(self.reasoner.tokenizer, params.stop), row, min(params.max_tokens, room), tag)
        embeds, deepstack = self.reasoner.prompt_embeddings(prompt)
        positions = prompt.positions[None].to(lm.device)
        logits = lm.run_prompt(embeds, positions, cache=self.cache, row=row, deepstack=deepstack)[0]
        self.rows[row] = seq
        return self._append(seq, int(seq.sampler.pick(logits)))

    def step(self, lookahead: bool | None = None) -> list[TokenEvent]:
        """One token for every live row.

        With `lookahead` the step after this one is launched before this one's tokens are read: the rows' next
        inputs are this step's sampled tokens, gathered on the device, so the GPU goes from one step to the next
        without waiting for the host's part of a step (building inputs, reading the tokens back, streaming text:
        ~0.5 ms of a 7.5 ms batch-1 Nano step on the H100, bench/results/decode/2026-12-06-0230412-nano-h100/).
        The tokens are the same: each row's sampler runs in the same order. A row that finishes on a stop or end
        token has had one more token computed, which is dropped; a row at its `max_tokens` is left out.
        `lookahead` overrides the batch's setting for this call (False: read the step in flight, launch none)."""
        ahead = self.lookahead if lookahead is None else lookahead
        pending, self._inflight = self._inflight, None
        if pending is not None and not any(self._holds(s) for s in pending.seqs):
            pending = None  # every row of it finished or was cancelled: nothing to read
        if pending is None:
            live = self.live
            if not live:
                return []
            pending = self._launch(live, None)
        if ahead:
            after = [s for s in self.live if not (pending.has(s) and len(s.tokens) + 1 >= s.max_tokens)]
            self._inflight = self._launch(after, pending) if after else None
        return self._accept(pending)

    def _holds(self, s: DecodeSeq) -> bool:
        return self.rows[s.row] is s and s.finish_reason is None

    def _launch(self, seqs: Sequence[DecodeSeq], pending: _Step | None) -> _Step:
        """Queue one step of `seqs` on the device; a row in `pending` takes pending's sampled token as its input."""
        n = max(s.row for s in seqs) + 1
        n = n if self.graphs is None else _bucket(n, 1, len(self.rows))
        tokens, index, rope, source = [0] * n, [0] * n, [0] * n, [-1] * n
        for s in seqs:
            j = -1 if pending is None else pending.position(s)
            ahead = int(j >= 0)  # its newest token is pending's, not yet on the host
            tokens[s.row], source[s.row] = (0 if ahead else s.tokens[-1]), j
            index[s.row] = s.index + ahead
            rope[s.row] = s.prompt.next_position + len(s.tokens) - 1 + ahead
        if max(rope) >= self.cache.length:  # past `text_rope`'s tables: on CUDA a device-side assert, not an error
            raise RuntimeError(f"MRoPE position {max(rope)} at or past the cache length {self.cache.length}")
        span = _bucket(max(index) + 1, MIN_SPAN, self.cache.length)
        # The step's own small copies and kernels sit between two graphs with nothing to overlap them (at one row of
        # a Nano step on the H200, 34 of its 215 kernels and copies): a graph takes the positions straight from pinned
        # memory, and a step whose every row continues pending's row of the same place takes pending's tokens as they
        # are.
        i, r = self._pinned(index, torch.long), self._pinned(rope, torch.long)
        if self.graphs is None:
            i, r = self._on_device(i), self._on_device(r)
        if pending is None or max(source) < 0:
            t = self._on_device(self._pinned(tokens, torch.long))
        elif source == list(range(len(pending.seqs))):
            t = pending.picks
        else:
            src, fed = (self._on_device(self._pinned(v, torch.long)) for v in (source, tokens))
            t = torch.where(src >= 0, pending.picks[src.clamp(min=0)], fed)
        if self.graphs is not None:
            self.captures_on_step += (n, span) not in self.graphs.entries
            logits = self.graphs.step(t, i, r, span)
        else:
            logits = self.lm.decode_step(self.cache, t, i, r, span, self.layer_fn, self.decode_attention)
        if all(s.params.greedy and s.sampler.seen is None for s in seqs):  # one argmax for the batch
            rows = [s.row for s in seqs]
            picked = logits[: len(rows)] if rows == list(range(len(rows))) else \
                logits[self._on_device(self._pinned(rows, torch.long))]
            picks = picked.argmax(-1)
        else:
            picks = torch.stack([s.sampler.pick(logits[s.row]) for s in seqs])
        return _Step(tuple(seqs), picks)

    def _pinned(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """On CUDA in pinned memory: a pageable copy would wait for the device to reach it, which with lookahead is
        the end of the step in flight."""
        return torch.tensor(values, dtype=dtype, pin_memory=self.lm.device.type == "cuda")

    def _on_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.lm.device, non_blocking=True)

    def _accept(self, step: _Step) -> list[TokenEvent]:
        tokens = step.host_tokens()  # the step's one host sync
        return [self._append(s, tok) for s, tok in zip(step.seqs, tokens, strict=True)
                if self._holds(s)]  # not cancelled or finished meanwhile

    def _append(self, s: DecodeSeq, tok: int) -> TokenEvent:
        s.tokens.append(tok)
        text = s.stream.push(tok)
        reason = None
        if not s.params.ignore_eos and (tok in self.reasoner.end_ids or tok in s.params.stop_token_ids):
            reason = "stop"
        elif s.stream.stopped:
            reason = "stop"
        elif len(s.tokens) >= s.max_tokens:
            reason = "length"
        if reason is not None:
            text += s.stream.finish()
            s.finish_reason = reason
            self.rows[s.row] = None
        return TokenEvent(s, tok, text, reason)

    def cancel(self, seq: DecodeSeq) -> None:
        if self.rows[seq.row] is seq:
            self.rows[seq.row] = None
            seq.finish_reason = seq.finish_reason or "cancelled"


def _bucket(n: int, lo: int, hi: int) -> int:
    size = lo
    while size < n:
        size *= 2
    return min(size, hi)


class Reasoner:
    """The served checkpoint's Reasoner as a chat model: `ReasonerLM`, the checkpoint's tokenizer (with its chat
    template) and, when the checkpoint ships one, the vision tower."""

    def __init__(self, lm: ReasonerLM, tokenizer: Any, vision: VisionTower | None = None, *, max_len: int = 8192,
                 name: str = "") -> None:
        # tokenizer None: prompts come as ids (benchmarks), no text is streamed.
        if tokenizer is not None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the Reasoner needs a tokenizer with a chat template")
        self.lm, self.tokenizer, self.vision, self.max_len, self.name = lm, tokenizer, vision, max_len, name
        ends: set[int] = set()
        if tokenizer is not None:
            vocab = tokenizer.get_vocab()
            ends = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
            ends |= {int(vocab[t]) for t in END_OF_TURN if t in vocab}
        self.end_ids = frozenset(ends)

    @property
    def text_only(self) -> bool:
        return self.vision is None

    def describe(self) -> dict[str, Any]:
        """What /v1/metadata says about the Reasoner."""
        return {"chat": True, "vision": not self.text_only, "max_context_tokens": self.max_len,
                "vocab_size": self.lm.vocab_size,
                "note": "images and videos: vision_encoder/ loaded" if self.vision is not None else
                "text only: the checkpoint has no vision_encoder/"}

    def prepare(self, messages: Sequence[dict[str, Any]], *, max_prompt_tokens: int | None = None) -> PreparedPrompt:
        return prepare_prompt(self.tokenizer, messages, self.vision,
                              max_prompt_tokens=min(max_prompt_tokens or self.max_len, self.max_len - 1))

    @torch.no_grad()
    def prompt_embeddings(self, prompt: PreparedPrompt) -> tuple[torch.Tensor, DeepStack | None]:
        """[1, U, h] input embeddings with the media's tower outputs in place, and their DeepStack features."""
        lm = self.lm
        embeds = lm.embed(torch.tensor([prompt.ids], device=lm.device))
        if not prompt.media:
            return embeds, None
        assert self.vision is not None and prompt.media_mask is not None
        outputs = {}
        for kind in ("image", "video"):  # encoded per kind, as transformers does
            group = [m for m in prompt.media if m.kind == kind]
            if group:
                outputs[kind] = self.vision.encode(group)
        # Back into prompt order: the media of one kind keep their order, so each medium is a slice of its kind's.
        merge, cursor = self.vision.merge, dict.fromkeys(outputs, 0)
        rows, deep = [], []
        for m in prompt.media:
            e, ds = outputs[m.kind]
            a = cursor[m.kind]
            cursor[m.kind] = b = a + m.tokens(merge)
            rows.append(e[a:b])
            deep.append([d[a:b] for d in ds])
        mask = prompt.media_mask.to(lm.device)
        embeds = embeds.clone()
        embeds[0, mask] = torch.cat(rows).to(embeds.dtype)
        stacks = [torch.cat([d[layer] for d in deep]) for layer in range(len(deep[0]))]
        return embeds, DeepStack(mask, stacks)

    def generate(self, prompts: Sequence[PreparedPrompt], params: SamplingParams | Sequence[SamplingParams], *,
                 on_step: Callable[[], None] | None = None, cuda_graphs: bool | None = None, fused: bool = False,
                 lookahead: bool = False, one_row: bool = False) -> Iterator[list[TokenEvent]]:
        """Decode `prompts` as one batch; yields the events of each prefill and each step (`on_step` runs between
        any two of them: where a server gives the device to other work). `one_row`: `DecodeBatch(one_row=True)`."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        batch = DecodeBatch(self, len(prompts), cuda_graphs=cuda_graphs, fused=fused, lookahead=lookahead,
                            one_row=one_row)
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
            if on_step is not None and i:
                on_step()
            yield [batch.admit(p, sp, tag=i)]
        while batch.live:
            if on_step is not None:
                on_step()
            yield batch.step()

    def complete(self, messages: Sequence[dict[str, Any]], params: SamplingParams, **kw: Any) -> DecodeSeq:
        """One conversation to its end; the finished sequence (text, tokens, finish reason)."""
        seq = None
        for events in self.generate([self.prepare(messages)], params, **kw):
            seq = events[0].seq if events else seq
        assert seq is not None
        return seq
