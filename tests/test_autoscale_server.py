"""Autoscaling a real fleet (`sloserve serve --instances 1:2 --autoscale reactive`, the embedded
model, worker processes on 127.0.0.1): a burst makes the front start a second worker; when the
burst is over one worker drains (its running stream moves to the other by live migration) and
stops; every request of the run completes with the text it has unscaled; no KV block is left."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from migration_helpers import ADMIN, admin, instances
from server_helpers import ServerProcess, wait_for

pytestmark = pytest.mark.slow

# A lower target must hold 30 s before a start is cancelled or a worker drained: on a slow machine a worker
# takes longer to come up than the 6 s window the burst stays in (at 2 s, the start was cancelled mid-load), and
# the lull's streams must be running on both workers before the drain comes, so the delay must exceed a cold
# start on a busy 2-core machine (4 s alone, 10-25 s with other tests beside it) by a margin.
ARGS = ["--instances", "1:2", "--autoscale", "reactive", "--capacity", "1.25", "--scaling-interval", "1",
        "--scale-down-delay", "30", "--stable-window", "6", "--router", "least-requests", "--max-num-seqs", "8",
        "--kv-cache-gib", "0.1", "--admin-key", ADMIN, "--log-level", "warning"]
# Lull streams: three clients each keep one LONG-token stream running until a worker has drained, so streams are in
# flight on both workers whenever the drain comes, however fast the machine (a fixed pair of streams can finish
# before the delay runs out on a fast one). Three clients, not two, as a margin: with two, a client that starts its
# next stream while the front still counts its last one can tie the counts and send both streams to one worker,
# leaving the drained one with nothing to move. At >= 6 ms a token (three streams share two workers on two cores)
# each stream lasts >= 3.6 s: three clients arrive at under 1 req/s, which one worker carries (capacity 1.25 x
# utilization 0.8), so the lull needs one instance; and three streams of LONG tokens fit one worker's KV pool
# (2,320 tokens at --kv-cache-gib 0.1) once the other has drained.
LONG = 600


def stream_text(base: str, prompt: str, max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    texts, usage = [], None
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event.get("choices"):
                    texts.append(event["choices"][0]["text"])
                if event.get("usage"):
                    usage = event["usage"]
    assert usage is not None and usage["completion_tokens"] == max_tokens
    return "".join(texts)


def burst_then_lull(base: str, prompts: list[str], long_prompts: list[str], expected: dict[str, str],
                    lull: list[tuple[str, str]], errors: list[BaseException]) -> int:
    """A burst of short streams grows the fleet to two workers; then three clients keep a long stream
    each running until a worker has drained and stopped. Returns the index in the dashboard's
    event log from which this round's events start."""
    events_before = len(admin("GET", base + "/dashboard/data").json()["events"])
    results: dict[str, str] = {}

    def run(p: str, n: int) -> None:
        results[p] = stream_text(base, p, n)

    threads = [threading.Thread(target=run, args=(p, 24)) for p in prompts]
    for t in threads:
        t.start()
        time.sleep(0.2)
    wait_for(lambda: [d["status"] for d in instances(base)["data"]] == ["healthy", "healthy"], 120,
             interval=0.5, what="a second worker started for the burst")
    for t in threads:
        t.join(180)
    assert len(results) == 10 and all(results[p] == expected[p] for p in prompts[:2])
    # Streams on both workers through the lull; one worker drains: its stream must move, not break. (The
    # requests that computed `expected` may already have scaled the fleet up and down once: count from here.)
    lull_over = threading.Event()

    def keep_streaming(p: str) -> None:
        try:
            while not lull_over.is_set():
                lull.append((p, stream_text(base, p, LONG)))
        except BaseException as e:  # a broken stream fails the test, not only its thread
            errors.append(e)
            lull_over.set()

    long_threads = [threading.Thread(target=keep_streaming, args=(p,)) for p in long_prompts]
    for t in long_threads:
        t.start()
    try:
        # the premise: a lull stream on each worker when the drain comes (a worker already draining takes none)
        def both_busy():
            info = instances(base)
            return info if all(d["in_flight"] > 0 for d in info["data"]) else None

        stops_before = wait_for(both_busy, 60, interval=0.2, what="a lull stream running on each worker")[
            "autoscale"]["stops"]
        wait_for(lambda: instances(base)["autoscale"]["stops"] > stops_before, 150, interval=0.5,
                 what="one worker drained and stopped")
    finally:
        lull_over.set()
        for t in long_threads:
            t.join(180)
    return events_before


def nothing_to_move(events: list[dict], since: int) -> bool:
    """Whether this round's drain found its worker's stream already gone, or saw it end before its
    move: the drain event counts the streams in flight; a move that lost that race says so."""
    drains = [i for i, e in enumerate(events) if i >= since and e["kind"] == "drain"]
    if not drains:
        return False
    detail = events[drains[-1]]["detail"]
    moves = [e["detail"] for e in events[drains[-1]:] if e["kind"] == "migration" and "(drain)" in e["detail"]]
    return (detail.endswith(" 0 in flight") and not moves) or (
        bool(moves) and all("stream ended" in m or "not_movable" in m or "finished" in m for m in moves))


def test_a_burst_adds_a_worker_and_the_lull_drains_one(tmp_path):
    server = ServerProcess(ARGS, tmp_path / "front.log", startup_timeout=300)
    base = server.base_url
    try:
        info = instances(base)
        assert [d["status"] for d in info["data"]] == ["healthy", "stopped"]
        assert info["autoscale"]["policy"] == "reactive" and info["autoscale"]["max"] == 2
        prompts = [f"Tell me about the number {i}." for i in range(10)]
        long_prompts = ["Write a long letter to a friend.", "Describe the sea at night.", "Explain how bread rises."]
        # computed side by side (one batch: greedy tokens do not depend on their batch, as the lull's
        # streams, batched with others, assert)
        wanted = [(prompts[0], 24), (prompts[1], 24), *((p, LONG) for p in long_prompts)]
        with ThreadPoolExecutor(len(wanted)) as pool:
            texts = pool.map(lambda pn: httpx.post(base + "/v1/completions", timeout=180, json={
                "prompt": pn[0], "max_tokens": pn[1], "temperature": 0, "ignore_eos": True}).json()["choices"][0]["text"],
                wanted)
            expected = dict(zip([p for p, _ in wanted], texts))
        time.sleep(7)  # those requests out of the stable window: the burst alone makes the fleet grow
        lull: list[tuple[str, str]] = []
        errors: list[BaseException] = []
        # The drain takes the worker with the least work left: its lull stream may be a few tokens from
        # its end, and end on its own before the move (nothing moves, rightly). Then that round proved
        # nothing about migration, and the burst and the lull run again (twice at most: a clean clone's CI
        # run on 2026-12-04 found nothing to move in two rounds in a row).
        for _ in range(3):
            drain_at = burst_then_lull(base, prompts, long_prompts, expected, lull, errors)
            if errors or not nothing_to_move(admin("GET", base + "/dashboard/data").json()["events"], drain_at):
                break
        assert not errors, errors
        assert lull and all(text == expected[p] for p, text in lull), [(p, t == expected[p]) for p, t in lull]
        info = instances(base)
        assert sorted(d["status"] for d in info["data"]) == ["healthy", "stopped"]
        a = info["autoscale"]
        assert a["starts"] >= 1 and a["drains"] >= 1 and a["measured_start_s"] > 0
        # the drained worker's long stream moved live
        assert info["migrations"]["completed"] >= 1, "\n".join(  # a string: pytest shows it whole
            f"{e['kind']} {e['instance']}: {e['detail']}" for e in admin("GET", base + "/dashboard/data").json()["events"])
        assert any("panic" in d["reason"] or "req/s" in d["reason"] for d in a["decisions"])
        wait_for(lambda: all(d["load"]["kv_blocks_used"] == 0 and d["in_flight"] == 0
                             for d in instances(base)["data"] if d["status"] == "healthy"), 30, interval=0.3,
                 what="the running worker's KV pool free")
        metrics = admin("GET", base + "/metrics").text
        assert 'sloserve:instances{state="stopped"} 1.0' in metrics and "sloserve:autoscale_starts_total" in metrics
        # The dashboard's event log tells the same story, in order: scale up, a worker starts and is
        # ready; scale down, one drains, its stream migrates off (the drain policy), it stops.
        events = admin("GET", base + "/dashboard/data").json()["events"]
        kinds = [(e["kind"], e["instance"]) for e in events]

        def last(kind: str, before: int) -> int:
            return max(i for i, (k, _) in enumerate(kinds[:before]) if k == kind)

        # (the four requests before the burst, or a first round whose drained stream ended on its own,
        # may already have scaled the fleet up and down: the long streams' last drain is the one)
        drain = last("drain", len(kinds))
        drained = kinds[drain][1]
        stop = kinds.index(("stop", drained), drain)
        start = last("start", drain)
        ready = kinds.index(("ready", kinds[start][1]), start)  # the started worker answers
        scale_up = last("scale", start)
        assert scale_up < start < ready < drain < stop, kinds
        # The migrations counted above are logged, each after the drain of the instance it left.
        moved = [i for i, e in enumerate(events) if e["kind"] == "migration" and "(drain)" in e["detail"]]
        assert moved and all(("drain", kinds[i][1]) in kinds[:i] for i in moved), events
    finally:
        server.kill()
