"""Assembling a non-streamed answer from a relayed stream (front/whole.py): what the front sends
when it asked a worker for a stream on the client's behalf. End to end (real workers, the
openai client, hand-offs, a killed worker) in test_pd_server.py and test_migration_server.py."""
from __future__ import annotations

import asyncio
import json

from sloserve.front.whole import answers_whole, as_stream, collect_whole


def sse(*objs) -> list[bytes]:
    return [f"data: {json.dumps(o)}\n\n".encode() for o in objs] + [b"data: [DONE]\n\n"]


async def _aiter(chunks):
    for c in chunks:
        yield c


def collect(chunks, chat: bool):
    return asyncio.run(collect_whole(_aiter(chunks), chat))


HEAD = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m"}


def test_only_single_choice_calls_without_stream_options_are_relayed():
    assert answers_whole({"prompt": "a"}, True) and answers_whole({"prompt": "a", "stream": False}, True)
    assert not answers_whole({"prompt": "a", "stream": True}, True)
    assert not answers_whole({"prompt": "a"}, False)  # n > 1 or several prompts
    assert not answers_whole({"prompt": "a", "stream_options": {"include_usage": True}}, True)  # the worker's 400
    assert as_stream({"prompt": "a", "stream": False}) == {"prompt": "a", "stream": True,
                                                            "stream_options": {"include_usage": True}}


def test_a_completion_is_put_back_together_across_chunk_boundaries():
    lp = lambda tok, off: {"tokens": [tok], "token_logprobs": [-0.5], "top_logprobs": [{tok: -0.5}],  # noqa: E731
                           "text_offset": [off]}
    raw = b"".join(sse(
        {**HEAD, "choices": [{"index": 0, "text": "Hel", "logprobs": lp("Hel", 0), "finish_reason": None}]},
        {**HEAD, "choices": [{"index": 0, "text": "lo", "logprobs": lp("lo", 3), "finish_reason": "stop",
                              "stop_reason": 7}]},
        {**HEAD, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                          "prompt_tokens_details": {"cached_tokens": 1}}}))
    pieces = [raw[i:i + 37] for i in range(0, len(raw), 37)]  # events split anywhere
    status, body = collect(pieces, chat=False)
    assert status == 200
    assert body == {**HEAD, "choices": [{"index": 0, "text": "Hello", "finish_reason": "stop", "stop_reason": 7,
                                         "logprobs": {"tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -0.5],
                                                      "top_logprobs": [{"Hel": -0.5}, {"lo": -0.5}],
                                                      "text_offset": [0, 3]}}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 1}}}


def test_a_chat_answer_keeps_the_workers_fields_and_drops_the_opening():
    head = {**HEAD, "id": "chatcmpl-1", "object": "chat.completion.chunk", "system_fingerprint": "fp"}
    status, body = collect(sse(
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None,
                              "logprobs": {"content": [{"token": "Hi", "logprob": -0.1, "top_logprobs": []}]}}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "length",
                              "logprobs": {"content": [{"token": "!", "logprob": -0.2, "top_logprobs": []}]}}]},
    ), chat=True)
    assert status == 200 and body["object"] == "chat.completion" and body["system_fingerprint"] == "fp"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hi!"} and choice["finish_reason"] == "length"
    assert [t["token"] for t in choice["logprobs"]["content"]] == ["Hi", "!"]
    assert body["usage"] is None  # the worker sent none


def test_a_stream_that_ends_in_an_error_or_early_is_an_error_answer():
    drained = {"error": {"message": "shutting down", "type": "server_error", "code": "draining", "param": None}}
    status, body = collect(sse({**HEAD, "choices": [{"index": 0, "text": "a"}]}, drained), chat=False)
    assert (status, body) == (503, drained)
    failed = {"error": {"message": "gone", "type": "server_error", "code": "instance_failed", "param": None}}
    assert collect(sse(failed), chat=False) == (500, failed)
    status, body = collect(sse({**HEAD, "choices": [{"index": 0, "text": "a", "finish_reason": None}]}), chat=False)
    assert status == 500 and body["error"]["code"] == "incomplete"
