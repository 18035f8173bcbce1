"""Canvas buckets, content size, padding and latent/token geometry.

Two bucket tables exist and they are not the same:

* the framework's `VIDEO_RES_SIZE_INFO` (what the DROID policy server uses; tier "480" has an extra
  "2,3" entry that diffusers lacks), and
* diffusers 0.42.1's `_ACTION_RESOLUTION_BINS` (keyed by the H/W ratio as a string).

For a 540x640 DROID canvas both pick 544x736, but they can differ for other inputs, so callers say
which one they want.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal

from wamrt.pipeline.errors import RequestError

# Data constants copied from cosmos-framework `cosmos_framework/data/generator/utils.py`
# (VIDEO_RES_SIZE_INFO, snapshot 5eee9ed); values are (W, H). Every tier is kept because the JSON
# prompt's aspect-ratio label is an exact (W, H) lookup across all of them.
FRAMEWORK_VIDEO_RES_SIZE_INFO: dict[str, dict[str, tuple[int, int]]] = {
    "256": {"1,1": (256, 256), "4,3": (320, 256), "3,4": (256, 320), "16,9": (320, 192), "9,16": (192, 320)},
    "480": {
        "1,1": (640, 640),
        "4,3": (736, 544),
        "3,4": (544, 736),
        "16,9": (832, 480),
        "9,16": (480, 832),
        "2,3": (512, 768),
    },
    "704": {
        "1,1": (960, 960),
        "4,3": (1088, 832),
        "3,4": (832, 1088),
        "16,9": (1280, 704),
        "9,16": (704, 1280),
    },
    "720": {
        "1,1": (960, 960),
        "4,3": (1104, 832),
        "3,4": (832, 1104),
        "16,9": (1280, 720),
        "9,16": (720, 1280),
    },
    "768": {
        "1,1": (1024, 1024),
        "4,3": (1184, 880),
        "3,4": (880, 1184),
        "16,9": (1360, 768),
        "9,16": (768, 1360),
    },
    "1080": {
        "1,1": (1440, 1440),
        "4,3": (1664, 1248),
        "3,4": (1248, 1664),
        "16,9": (1920, 1080),
        "9,16": (1080, 1920),
    },
    "1280": {
        "1,1": (1712, 1712),
        "4,3": (1968, 1472),
        "3,4": (1472, 1968),
        "16,9": (2272, 1280),
        "9,16": (1280, 2272),
    },
    "2048": {
        "1,1": (2728, 2728),
        "4,3": (3160, 2368),
        "3,4": (2368, 3160),
        "16,9": (3640, 2048),
        "9,16": (2048, 3640),
    },
    "gt_2048": {
        "1,1": (5464, 5464),
        "4,3": (6304, 4728),
        "3,4": (4728, 6304),
        "16,9": (7280, 4096),
        "9,16": (4096, 7280),
    },
}

# Data constants copied from diffusers 0.42.1 `pipelines/cosmos/pipeline_cosmos3_omni.py`
# (_ACTION_RESOLUTION_BINS); key = H/W ratio as written there, value = (H, W). Note the swapped
# value order compared with the framework table.
DIFFUSERS_ACTION_RESOLUTION_BINS: dict[str, dict[str, tuple[int, int]]] = {
    "256": {
        "1.0": (256, 256),
        "0.8": (256, 320),
        "1.25": (320, 256),
        "0.6": (192, 320),
        "1.6666666666666667": (320, 192),
    },
    "480": {
        "1.0": (640, 640),
        "0.7391304347826086": (544, 736),
        "1.3529411764705883": (736, 544),
        "0.5769230769230769": (480, 832),
        "1.7333333333333334": (832, 480),
    },
    "704": {
        "1.0": (960, 960),
        "0.7647058823529411": (832, 1088),
        "1.3076923076923077": (1088, 832),
        "0.55": (704, 1280),
        "1.8181818181818181": (1280, 704),
    },
    "720": {
        "1.0": (960, 960),
        "0.7536231884057971": (832, 1104),
        "1.3269230769230769": (1104, 832),
        "0.5625": (720, 1280),
        "1.7777777777777777": (1280, 720),
    },
}

# VAE compression of the Wan2.2 VAE used by Cosmos 3 and the transformer's latent patch size.
VAE_SPATIAL = 16
VAE_TEMPORAL = 4
LATENT_PATCH = 2

BucketTable = Literal["framework", "diffusers"]
PadMode = Literal["none", "reflect", "edge"]


@dataclass(frozen=True)
class Bucket:
    """One canvas entry of a tier table."""

    table: BucketTable
    tier: str
    key: str  # framework: "W,H" aspect label; diffusers: the H/W ratio string
    height: int
    width: int


@dataclass(frozen=True)
class CanvasGeometry:
    """Where an (h, w) picture lands on its bucket canvas: content at top-left, pad bottom/right."""

    source_h: int
    source_w: int
    canvas_h: int
    canvas_w: int
    content_h: int
    content_w: int

    @property
    def pad_bottom(self) -> int:
        return self.canvas_h - self.content_h

    @property
    def pad_right(self) -> int:
        return self.canvas_w - self.content_w

    @property
    def needs_resize(self) -> bool:
        return (self.content_h, self.content_w) != (self.source_h, self.source_w)

    @property
    def pad_mode(self) -> PadMode:
        # Both implementations fall back to edge/replicate padding as soon as either pad is at least as
        # large as the content along its axis (a mirror would need to reflect more than once).
        if self.pad_bottom == 0 and self.pad_right == 0:
            return "none"
        if self.pad_right >= self.content_w or self.pad_bottom >= self.content_h:
            return "edge"
        return "reflect"

    @property
    def image_size(self) -> tuple[int, int, int, int]:
        """[canvas_h, canvas_w, content_h, content_w], the model's `image_size` convention."""
        return (self.canvas_h, self.canvas_w, self.content_h, self.content_w)


@dataclass(frozen=True)
class LatentGeometry:
    """Latent grid and token counts for a clip whose content (unpadded) size is known."""

    num_frames: int
    latent_t: int
    latent_h: int  # content rows // 16 (the padded rows are cropped away after encoding)
    latent_w: int
    patch_h: int  # ceil(latent_h / 2): odd latents are zero-padded before 2x2 patchify
    patch_w: int

    @property
    def tokens_per_frame(self) -> int:
        return self.patch_h * self.patch_w

    @property
    def num_vision_tokens(self) -> int:
        return self.latent_t * self.tokens_per_frame


def _check_hw(h: int, w: int, what: str) -> None:
    if not (isinstance(h, numbers.Integral) and isinstance(w, numbers.Integral)) or h <= 0 or w <= 0:
        raise RequestError(f"must be positive integers, got {h}x{w}", field=what)


def _tier_key(tier: str | int) -> str:
    return str(tier)


def framework_bucket(h: int, w: int, tier: str | int = "480") -> Bucket:
    """Framework `find_closest_target_size`: the entry whose H/W is closest to h/w (first wins a tie)."""
    _check_hw(h, w, "image_size")
    key = _tier_key(tier)
    if key not in FRAMEWORK_VIDEO_RES_SIZE_INFO:
        raise RequestError(f"unknown framework resolution tier {tier!r}", field="resolution_tier")
    ratio = h / w
    best: tuple[str, int, int] | None = None
    best_diff = math.inf
    for aspect, (cand_w, cand_h) in FRAMEWORK_VIDEO_RES_SIZE_INFO[key].items():
        diff = abs(ratio - cand_h / cand_w)
        if diff < best_diff:  # strict: the earlier entry keeps a tie, as in the framework
            best_diff, best = diff, (aspect, cand_h, cand_w)
    assert best is not None
    return Bucket("framework", key, best[0], best[1], best[2])


def diffusers_bucket(h: int, w: int, tier: str | int = 480) -> Bucket:
    """diffusers `VideoProcessor.classify_height_width_bin` over `_ACTION_RESOLUTION_BINS[tier]`."""
    _check_hw(h, w, "image_size")
    key = _tier_key(tier)
    if key not in DIFFUSERS_ACTION_RESOLUTION_BINS:
        raise RequestError(f"unknown diffusers resolution tier {tier!r}", field="resolution_tier")
    bins = DIFFUSERS_ACTION_RESOLUTION_BINS[key]
    ratio = float(h / w)
    # min() returns the first of equal keys, matching diffusers' tie behaviour.
    ratio_key = min(bins, key=lambda k: abs(float(k) - ratio))
    bh, bw = bins[ratio_key]
    return Bucket("diffusers", key, ratio_key, bh, bw)


def pick_bucket(h: int, w: int, tier: str | int, table: BucketTable) -> Bucket:
    if table == "framework":
        return framework_bucket(h, w, tier)
    if table == "diffusers":
        return diffusers_bucket(h, w, tier)
    raise RequestError(f"unknown bucket table {table!r}", field="table")


def content_size(h: int, w: int, canvas_h: int, canvas_w: int) -> tuple[int, int]:
    """Aspect-preserving fit inside the canvas; never upscales; sizes rounded half up."""
    _check_hw(h, w, "image_size")
    scale = min(canvas_w / w, canvas_h / h, 1.0)
    # int(x + 0.5) is the rounding both implementations use (not Python's banker's round()).
    return max(1, int(scale * h + 0.5)), max(1, int(scale * w + 0.5))


def canvas_geometry(
    h: int, w: int, tier: str | int = "480", table: BucketTable = "framework"
) -> CanvasGeometry:
    """Bucket + content size for an (h, w) picture."""
    bucket = pick_bucket(h, w, tier, table)
    ch, cw = content_size(h, w, bucket.height, bucket.width)
    return CanvasGeometry(h, w, bucket.height, bucket.width, ch, cw)


def latent_geometry(
    num_frames: int,
    content_h: int,
    content_w: int,
    *,
    spatial: int = VAE_SPATIAL,
    temporal: int = VAE_TEMPORAL,
) -> LatentGeometry:
    """Latent T/H/W of the (cropped) conditioning latent and its 2x2 patch grid."""
    if num_frames < 1:
        raise RequestError(f"num_frames must be >= 1, got {num_frames}", field="num_frames")
    _check_hw(content_h, content_w, "content_size")
    latent_t = (num_frames - 1) // temporal + 1
    latent_h = max(content_h // spatial, 1)
    latent_w = max(content_w // spatial, 1)
    return LatentGeometry(
        num_frames=num_frames,
        latent_t=latent_t,
        latent_h=latent_h,
        latent_w=latent_w,
        patch_h=-(-latent_h // LATENT_PATCH),
        patch_w=-(-latent_w // LATENT_PATCH),
    )


def framework_aspect_label(canvas_h: int, canvas_w: int) -> str:
    """The JSON prompt's `aspect_ratio`: exact (W, H) match in any framework tier, else reduced W,H."""
    for tier in FRAMEWORK_VIDEO_RES_SIZE_INFO.values():
        for label, (cand_w, cand_h) in tier.items():
            if (cand_w, cand_h) == (canvas_w, canvas_h):
                return label
    g = math.gcd(canvas_w, canvas_h)
    if g == 0:
        raise RequestError("canvas size must be non-zero", field="canvas")
    return f"{canvas_w // g},{canvas_h // g}"
