"""Chat messages -> the Reasoner's prompt: token ids (chat template, media placeholders expanded the way
`Qwen3VLProcessor` expands them), Qwen3-VL's 3-D MRoPE positions and the media to encode.

Messages are `{"role": ..., "content": str | [parts]}` with parts `{"type": "text", "text": ...}`,
`{"type": "image", "image": PIL.Image}` and `{"type": "video", "video": uint8 [T, H, W, 3], "fps": float}`. A medium
becomes `<|vision_start|><|image_pad|><|vision_end|>` in the message text (what Qwen3-VL's chat template writes for
an image part), then `<|image_pad|>` is repeated once per merged patch; a video becomes, per temporal patch,
`<t seconds><|vision_start|><|video_pad|>...<|vision_end|>`.

Positions (Qwen3-VL `get_rope_index`): text continues one by one on all three axes; a medium's tokens (one
temporal patch of a video at a time) sit at t = c, h = c + row, w = c + column, where c is the next text position,
and the text after it continues at c + max(rows, columns).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..pipeline.errors import RequestError
from .vision import MediaInput, VisionTower

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
ROLES = ("system", "user", "assistant")


@dataclass
class PreparedPrompt:
    ids: list[int]
    positions: torch.Tensor  # [3, U] float32
    next_position: int  # MRoPE position of the first generated token
    media: list[MediaInput]
    media_mask: torch.Tensor | None  # [U] bool: the media tokens, in the order of `media`

    @property
    def length(self) -> int:
        return len(self.ids)


def special_ids(tokenizer: Any) -> dict[str, int]:
    vocab = tokenizer.get_vocab()
    return {name: int(vocab[tok]) for name, tok in (("image", IMAGE_PAD), ("video", VIDEO_PAD),
                                                      ("vision_start", VISION_START), ("vision_end", VISION_END))
            if tok in vocab}


def render(tokenizer: Any, messages: Sequence[dict[str, Any]], vision: VisionTower | None
           ) -> tuple[str, list[MediaInput]]:
    """The chat-template text with one placeholder per medium, and the media prepared for the tower (CPU work)."""
    if not messages:
        raise RequestError("must hold at least one message", field="messages")
    flat, media = [], []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(f"role must be one of {', '.join(ROLES)}", field=f"{where}.role")
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise RequestError("must be a string or a list of content parts", field=f"{where}.content")
        text = []
        for j, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                text.append(part["text"])
                continue
            if kind not in ("image", "video"):
                raise RequestError("must be a text, image or video part", field=f"{where}.content[{j}]")
            if vision is None:
                raise RequestError("the served checkpoint has no vision encoder (vision_encoder/): text only",
                                   field=f"{where}.content[{j}]")
            if message["role"] != "user":
                raise RequestError("only user messages carry images or videos", field=f"{where}.content[{j}]")
            media.append(vision.image(part["image"]) if kind == "image" else vision.video(part["video"], part["fps"]))
            text.append(VISION_START + (IMAGE_PAD if kind == "image" else VIDEO_PAD) + VISION_END)
        flat.append({"role": message["role"], "content": "".join(text)})
    if flat[-1]["role"] == "assistant":
        raise RequestError("the last message must not be the assistant's (it is what gets generated)",
                           field=f"messages[{len(flat) - 1}].role")
    text = tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    return text, media


def expand_media(text: str, media: Sequence[MediaInput], merge: int) -> str:
    """Replace every medium's placeholder by its tokens (`Qwen3VLProcessor`'s expansion)."""
    out, rest = [], text
    for m in media:
        token = IMAGE_PAD if m.kind == "image" else VIDEO_PAD
        marker = VISION_START + token + VISION_END
        at = rest.find(marker)
        if at < 0:
            raise RequestError("the chat template dropped a medium's placeholder", field="messages")
        out.append(rest[:at])
        if m.kind == "image":
            out.append(VISION_START + IMAGE_PAD * m.tokens(merge) + VISION_END)
        else:
            per_frame = m.grid_thw[1] * m.grid_thw[2] // merge**2
            assert m.timestamps is not None and len(m.timestamps) == m.grid_thw[0]
            out.extend(f"<{t:.1f} seconds>{VISION_START}{VIDEO_PAD * per_frame}{VISION_END}" for t in m.timestamps)
        rest = rest[at + len(marker):]
    out.append(rest)
    return "".join(out)


def _frames(media: Sequence[MediaInput]) -> Iterator[tuple[str, int, int]]:
    """(kind, rows, columns) of every run of media tokens, in order: an image, or one temporal patch of a video."""
    for m in media:
        t, h, w = m.grid_thw
        for _ in range(t if m.kind == "video" else 1):
            yield m.kind, h, w


def mrope_positions(ids: Sequence[int], media: Sequence[MediaInput], media_ids: dict[str, int], merge: int
                    ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """-> (positions [3, U] float32, next position, media mask [U] or None)."""
    token_kind = {media_ids[k]: k for k in ("image", "video") if k in media_ids}
    runs, chunks, cur, i, n = _frames(media), [], 0, 0, len(ids)
    mask = torch.zeros(n, dtype=torch.bool)
    while i < n:
        kind = token_kind.get(ids[i])
        j = i + 1
        while j < n and token_kind.get(ids[j]) == kind:
            j += 1
        if kind is None:
            chunks.append(torch.arange(cur, cur + j - i).expand(3, -1))
            cur += j - i
        else:
            got = next(runs, None)
            if got is None or got[0] != kind or (j - i) != got[1] * got[2] // merge**2:
                raise RequestError(f"the prompt's {kind} tokens do not match its media (is "
                                   f"{IMAGE_PAD if kind == 'image' else VIDEO_PAD} written in the text?)",
                                   field="messages")
            h, w = got[1] // merge, got[2] // merge
            rows = torch.arange(h).repeat_interleave(w)
            cols = torch.arange(w).repeat(h)
            chunks.append(torch.stack((torch.zeros(h * w, dtype=torch.long), rows, cols)) + cur)
            mask[i:j] = True
            cur += max(h, w)
        i = j
    if next(runs, None) is not None:
        raise RequestError("a medium's tokens are missing from the prompt", field="messages")
    positions = torch.cat(chunks, dim=1).float() if chunks else torch.zeros(3, 0)
    nxt = int(positions.max().item()) + 1 if n else 0
    return positions, nxt, (mask if media else None)


def prepare_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]], vision: VisionTower | None, *,
                   max_prompt_tokens: int) -> PreparedPrompt:
    """Messages -> ids, positions and media. The media tokens are counted from the processed sizes before the
    text is tokenized, so an over-long prompt is refused before it costs more than its resize."""
    text, media = render(tokenizer, messages, vision)
    merge = vision.merge if vision is not None else 2
    media_tokens = sum(m.tokens(merge) for m in media)
    if media_tokens > max_prompt_tokens:
        raise RequestError(f"the images / videos alone are {media_tokens} tokens, over this server's "
                           f"{max_prompt_tokens}-token prompt limit", field="messages")
    ids = list(tokenizer(expand_media(text, media, merge), add_special_tokens=False)["input_ids"])
    if len(ids) > max_prompt_tokens:
        raise RequestError(f"the prompt is {len(ids)} tokens, over this server's {max_prompt_tokens}-token limit",
                           field="messages")
    positions, nxt, mask = mrope_positions(ids, media, special_ids(tokenizer), merge)
    return PreparedPrompt(ids, positions, nxt, media, mask)
