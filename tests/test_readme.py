"""The README is a quickstart that cannot drift: its openpi-client snippet runs against a real `wamrt serve`,
and its shape rules (length, no commit hashes outside links, no issue numbers, no paths outside the repository)
hold."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def snippet(name: str) -> str:
    """The fenced block right after `<!-- readme-test: NAME -->`."""
    m = re.search(rf"<!-- readme-test: {re.escape(name)} -->\s*```python\n(.*?)```", README, re.S)
    assert m, f"README has no `<!-- readme-test: {name} -->` python block"
    return m.group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_is_a_quickstart() -> None:
    lines = README.splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (a quickstart keeps to 150)"
    without_links = re.sub(r"\]\([^)]*\)", "]", README)
    hashes = re.findall(r"\b[0-9a-f]{7,40}\b", without_links)
    assert not [h for h in hashes if re.search(r"[a-f]", h) and re.search(r"\d", h)], hashes
    assert not re.search(r"\bissues? \d+", README, re.I), "README refers to issue numbers"
    assert "../" not in README, "README points outside the repository"
    for link in re.findall(r"\]\(([^)#]+)", README):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), f"README links a missing file: {link}"


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, dict[str, str]]]:
    """`wamrt serve --model tiny-droid` as a user starts it (a subprocess), ready."""
    pytest.importorskip("openpi_client")
    port = free_port()
    cache = os.environ.get("WAMRT_CACHE", str(tmp_path_factory.mktemp("cache")))
    env = {**os.environ, "WAMRT_CACHE": cache}
    cmd = [sys.executable, "-m", "wamrt", "serve", "--model", "tiny-droid", "--port", str(port), "--steps", "1"]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"wamrt serve exited:\n{server.stdout.read()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "wamrt serve was not ready within 120 s"
            time.sleep(0.5)
        yield port, env
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()


def run_python(code: str, env: dict[str, str]) -> str:
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_openpi_client_snippet_against_wamrt_serve(readme_server: tuple[int, dict[str, str]]) -> None:
    port, env = readme_server
    out = run_python(snippet("openpi-client").replace("port=8000", f"port={port}"), env)
    assert out.strip().endswith("(32, 8)"), out


def test_realtime_snippet_against_wamrt_serve(readme_server: tuple[int, dict[str, str]]) -> None:
    """The 15 Hz runner snippet, after the openpi one (it reads that `observation`), for 3 s of ticks with a
    stand-in robot: rows come out every tick and at least one reply is spliced in."""
    port, env = readme_server
    openpi = snippet("openpi-client").replace("port=8000", f"port={port}")
    realtime = snippet("realtime").replace("localhost:8000", f"127.0.0.1:{port}").replace("range(150)", "range(45)")
    assert realtime != snippet("realtime"), "the realtime snippet no longer names the port or the tick count"
    robot = ("class robot:\n    rows = []\n    command = staticmethod(rows.append)\n"
             "read_observation = lambda: observation\n")
    check = ("\nassert len(robot.rows) == 45 and all(r.shape == (8,) for r in robot.rows)\n"
             "assert max(runner.log.chunk) >= 0, 'no reply was spliced in'\nprint('ok')\n")
    out = run_python(openpi + robot + realtime + check, env)
    assert out.strip().endswith("ok"), out
