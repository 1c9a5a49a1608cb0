"""Splitting a non-streamed call with several choices into one-choice calls, and putting the
answer back together (front/fanout.py). End to end on a `--pd` fleet of real workers, where
every part is handed off: test_pd_server.py."""
from __future__ import annotations

import asyncio
import json

from sloserve.front.fanout import MergedStream, merge, split
from sloserve.server.protocol import choice_seed


def test_choices_are_ordered_and_seeded_as_the_worker_orders_and_seeds_them():
    call_id, parts = split({"prompt": ["a", "b"], "n": 3, "seed": 9, "best_of": 3, "max_tokens": 4}, False, None)
    assert call_id.startswith("cmpl-")
    assert [(p.index, p.prompt_index, p.sample) for p in parts] == [(i, i // 3, i % 3) for i in range(6)]
    assert [p.body["prompt"] for p in parts] == ["a"] * 3 + ["b"] * 3
    assert [p.body["seed"] for p in parts] == [9, 10, 11] * 2
    for p in parts:
        assert p.body["n"] == 1 and "best_of" not in p.body and p.body["max_tokens"] == 4
        assert p.request_id == f"{call_id}-{p.index}"
    # The worker's own n samples use the same seeds; the top of the range wraps to a valid seed.
    assert choice_seed(2**63 - 1, 1) == -2**63 and choice_seed(None, 2) is None and choice_seed(5, 0) == 5


def test_token_id_prompts_chat_and_the_clients_request_id():
    _, parts = split({"prompt": [[1, 2], [3]], "n": 1}, False, "mine")
    assert [p.body["prompt"] for p in parts] == [[1, 2], [3]] and [p.request_id for p in parts] == ["mine-0", "mine-1"]
    _, parts = split({"prompt": [1, 2, 3], "n": 2}, False, None)  # one prompt of token ids, two samples
    assert [p.body["prompt"] for p in parts] == [[1, 2, 3]] * 2
    call_id, parts = split({"messages": [{"role": "user", "content": "hi"}], "n": 2}, True, "x" * 128)
    assert call_id == "x" * 128 and all(len(p.request_id) == 128 for p in parts)  # within X-Request-Id's limit
    assert parts[1].request_id.endswith("-1") and parts[0].body["messages"] == [{"role": "user", "content": "hi"}]
    assert "seed" not in parts[1].body  # no seed given: none invented


def test_calls_the_split_cannot_carry_stay_whole():
    stays = [
        {"prompt": "a"}, {"prompt": ["a"]}, {"prompt": "a", "n": 1},  # one choice: relayed whole already
        {"prompt": "a", "n": 2, "stream_options": {"include_usage": True}},  # the worker's 400
        {"prompt": "a", "n": 2, "best_of": 3}, {"prompt": "a", "n": "2"}, {"prompt": "a", "n": 0},
        {"prompt": "a", "n": 65}, {"prompt": ["a"] * 33, "n": 2},  # past MAX_CHOICES: the worker's 400
        {"prompt": "a", "n": 2, "seed": 1.5}, {"prompt": "a", "n": True},
    ]
    for body in stays:
        assert split(body, False, None) is None, body
    assert split({"prompt": "a", "n": 2}, False, "bad id") is None  # the worker refuses the id
    assert split({"prompt": "a", "n": 2, "stream": "yes"}, False, None) is None
    _, parts = split({"prompt": "a", "n": 2, "stream": True, "stream_options": {"include_usage": True}}, False, None)
    assert all(p.body["stream"] is True and p.body["stream_options"] == {"include_usage": True} for p in parts)


def test_the_answer_is_put_back_together_as_the_worker_would_send_it():
    call_id, parts = split({"prompt": ["a", "bb"], "n": 2}, False, "call")

    def answer(i: int, prompt_tokens: int, cached: int) -> dict:
        return {"id": f"call-{i}", "object": "text_completion", "created": 7 + i, "model": "m",
                "choices": [{"index": 0, "text": f"t{i}", "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": i + 1,
                          "total_tokens": prompt_tokens + i + 1,
                          "prompt_tokens_details": {"cached_tokens": cached}}}

    answers = [answer(0, 3, 0), answer(1, 3, 2), answer(2, 5, 1), answer(3, 5, 5)]
    merged = merge(call_id, parts, answers)
    assert merged["id"] == "call" and merged["created"] == 7 and merged["object"] == "text_completion"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "t0"), (1, "t1"), (2, "t2"), (3, "t3")]
    # each prompt once, with its first sample's cached tokens (as the worker counts them)
    assert merged["usage"] == {"prompt_tokens": 8, "completion_tokens": 10, "total_tokens": 18,
                               "prompt_tokens_details": {"cached_tokens": 1}}


def _sse(*objs) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)


async def _pieces(data: bytes, size: int, pause: float = 0.0):
    for i in range(0, len(data), size):  # events cut anywhere
        await asyncio.sleep(pause)
        yield data[i:i + size]


def _read(stream: MergedStream) -> list:
    async def go():
        return [e async for e in stream.events()]
    events = b"".join(asyncio.run(go())).split(b"\n\n")[:-1]
    return [e[6:].decode() if e == b"data: [DONE]" else json.loads(e[6:]) for e in events]


def _chunk(part_id: str, created: int, text: str, finish=None) -> dict:
    return {"id": part_id, "object": "text_completion", "created": created, "model": "m", "usage": None,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def test_a_split_stream_interleaves_its_parts_under_one_id_with_one_usage_chunk_and_one_done():
    call_id, parts = split({"prompt": ["a", "b"], "n": 1, "stream": True,
                            "stream_options": {"include_usage": True}}, False, "s")
    usage = lambda p, c: {"id": "x", "object": "text_completion", "created": 1, "model": "m", "choices": [],  # noqa
                          "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                                    "prompt_tokens_details": {"cached_tokens": 0}}}
    first = _sse(_chunk("s-0", 5, "He"), _chunk("s-0", 5, "llo", "length"), usage(3, 2), b"[DONE]")
    second = _sse(_chunk("s-1", 6, "Hi", "stop"), usage(4, 1), b"[DONE]")
    events = _read(MergedStream(call_id, parts, [_pieces(first, 23, 0.001), _pieces(second, 7, 0.002)]))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    assert {e["id"] for e in events[:-1]} == {"s"} and len({e["created"] for e in events[:-1]}) == 1
    by_index = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)}
    assert by_index == {0: "Hello", 1: "Hi"} and all(c["usage"] is None for c in chunks)
    assert events[-2]["choices"] == [] and events[-2]["usage"] == {
        "prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_part_that_fails_mid_stream_ends_the_split_stream_with_its_error():
    call_id, parts = split({"prompt": "a", "n": 2, "stream": True}, False, None)
    error = {"error": {"message": "gone", "type": "server_error", "code": "instance_failed", "param": None}}
    failing = _sse(_chunk("p", 1, "a"), error, b"[DONE]")

    async def endless():
        while True:  # never ends by itself: the failure must end the call
            await asyncio.sleep(0.01)
            yield _sse(_chunk("q", 1, "b"))

    events = _read(MergedStream(call_id, parts, [_pieces(failing, 10), endless()]))
    assert events[-2] == error and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not any("usage" in e and e["usage"] for e in events[:-1] if isinstance(e, dict))
