"""A policy served by `wamrt serve`, used by simulator lanes as concurrent websocket clients.

Each lane process opens its own openpi websocket on first use, so the server's batcher sees the lanes
as separate robots and can batch them. Per-request seeds and sampling overrides travel in the request
(`seed`, `params`), so a seeded rollout through the server draws the same noise as an in-process one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .agents import PolicyAgent

# SamplingOptions names -> the wire's `params` keys (serving/observation.py PARAM_ALIASES).
_WIRE_PARAMS = {"steps": "num_steps", "guidance": "guidance", "shift": "shift",
                "guidance_interval": "guidance_interval"}


def is_url(name: str) -> bool:
    return name.startswith(("ws://", "wss://"))


def server_metadata(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """The server's own account of what it serves (GET /v1/policy/metadata beside the websocket), so a
    rollout or gate result names its candidate by model, sampler, quantization and engine, not by URL only."""
    import json
    import urllib.request
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    scheme = "https" if parts.scheme == "wss" else "http"
    req = urllib.request.Request(f"{scheme}://{parts.netloc}/v1/policy/metadata",
                                 headers={"Accept": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        meta = json.loads(resp.read())
    policy = meta.get("policy", {}) if isinstance(meta, dict) else {}
    return {"model": meta.get("model"), "sampler": meta.get("sampler"), "quantization": policy.get("quantization"),
            "engine": policy.get("engine"), "action_normalization": policy.get("action_normalization"),
            "gpu": policy.get("gpu", "unknown"), "max_batch": meta.get("max_batch")}


def effective_sampling(server: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """What a candidate's requests ran with: the server's defaults, then the request's overrides."""
    sampler = dict(server.get("sampler") or {})
    out = {"steps": sampler.get("num_steps"), "guidance": sampler.get("guidance"), "shift": sampler.get("shift"),
           "guidance_interval": sampler.get("guidance_interval")}
    for k, v in overrides.items():
        out[k] = list(v) if isinstance(v, tuple) else v
    out["quantization"] = server.get("quantization")
    return out


@dataclass
class RemoteChunk:
    actions: np.ndarray


class RemotePolicy:
    """`infer(obs, seed=..., **overrides)` over the openpi websocket; connects lazily (picklable)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        if not is_url(url):
            raise ValueError(f"expected a ws:// or wss:// URL, got {url!r}")
        self.url, self.api_key, self.timeout_s = url, api_key, timeout_s
        self._client: Any = None

    def infer(self, obs: dict[str, Any], *, seed: int | None = None, **overrides: Any) -> RemoteChunk:
        if self._client is None:
            from ..client.ws import PolicyClient

            self._client = PolicyClient(self.url, api_key=self.api_key)
        msg = dict(obs)
        if seed is not None:
            msg["seed"] = int(seed)
        unknown = set(overrides) - set(_WIRE_PARAMS)
        if unknown:
            raise ValueError(f"cannot send sampling overrides {sorted(unknown)} to a server")
        params = {_WIRE_PARAMS[k]: (list(v) if isinstance(v, tuple) else v) for k, v in overrides.items()}
        if params:
            msg["params"] = params
        reply = self._client.infer(msg, timeout=self.timeout_s)
        actions = reply["actions"] if isinstance(reply, dict) else reply
        return RemoteChunk(np.asarray(actions, dtype=np.float32))


@dataclass
class RemoteAgentFactory:
    """Picklable factory for process lanes: one websocket client per lane."""

    url: str
    execute_steps: int = 8
    overrides: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None

    def __call__(self) -> PolicyAgent:
        return PolicyAgent(RemotePolicy(self.url, self.api_key), execute_steps=self.execute_steps, **self.overrides)
