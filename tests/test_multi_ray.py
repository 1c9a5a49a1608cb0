"""`--backend ray`: the same worker, as a Ray actor on a local Ray instance, serves a request
through the front."""
from __future__ import annotations

import httpx
import pytest

from server_helpers import ServerProcess

pytestmark = pytest.mark.slow


def test_a_request_is_served_by_a_ray_actor_worker(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    # Ray kills actors when the *machine* is over 95% memory; on a shared test machine that can be
    # other jobs' doing. The front would replace the actor (with back-off), but the test should not wait.
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    server = ServerProcess(["--instances", "1", "--backend", "ray", "--max-num-seqs", "2", "--kv-cache-gib", "0.1",
                            "--log-level", "warning"], tmp_path / "ray.log", startup_timeout=300)
    try:
        info = httpx.get(server.base_url + "/v1/instances", timeout=10).json()
        assert info["data"][0]["kind"] == "ray" and info["data"][0]["status"] == "healthy"
        r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                       json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["choices"][0]["text"]
        assert httpx.get(server.base_url + "/v1/instances", timeout=10).json()["data"][0]["routed"] == 1
    finally:
        server.kill()
