"""A stand-in policy for the serving tests: the pipeline's real input checks, a sleep instead of the model."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from wamrt.pipeline.canvas import compose_droid_canvas
from wamrt.pipeline.droid import ActionChunk
from wamrt.pipeline.errors import RequestError
from wamrt.pipeline.noise import state_row_from_observation
from wamrt.pipeline.observation import check_observation


class FakePolicy:
    """Validates like the real policy, answers a deterministic [32, 8] chunk after `delay` seconds."""

    def __init__(self, delay: float = 0.0, actions: np.ndarray | None = None) -> None:
        self.delay, self.fixed = delay, actions
        self.calls: list[int] = []  # batch size of every infer_batch call
        self.lock = threading.Lock()
        self.active = 0
        self.max_active = 0
        self.generic_threads: list[str] = []  # thread of every generic (FD/ID) call

    def infer_batch(self, observations: list[Mapping[str, Any]], *, seeds: list[int | None] | None = None,
                    **overrides: Any) -> list[ActionChunk | Exception]:
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            self.calls.append(len(observations))
            time.sleep(self.delay)
            out: list[ActionChunk | Exception] = []
            for obs, seed in zip(observations, seeds or [None] * len(observations), strict=True):
                try:
                    checked = check_observation(obs)  # the contract Policy.infer and the server run
                    state = state_row_from_observation(checked.observation)
                    compose_droid_canvas(checked.observation)
                    actions = (self.fixed if self.fixed is not None
                               else np.tile(state, (32, 1)).astype(np.float32))
                    out.append(ActionChunk(actions.copy(), seed or 0, obs["prompt"],
                                           {"preprocess": 1.0, "denoise": 1e3 * self.delay, "postprocess": 0.1,
                                            "total": 1e3 * self.delay + 1.1}, notes=checked.notes))
                except RequestError as exc:
                    out.append(exc)
            return out
        finally:
            with self.lock:
                self.active -= 1

    def generic(self, mode: str, **request: Any) -> Any:
        """Forward / inverse dynamics stand-in: the real generic request checks, deterministic outputs
        (ID: actions 0.25; FD: frame k filled with 8 * k), `delay` seconds of "model" time."""
        import torch

        from wamrt.pipeline.generic import GenericResult, generic_request

        decode = request.pop("decode", False)
        for key in ("steps", "guidance", "shift", "generator"):
            request.pop(key, None)
        self.generic_threads.append(threading.current_thread().name)
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            req = generic_request(mode=mode, **request)
            time.sleep(self.delay)
            actions = None
            if mode != "forward_dynamics":
                actions = torch.full((req.chunk_size, req.domain.raw_action_dim), 0.25)
            frames = None
            if decode:
                h, w = req.canvas.content_h, req.canvas.content_w
                ramp = (8 * torch.arange(req.chunk_size + 1, dtype=torch.uint8))[:, None, None, None]
                frames = ramp.expand(-1, h, w, 3).contiguous()
            total = 1e3 * self.delay + 2.0
            return GenericResult(actions, torch.zeros(1, 1, 1, 1, 1), frames,
                                 {"preprocess": 1.0, "denoise": 1e3 * self.delay, "vae_decode": 1.0, "total": total})
        finally:
            with self.lock:
                self.active -= 1

    def metadata(self) -> dict[str, Any]:
        return {"model": "fake", "action_horizon": 32, "action_dim": 8, "control_hz": 15.0,
                "image_size": [540, 640], "num_steps": 4, "guidance": 3.0, "shift": 5.0, "guidance_interval": None}
