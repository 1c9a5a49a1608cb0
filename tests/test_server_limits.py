"""Overload and shutdown: the admission bound gives 429s and loses nothing it admitted;
SIGTERM drains (503 for new work, in-flight requests finish or are aborted) and exits 0.

A server with room for 2 running + 2 queued requests. The drain test stops it, so it runs last.
"""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from server_helpers import ServerProcess, assert_error_schema, metric, scrape, wait_for
from sloserve import SamplingParams

pytestmark = pytest.mark.slow

GRACE_S = 4.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server-limits")
    srv = ServerProcess(["--max-num-seqs", "2", "--max-queue", "2", "--grace-period", str(GRACE_S),
                         "--served-model-name", "small", "--served-model-name", "default"], tmp / "server.log")
    yield srv
    srv.kill()


def test_served_model_names_and_aliases(server):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["small", "default"]
    resp = client.completions.create(model="default", prompt="Hi", max_tokens=2, temperature=0)
    assert resp.model == "default"


def test_burst_gets_429_and_no_admitted_request_is_lost(server, llm):
    n, max_tokens = 12, 8
    prompts = [f"Item {i}:" for i in range(n)]
    offline = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    expected = {p: o.text for p, o in zip(prompts, offline)}
    before = scrape(server.base_url)

    async def one(aclient: openai.AsyncOpenAI, prompt: str):
        try:
            resp = await aclient.completions.create(model="small", prompt=prompt, max_tokens=max_tokens,
                                                    temperature=0, logprobs=0, extra_body={"ignore_eos": True})
            return prompt, resp
        except openai.RateLimitError as err:
            return prompt, err

    async def main():
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120) as aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, p) for p in prompts)), 180)

    results = asyncio.run(main())
    ok = [(p, r) for p, r in results if not isinstance(r, Exception)]
    limited = [r for _, r in results if isinstance(r, openai.RateLimitError)]
    assert len(ok) + len(limited) == n
    assert len(ok) >= 4, "the first max_num_seqs + max_queue arrivals are admitted"
    assert limited, "a burst of 12 against room for 4 must be refused in part"
    for err in limited:
        assert err.status_code == 429 and err.response.headers.get("retry-after") == "1"
        assert err.response.json()["error"]["code"] == "queue_full"
    for prompt, resp in ok:  # every admitted request finished, whole and correct
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.completion_tokens == max_tokens
        assert len(resp.choices[0].logprobs.tokens) == max_tokens
        assert "".join(resp.choices[0].logprobs.tokens) == resp.choices[0].text
        assert resp.choices[0].text == expected[prompt]
    after = scrape(server.base_url)
    assert metric(after, "sloserve:requests_rejected_total", reason="queue_full") - \
        metric(before, "sloserve:requests_rejected_total", reason="queue_full") == len(limited)
    assert metric(after, "sloserve:http_requests_total", route="/v1/completions", status="429") - \
        metric(before, "sloserve:http_requests_total", route="/v1/completions", status="429") == len(limited)
    assert metric(after, "sloserve:request_success_total", finished_reason="length") - \
        metric(before, "sloserve:request_success_total", finished_reason="length") == len(ok)
    assert metric(after, "sloserve:num_requests_in_flight") == 0


def test_sigterm_drains_then_exits_zero(server):
    headers = {"Content-Type": "application/json"}
    long_body = {"model": "small", "prompt": "Write a very long essay.", "max_tokens": 4000, "ignore_eos": True,
                 "stream": True}
    short_body = {"model": "small", "prompt": "Say hi.", "max_tokens": 6, "ignore_eos": True, "stream": True}
    results: dict[str, list[str]] = {}
    started = {name: threading.Event() for name in ("long", "short")}

    def consume(name: str, body: dict) -> None:
        events: list[str] = []
        with httpx.stream("POST", server.v1 + "/completions", json=body, headers=headers, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    if '"text":"' in line and not started[name].is_set():
                        started[name].set()
        results[name] = events

    threads = [threading.Thread(target=consume, args=("long", long_body)),
               threading.Thread(target=consume, args=("short", short_body))]
    for t in threads:
        t.start()
    for name in ("long", "short"):
        assert started[name].wait(60), f"{name} stream produced no token"
    t0 = time.monotonic()
    server.signal(signal.SIGTERM)

    def refused() -> bool:
        try:
            r = httpx.post(server.v1 + "/completions", json={"model": "small", "prompt": "late"}, timeout=5)
        except httpx.TransportError:
            return False
        return r.status_code == 503

    wait_for(refused, 5, interval=0.05, what="503 for new requests while draining")
    late = httpx.post(server.v1 + "/completions", json={"model": "small", "prompt": "late"}, timeout=5)
    assert_error_schema(late, 503)
    assert late.headers.get("retry-after") == "1"
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 503

    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert server.wait(60) == 0, server.log()
    elapsed = time.monotonic() - t0
    assert elapsed >= GRACE_S * 0.9 and elapsed < GRACE_S + 30

    def finish(events: list[str]) -> str:
        assert events[-1] == "[DONE]"
        return [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e)["choices"]][-1]

    assert finish(results["short"]) == "length"  # finished within the grace period
    assert finish(results["long"]) == "abort"  # cut off when it ran out
    log = server.log()
    assert "aborted 1 requests" in log
