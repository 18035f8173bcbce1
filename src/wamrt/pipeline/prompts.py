"""Caption construction: the DROID framework prompts (plain and JSON), diffusers' action JSON and
diffusers' world-generation captions (prompt + duration / resolution sentences).

The sentences below are training-data constants; a single changed byte changes the tokens the model
sees, so they are reproduced exactly and checked against the fixtures' `prompt.txt` and against
diffusers' own `_build_action_json_prompt`.
"""

from __future__ import annotations

import json
import math
from typing import Any

from wamrt.pipeline.errors import RequestError
from wamrt.pipeline.geometry import framework_aspect_label

# cosmos-framework `data/generator/action/utils/viewpoint_utils.py` DEFAULT_VIEWPOINT_TEMPLATES
# (the concat_view sentence is also visible in every fixture prompt.txt).
FRAMEWORK_VIEWPOINT_TEMPLATES: dict[str, str] = {
    "ego_view": "This video is captured from a first-person perspective looking at the scene.",
    "third_person_view": (
        "This video is captured from a third-person perspective looking towards the agent from the front."
    ),
    "wrist_view": "This video is captured from a wrist-mounted camera.",
    "concat_view": "This video contains concatenated views from multiple camera perspectives.",
    "top_down_2d_view": "This video is captured from a top-down view of a flat 2D scene.",
    "video_game_view": "This video is captured from an in-game camera perspective in a virtual environment.",
}

# cosmos-framework `scripts/action_policy_server_robolab.py` _CONCAT_VIEW_DESCRIPTION (188 chars).
DROID_CONCAT_VIEW_DESCRIPTION = (
    "The top row is from the wrist-mounted camera. "
    "The bottom row contains two horizontally concatenated third-person perspective views of the scene from opposite "
    "sides, with the robot visible."
)
DROID_VIEWPOINT = "concat_view"
DROID_NUM_FRAMES = 33  # chunk 32 + the conditioning frame
DROID_FPS = 15.0

# cosmos-framework augmentors DurationFPSTextTimeStamps.DEFAULT_TEMPLATE and
# ResolutionTextInfo.DEFAULT_VIDEO_TEMPLATE (diffusers carries the same two strings).
DURATION_FPS_TEMPLATE = "The video is {duration:.1f} seconds long and is of {fps:.0f} FPS."
VIDEO_RESOLUTION_TEMPLATE = "This video is of {height}x{width} resolution."

# The other sentences of diffusers 0.42.1 `Cosmos3OmniPipeline.__init__`: the image resolution sentence
# (one-frame requests) and the negations that the negative prompt gets.
IMAGE_RESOLUTION_TEMPLATE = "This image is of {height}x{width} resolution."
NEGATED_DURATION_FPS_TEMPLATE = "The video is not {duration:.1f} seconds long and is not of {fps:.0f} FPS."
NEGATED_VIDEO_RESOLUTION_TEMPLATE = "This video is not of {height}x{width} resolution."
NEGATED_IMAGE_RESOLUTION_TEMPLATE = "This image is not of {height}x{width} resolution."

# diffusers 0.42.1 `pipeline_cosmos3_omni.py` _ACTION_VIEWPOINT_TEMPLATES (a subset of the framework's).
DIFFUSERS_VIEWPOINT_TEMPLATES: dict[str, str] = {
    k: FRAMEWORK_VIEWPOINT_TEMPLATES[k]
    for k in ("ego_view", "third_person_view", "wrist_view", "concat_view")
}

# diffusers 0.42.1 _SYSTEM_PROMPT_IMAGE / _SYSTEM_PROMPT_VIDEO, typo ("a give prompt") included: the
# checkpoints were trained with it.
SYSTEM_PROMPT_IMAGE = "You are a helpful assistant who will generate images from a give prompt."
SYSTEM_PROMPT_VIDEO = "You are a helpful assistant who will generate videos from a give prompt."

_DIFFUSERS_ASPECT_LABELS = ("1,1", "4,3", "3,4", "16,9", "9,16")


def _check_text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"must be a string, got {type(value).__name__}", field=field)
    return value


def _framework_fps(fps: float) -> float:
    # The server stores conditioning_fps as a long tensor, so a fractional fps is truncated before
    # either prompt formatter sees it (15.9 -> "15 FPS" / 15.0).
    if not isinstance(fps, (int, float)) or not math.isfinite(fps) or int(fps) <= 0:
        raise RequestError(f"must be a finite number >= 1, got {fps!r}", field="fps")
    return float(int(fps))


def _join(caption: str, addition: str) -> str:
    # Every framework appender uses " " after a caption ending in "." and ". " otherwise.
    return caption + (" " if caption.rstrip().endswith(".") else ". ") + addition


def _framing(viewpoint: str | None, view_description: str | None) -> str | None:
    template = FRAMEWORK_VIEWPOINT_TEMPLATES.get(viewpoint) if viewpoint is not None else None
    if template is None:
        return None
    if view_description:
        template = _join(template, view_description.rstrip())
    return template


def framework_plain_prompt(
    instruction: str,
    *,
    canvas_hw: tuple[int, int],
    viewpoint: str | None = DROID_VIEWPOINT,
    view_description: str | None = DROID_CONCAT_VIEW_DESCRIPTION,
    num_frames: int = DROID_NUM_FRAMES,
    fps: float = DROID_FPS,
) -> str:
    """Plain-text caption (Nano default): instruction + viewpoint + duration/FPS + resolution sentences.

    An empty instruction stays "" (that is the unconditional caption). An unknown viewpoint drops only
    the viewpoint sentence, as the framework does (it logs a warning there); viewpoint=None does the
    same here, where the framework would raise.
    """
    caption = _check_text(instruction, "prompt")
    fps = _framework_fps(fps)
    if caption == "":
        return ""
    template = _framing(viewpoint, view_description)
    if template is not None:
        caption = _join(caption.rstrip(), template)
    # The framework formats an int duration with :.1f, hence "2.0" for 33 frames at 15 fps.
    caption = _join(caption, DURATION_FPS_TEMPLATE.format(duration=int(num_frames / fps), fps=fps))
    height, width = canvas_hw
    return _join(caption, VIDEO_RESOLUTION_TEMPLATE.format(height=int(height), width=int(width)))


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "!", "?")) else f"{text}."


def _prune_empty(value: Any) -> Any:
    if isinstance(value, dict):
        kept = {k: _prune_empty(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in (None, "", [], {})}
    if isinstance(value, list):
        kept_items = [_prune_empty(v) for v in value]
        return [v for v in kept_items if v not in (None, "", [], {})]
    return value


def framework_json_prompt(
    instruction: str,
    *,
    canvas_hw: tuple[int, int],
    viewpoint: str | None = DROID_VIEWPOINT,
    view_description: str | None = DROID_CONCAT_VIEW_DESCRIPTION,
    num_frames: int = DROID_NUM_FRAMES,
    fps: float = DROID_FPS,
) -> str:
    """JSON caption (Edge): the framework's `ActionPromptJsonFormatter` dict, serialized by json.dumps.

    Differences from diffusers' JSON: `framing` carries the extra view description, the aspect label is
    an exact table lookup (else the reduced W,H), and a whitespace-only instruction becomes ".".
    """
    caption = _check_text(instruction, "prompt")
    fps = _framework_fps(fps)
    if caption == "":
        return ""
    seconds = int(num_frames) / fps
    end = round(seconds)
    height, width = int(canvas_hw[0]), int(canvas_hw[1])
    framing = _framing(viewpoint, view_description)
    if framing is None and view_description:  # unknown viewpoint: the description alone, if any
        framing = view_description.rstrip() or None
    prompt = {
        "cinematography": {"framing": framing},
        "actions": [{"time": f"0:00-{end // 60}:{end % 60:02d}", "description": _sentence(caption)}],
        "duration": f"{int(seconds)}s",
        "fps": fps,
        "resolution": {"H": height, "W": width},
        "aspect_ratio": framework_aspect_label(height, width),
    }
    return json.dumps(_prune_empty(prompt))


def droid_prompt(instruction: str, *, json_format: bool, canvas_hw: tuple[int, int] = (544, 736)) -> str:
    """The DROID server's caption for one request (concat_view, 33 frames at 15 fps)."""
    build = framework_json_prompt if json_format else framework_plain_prompt
    return build(instruction, canvas_hw=canvas_hw)


def diffusers_aspect_label(height: int, width: int) -> str:
    """Closest of diffusers' five W,H labels to the canvas' W/H (first wins a tie)."""
    ratio = width / height if height > 0 else 1.0
    return min(
        _DIFFUSERS_ASPECT_LABELS, key=lambda r: abs(int(r.split(",")[0]) / int(r.split(",")[1]) - ratio)
    )


def diffusers_action_json_prompt(
    description: str, *, view_point: str | None, num_frames: int, fps: float, height: int, width: int
) -> str:
    """diffusers' `_build_action_json_prompt` (the pipeline passes num_frames = chunk_size + 1).

    Unlike the framework, an unknown view point drops `cinematography` entirely and fps <= 0 is allowed
    (duration then reads "0s").
    """
    description = _check_text(description, "prompt")
    seconds = num_frames / fps if fps > 0 else 0.0
    valid = seconds >= 0 and math.isfinite(seconds)
    end = round(seconds) if valid else 0
    minutes, secs = divmod(end, 60)
    desc = description.strip()
    if desc and not desc.endswith((".", "!", "?")):
        desc += "."
    prompt: dict[str, Any] = {}
    framing = DIFFUSERS_VIEWPOINT_TEMPLATES.get(view_point) if view_point is not None else None
    if framing:
        prompt["cinematography"] = {"framing": framing}
    prompt["actions"] = [{"time": f"0:00-{minutes}:{secs:02d}", "description": desc}]
    prompt["duration"] = f"{int(seconds) if valid else 0}s"
    prompt["fps"] = float(fps)
    prompt["resolution"] = {"H": int(height), "W": int(width)}
    prompt["aspect_ratio"] = diffusers_aspect_label(height, width)
    return json.dumps(prompt)


def diffusers_system_prompt(num_frames: int) -> str:
    """System message diffusers adds when `use_system_prompt` is on (image prompt for 1 frame)."""
    return SYSTEM_PROMPT_IMAGE if num_frames == 1 else SYSTEM_PROMPT_VIDEO


def _diffusers_append(caption: str, sentence: str) -> str:
    # Unlike the framework's joiner: every trailing "." goes (trailing spaces stay), an empty caption
    # becomes the sentence alone.
    caption = caption.rstrip(".")
    return f"{caption}. {sentence}" if caption else sentence


def diffusers_world_caption(
    caption: str,
    *,
    negative: bool,
    num_frames: int,
    height: int,
    width: int,
    fps: float,
    use_duration_template: bool = True,
    use_resolution_template: bool = True,
) -> str:
    """diffusers' `tokenize_prompt` text for world generation: the prompt (or, with `negative`, the
    negative prompt) plus the duration/FPS sentence (videos only) and the resolution sentence, negated
    for the negative prompt. `use_*_template` are diffusers' `add_*_template`."""
    caption = _check_text(caption, "negative_prompt" if negative else "prompt")
    image = num_frames == 1
    if use_duration_template and not image:
        template = NEGATED_DURATION_FPS_TEMPLATE if negative else DURATION_FPS_TEMPLATE
        caption = _diffusers_append(caption, template.format(duration=num_frames / fps, fps=fps))
    if use_resolution_template:
        if image:
            template = NEGATED_IMAGE_RESOLUTION_TEMPLATE if negative else IMAGE_RESOLUTION_TEMPLATE
        else:
            template = NEGATED_VIDEO_RESOLUTION_TEMPLATE if negative else VIDEO_RESOLUTION_TEMPLATE
        caption = _diffusers_append(caption, template.format(height=height, width=width))
    return caption
