"""`/v1/chat/completions` through the official `openai` client on a real server (built-in tiny-world: the hub layout
with a vision tower; tiny-droid: text only), typed errors in OpenAI's shape, prompt upsampling on generation jobs,
and policy latency while a long chat stream runs on the same device."""

from __future__ import annotations

import base64
import io
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from oracle.latency import percentile, policy_request_ms
from PIL import Image

from wamrt.client.wire import packb
from wamrt.sample import sample_observation
from wamrt.serving import ServeConfig, ServerThread

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # the sound tokenizer's weight_norm


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    import wamrt

    os.environ.setdefault("WAMRT_CACHE", str(tmp_path_factory.mktemp("wamrt_cache")))
    policy = wamrt.load_policy("tiny-world", device="cpu")
    config = ServeConfig(model_name="tiny-world", steps=1, max_batch=4, max_wait_ms=2.0, chat_max_tokens=4096,
                         chat_max_image_pixels=512 * 512, upsample_max_tokens=24)
    with ServerThread(policy, config) as s:
        yield s


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _png_url(hw=(48, 64), seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (*hw, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_not_streaming(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="tiny-world", messages=[{"role": "user", "content": "Hello robot"}],
                                         max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.model == "tiny-world"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 12
    # The chat template around the message, in the served byte-level tokenizer: one token per byte and per special
    # token: <|im_start|> "user\n" (5) "Hello robot" (11) <|im_end|> "\n" <|im_start|> "assistant\n" (10) = 30.
    assert out.usage.prompt_tokens == 30
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    again = client.chat.completions.create(model="tiny-world", messages=[{"role": "user", "content": "Hello robot"}],
                                           max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == choice.message.content  # greedy: the same answer


def _metric(server: ServerThread, name: str) -> float:
    text = httpx.get(server.http_url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_chat_metrics_count_requests_tokens_and_the_first_token(server: ServerThread, client: openai.OpenAI) -> None:
    before = {n: _metric(server, n) for n in ("wamrt_chat_requests_total", "wamrt_chat_tokens_total",
                                              "wamrt_chat_first_token_seconds_count")}
    client.chat.completions.create(model="tiny-world", messages=[{"role": "user", "content": "count"}],
                                   max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert _metric(server, "wamrt_chat_requests_total") - before["wamrt_chat_requests_total"] == 1
    assert _metric(server, "wamrt_chat_tokens_total") - before["wamrt_chat_tokens_total"] == 7
    assert _metric(server, "wamrt_chat_first_token_seconds_count") - before["wamrt_chat_first_token_seconds_count"] == 1
    assert _metric(server, "wamrt_chat_device_seconds_total") > 0 and _metric(server, "wamrt_chat_running") == 0
    text = httpx.get(server.http_url + "/metrics").text  # decode graphs: none on the CPU, none captured on a step
    assert "wamrt_chat_graphs_planned 0.0" in text and "wamrt_chat_graphs_captured_on_request_total 0.0" in text


def test_chat_streaming_with_an_image(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url()}},
                                             {"type": "text", "text": "What is this?"}]}]
    stream = client.chat.completions.create(model="tiny-world", messages=messages, max_tokens=10, stream=True,
                                            temperature=0.8, seed=7, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # Template (19) + "What is this?" (13) + <|vision_start|><|vision_end|> + the image's 4 tokens (48x64 is resized
    # to 64x64 = 4x4 patches of 16, merged 2x2).
    assert chunks[-1].usage.prompt_tokens == 19 + 13 + 2 + 4
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    again = client.chat.completions.create(model="tiny-world", messages=messages, max_tokens=10, temperature=0.8,
                                           seed=7, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == text  # seeded: streamed and not, the same text


@pytest.mark.parametrize(("kwargs", "status", "param"), [
    ({"model": "gpt-4o"}, 404, "model"),
    ({"max_tokens": 10**6}, 400, "max_tokens"),
    ({"n": 2}, 400, "n"),
    ({"temperature": 3.0}, 400, "temperature"),
    ({"extra_body": {"tools": [{"type": "function", "function": {"name": "f"}}]}}, 400, "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": "https://example.com/a.png"}}]}]},
     400, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": _png_url((600, 600))}}]}]},
     400, "messages[0].content[0]"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x" * 7000}]}, 400, "messages"),
])
def test_errors_are_typed_in_openai_shape(client: openai.OpenAI, kwargs: dict[str, Any], status: int,
                                          param: str) -> None:
    args = {"model": "tiny-world", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(**args)
    assert err.value.status_code == status
    body = err.value.body
    assert body["param"] == param and body["code"] and body["message"], body


def test_metadata_says_what_the_reasoner_serves(server: ServerThread) -> None:
    meta = httpx.get(server.http_url + "/v1/metadata").json()
    assert meta["reasoner"]["chat"] is True and meta["reasoner"]["vision"] is True
    models = httpx.get(server.http_url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-world"]


def test_text_only_checkpoint_says_so_and_refuses_images(tmp_path_factory: pytest.TempPathFactory) -> None:
    import wamrt

    os.environ.setdefault("WAMRT_CACHE", str(tmp_path_factory.mktemp("wamrt_cache")))
    with ServerThread(wamrt.load_policy("tiny-droid", device="cpu"), ServeConfig(model_name="tiny-droid", steps=1,
                                                                                 warmup_requests=0)) as s:
        meta = httpx.get(s.http_url + "/v1/metadata").json()
        assert meta["reasoner"]["vision"] is False and "text only" in meta["reasoner"]["note"]
        client = openai.OpenAI(base_url=s.http_url + "/v1", api_key="x", max_retries=0)
        ok = client.chat.completions.create(model="tiny-droid", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3)
        assert ok.usage.completion_tokens <= 3
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny-droid", max_tokens=3, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _png_url()}}]}])
        assert "no vision encoder" in err.value.body["message"]


def test_upsample_prompt_on_generation_jobs(server: ServerThread) -> None:
    """Random weights write no JSON: the job falls back to the prompt with a note and still renders; a prompt that
    already is a scene object is passed through as the caption, with the job's own duration and fps."""
    with httpx.Client(base_url=server.http_url, timeout=300) as http:
        r = http.post("/v1/images/generations", json={"prompt": "a red cube on a table", "size": "64x64",
                                                       "num_inference_steps": 1, "upsample_prompt": True})
        assert r.status_code == 200, r.text
        body = r.json()
        up = body["metadata"]["upsampled_prompt"]
        assert up["source"] == "fallback" and "no JSON" in up["note"]
        assert body["data"][0]["revised_prompt"] == "a red cube on a table"
        png = base64.b64decode(body["data"][0]["b64_json"])
        assert Image.open(io.BytesIO(png)).size == (64, 64)
        assert up["note"] in body["metadata"]["notes"] and body["stage_durations"]["upsample"] > 0

        scene = {"subjects": [{"description": "a robot arm"}], "actions": [{"time": "0:00-0:01",
                                                                           "description": "it waves"}]}
        r = http.post("/v1/videos/sync", headers={"Accept": "application/json"},
                      data={"prompt": json.dumps(scene), "size": "64x48", "num_frames": "5", "fps": "5",
                            "num_inference_steps": "1", "upsample_prompt": "true"})
        assert r.status_code == 200, r.text
        up = r.json()["metadata"]["upsampled_prompt"]
        assert up["source"] == "passthrough"
        assert json.loads(up["prompt"]) == {**scene, "duration": "1s", "fps": 5.0}
        assert len(base64.b64decode(r.json()["data"][0]["b64_json"])) > 0


def test_policy_latency_while_a_long_chat_streams(server: ServerThread, client: openai.OpenAI) -> None:
    """Closed-loop policy requests alone and while one chat stream decodes continuously (ignore_eos, thousands of
    tokens), in alternating blocks so the shared box's drifting load hits both alike. The chat thread takes the
    device one decode step at a time and only while no policy work waits, so a policy request waits at most one
    step: the median stays within 1.25x of the solo median, and the p90 within 1.25x of the solo p90 plus the
    longest chat segment. p90 rather than p99: of 24 samples the p99 is one sample, and on a 2-core CI box one OS or
    GIL hiccup (client, server and test share a process) decided it (CI at 270e135: 126 ms against a solo 91 ms, every
    other busy sample at or below 91 ms). A server that did not yield would make requests wait for the whole
    4,000-token stream, seconds, and fail both bounds."""
    n, rounds = int(os.environ.get("WAMRT_LATENCY_N", "8")), 3
    blob = packb(sample_observation(0))
    chat = server.service.chat
    quiet: list[float] = []
    busy: list[float] = []
    steps = 0
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        policy_ms = partial(policy_request_ms, http, blob)

        for _ in range(3):
            policy_ms()
        for _ in range(rounds):
            quiet += [policy_ms() for _ in range(n)]
            stop = threading.Event()

            def chat_lane(stop: threading.Event = stop) -> None:
                stream = client.chat.completions.create(model="tiny-world", stream=True, max_tokens=4000,
                                                        messages=[{"role": "user", "content": "Tell a long story."}],
                                                        extra_body={"ignore_eos": True})
                for _chunk in stream:
                    if stop.is_set():
                        break
                stream.close()  # hang up: the server frees the row

            lane = threading.Thread(target=chat_lane)
            before = chat.steps
            lane.start()
            deadline = time.monotonic() + 30
            while chat.running == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            busy += [policy_ms() for _ in range(n)]
            assert chat.running == 1  # the stream was decoding the whole time
            steps += chat.steps - before
            stop.set()
            lane.join(60)
            deadline = time.monotonic() + 10
            while chat.running and time.monotonic() < deadline:
                time.sleep(0.01)
            assert chat.running == 0  # the hung-up stream's row was freed
    q50, q90, q99 = statistics.median(quiet), percentile(quiet, 90), percentile(quiet, 99)
    b50, b90, b99 = statistics.median(busy), percentile(busy, 90), percentile(busy, 99)
    print(f"\npolicy latency ms: solo p50 {q50:.1f} p90 {q90:.1f} p99 {q99:.1f} | with a chat stream p50 {b50:.1f} "
          f"p90 {b90:.1f} p99 {b99:.1f} | chat decode steps meanwhile {steps}, "
          f"longest segment {chat.segment_max_ms:.1f} ms")
    assert steps >= len(busy) // 2  # chat really decoded in the gaps between the policy requests
    assert b50 <= 1.25 * q50, (quiet, busy)
    assert b90 <= 1.25 * q90 + chat.segment_max_ms, (quiet, busy, chat.segment_max_ms)
