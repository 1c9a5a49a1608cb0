"""`--backend ray`: the same worker, as Ray actors on a local Ray instance, serves requests
through the front, disaggregated (`--pd 1:1`): each stream is handed from the prefill actor to
the decode actor after its first token, and an operator's move sends one back live (the KV goes
over the same transfer path as between worker processes: the actors' own HTTP servers)."""
from __future__ import annotations

import httpx
import pytest

from migration_helpers import ADMIN, Stream, instances, pools_free
from server_helpers import ServerProcess, wait_for

pytestmark = pytest.mark.slow


def test_ray_actor_workers_serve_and_migrate(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    # Ray kills actors when the *machine* is over 95% memory; on a shared test machine that can be
    # other jobs' doing. The front would replace the actor (with back-off), but the test should not wait.
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    server = ServerProcess(["--pd", "1:1", "--backend", "ray", "--max-num-seqs", "2", "--kv-cache-gib", "0.1",
                            "--admin-key", ADMIN, "--log-level", "warning"], tmp_path / "ray.log",
                           startup_timeout=300)
    base = server.base_url
    try:
        wait_for(lambda: [d["status"] for d in instances(base)["data"]] == ["healthy", "healthy"], 240,
                 interval=0.5, what="both Ray actors healthy")
        assert [(d["kind"], d["role"]) for d in instances(base)["data"]] == [("ray", "prefill"), ("ray", "decode")]
        r = httpx.post(base + "/v1/completions", timeout=120,
                       json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["choices"][0]["text"]

        params = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}
        expected = Stream(base, "ray-plain", params).run()
        moved = Stream(base, "ray-moved", params, migrate_at=(12,)).run()  # handed off, then moved back
        assert len(moved.moves) == 1 and moved.moves[0]["migrated"] and moved.moves[0]["instance"] == 0, moved.moves
        moved.assert_complete(32)
        assert moved.text == expected.text
        assert instances(base)["handoffs"]["completed"] == 2
        wait_for(lambda: pools_free(base), 30, interval=0.3, what="both KV pools free")
    finally:
        server.kill()
