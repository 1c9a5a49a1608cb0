"""Live migration and failover on a real two-worker fleet (`sloserve serve --instances 2`, the
embedded model, 127.0.0.1). A stream moved mid-decode, at several points and twice in a row,
gives the client exactly the tokens and text it gets unmoved (greedy and seeded), each once,
with one usage chunk and one [DONE]; both KV pools end fully free. A worker SIGKILLed under
load loses no stream: those with tokens resume elsewhere and finish with identical text.
A move whose target or source dies mid-copy still completes the request."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from migration_helpers import ADMIN, Stream, admin, colocated, instances, pools_free
from server_helpers import ServerProcess, wait_for

pytestmark = pytest.mark.slow

ARGS = ["--instances", "2", "--router", "round-robin", "--max-num-seqs", "8", "--kv-cache-gib", "0.1",
        "--admin-key", ADMIN, "--log-level", "warning"]
MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    server = ServerProcess(ARGS, tmp_path_factory.mktemp("front") / "front.log", startup_timeout=300)
    try:
        wait_for(lambda: [d["status"] for d in instances(server.base_url)["data"]] == ["healthy", "healthy"], 240,
                 interval=0.5, what="both workers healthy")
        yield server
    finally:
        server.kill()


GREEDY = {"max_tokens": 64, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_tokens": 64, "temperature": 0.9, "seed": 4242, "ignore_eos": True}


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_migrated_streams_match_unmigrated_ones(fleet, params):
    base = fleet.base_url
    expected = Stream(base, f"plain-{params['temperature']}", params).run()
    expected.assert_complete(64)
    for at in ((3,), (20, 40)):  # early; and twice in a row (there and back)
        moved = Stream(base, f"moved-{params['temperature']}-{at[0]}", params, at).run()
        assert len(moved.moves) == len(at) and all(m["migrated"] for m in moved.moves), moved.moves
        moved.assert_complete(64)
        assert moved.text == expected.text
    wait_for(lambda: pools_free(base), 30, interval=0.3, what="both KV pools free")
    info = instances(base)
    assert info["migrations"]["completed"] >= 3 and info["migrations"]["bytes"] > 0
    metrics = admin("GET", base + "/metrics").text
    assert "sloserve:migrations_completed_total" in metrics


def test_openai_client_sees_one_uninterrupted_stream(fleet):
    base = fleet.base_url
    client = OpenAI(base_url=base + "/v1", api_key="none")
    pieces: list[str] = []
    moved: list[dict] = []
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name five colours."}], max_tokens=40, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_headers={"X-Request-Id": "chat-move"})
    usage = None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            if len(pieces) == 10:
                for target in (0, 1):
                    r = admin("POST", base + "/v1/migrations", json={"request_id": "chat-move", "target": target})
                    if r.status_code == 200:
                        moved.append(r.json())
                        break
        if chunk.usage:
            usage = chunk.usage
    assert moved and moved[0]["migrated"]
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name five colours."}],
                                           max_tokens=40, temperature=0)
    assert "".join(pieces) == plain.choices[0].message.content
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens


def test_a_forced_tool_call_stream_moved_mid_call_reads_as_the_unmoved_answer(fleet):
    """The instance a stream moves to rebuilds what the client was sent of the calls from the tokens:
    the call is opened once, and its argument fragments add up to the unmoved answer's."""
    base = fleet.base_url
    client = OpenAI(base_url=base + "/v1", api_key="none")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}]
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris for three days?"}],
           "tools": tools, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60, "temperature": 0}
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls
    opened, arguments, moved, chunks = [], "", [], 0
    for chunk in client.chat.completions.create(**ask, stream=True, extra_headers={"X-Request-Id": "tool-move"}):
        if not chunk.choices:
            continue
        chunks += 1
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.id is not None:
                opened.append((d.id, d.function.name))
            arguments += d.function.arguments or ""
        if chunks == 12 and not moved:  # inside the call's arguments
            for target in (0, 1):
                r = admin("POST", base + "/v1/migrations", json={"request_id": "tool-move", "target": target})
                if r.status_code == 200:
                    moved.append(r.json())
                    break
    assert moved and moved[0]["migrated"], moved
    assert [name for _, name in opened] == ["get_weather"] and arguments == whole[0].function.arguments


def test_a_killed_worker_loses_no_stream(fleet):
    base = fleet.base_url
    params = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
    prompts = [f"Story number {i}: once upon a time" for i in range(4)]
    expected = {}
    for p in prompts:
        r = httpx.post(base + "/v1/completions", json={"prompt": p, **params}, timeout=120)
        expected[p] = r.json()["choices"][0]["text"]

    started: set[str] = set()

    def read(prompt: str, rid: str) -> Stream:
        s = Stream(base, rid, params, prompt=prompt)
        s.on_chunk = lambda s: started.add(rid) if len(s.tokens) >= 2 else None
        return s.run()

    victim = instances(base)["data"][0]["pid"]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(read, prompts[i % 4], f"kill-{i}") for i in range(8)]
        # every stream has tokens (round-robin put 4 on each worker): worker 0's must resume, not restart
        wait_for(lambda: len(started) == 8, 120, interval=0.02, what="all 8 streams under way")
        os.kill(victim, signal.SIGKILL)
        results = [f.result(timeout=240) for f in futures]
    for i, s in enumerate(results):
        s.assert_complete(48)
        assert s.text == expected[prompts[i % 4]]
    counters = instances(base)["counters"]
    assert counters["failed_midstream"] == 0 and counters["resumed_midstream"] >= 1
    wait_for(lambda: instances(base)["data"][0]["status"] == "healthy", 240, interval=0.5, what="replacement")


def test_a_non_streamed_call_moves_live_and_survives_its_worker(fleet):
    """A call without `stream` is relayed as a stream (and answered whole), so the controller can
    move it and a dying worker does not lose it: the answer equals the unmoved one."""
    base = fleet.base_url
    wait_for(lambda: [d["status"] for d in instances(base)["data"]] == ["healthy", "healthy"], 240, interval=0.5,
             what="both workers healthy")
    params = {"max_tokens": 96, "temperature": 0, "ignore_eos": True}
    prompt = "Write a letter to a friend about a summer holiday by the sea."
    expected = colocated(base, prompt, params, whole=True)

    def call(rid: str, settings: dict = params) -> dict:
        r = httpx.post(base + "/v1/completions", json={"prompt": prompt, **settings}, headers={"X-Request-Id": rid},
                       timeout=240)
        assert r.status_code == 200, r.text
        return r.json()

    def move(rid: str) -> bool:
        for target in (0, 1):
            r = admin("POST", base + "/v1/migrations", json={"request_id": rid, "target": target})
            if r.status_code == 200 and r.json()["migrated"]:
                return True
        return False

    with ThreadPoolExecutor(1) as pool:
        moved = pool.submit(call, "whole-move")
        wait_for(lambda: move("whole-move"), 60, interval=0.05, what="the non-streamed call moved")
        answer = moved.result(timeout=240)
    assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] == 96 and answer["object"] == "text_completion"

    # Two samples (split into two one-choice calls, round-robin puts one on each worker): the
    # one whose worker dies resumes elsewhere, and the answer is the worker's own n = 2 answer.
    seeded = {**params, "temperature": 0.8, "seed": 11, "n": 2}
    expected = colocated(base, prompt, seeded, whole=True)
    before = instances(base)["counters"]
    with ThreadPoolExecutor(1) as pool:
        killed = pool.submit(call, "whole-kill", seeded)
        busy = wait_for(lambda: next((d for d in instances(base)["data"] if d["in_flight"] > 0), None), 60,
                        interval=0.02, what="the call in flight")
        time.sleep(0.5)  # a short prompt's prefill takes ~0.1 s, its 96 tokens over a second
        os.kill(busy["pid"], signal.SIGKILL)
        answer = killed.result(timeout=240)
    assert [c["text"] for c in answer["choices"]] == [c["text"] for c in expected["choices"]]
    assert answer["id"] == "whole-kill" and answer["usage"]["completion_tokens"] == 2 * 96
    after = instances(base)["counters"]
    assert after["resumed_midstream"] >= before["resumed_midstream"] + 1
    assert after["failed_midstream"] == before["failed_midstream"]
    assert after["split_calls"] == before["split_calls"] + 1
    wait_for(lambda: [d["status"] for d in instances(base)["data"]] == ["healthy", "healthy"], 240, interval=0.5,
             what="the replacement worker healthy")
    wait_for(lambda: pools_free(base), 30, interval=0.3, what="both KV pools free")


@pytest.mark.parametrize("victim", ["target", "source"])
def test_a_worker_dying_mid_migration_loses_nothing(fleet, victim):
    base = fleet.base_url
    wait_for(lambda: [d["status"] for d in instances(base)["data"]] == ["healthy", "healthy"], 240, interval=0.5,
             what="both workers healthy")
    expected = Stream(base, f"plain-die-{victim}", GREEDY).run()
    s = Stream(base, f"die-{victim}", GREEDY)
    killed = threading.Event()

    def kill_during_move() -> dict:
        data = instances(base)["data"]
        source = next(d for d in data if d["in_flight"] > 0)
        target = next(d for d in data if d is not source)
        pid = (target if victim == "target" else source)["pid"]
        timer = threading.Timer(0.02, lambda: (os.kill(pid, signal.SIGKILL), killed.set()))
        timer.start()
        r = admin("POST", base + "/v1/migrations", json={"request_id": s.rid, "target": target["instance"]})
        timer.join()
        return r.json() if r.status_code == 200 else {"migrated": False, "status": r.status_code}

    s.move = kill_during_move  # type: ignore[method-assign]
    s.migrate_at = [8]
    s.run()
    assert killed.is_set()
    s.assert_complete(64)
    assert s.text == expected.text
    wait_for(lambda: [d["status"] for d in instances(base)["data"]] == ["healthy", "healthy"], 240, interval=0.5,
             what="the replacement worker")
    wait_for(lambda: pools_free(base), 60, interval=0.5, what="both KV pools free")


def test_a_frozen_workers_streams_resume_elsewhere(fleet):
    """A worker that stops answering (SIGSTOP) is not dead, so nothing errors; but its
    started streams would stall for as long as it stays frozen. They resume on the other
    worker once it leaves routing, and the frozen one drops them when it wakes."""
    base = fleet.base_url
    wait_for(lambda: [d["status"] for d in instances(base)["data"]] == ["healthy", "healthy"], 240, interval=0.5,
             what="both workers healthy")
    params = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
    expected = Stream(base, "plain-frozen", params).run()
    s = Stream(base, "frozen", params)
    frozen: list[int] = []

    def freeze() -> dict:
        source = next(d for d in instances(base)["data"] if d["in_flight"] > 0)
        os.kill(source["pid"], signal.SIGSTOP)
        frozen.append(source["pid"])
        return {"migrated": True}

    s.move = freeze  # type: ignore[method-assign]
    s.migrate_at = [6]
    try:
        s.run()
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    s.assert_complete(48)
    assert s.text == expected.text
    assert instances(base)["counters"]["moved_stalled"] >= 1
    wait_for(lambda: [d["status"] for d in instances(base)["data"]] == ["healthy", "healthy"], 60, interval=0.5,
             what="the frozen worker back")
    wait_for(lambda: pools_free(base), 60, interval=0.5, what="both KV pools free")
