"""A server in a process of its own, for the benches and tests that measure the server alone: its resident
memory (and the peak of one phase), its open files, and how it exits on SIGTERM.

`ServerProcess.serve(flags)` runs `python -m wamrt.cli serve ...` exactly as a user starts it; any other
command that serves on `port` works too (`ServerProcess(argv, port)`). Linux only (/proc).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self
from urllib.error import URLError
from urllib.request import urlopen

from ..net import free_port


class ServerProcess:
    def __init__(self, argv: list[str], port: int, *, env: dict[str, str] | None = None) -> None:
        self.argv, self.port, self.env = argv, port, env
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()

    @classmethod
    def serve(cls, flags: list[str], *, env: dict[str, str] | None = None) -> ServerProcess:
        port = free_port()
        argv = [sys.executable, "-m", "wamrt.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warning", *flags]
        return cls(argv, port, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 300.0) -> Self:
        """Start and wait until /readyz answers 200 (warm-up done)."""
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(self.env or {})})
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urlopen(self.url + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout:g} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def _status(self, key: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def rss(self) -> int:
        """Resident bytes now."""
        return self._status("VmRSS")

    def reset_peak(self) -> None:
        """Start a new peak-RSS window (`echo 5 > /proc/PID/clear_refs`)."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")

    def peak(self) -> int:
        """Largest resident bytes since `reset_peak` (or the start)."""
        return self._status("VmHWM")

    def open_files(self) -> list[str]:
        """Targets of the process's file descriptors (sockets show as `socket:[...]`)."""
        out = []
        for fd in Path(f"/proc/{self.pid}/fd").iterdir():
            try:
                out.append(os.readlink(fd))
            except OSError:
                pass  # closed meanwhile
        return out

    def terminate(self, timeout: float = 60.0) -> float:
        """SIGTERM; the seconds until the process exited (it is killed past `timeout`)."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.monotonic() - t0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()
