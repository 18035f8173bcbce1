"""Writes tests/pipeline/data/control_goldens.npz: the edge and blur controls of a fixed synthetic clip, computed
here step by step as cosmos-framework's `AddControlInputEdge` / `AddControlInputBlur` (inference presets,
`use_random=False`) lay them out -- the clip as [C, T, H, W], OpenCV called frame by frame on [H, W, C] views --
written independently of `wamrt.pipeline.controls`, which tests/pipeline/test_controls.py checks against it.

    python scripts/make_control_goldens.py   # needs opencv-python-headless (the `world` extra)
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "pipeline" / "data" / "control_goldens.npz"
EDGE = {"very_low": (20, 50), "low": (50, 100), "medium": (100, 200), "high": (200, 300), "very_high": (300, 400)}
# preset -> (downscale before the bilateral filter, final down-up factor): the framework's `blur_downup_preset_values`
# and `downup_preset_values` with min / max down-up factors 4 / 16.
BLUR = {"none": (1, 1), "very_low": (1, 4), "low": (4, 4), "medium": (2, 10), "high": (1, 16), "very_high": (4, 16)}


def clip(t: int = 2, h: int = 48, w: int = 64) -> np.ndarray:
    """uint8 [T, H, W, 3]: shapes with edges on a gradient, moving a little each frame, plus noise."""
    rng = np.random.default_rng(7)
    yy, xx = np.mgrid[0:h, 0:w]
    frames = []
    for k in range(t):
        img = np.stack([120 + 100 * yy / h, 60 + 120 * xx / w, 90 + 40 * np.sin((xx + yy + 5 * k) / 6)], -1)
        img[(yy - 20) ** 2 + (xx - 26 - 3 * k) ** 2 < 90] = (240, 30, 30)
        img[6 + k:20 + k, 40:56] = (20, 20, 200)
        frames.append(np.clip(img + rng.integers(-12, 12, img.shape), 0, 255).astype(np.uint8))
    return np.stack(frames)


def edge(frames_cthw: np.ndarray, preset: str) -> np.ndarray:
    lo, hi = EDGE[preset]
    maps = np.stack([cv2.Canny(img, lo, hi) for img in frames_cthw.transpose(1, 2, 3, 0)])[None]
    return np.broadcast_to(maps, (3, *maps.shape[1:])).transpose(1, 2, 3, 0).copy()  # -> [T, H, W, 3]


def blur(frames_cthw: np.ndarray, preset: str) -> np.ndarray:
    c, t, h, w = frames_cthw.shape
    if preset == "none":
        return frames_cthw.transpose(1, 2, 3, 0).copy()
    pre, downup = BLUR[preset]
    small = np.empty((c, t, h // pre, w // pre), np.uint8)
    for k in range(t):
        small[:, k] = cv2.resize(np.ascontiguousarray(frames_cthw[:, k].transpose(1, 2, 0)), (w // pre, h // pre),
                                 interpolation=cv2.INTER_AREA).transpose(2, 0, 1)
    longest = max(small.shape[2], small.shape[3])
    d = max(1, int(round(30.0 * longest / 720)))
    d = d + 1 if d % 2 == 0 else d
    sc, ss = max(1.0, 150.0 * longest / 720), max(1.0, 100.0 * longest / 720)
    out = np.empty((c, t, h, w), np.uint8)
    for k in range(t):
        x = cv2.bilateralFilter(np.ascontiguousarray(small[:, k].transpose(1, 2, 0)), d, sc, ss)
        x = cv2.resize(x, (w, h), interpolation=cv2.INTER_LINEAR)
        x = cv2.resize(x, (int(w / downup), int(h / downup)), interpolation=cv2.INTER_CUBIC)
        out[:, k] = cv2.resize(x, (w, h), interpolation=cv2.INTER_CUBIC).transpose(2, 0, 1)
    return out.transpose(1, 2, 3, 0)


def main() -> None:
    frames = clip()
    cthw = np.ascontiguousarray(frames.transpose(3, 0, 1, 2))
    arrays = {"clip": frames}
    arrays |= {f"edge_{p}": edge(cthw, p) for p in EDGE}
    arrays |= {f"blur_{p}": blur(cthw, p) for p in BLUR if p != "none"}  # "none" is the clip itself
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays, opencv=np.array(cv2.__version__))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): {sorted(arrays)}")


if __name__ == "__main__":
    main()
