"""Prefill/decode disaggregation with the live transfer (pre-copy while the prefill instance
keeps decoding) and per-pool scheduler settings, on a real 1:1 fleet; and the prefill instance
gone: a decode instance serves requests whole until its replacement is up. The pipelined
transfer (KV sent block by block while the prompt is computed): output unchanged, bytes sent
during the prefill, and its decode instance dying mid-prefill or the request ending at its first
token leave nothing held. And a fleet without pools whose mixed instances hand each stream off
after its first token (`--mixed-handoff`)."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from migration_helpers import all_healthy, colocated, handoffs, instances, pools_free, running_fleet, stream
from server_helpers import wait_for

pytestmark = pytest.mark.slow

GREEDY = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def live_fleet(tmp_path_factory):
    """1 prefill + 1 decode with the live (pre-copy) transfer and per-pool settings."""
    with running_fleet(["--pd", "1:1", "--pd-transfer", "live", "--pd-prefill", "seqs=4,budget=256",
                        "--pd-decode", "seqs=8"], tmp_path_factory, 2) as server:
        yield server


def test_live_transfer_matches_colocated_output(live_fleet):
    base = live_fleet.base_url
    prompt = "Explain why the sky is blue to a child."
    expected = colocated(base, prompt, GREEDY)
    text, _ = stream(base, prompt, GREEDY)
    assert text == expected
    h = handoffs(base)
    assert h["transfer"] == "live" and h["completed"] >= 1
    wait_for(lambda: pools_free(base), 30, interval=0.3, what="every KV pool free")


def test_with_the_prefill_instance_gone_a_decode_instance_serves_it_whole(live_fleet):
    base = live_fleet.base_url
    prompt = "Give me a recipe for pancakes."
    expected = colocated(base, prompt, GREEDY)
    prefill = next(d for d in instances(base)["data"] if d["role"] == "prefill")
    os.kill(prefill["pid"], signal.SIGKILL)
    started = time.monotonic()
    text, _ = stream(base, prompt, GREEDY)  # retried on (or routed straight to) the decode instance
    assert text == expected and time.monotonic() - started < 60
    assert instances(base)["counters"]["pd_fallback"] >= 1
    all_healthy(base, 2)
    wait_for(lambda: pools_free(base), 60, interval=0.5, what="every KV pool free")


@pytest.fixture(scope="module")
def mixed_fleet(tmp_path_factory):
    """Two mixed instances; every stream decodes on the one that did not prefill it."""
    with running_fleet(["--instances", "2", "--mixed-handoff", "always"], tmp_path_factory, 2) as server:
        yield server


def test_a_mixed_instance_hands_a_stream_off_once_and_the_output_is_unchanged(mixed_fleet):
    base = mixed_fleet.base_url
    info = instances(base)
    assert [d["role"] for d in info["data"]] == ["mixed", "mixed"] and info["handoffs"]["mixed_handoff"] == "always"
    prompt = "Write two sentences about autumn leaves."
    expected = colocated(base, prompt, GREEDY)
    before = handoffs(base)
    text, usage = stream(base, prompt, GREEDY)
    assert text == expected and usage["completion_tokens"] == GREEDY["max_tokens"]
    after = handoffs(base)
    assert after["completed"] == before["completed"] + 1 and after["started"] == before["started"] + 1  # not bounced
    assert after["decoded_on_prefill"] == 0
    # a call with two choices: two one-choice calls, each handed off once
    whole = httpx.post(base + "/v1/completions", json={"prompt": prompt, **GREEDY, "n": 2}, timeout=120)
    assert whole.status_code == 200 and [c["text"] for c in whole.json()["choices"]] == [expected, expected]
    assert handoffs(base)["completed"] == after["completed"] + 2
    wait_for(lambda: pools_free(base), 30, interval=0.3, what="every KV pool free")


def long_prompt(topic: str, sentences: int) -> str:
    """A prompt of about 19 tokens a sentence, different per topic (no prefix-cache hits)."""
    return " ".join(f"Note {i} on {topic}: the keeper logged the weather, the ships and the lamp."
                    for i in range(sentences))


@pytest.fixture(scope="module")
def pipelined_fleet(tmp_path_factory):
    """1 prefill + 1 decode, pipelined: with 32 prompt tokens a step, a long prompt's KV goes to
    the decode instance over many steps before its first token exists."""
    with running_fleet(["--pd", "1:1", "--pd-transfer", "pipelined", "--pd-prefill", "budget=32"],
                       tmp_path_factory, 2) as server:
        yield server


def test_pipelined_transfer_sends_kv_during_the_prefill_and_output_is_unchanged(pipelined_fleet):
    base = pipelined_fleet.base_url
    before = handoffs(base)
    assert before["transfer"] == "pipelined"
    prompt = long_prompt("tides", 40)  # ~760 tokens: ~24 prefill steps
    text, usage = stream(base, prompt, GREEDY)
    after = handoffs(base)
    assert after["completed"] == before["completed"] + 1 and after["decoded_on_prefill"] == 0
    assert after["pipelined"] == before["pipelined"] + 1
    moved = after["bytes"] - before["bytes"]
    early = after["pipelined_bytes"] - before["pipelined_bytes"]
    # most of the prompt's KV went while it was computed; the rest at the first token
    assert 0 < early < moved and early >= moved // 2, (early, moved)
    assert text == colocated(base, prompt, GREEDY) and usage["prompt_tokens"] >= 400
    wait_for(lambda: pools_free(base), 30, interval=0.3, what="every KV pool free")
    metrics = httpx.get(base + "/metrics", headers={"Authorization": "Bearer admin-key-for-tests"}).text
    assert "sloserve:pd_handoff_pipelined_bytes_total" in metrics


def test_a_pipelined_request_that_ends_at_its_first_token_releases_the_decode_reservation(pipelined_fleet):
    base = pipelined_fleet.base_url
    one = {"max_tokens": 1, "temperature": 0}
    before = handoffs(base)
    text, _ = stream(base, long_prompt("gulls", 30), one)
    assert text
    assert handoffs(base)["started"] == before["started"]  # nothing left to decode: no hand-off
    # the blocks the decode instance reserved at admission are let go now, not after the 30 s hold
    wait_for(lambda: pools_free(base), 10, interval=0.2, what="every KV pool free")


def test_the_decode_instance_dying_during_a_pipelined_prefill_loses_nothing(pipelined_fleet):
    base = pipelined_fleet.base_url
    prompt = long_prompt("storms", 60)  # ~1,150 tokens: ~36 steps of 32 (the context: 2,320)
    decode = next(d for d in instances(base)["data"] if d["role"] == "decode")
    result: dict = {}
    reader = threading.Thread(target=lambda: result.update(zip(("text", "usage"), stream(base, prompt, GREEDY))))
    reader.start()
    time.sleep(0.3)  # the prefill has begun, and its KV is on the way to the decode instance
    os.kill(decode["pid"], signal.SIGKILL)
    reader.join(180)
    assert not reader.is_alive() and result["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    all_healthy(base, 2)  # the decode instance was replaced
    assert result["text"] == colocated(base, prompt, GREEDY)
    wait_for(lambda: pools_free(base), 60, interval=0.5, what="every KV pool free")
