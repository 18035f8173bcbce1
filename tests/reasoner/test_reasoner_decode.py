"""The decode loop's sampling (against transformers' logits processors), seeding, stop strings, batched rows, and
loading the Reasoner's parts from the built-in checkpoints (hub layout with a vision tower; text only)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from oracle.reasoner import build_tiny_reasoner
from transformers import AutoTokenizer
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from wamrt.pipeline.errors import RequestError
from wamrt.reasoner.engine import DecodeBatch
from wamrt.reasoner.sampling import MAX_UNFINISHED_TOKENS, SamplingParams, SequenceSampler, TextStream


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_reasoner(tmp_path_factory.mktemp("tiny_decode"), vision=False)


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "penalty"),
                         [(0.7, 0, 1.0, 1.0), (1.0, 20, 1.0, 1.0), (1.3, 0, 0.8, 1.0), (0.9, 50, 0.9, 1.3)])
def test_filtered_logits_equal_transformers_processors(temperature, top_k, top_p, penalty) -> None:
    vocab = 300
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 3
    prompt = [5, 17, 17, 250]
    sp = SequenceSampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                        repetition_penalty=penalty, seed=0), vocab, torch.device("cpu"), prompt)
    ours = sp.filtered(logits)
    ids, ref = torch.tensor([prompt]), logits[None].clone()
    chain = [RepetitionPenaltyLogitsProcessor(penalty)] if penalty != 1.0 else []
    chain.append(TemperatureLogitsWarper(temperature))
    if top_k:
        chain.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        chain.append(TopPLogitsWarper(top_p))
    for proc in chain:
        ref = proc(ids, ref)
    kept = torch.isfinite(ref[0])
    assert torch.equal(torch.isfinite(ours), kept) and 1 < int(kept.sum()) <= vocab
    assert torch.allclose(ours[kept], ref[0][kept], rtol=1e-6, atol=1e-6)


def test_seeded_sampling_repeats_and_seeds_differ(tiny) -> None:
    r = tiny.reasoner
    prompt = r.prepare([{"role": "user", "content": "Name a colour."}])

    def run(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
        return list(r.generate([prompt], params))[-1][0].seq.tokens

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_batched_rows_equal_solo_runs(tiny) -> None:
    """Three prompts of different lengths decoded together give each the tokens it gets alone (greedy), and a row
    that finishes early frees its row while the others go on."""
    r = tiny.reasoner
    prompts = [r.prepare([{"role": "user", "content": t}]) for t in ("Hi.", "Describe a kitchen.", "One two three")]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 5, 9)]
    solo = [list(r.generate([p], sp))[-1][0].seq.tokens for p, sp in zip(prompts, params, strict=True)]
    finished = {}
    for events in r.generate(prompts, params):
        for e in events:
            if e.finish_reason:
                finished[e.seq.tag] = e.seq.tokens
    assert [finished[i] for i in range(3)] == solo
    assert [len(t) for t in solo] == [12, 5, 9]


def test_stop_strings_cut_the_text_and_hold_back_prefixes() -> None:
    tok = _byte_tokenizer()
    ids = tok("abc STOP def", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, stop=("STOP",))
    out = [stream.push(i) for i in ids]
    # "S", "ST", "STO" were held back (they could have become the stop string); nothing after it is ever sent.
    assert "".join(out) == "abc " and stream.stopped and stream.text == "abc "
    stream = TextStream(tok, stop=("STOP",))
    deltas = [stream.push(i) for i in tok("a ST b", add_special_tokens=False)["input_ids"]]
    assert "".join(deltas) + stream.finish() == "a ST b" and not stream.stopped


def _metaspace_tokenizer():
    """SentencePiece-style words ("▁word"): a token's text depends on whether it starts the decoded text (its
    leading space is dropped there), the case a window decode must get right."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "▁the", "▁arm", "▁picks", "▁up", "▁cube", ".", "▁ü", "ber", "▁東京"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.mark.parametrize("which", ["bytes", "metaspace"])
def test_the_stream_is_the_whole_decode_from_bounded_windows(which) -> None:
    """Streamed pieces add up to the whole sequence decoded at once (multi-byte characters split across tokens,
    invalid bytes, leading spaces), while each token decodes only a few ids, however long the sequence."""
    tok = _byte_tokenizer() if which == "bytes" else _metaspace_tokenizer()
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(["the", "arm", "picks", "up", "cube.", "über", "東京", "20°C", "🤖"], 400))
    sequences = [tok(text, add_special_tokens=False)["input_ids"]]
    if which == "bytes":  # random bytes: unfinished and invalid UTF-8 everywhere
        sequences += [list(map(int, rng.integers(0, 256, 500))) for _ in range(5)]
    else:
        sequences += [list(map(int, rng.integers(1, 10, 500))) for _ in range(5)]
    for ids in sequences:
        decoded: list[int] = []
        original = tok.decode

        def counting(window, **kw):
            decoded.append(len(window))
            return original(window, **kw)

        tok.decode = counting
        try:
            stream = TextStream(tok)
            pieces = [stream.push(i) for i in ids]
            pieces.append(stream.finish())
        finally:
            tok.decode = original
        whole = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert "".join(pieces) == whole == stream.text
        assert max(decoded) <= 2 * MAX_UNFINISHED_TOKENS + 2, max(decoded)  # not the sequence's length


def test_an_unfinished_character_is_held_back_until_its_last_byte() -> None:
    tok = _byte_tokenizer()
    ids = tok("a🤖b", add_special_tokens=False)["input_ids"]  # a, 4 bytes of the robot, b
    stream = TextStream(tok)
    assert [stream.push(i) for i in ids] == ["a", "", "", "", "🤖", "b"]


def test_stop_string_and_max_tokens_finish_reasons(tiny) -> None:
    r = tiny.reasoner
    prompt = r.prepare([{"role": "user", "content": "Say something."}])
    free = list(r.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)))[-1][0].seq
    assert free.finish_reason == "length" and len(free.tokens) == 30
    # Pick a stop string out of what greedy decoding writes anyway: the run must stop right before it.
    text = free.text
    cut = next(i for i in range(3, len(text) - 2) if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    stop = text[cut:cut + 2]
    seq = list(r.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                   stop=(stop,))))[-1][0].seq
    assert seq.finish_reason == "stop" and seq.text == text[:cut]


def test_bad_sampling_settings_name_the_field() -> None:
    for kw, name in (({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                     ({"stop": ("",)}, "stop"), ({"repetition_penalty": 0}, "repetition_penalty")):
        with pytest.raises(RequestError) as err:
            SamplingParams(**kw)
        assert err.value.field == name


def test_prompt_over_the_context_is_refused(tiny) -> None:
    r = tiny.reasoner
    with pytest.raises(RequestError) as err:
        r.prepare([{"role": "user", "content": "x" * 600}])  # byte-level tokens: > 512 - 1
    assert err.value.field == "messages" and "limit" in str(err.value)
    with pytest.raises(RequestError) as err:
        r.prepare([{"role": "user", "content": [{"type": "image", "image": None}]}])
    assert "no vision encoder" in str(err.value)
    batch = DecodeBatch(r, 1)
    assert batch.free_rows == 1


def test_builtin_checkpoints_load_their_reasoner(tmp_path, monkeypatch) -> None:
    """tiny-world is in the hub layout (root index over transformer/ and vision_encoder/): lm_head and the vision
    tower load; tiny-droid has lm_head but no vision_encoder/: text only."""
    import wamrt
    from wamrt.reasoner import reasoner_of

    monkeypatch.setenv("WAMRT_CACHE", os.environ.get("WAMRT_CACHE", str(tmp_path)))
    world, why = reasoner_of(wamrt.load_policy("tiny-world", device="cpu"), "tiny-world")
    assert world is not None, why
    assert not world.text_only and world.describe()["vision"] is True
    assert world.vision.deepstack_layers == 2
    droid, why = reasoner_of(wamrt.load_policy("tiny-droid", device="cpu"), "tiny-droid")
    assert droid is not None and droid.text_only and "text only" in droid.describe()["note"]
    seq = droid.complete([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4, temperature=0,
                                                                               ignore_eos=True))
    assert len(seq.tokens) == 4


def _byte_tokenizer():
    import tempfile
    from pathlib import Path

    from wamrt.pipeline.builtin import write_tokenizer

    folder = Path(tempfile.mkdtemp()) / "tok"
    write_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _eager_graphs(monkeypatch, captures: list) -> None:
    """DecodeGraphs replaced by a CPU stand-in that "captures" by running what warm-up and capture write (at the
    cache's scratch position) and replays eagerly; `captures` records (rows, span) of every capture."""
    import wamrt.reasoner.graphs as graphs

    class EagerGraphs(graphs.DecodeGraphs):
        def __init__(self, lm, cache, layer_fn=None, attention="sdpa") -> None:
            self.lm, self.cache, self.layer_fn, self.entries, self.attention = lm, cache, layer_fn, {}, attention

        def capture(self, rows: int, span: int):
            index = torch.full((rows,), self.scratch, dtype=torch.long)
            for _ in range(2):  # what warm-up and capture write
                self.lm.decode_step(self.cache, torch.zeros(rows, dtype=torch.long), index, torch.zeros(rows), span,
                                    attention=self.attention)
            captures.append((rows, span))
            self.entries[(rows, span)] = True
            return True

        def step(self, tokens, index, rope_pos, span):
            if (tokens.shape[0], span) not in self.entries:
                self.capture(tokens.shape[0], span)
            return self.lm.decode_step(self.cache, tokens, index, rope_pos, span, attention=self.attention)

    monkeypatch.setattr(graphs, "DecodeGraphs", EagerGraphs)


def test_graph_bookkeeping_on_cpu(tiny, monkeypatch) -> None:
    """The graph path's host side on CPU: rows padded to a power of two (at most the batch's rows), captures made
    mid-run (writing only the cache's scratch position) leave live sequences intact; a stand-in replays eagerly."""
    captures = []
    _eager_graphs(monkeypatch, captures)
    r = tiny.reasoner
    prompts = [r.prepare([{"role": "user", "content": t}]) for t in ("Hi.", "Describe a kitchen.", "Three")]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    solo = [list(r.generate([p], params, cuda_graphs=False))[-1][0].seq.tokens for p in prompts]
    done = {}
    for events in r.generate(prompts, params, cuda_graphs=True):
        for e in events:
            if e.finish_reason:
                done[e.seq.tag] = e.seq.tokens
    assert [done[i] for i in range(3)] == solo
    assert {rows for rows, _ in captures} == {3} and all(span % 128 == 0 for _, span in captures)


def _drive(r, prompts, params, *, lookahead: bool, admit_late: dict | None = None, cancel_at: dict | None = None,
           graphs: bool = False):
    """A continuous-batching driver (as a server's): admit, step, admit more between steps, cancel between steps;
    -> each tag's (tokens, finish reason, text) and its events in order."""
    batch = DecodeBatch(r, len(prompts), cuda_graphs=graphs, lookahead=lookahead)
    admit_late, cancel_at = admit_late or {}, cancel_at or {}
    seqs, events, steps = {}, [], 0
    for tag, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        if tag not in admit_late:
            events.append(batch.admit(p, sp, tag=tag))
            seqs[tag] = events[-1].seq
    while batch.live or any(t not in seqs for t in admit_late):
        for tag, at in admit_late.items():
            if at == steps and tag not in seqs and batch.free_rows:
                events.append(batch.admit(prompts[tag], params[tag], tag=tag))
                seqs[tag] = events[-1].seq
        for tag, at in cancel_at.items():
            if at == steps and tag in seqs:
                batch.cancel(seqs[tag])
        events += batch.step()
        steps += 1
        assert steps < 200
    out = {tag: (s.tokens, s.finish_reason, s.stream.text) for tag, s in seqs.items()}
    # Per row, in order (a row admitted between steps joins the step after the one in flight under lookahead, so
    # the rows' events interleave differently across steps)
    return out, {tag: [(e.token, e.text, e.finish_reason) for e in events if e.seq.tag == tag] for tag in seqs}


@pytest.mark.parametrize("graphs", [False, True])
def test_lookahead_decodes_what_the_plain_loop_does(tiny, monkeypatch, graphs: bool) -> None:
    """`DecodeBatch(lookahead=True)` launches each step before reading the previous one's tokens: the same tokens,
    texts, finish reasons and events per row as the plain loop, for greedy rows of different lengths, seeded sampling
    with top-p and a repetition penalty (the per-row sampler path), a stop string, a row admitted mid-run into a
    freed row, and a row cancelled mid-run (on the graph path's bookkeeping too)."""
    if graphs:
        _eager_graphs(monkeypatch, [])
    r = tiny.reasoner
    texts = ("Hi.", "Describe a kitchen.", "One two three", "Name a colour.")
    prompts = [r.prepare([{"role": "user", "content": t}]) for t in texts]
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 5, 9, 7)]
    sampled = [SamplingParams(max_tokens=n, temperature=1.1, top_p=0.9, repetition_penalty=1.2, seed=7 + n,
                              ignore_eos=True) for n in (10, 4, 8, 6)]
    free = list(r.generate([prompts[0]], greedy[0]))[-1][0].seq.stream.text
    stop = next(free[i:i + 2] for i in range(3, len(free) - 2) if free[i:i + 2].strip()
                and free.find(free[i:i + 2]) == i)
    stopping = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=(stop,)), *greedy[1:]]
    runs = {}
    for name, params, late, cancel in (("greedy", greedy, {3: 6}, {}), ("sampled", sampled, {3: 4}, {2: 3}),
                                       ("stop", stopping, {}, {1: 2})):
        plain = _drive(r, prompts, params, lookahead=False, admit_late=late, cancel_at=cancel, graphs=graphs)
        ahead = _drive(r, prompts, params, lookahead=True, admit_late=late, cancel_at=cancel, graphs=graphs)
        assert ahead == plain, name
        runs[name] = ahead[0]
    assert [(len(t), why) for t, why, _ in runs["greedy"].values()] == [(12, "length"), (5, "length"), (9, "length"),
                                                                       (7, "length")]
    assert runs["sampled"][2][1] == "cancelled" and len(runs["sampled"][2][0]) < 8
    assert runs["stop"][0][1:] == ("stop", free[:free.index(stop)]) and runs["stop"][1][1] == "cancelled"


def test_lookahead_leaves_out_rows_at_their_length(tiny, monkeypatch) -> None:
    """A row whose next token is its last is not launched again: with one row of 5 tokens, lookahead runs 4 decode
    steps, as the plain loop does (the first token comes from the prefill)."""
    calls = []
    real = tiny.reasoner.lm.decode_step

    def counting(*a, **kw):
        calls.append(a[1].shape[0])
        return real(*a, **kw)

    monkeypatch.setattr(tiny.reasoner.lm, "decode_step", counting)
    r = tiny.reasoner
    prompt = r.prepare([{"role": "user", "content": "Hi."}])
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    tokens = list(r.generate([prompt], params, lookahead=True))[-1][0].seq.tokens
    assert len(tokens) == 5 and len(calls) == 4
    assert tokens == list(r.generate([prompt], params))[-1][0].seq.tokens


@pytest.mark.parametrize("ahead", [True, False])
def test_chat_worker_captures_every_bucket_while_idle(tiny, monkeypatch, ahead: bool) -> None:
    """A server's chat thread captures every (rows, span) bucket of the decode graphs while idle, once allowed
    (after warm-up and the policy's captures), one bucket per device segment; a chat afterwards captures nothing
    on its steps and decodes what the eager path does. Without it, the chat's first step captures."""
    import threading
    import time

    import wamrt.reasoner.engine as engine
    from wamrt.serving.batcher import DeviceGate
    from wamrt.serving.chat_worker import ChatWorker

    captures = []
    _eager_graphs(monkeypatch, captures)

    class GraphBatch(engine.DecodeBatch):  # the CUDA path's bookkeeping on the CPU
        def __init__(self, reasoner, rows, **kw) -> None:
            super().__init__(reasoner, rows, cuda_graphs=True)

    monkeypatch.setattr(engine, "DecodeBatch", GraphBatch)
    r = tiny.reasoner
    prompt = r.prepare([{"role": "user", "content": "Describe a kitchen."}])
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    allowed = threading.Event()
    worker = ChatWorker(r, DeviceGate(), max_batch=2, max_queue=4,
                        precapture_when=allowed.is_set if ahead else None)
    try:
        time.sleep(0.3)
        assert worker.batch is None and not captures  # nothing before the server allows it
        allowed.set()
        deadline = time.monotonic() + 120
        while ahead and (worker.graphs_planned == 0 or worker.graphs_precaptured < worker.graphs_planned):
            assert time.monotonic() < deadline, worker.stats()
            time.sleep(0.05)
        if ahead:  # rows 1 and 2, every span from 128 up to the cache (512 tokens + the scratch position)
            assert sorted(captures) == sorted((rows, span) for rows in (1, 2) for span in (128, 256, 512, 640))
        text, reason, tokens = worker.run(prompt, params)
    finally:
        worker.stop()
    eager = list(r.generate([prompt], params, cuda_graphs=False))[-1][0].seq
    assert (reason, tokens, text) == ("length", 6, eager.stream.text)
    assert worker.stats()["graphs"]["captured_on_request"] == (0 if ahead else 1)


def test_a_decode_step_runs_eagerly_while_another_thread_captures(monkeypatch) -> None:
    """DecodeGraphs.step for a bucket without a graph while another thread holds the capture turn (the policy
    ladder compiling): the step runs on the eager layers (no compile beside a capture) instead of waiting with the
    device held, and the next step, with the turn free, captures the bucket."""
    from types import SimpleNamespace

    from oracle.turn_holder import turn_held_elsewhere

    import wamrt.reasoner.graphs as graphs

    calls: list = []

    class FakeLM:
        device = torch.device("cpu")

        def decode_step(self, cache, tokens, index, rope_pos, span, layer_fn=None, attention="sdpa"):
            calls.append(layer_fn)
            return torch.full((tokens.shape[0], 4), 7.0)

    g = graphs.DecodeGraphs.__new__(graphs.DecodeGraphs)
    g.lm, g.cache, g.layer_fn, g.entries, g.attention = FakeLM(), None, "compiled", {}, "sdpa"
    captured: list = []

    def capture(rows: int, span: int):
        captured.append((rows, span))
        entry = SimpleNamespace(tokens=torch.zeros(rows, dtype=torch.long), index=torch.zeros(rows, dtype=torch.long),
                                rope_pos=torch.zeros(rows, dtype=torch.long), logits=torch.ones(rows, 4),
                                graph=SimpleNamespace(replay=lambda: None))
        g.entries[(rows, span)] = entry
        return entry

    monkeypatch.setattr(g, "capture", capture)
    tokens, index, pos = (torch.zeros(2, dtype=torch.long) for _ in range(3))
    with turn_held_elsewhere():  # the policy ladder compiling
        eager = g.step(tokens, index, pos, 128)
    assert calls == [None] and captured == [] and torch.equal(eager, torch.full((2, 4), 7.0))
    replayed = g.step(tokens, index, pos, 128)
    assert captured == [(2, 128)] and torch.equal(replayed, torch.ones(2, 4)) and calls == [None]


def test_decode_attention_auto_takes_the_kernel_only_where_it_runs(tiny, monkeypatch) -> None:
    """The default picks the split-key kernel where `decode_attention_problem` finds none (a CUDA device, bf16/fp16,
    a power-of-two head size), SDPA elsewhere; an explicit choice is kept."""
    import wamrt.ops.decode_attention as kernel

    r = tiny.reasoner
    assert DecodeBatch(r, 1, cuda_graphs=False).decode_attention == "sdpa"  # the CPU
    assert DecodeBatch(r, 1, cuda_graphs=False, decode_attention="split").decode_attention == "split"
    monkeypatch.setattr(kernel, "decode_attention_problem", lambda q, keys, values=None: None)
    assert DecodeBatch(r, 1, cuda_graphs=False).decode_attention == "split"


def test_chat_worker_one_row_decodes_the_layers_tokens(tiny) -> None:
    """`--chat-decode one-row`: the chat thread's batch runs `OneRowDecode` on the model's own matrices, nothing
    compiled and nothing fused or folded (the policy shares them), and a greedy chat gets the tokens of the layers;
    a model it cannot run (a projection that is not a plain linear layer) keeps the layers."""
    import torch

    from wamrt.reasoner.fused import OneRowDecode
    from wamrt.serving.batcher import DeviceGate
    from wamrt.serving.chat_worker import ChatWorker

    r = tiny.reasoner
    prompt = r.prepare([{"role": "user", "content": "Describe a kitchen."}])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    weights = {name: p.clone() for name, p in r.lm.named_parameters()}
    worker = ChatWorker(r, DeviceGate(), max_batch=2, max_queue=4, one_row=True)
    try:
        text, reason, tokens = worker.run(prompt, params)
        layer_fn = worker.batch.layer_fn
    finally:
        worker.stop()
    assert isinstance(layer_fn, OneRowDecode) and not layer_fn.compile_rows
    assert all(torch.equal(p, weights[name]) for name, p in r.lm.named_parameters())  # the model untouched
    eager = list(r.generate([prompt], params, cuda_graphs=False))[-1][0].seq
    assert (reason, tokens, text) == ("length", 8, eager.stream.text)
    attn = r.lm.transformer.layers[0].self_attn
    plain, attn.to_v = attn.to_v, torch.nn.Sequential(attn.to_v)
    try:
        fallback = ChatWorker(r, DeviceGate(), max_batch=1, max_queue=4, one_row=True)
        fallback.stop()
    finally:
        attn.to_v = plain
    assert fallback.decode_options == {}


def test_chat_decode_flag_reaches_the_config_and_is_checked() -> None:
    import argparse

    from wamrt.cli.serve import add_arguments
    from wamrt.serving.config import CHAT_DECODE, ServeConfig, ServeConfigError
    from wamrt.serving.server import config_from_args

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert config_from_args(ap.parse_args([])).chat_decode == "one-row" == ServeConfig.chat_decode
    assert config_from_args(ap.parse_args(["--chat-decode", "layers"])).chat_decode == "layers"
    assert set(ap._option_string_actions["--chat-decode"].choices) == set(CHAT_DECODE)
    with pytest.raises(ServeConfigError) as err:
        ServeConfig(chat_decode="fast")
    assert err.value.flag == "--chat-decode" and "one-row" in str(err.value)


def test_wamrt_chat_decodes_the_same_answer_on_the_one_row_stack(capsys) -> None:
    """`wamrt chat --decode one-row` (the default) answers what `--decode layers` answers (greedy, tiny-world on the
    CPU, where the stack runs the model's own ops)."""
    from wamrt.cli import main

    answers = {}
    for decode in ("one-row", "layers"):
        assert main(["chat", "--model", "tiny-world", "--device", "cpu", "--prompt", "Describe a kitchen.",
                     "--max-tokens", "12", "--temperature", "0", "--decode", decode]) == 0
        answers[decode] = capsys.readouterr().out
    assert answers["one-row"] == answers["layers"] and answers["layers"].strip()


def test_text_rope_gathers_what_the_per_step_tables_compute(tiny) -> None:
    """`ReasonerLM.text_rope` (the decode step's cos/sin, gathered from tables made once per cache length) equals the
    MRoPE tables made for the same positions on the three axes, bit for bit, from long and from float positions; the
    table is made once; a position past the table is an error, not a silent clamp."""
    lm = tiny.reasoner.lm
    pos = torch.tensor([0, 5, 37, 127])
    want = lm.rope(pos.float()[:, None, None].expand(4, 3, 1))
    for given in (pos, pos.float()):
        got = lm.text_rope(given, 128)
        assert got.cos.shape == want.cos.shape == (4, 1, lm.config.head_dim)
        assert torch.equal(got.cos, want.cos) and torch.equal(got.sin, want.sin)
    tables = dict(lm._text_rope)
    lm.text_rope(pos, 128)
    assert lm._text_rope == tables and all(a is b for a, b in zip(lm._text_rope.values(), tables.values(), strict=True))
    with pytest.raises(IndexError):
        lm.text_rope(torch.tensor([128]), 128)
