"""Structured prompt upsampling: a short request -> the Reasoner -> one JSON scene description -> the Generator.

The contract (the field names and the fenced-JSON answer are NVIDIA's; the instruction text is ours): the Reasoner is
asked for one JSON object in a ```json fence with a temporal caption, subjects, background, lighting,
cinematography, actions, segments, duration and fps (text-to-video also an audio description; an image has no
timeline). The object, serialised with `json.dumps` as the released models were trained on, is the caption the
Generator is conditioned on. A prompt that already is such an object is passed through without running the
Reasoner. An answer with no parseable object (random weights write garbage) falls back to the original prompt with
a note: upsampling never fails a job.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

VIDEO_FIELDS = ("temporal_caption", "subjects", "background_setting", "lighting", "cinematography", "actions",
                "segments", "duration", "fps")
AUDIO_FIELD = "audio_description"
IMAGE_FIELDS = ("subjects", "background_setting", "lighting", "cinematography", "aesthetics")
KNOWN = frozenset((*VIDEO_FIELDS, AUDIO_FIELD, *IMAGE_FIELDS, "resolution", "aspect_ratio", "style_medium", "context"))
_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.DOTALL)

_FIELD_HELP = {
    "temporal_caption": "the clip as a timeline from 0:00 to its end: timestamped beats (M:SS) wherever something "
                        "happens (subject actions, camera moves, lighting changes)",
    "audio_description": "the soundscape: ambience, effects, music, speech, timestamped where it changes",
    "subjects": "a list of objects, one per subject: description, appearance, location in frame, pose, action",
    "background_setting": "where the scene takes place",
    "lighting": "an object: conditions, direction, shadows",
    "cinematography": "an object: camera_motion, framing, camera_angle, depth_of_field",
    "aesthetics": "an object: composition, color_scheme, mood",
    "actions": "a list of {\"time\": \"M:SS-M:SS\", \"description\": ...} covering the clip",
    "segments": "a list of {\"time_range\": \"M:SS-M:SS\", \"description\": ...}: the clip's parts in order",
    "duration": "the clip length, e.g. \"5s\"",
    "fps": "frames per second, a number",
}


@dataclass
class UpsampleTask:
    """What the caption is for: `kind` t2v (text-to-video), i2v (its first frame given) or t2i (one image)."""

    prompt: str
    kind: str
    width: int
    height: int
    num_frames: int = 1
    fps: float = 24.0

    @property
    def fields(self) -> tuple[str, ...]:
        if self.kind == "t2i":
            return IMAGE_FIELDS
        return (*VIDEO_FIELDS[:1], AUDIO_FIELD, *VIDEO_FIELDS[1:]) if self.kind == "t2v" else VIDEO_FIELDS

    @property
    def seconds(self) -> float:
        return self.num_frames / self.fps


@dataclass
class Upsampled:
    caption: str  # what conditions the Generator
    source: str  # "reasoner" | "passthrough" | "fallback"
    structured: dict[str, Any] | None = None
    note: str | None = None
    reasoner_text: str | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt": self.caption, "source": self.source}
        if self.note:
            out["note"] = self.note
        return out


def instruction(task: UpsampleTask) -> str:
    what = "an image" if task.kind == "t2i" else "a video"
    lines = [f"You write scene descriptions for {what} generator. Turn the request below into one detailed, "
             "concrete description of exactly what should be seen" + ("" if task.kind == "t2i" else " and heard")
             + ". Keep everything the request asks for; invent the visual details it leaves open.",
             "Answer with a single JSON object inside a ```json fenced block and nothing else. Its fields:"]
    lines += [f'- "{name}": {_FIELD_HELP[name]}' for name in task.fields]
    geometry = f"{task.width}x{task.height}"
    if task.kind != "t2i":
        geometry += f", {task.seconds:.1f} seconds at {task.fps:g} fps"
    if task.kind == "i2v":
        lines.append("The attached image is the first frame: describe what it shows and continue from it.")
    lines += [f"Output: {geometry}.", "", f"Request: {task.prompt.strip()}"]
    return "\n".join(lines)


def messages(task: UpsampleTask, image: Any | None = None) -> list[dict[str, Any]]:
    """The Reasoner conversation (no system prompt, as the checkpoints' chat template defaults to)."""
    content: list[dict[str, Any]] = [{"type": "text", "text": instruction(task)}]
    if image is not None:
        content.insert(0, {"type": "image", "image": image})
    return [{"role": "user", "content": content}]


def parse_object(text: str) -> dict[str, Any] | None:
    """The first fenced JSON object of `text` (or, without a fence, the first balanced {...} that parses) when it
    has at least one known field; else None."""
    candidates = [m.group(1) for m in _FENCE.finditer(text)]
    start = text.find("{")
    while start >= 0 and len(candidates) < 8:
        end = _balanced_end(text, start)
        if end is None:
            break
        candidates.append(text[start:end])
        start = text.find("{", end)
    for c in candidates:
        try:
            obj = json.loads(c.strip())
        except ValueError:
            continue
        if isinstance(obj, dict) and KNOWN & set(obj):
            return obj
    return None


def _balanced_end(text: str, start: int) -> int | None:
    depth, in_str, escape = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def caption_of(obj: dict[str, Any], task: UpsampleTask) -> str:
    """The Generator's caption: the object with the request's own duration / fps (what is rendered), as JSON."""
    obj = dict(obj)
    if task.kind != "t2i":
        obj["duration"] = f"{int(task.seconds)}s"
        obj["fps"] = float(task.fps)
    return json.dumps(obj)


def upsample(task: UpsampleTask, run: Callable[[list[dict[str, Any]]], str], image: Any | None = None) -> Upsampled:
    """`run(messages) -> the Reasoner's answer`; its errors and unparseable answers fall back to the prompt."""
    given = parse_object(task.prompt) if task.prompt.lstrip().startswith(("{", "```")) else None
    if given is not None:
        return Upsampled(caption_of(given, task), "passthrough", given)
    try:
        text = run(messages(task, image))
    except Exception as exc:  # noqa: BLE001  # upsampling never fails the job
        return Upsampled(task.prompt, "fallback", note=f"prompt upsampling failed ({type(exc).__name__}: {exc}); "
                         "the original prompt conditions the generator")
    obj = parse_object(text)
    if obj is None:
        return Upsampled(task.prompt, "fallback", reasoner_text=text,
                         note="the Reasoner's answer held no JSON scene object; the original prompt conditions the "
                              "generator")
    return Upsampled(caption_of(obj, task), "reasoner", obj, reasoner_text=text)
