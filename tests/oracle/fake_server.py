"""`python -m oracle.fake_server SPEC`: a `FakePolicy` server in a process of its own, for tests that signal or
measure the server alone. SPEC is JSON: {"delay": seconds per batch, "config": ServeConfig fields}."""

from __future__ import annotations

import json
import sys

from oracle.fake_policy import FakePolicy
from wamrt.serving import ServeConfig, build_app
from wamrt.serving.server import server_for


def main() -> None:
    spec = json.loads(sys.argv[1])
    config = ServeConfig(**spec["config"])
    server_for(build_app(FakePolicy(delay=spec.get("delay", 0.0)), config), config, log_level="warning").run()


if __name__ == "__main__":
    main()
