"""The stand-in tokenizers of random-weight models: fixed counts for the latency workload, text-following
counts for serving (issue 13: the load benchmark must see instructions of different lengths)."""

from __future__ import annotations

import pytest
import torch

from wamrt.bench.prompts import MIXED_INSTRUCTIONS
from wamrt.pipeline.policy import random_policy
from wamrt.pipeline.prompts import droid_prompt
from wamrt.pipeline.random_weights import FixedLengthTokenizer, VariableLengthTokenizer, random_tokenizer
from wamrt.sample import INSTRUCTION

VOCAB = 151936


def caption(instruction: str) -> str:
    return droid_prompt(instruction, json_format=False, canvas_hw=(540, 640))


def test_variable_length_follows_the_text_and_ids_follow_the_bytes():
    tok = VariableLengthTokenizer(VOCAB)
    lengths = [tok.encode(caption(i)).und_len for i in MIXED_INSTRUCTIONS]
    assert len(set(lengths)) == len(MIXED_INSTRUCTIONS) >= 8  # the load benchmark's mix: all different
    assert min(lengths) <= 128 < max(lengths)  # it straddles a 64-token bucket boundary
    # performance.md's counts for the sample instruction and the unconditional branch
    assert tok.encode(caption(INSTRUCTION)).und_len == 125 and tok.encode("").und_len == 30
    a, b = tok.encode("open the drawer"), VariableLengthTokenizer(VOCAB).encode("open the drawer")
    assert a.text_ids == b.text_ids  # deterministic across instances (a server restart keeps its K/V keys)
    assert a.text_ids[-2:] == (1, 2)  # eos, vision_start close the prefix
    other = tok.encode("close the drawer")
    assert other.und_len == a.und_len and other.text_ids != a.text_ids
    assert all(4 <= i < VOCAB for i in a.chat_template_ids)
    assert tok.encode("x" * 60).und_len == tok.encode("").und_len + 10  # long words split every 6 letters


def test_fixed_length_stays_the_latency_workload():
    fixed = random_tokenizer("fixed", VOCAB)
    assert isinstance(fixed, FixedLengthTokenizer)
    assert {fixed.encode(caption(i)).und_len for i in MIXED_INSTRUCTIONS} == {125}
    assert isinstance(random_tokenizer("variable", VOCAB), VariableLengthTokenizer)
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        random_tokenizer("bpe", VOCAB)


def test_random_policy_keeps_fixed_lengths_unless_asked():
    """`wamrt bench latency` calls random_policy without a tokenizer: performance.md's 125 / 30 tokens."""
    assert isinstance(random_policy("tiny-edge", "cpu", torch.float32, tiny_vae=True).tokenizer, FixedLengthTokenizer)
    served = random_policy("tiny-edge", "cpu", torch.float32, tiny_vae=True, tokenizer="variable")
    assert isinstance(served.tokenizer, VariableLengthTokenizer)
