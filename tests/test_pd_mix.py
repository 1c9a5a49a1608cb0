"""Prefill/decode hand-offs under a mixed load (`sloserve serve --pd 1:1`, the embedded model in
the tests' exact precision, worker processes, 127.0.0.1): 40 completions, half streamed, 4-96
tokens, 40% long prompts, 8 at a time, some streams closed early by their clients.

Every client gets what one instance gives for its request asked alone (greedy); a request
whose max_tokens leaves less to decode than a hand-off's pause stays where it was prefilled
instead of racing its own end; no hand-off is started for a request its prefill instance does
not hold (the worker names why it refused: `finished` when the move came too late); nothing
falls back to decoding on the prefill instance; every abort is counted by its reason in
/metrics; and both KV pools end free."""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from migration_helpers import ADMIN, colocated, handoffs, pools_free
from server_helpers import ServerProcess, scrape, wait_for

pytestmark = pytest.mark.slow

LONG = ("The history of lighthouses spans thousands of years, from fires on hilltops to towers of stone with "
        "rotating lenses. Keepers lived in isolation, tending lamps through storms. ") * 14  # ~450 tokens


def mix(n: int = 40, seed: int = 5) -> list[dict]:
    rng = random.Random(seed)
    calls = []
    for i in range(n):
        prompt = (LONG if rng.random() < 0.4 else "") + f"Question {i}: tell me something about the sea."
        max_tokens = 4 if i % 8 == 0 else rng.randint(4, 96)  # a few that finish at once
        streamed = rng.random() < 0.5
        calls.append({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": streamed,
                      "close_after": 3 if streamed and rng.random() < 0.2 and max_tokens > 8 else None})
    return calls


def send(base: str, call: dict) -> tuple[str, bool]:
    """(the text the client read, whether it closed the stream early)."""
    body = {k: v for k, v in call.items() if k != "close_after"}
    if not call["stream"]:
        r = httpx.post(base + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], False
    texts, done = [], False
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                texts.append(event["choices"][0]["text"])
                if call["close_after"] and len(texts) >= call["close_after"]:
                    return "".join(texts), True
    assert done
    return "".join(texts), False


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    server = ServerProcess(["--pd", "1:1", "--admin-key", ADMIN, "--max-num-seqs", "16", "--kv-cache-gib", "0.5",
                            "--log-level", "info"], tmp_path_factory.mktemp("pdmix") / "front.log",
                           startup_timeout=300)
    try:
        yield server
    finally:
        server.kill()


def test_a_mixed_load_hands_off_what_pays_and_answers_every_client_as_one_instance(fleet):
    base = fleet.base_url
    calls = mix()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda c: send(base, c), calls))
    for call, (text, closed) in zip(calls, answers):
        expected = colocated(base, call["prompt"], {"max_tokens": call["max_tokens"], "temperature": 0})
        assert expected.startswith(text) if closed else text == expected, (call, text, expected)

    counts = handoffs(base)
    aborted = counts["aborted_by_reason"]
    assert aborted["unknown_request"] == aborted["not_running"] == 0, (aborted, fleet.log()[-4000:])
    assert counts["started"] == counts["completed"] + counts["aborted"] and counts["completed"] > 0, counts
    assert sum(aborted.values()) == counts["aborted"], counts
    assert counts["kept"].get("finishes_within_handoff", 0) >= 3, counts  # most 4-token calls, at least
    assert counts["decoded_on_prefill"] == 0, counts
    metrics = scrape(base, ADMIN)
    kept = {dict(labels)["reason"]: v for (name, labels), v in metrics.items()
            if name == "sloserve:pd_handoffs_kept_total"}
    assert kept == counts["kept"]
    for reason, n in aborted.items():
        assert metrics[("sloserve:pd_handoff_aborts_total", (("reason", reason),))] == n
    wait_for(lambda: pools_free(base), 60, interval=0.3, what="every KV pool free")
