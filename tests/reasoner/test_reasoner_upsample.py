"""The upsampling contract: our instruction names the fields, a fenced JSON answer becomes the caption (with the
request's own duration / fps), a scene object given as the prompt is passed through without the Reasoner, and any
other answer (or a failing Reasoner) falls back to the prompt with a note."""

from __future__ import annotations

import json

import pytest

from wamrt.reasoner.upsample import UpsampleTask, parse_object, upsample

T2V = UpsampleTask("a dog runs on a beach", "t2v", 1280, 720, num_frames=121, fps=24.0)


def test_instruction_names_the_fields_per_kind() -> None:
    from wamrt.reasoner.upsample import instruction

    t2v, t2i = instruction(T2V), instruction(UpsampleTask("a cat", "t2i", 1024, 1024))
    for name in ("temporal_caption", "audio_description", "subjects", "lighting", "cinematography", "actions",
                 "segments", "duration", "fps"):
        assert f'"{name}"' in t2v
    assert "```json" in t2v and "a dog runs on a beach" in t2v and "5.0 seconds at 24 fps" in t2v
    assert '"temporal_caption"' not in t2i and '"subjects"' in t2i and "1024x1024" in t2i
    i2v = instruction(UpsampleTask("it moves", "i2v", 640, 480, 33, 16.0))
    assert '"audio_description"' not in i2v and "first frame" in i2v


def test_fenced_answer_becomes_the_caption() -> None:
    scene = {"temporal_caption": "0:00 a dog sprints", "subjects": [{"description": "a brown dog"}],
             "duration": "9s", "fps": 30}
    seen = []

    def run(messages):
        seen.append(messages)
        return "Sure!\n```json\n" + json.dumps(scene, indent=2) + "\n```\nEnjoy."

    out = upsample(T2V, run)
    assert out.source == "reasoner" and out.note is None and out.structured == scene
    # The request's own clip length and rate override the Reasoner's: they are what is rendered.
    assert json.loads(out.caption) == {**scene, "duration": "5s", "fps": 24.0}
    assert seen[0][0]["role"] == "user" and len(seen) == 1


@pytest.mark.parametrize("answer", ["garbage )( tokens", "```json\n{not json}\n```", '{"unrelated": 1}', ""])
def test_unusable_answers_fall_back_to_the_prompt(answer: str) -> None:
    out = upsample(T2V, lambda _m: answer)
    assert out.source == "fallback" and out.caption == T2V.prompt and "no JSON" in out.note


def test_a_failing_reasoner_falls_back_too() -> None:
    def run(_messages):
        raise RuntimeError("out of memory")

    out = upsample(T2V, run)
    assert out.source == "fallback" and out.caption == T2V.prompt and "RuntimeError" in out.note


def test_a_scene_object_prompt_passes_through() -> None:
    scene = {"subjects": [{"description": "a robot"}], "lighting": {"conditions": "dusk"}}
    task = UpsampleTask(json.dumps(scene), "t2v", 640, 480, 49, 16.0)
    out = upsample(task, lambda _m: pytest.fail("the Reasoner must not run"))
    assert out.source == "passthrough" and json.loads(out.caption) == {**scene, "duration": "3s", "fps": 16.0}


def test_parse_object_finds_unfenced_objects_and_skips_strings_with_braces() -> None:
    text = 'Here: {"lighting": {"conditions": "a } in a string"}, "subjects": []} trailing'
    assert parse_object(text) == {"lighting": {"conditions": "a } in a string"}, "subjects": []}
    assert parse_object("{ unbalanced") is None
