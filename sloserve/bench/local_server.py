"""An OpenAI-compatible server as a child process on a free loopback port: for benchmarks that
need a real server beside their client (the tests have their own fixture). `sloserve serve` by
default; any server that takes `--host/--port` and answers `GET /health` (e.g. `vllm serve`)."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


SLOSERVE_SERVE = (sys.executable, "-m", "sloserve.cli", "serve", "--log-level", "warning")


class LocalServer:
    """A server on a free loopback port, stopped with SIGTERM (a clean drain) at the end.

    `launcher` is the command before `--host 127.0.0.1 --port P` and `server_args`."""

    def __init__(self, server_args: Sequence[str], log_path: Path, launcher: Sequence[str] = SLOSERVE_SERVE,
                 env: Optional[Mapping[str, str]] = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [*launcher, "--host", "127.0.0.1", "--port", str(self.port), *server_args],
            cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=dict(env) if env is not None else None)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}; see {self._log.name}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise SystemExit(f"server not ready after {timeout}s; see {self._log.name}")

    def stop(self) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
