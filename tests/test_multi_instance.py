"""`sloserve serve --instances 2` for real: two engine worker processes (the embedded model)
behind the router on 127.0.0.1. Requests spread per policy; killing a worker mid-load loses no
request (streams that had tokens resume on the other worker); the replacement joins and serves."""
from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_helpers import ServerProcess, wait_for

pytestmark = pytest.mark.slow

ARGS = ["--instances", "2", "--router", "round-robin", "--max-num-seqs", "4", "--kv-cache-gib", "0.1",
        "--log-level", "warning"]


def instances(base: str) -> dict:
    return httpx.get(base + "/v1/instances", timeout=10).json()


def stream(base: str, prompt: str, max_tokens: int) -> tuple[int, list]:
    """One streamed completion: (status, events). A transport error fails the test: the front must end
    every stream itself."""
    events = []
    with httpx.stream("POST", base + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
        return r.status_code, events


def test_two_workers_spread_survive_a_kill_and_replace_it(tmp_path):
    server = ServerProcess(ARGS, tmp_path / "front.log", startup_timeout=300)
    base = server.base_url
    try:
        # the front serves once one worker is healthy; the other joins when it answers
        wait_for(lambda: [d["status"] for d in instances(base)["data"]] == ["healthy", "healthy"], 240,
                 interval=0.5, what="both workers healthy")
        info = instances(base)
        assert all(d["kind"] == "process" and d["pid"] for d in info["data"])
        for i in range(4):
            r = httpx.post(base + "/v1/completions", timeout=60,
                           json={"prompt": f"Count to {i}:", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert [d["routed"] for d in instances(base)["data"]] == [2, 2]  # round-robin
        assert httpx.get(base + "/v1/models", timeout=10).json()["data"]

        victim_pid = instances(base)["data"][0]["pid"]
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(stream, base, f"Story number {i}:", 48) for i in range(8)]
            wait_for(lambda: instances(base)["data"][0]["in_flight"] > 0, 60, what="load on worker 0")
            os.kill(victim_pid, signal.SIGKILL)
            results = [f.result(timeout=180) for f in futures]
        completed = errored = 0
        for status, events in results:
            assert status == 200 and events and events[-1] == "[DONE]"  # every stream ends properly
            if any(isinstance(e, dict) and "error" in e for e in events):
                errored += 1
                assert [e for e in events if isinstance(e, dict) and "error" in e][0]["error"]["code"] == "instance_failed"
            else:
                completed += 1
                assert events[-2]["usage"]["completion_tokens"] == 48
        assert completed == 8 and errored == 0  # those that had tokens resumed on the other worker

        def replaced():
            d = instances(base)["data"][0]
            return d["status"] == "healthy" and d["generation"] == 1 and d["pid"] != victim_pid

        wait_for(replaced, 240, interval=0.5, what="the replacement worker to join")
        before = instances(base)["data"][0]["routed"]
        for i in range(2):
            r = httpx.post(base + "/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200
        assert instances(base)["data"][0]["routed"] == before + 1  # the new worker takes its turn
        metrics = httpx.get(base + "/metrics", timeout=10).text
        assert 'sloserve:front_replacements_total 1.0' in metrics
        # The dashboard saw it all, as the clients did: 14 answers (the resumed streams included),
        # the kill and the replacement, and both workers' rows in its frames.
        timeline = httpx.get(base + "/dashboard/data", timeout=10).json()
        assert timeline["totals"]["default"]["finished"] == 14
        assert 'sloserve:slo_requests_total{qos_class="default"} 14.0' in metrics
        kinds = [(e["kind"], e["instance"]) for e in timeline["events"]]
        assert ("failure", 0) in kinds and kinds.index(("failure", 0)) < len(kinds) - 1 - kinds[::-1].index(("ready", 0))
        assert sum(i["tokens_per_s"] for f in timeline["frames"] for i in f["instances"]) > 0

        def both_ready_in_a_frame() -> bool:  # the next frame (one a second) shows the replacement
            last = httpx.get(base + "/dashboard/data", timeout=10).json()["frames"][-1]["instances"]
            return [(i["instance"], i["status"]) for i in last] == [(0, "ready"), (1, "ready")]

        wait_for(both_ready_in_a_frame, 5, what="a frame with both workers ready")
    finally:
        server.kill()


def test_prefix_affinity_finds_a_tenants_prefix_on_the_worker_that_cached_it(tmp_path):
    """The workers salt block keys with an HMAC under one fleet-wide secret, and the front's
    router computes the same keys for the same tenant: the holder of a prefix is found even
    when it is the busier instance (a mismatch would send the request to the idle one)."""
    key = "sk-affinity-test"
    server = ServerProcess(["--instances", "2", "--router", "prefix-affinity", "--max-num-seqs", "4",
                            "--kv-cache-gib", "0.1", "--log-level", "warning", "--api-key", key],
                           tmp_path / "front.log", startup_timeout=300)
    base, auth = server.base_url, {"Authorization": f"Bearer {key}"}
    prompt = "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi. " * 5

    def fleet() -> list:
        return httpx.get(base + "/v1/instances", headers=auth, timeout=10).json()["data"]

    def cached_tokens() -> int:
        r = httpx.post(base + "/v1/completions", headers=auth, timeout=60,
                       json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        wait_for(lambda: [d["status"] for d in fleet()] == ["healthy", "healthy"], 240, interval=0.5,
                 what="both workers healthy")
        assert cached_tokens() == 0  # both idle, nothing cached: instance 0 takes it
        wait_for(lambda: fleet()[0]["load"]["cached_prefix_blocks"] >= 4, 30, what="instance 0's prefix keys")
        body = {"prompt": "Write a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", headers=auth, json=body, timeout=120) as busy:
            lines = busy.iter_lines()  # kept referenced: a collected line iterator closes the stream
            next(line for line in lines if line.startswith("data:"))
            assert [d["in_flight"] for d in fleet()] == [1, 0]  # no match anywhere: the lowest index took it
            assert cached_tokens() >= 64  # routed to its prefix's holder, the busier instance
    finally:
        server.kill()
