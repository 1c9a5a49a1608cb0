"""Start a real `sloserve serve` subprocess on a free loopback port, and read its metrics."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import httpx

from engine_helpers import EXACT
from sloserve.workers.handles import die_with_parent

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


EXACT_FLAGS = [flag for key, value in EXACT.items() for flag in (f"--{key}", value)]


class ServerProcess:
    """`sloserve serve` bound to 127.0.0.1; one torch thread so a client can share two cores.

    `exact` (the default) serves in engine_helpers.EXACT, so what the tests compare against the
    offline engine or across workers is batch-shape independent; exact=False serves the defaults."""

    def __init__(self, args: Sequence[str], log_path: Path, startup_timeout: float = 180.0,
                 exact: bool = True) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # Half a GiB of KV (8,192 tokens fit even in float32) unless the test says otherwise: two test workers'
        # servers and fleets share the machine's memory with their models.
        cmd = [sys.executable, "-m", "sloserve.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--num-threads", "1", "--kv-cache-gib", "0.5", *(EXACT_FLAGS if exact else []), *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        env.pop("SLOSERVE_API_KEY", None)
        self._log = open(log_path, "wb")
        # a test process that dies (killed for memory, say) takes its server along: nothing is left running
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=die_with_parent)
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log()}")

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> Optional[int]:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        stop_process(self.proc)
        self._log.close()


def stop_process(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM, and SIGKILL if it has not exited within `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def scrape(base_url: str, api_key: Optional[str] = None) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels without model_name): value}, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=10.0).text
    samples: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    """Poll until predicate() is truthy; returns its value or fails with `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def assert_error_schema(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err
