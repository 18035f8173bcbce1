"""`upsample_prompt=true` on generation jobs: the job's prompt goes through the Reasoner (`reasoner.upsample`) on the
chat thread, with the device shared as chat shares it, before the job's own segments start; the structured caption
then conditions the Generator, and the reply carries it (`metadata.upsampled_prompt`; an image's `revised_prompt`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..reasoner.upsample import Upsampled, UpsampleTask, upsample
from .chat_worker import ChatWorker
from .config import ServeConfig


def task_of(kind: str, kwargs: dict[str, Any]) -> UpsampleTask:
    """A generation request's kind and pipeline kwargs -> what the caption is for."""
    conditioned = kwargs.get("image") is not None or kwargs.get("video") is not None
    return UpsampleTask(kwargs["prompt"], "t2i" if kind == "image" else "i2v" if conditioned else "t2v",
                        int(kwargs["width"]), int(kwargs["height"]), int(kwargs.get("num_frames", 1)),
                        float(kwargs.get("fps", 24.0)))


def first_frame(kwargs: dict[str, Any]) -> Any | None:
    """The conditioning image (or a video's first frame) as a PIL image, for a Reasoner that sees."""
    from PIL import Image

    src = kwargs.get("image")
    if src is None and kwargs.get("video") is not None:
        src = kwargs["video"][0]
    if src is None:
        return None
    if isinstance(src, Image.Image):
        return src.convert("RGB")
    arr = np.asarray(src)
    return Image.fromarray(arr.astype(np.uint8)) if arr.ndim == 3 and arr.shape[-1] == 3 else None


class Upsampler:
    def __init__(self, chat: ChatWorker, config: ServeConfig) -> None:
        self.chat, self.max_tokens = chat, config.upsample_max_tokens

    def __call__(self, kind: str, kwargs: dict[str, Any], cancelled: Callable[[], bool] = lambda: False) -> Upsampled:
        from ..reasoner.sampling import SamplingParams

        reasoner = self.chat.reasoner
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0, repetition_penalty=1.05)

        def run(messages: list[dict[str, Any]]) -> str:
            return self.chat.run(reasoner.prepare(messages), params, cancelled=cancelled)[0]

        image = first_frame(kwargs) if reasoner.vision is not None else None
        return upsample(task_of(kind, kwargs), run, image)
