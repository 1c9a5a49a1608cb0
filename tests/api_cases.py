"""One server configuration and one list of bad requests, for the single server
(tests/test_server.py) and the multi-instance front (tests/test_front_api.py) alike: every
check the single server makes of a request must hold at the front too, with the same status
and the same parameter named, before the front forwards anything."""
from __future__ import annotations

import httpx

from server_helpers import assert_error_schema

KEY = "sk-test-alice"
OTHER_KEY = "sk-test-bob"
MAX_BODY = 4 * 2**20  # the servers' default, named so both are started with it
QOS_CONFIG = {
    "default_class": "standard",
    "classes": {
        "interactive": {"ttft_ms": 60000, "tbt_ms": 60000, "priority": 0},
        "standard": {"ttft_s": 120, "tbt_s": 60, "priority": 1},
        "impossible": {"ttft_ms": 0.001, "tbt_ms": 0.001, "priority": 2},
    },
    # bob may ask for the more urgent interactive class (and priority 0) because the config says so
    "api_keys": {KEY: {"tenant": "alice", "default_class": "interactive"},
                 OTHER_KEY: {"tenant": "bob", "classes": ["interactive", "impossible"]}},
}

LONG_PROMPT = "hello " * 9000  # > 8192 tokens, well under the body limit
C, CH = "/v1/completions", "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "hi"}]

# (id, path, json body or raw bytes, extra headers, expected status, expected param or None).
# Raw bytes where json.dumps would change the body: a lone surrogate is a legal JSON escape
# ("\ud800") that json.dumps would write the same way, but no UTF-8 encoder takes the string.
BAD_REQUESTS = [
    ("malformed-json", C, b'{"prompt": "hi",', {}, 400, None),
    ("json-array-body", C, b"[1, 2]", {}, 400, None),
    ("form-body", C, b"prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"}, 400, None),
    ("empty-body", C, b"", {}, 400, None),
    ("missing-prompt", C, {"max_tokens": 4}, {}, 400, "prompt"),
    # the front's own field (the prompt's ids, tokenized once): nobody else may set it
    ("front-prompt-ids", C, {"prompt": "hi", "sloserve_prompt_ids": [1, 2]}, {}, 400, "sloserve_prompt_ids"),
    ("front-prompt-ids-chat", CH, {"messages": OK_MSG, "sloserve_prompt_ids": [1]}, {}, 400, "sloserve_prompt_ids"),
    ("missing-messages", CH, {"max_tokens": 4}, {}, 400, "messages"),
    ("max-tokens-string", C, {"prompt": "hi", "max_tokens": "ten"}, {}, 400, "max_tokens"),
    ("max-tokens-zero", C, {"prompt": "hi", "max_tokens": 0}, {}, 400, "max_tokens"),
    ("max-tokens-negative", C, {"prompt": "hi", "max_tokens": -5}, {}, 400, "max_tokens"),
    ("max-tokens-huge", C, {"prompt": "hi", "max_tokens": 10**9}, {}, 400, "max_tokens"),
    ("max-tokens-float", C, {"prompt": "hi", "max_tokens": 1.5}, {}, 400, "max_tokens"),
    ("max-completion-tokens-zero", CH, {"messages": OK_MSG, "max_completion_tokens": 0}, {}, 400,
     "max_completion_tokens"),
    ("temperature-negative", C, {"prompt": "hi", "temperature": -0.5}, {}, 400, "temperature"),
    ("temperature-string", C, {"prompt": "hi", "temperature": "hot"}, {}, 400, "temperature"),
    ("top-p-zero", C, {"prompt": "hi", "top_p": 0}, {}, 400, "top_p"),
    ("top-p-above-one", C, {"prompt": "hi", "top_p": 1.5}, {}, 400, "top_p"),
    ("top-k-negative", C, {"prompt": "hi", "top_k": -2}, {}, 400, "top_k"),
    ("min-p-above-one", C, {"prompt": "hi", "min_p": 2}, {}, 400, "min_p"),
    ("presence-penalty-range", C, {"prompt": "hi", "presence_penalty": 3}, {}, 400, "presence_penalty"),
    ("frequency-penalty-range", C, {"prompt": "hi", "frequency_penalty": -3}, {}, 400, "frequency_penalty"),
    ("repetition-penalty-zero", C, {"prompt": "hi", "repetition_penalty": 0}, {}, 400, "repetition_penalty"),
    ("n-zero", C, {"prompt": "hi", "n": 0}, {}, 400, "n"),
    ("n-huge", C, {"prompt": "hi", "n": 1000}, {}, 400, "n"),
    ("choices-beyond-limit", C, {"prompt": ["a", "b", "c"], "n": 30}, {}, 400, "n"),
    ("logprobs-too-many", C, {"prompt": "hi", "logprobs": 50}, {}, 400, "logprobs"),
    ("top-logprobs-without-logprobs", CH, {"messages": OK_MSG, "top_logprobs": 2}, {}, 400, "top_logprobs"),
    ("top-logprobs-too-many", CH, {"messages": OK_MSG, "logprobs": True, "top_logprobs": 21}, {}, 400,
     "top_logprobs"),
    ("unknown-model", C, {"prompt": "hi", "model": "gpt-4"}, {}, 404, "model"),
    ("empty-messages", CH, {"messages": []}, {}, 400, "messages"),
    ("bad-role", CH, {"messages": [{"role": "wizard", "content": "hi"}]}, {}, 400, "messages.0.role"),
    ("content-not-string", CH, {"messages": [{"role": "user", "content": 42}]}, {}, 400, "messages.0.content"),
    ("message-without-role", CH, {"messages": [{"content": "hi"}]}, {}, 400, "messages.0.role"),
    ("image-content-part", CH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {}, 400,
     "messages.0.content"),
    ("prompt-beyond-context", C, {"prompt": LONG_PROMPT, "max_tokens": 4}, {}, 400, "prompt"),
    ("chat-beyond-context", CH, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, {}, 400, "messages"),
    ("prompt-empty", C, {"prompt": ""}, {}, 400, "prompt"),
    ("prompt-token-out-of-vocab", C, {"prompt": [10**7]}, {}, 400, "prompt"),
    ("prompt-mixed-list", C, {"prompt": [1, "a"]}, {}, 400, "prompt"),
    ("prompt-empty-list", C, {"prompt": []}, {}, 400, "prompt"),
    # token-id prompts and batches of every shape: each prompt of a batch is judged and named
    ("prompt-batch-one-empty-ids", C, {"prompt": [[1, 2], []]}, {}, 400, "prompt"),
    ("prompt-batch-first-empty-ids", C, {"prompt": [[], [1, 2]]}, {}, 400, "prompt"),
    ("prompt-batch-only-empty-ids", C, {"prompt": [[]]}, {}, 400, "prompt"),
    ("prompt-batch-all-empty-ids", C, {"prompt": [[], []]}, {}, 400, "prompt"),
    ("prompt-batch-one-empty-string", C, {"prompt": ["hi", ""]}, {}, 400, "prompt"),
    ("prompt-batch-only-empty-string", C, {"prompt": [""]}, {}, 400, "prompt"),
    ("prompt-batch-text-and-ids", C, {"prompt": ["hi", [1, 2]]}, {}, 400, "prompt"),
    ("prompt-ids-nested-deeper", C, {"prompt": [[[1]]]}, {}, 400, "prompt"),
    ("prompt-ids-nested-mixed", C, {"prompt": [[1, [2]]]}, {}, 400, "prompt"),
    ("prompt-ids-null", C, {"prompt": [None]}, {}, 400, "prompt"),
    ("prompt-batch-ids-null", C, {"prompt": [[1, None]]}, {}, 400, "prompt"),
    ("prompt-ids-float", C, {"prompt": [[1.5, 2]]}, {}, 400, "prompt"),
    ("prompt-ids-negative", C, {"prompt": [-1, 2]}, {}, 400, "prompt"),
    ("prompt-batch-ids-negative", C, {"prompt": [[1, 2], [-1]]}, {}, 400, "prompt"),
    ("prompt-batch-ids-out-of-vocab", C, {"prompt": [[1, 2], [10**7]]}, {}, 400, "prompt"),
    ("prompt-batch-ids-out-of-vocab-n2", C, {"prompt": [[1], [10**7]], "n": 2}, {}, 400, "prompt"),
    ("prompt-batch-beyond-context", C, {"prompt": ["hi", LONG_PROMPT], "max_tokens": 4}, {}, 400, "prompt"),
    ("lone-surrogate-prompt", C, b'{"prompt": "abc\\udc80def", "max_tokens": 2}', {}, 400, "prompt"),
    ("lone-surrogate-prompt-list", C, b'{"prompt": ["ok", "\\ud800"], "max_tokens": 2}', {}, 400, "prompt"),
    ("lone-surrogate-message", CH, b'{"messages": [{"role": "user", "content": "x\\udfff"}]}', {}, 400,
     "messages.0.content"),
    ("lone-surrogate-text-part", CH,
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}', {}, 400,
     "messages.0.content"),
    ("lone-surrogate-stop", C, b'{"prompt": "hi", "stop": ["\\udc00"]}', {}, 400, "stop"),
    ("lone-surrogate-user", C, b'{"prompt": "hi", "user": "\\ud800"}', {}, 400, "user"),
    ("lone-surrogate-tokenize", "/tokenize", b'{"prompt": "\\udc00"}', {}, 400, "prompt"),
    ("stop-empty-string", C, {"prompt": "hi", "stop": [""]}, {}, 400, "stop"),
    ("seed-string", C, {"prompt": "hi", "seed": "x"}, {}, 400, "seed"),
    ("unknown-field", C, {"prompt": "hi", "max_token": 5}, {}, 400, "max_token"),
    ("stream-not-bool", C, {"prompt": "hi", "stream": "yes"}, {}, 400, "stream"),
    ("stream-options-without-stream", C, {"prompt": "hi", "stream_options": {"include_usage": True}}, {}, 400,
     "stream_options"),
    ("logit-bias-unsupported", C, {"prompt": "hi", "logit_bias": {"50256": -100}}, {}, 400, "logit_bias"),
    ("tool-without-function", CH, {"messages": OK_MSG, "tools": [{"type": "function"}]}, {}, 400,
     "tools.0.function"),
    ("tool-name-invalid", CH, {"messages": OK_MSG, "tools": [{"type": "function", "function": {"name": "get weather"}}]},
     {}, 400, "tools"),
    ("tool-declared-twice", CH, {"messages": OK_MSG, "tools": [{"type": "function", "function": {"name": "f"}}] * 2},
     {}, 400, "tools"),
    ("tool-choice-unknown-function", CH, {"messages": OK_MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
                                          "tool_choice": {"type": "function", "function": {"name": "g"}}}, {}, 400,
     "tool_choice"),
    ("tool-choice-required-without-tools", CH, {"messages": OK_MSG, "tool_choice": "required"}, {}, 400, "tool_choice"),
    ("tool-choice-and-response-format", CH,
     {"messages": OK_MSG, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, {}, 400, "response_format"),
    ("tool-calls-on-a-user-turn", CH, {"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, {}, 400,
     "messages.0.tool_calls"),
    ("tool-call-arguments-not-an-object", CH, {"messages": [*OK_MSG, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1"}}]}]}, {}, 400,
     "messages.1.tool_calls"),
    ("echo-unsupported", C, {"prompt": "hi", "echo": True}, {}, 400, "echo"),
    ("unknown-qos-class", C, {"prompt": "hi", "qos_class": "platinum"}, {}, 400, "qos_class"),
    ("priority-not-permitted", C, {"prompt": "hi", "qos_class": "interactive", "priority": -1},
     {"Authorization": f"Bearer {OTHER_KEY}"}, 403, "priority"),
    ("priority-not-int32", C, {"prompt": "hi", "priority": 2**40}, {}, 400, "priority"),
    ("priority-header-not-int", C, {"prompt": "hi"}, {"X-Priority": "high"}, 400, "X-Priority"),
    ("request-id-header-invalid", C, {"prompt": "hi"}, {"X-Request-Id": "bad id with spaces"}, 400, "X-Request-Id"),
    ("missing-api-key", C, {"prompt": "hi"}, {"Authorization": ""}, 401, None),
    ("wrong-api-key", C, {"prompt": "hi"}, {"Authorization": "Bearer sk-nope"}, 401, None),
    ("oversized-body", C, {"prompt": "x" * (MAX_BODY + 1)}, {}, 413, None),
    ("unknown-route", "/v1/embeddings", {"input": "hi"}, {}, 404, None),
    ("wrong-method", C, None, {}, 405, None),
]


# The words a case's error message must hold (which prompt of a batch it names), at both servers.
NAMED_IN_MESSAGE = {
    "prompt-batch-one-empty-ids": "prompt[1] is empty",
    "prompt-batch-first-empty-ids": "prompt[0] is empty",
    "prompt-batch-only-empty-ids": "prompt is empty",
    "prompt-batch-all-empty-ids": "prompt[0] is empty",
    "prompt-batch-one-empty-string": "prompt[1] is empty",
    "prompt-batch-only-empty-string": "prompt is empty",
    "prompt-batch-ids-negative": "prompt[1]: ",
    "prompt-batch-ids-out-of-vocab": "prompt[1]: ",
    "prompt-batch-ids-out-of-vocab-n2": "prompt[1]: ",
    "prompt-batch-beyond-context": "prompt[1]: ",
}


def send_bad_request(http: httpx.Client, case: tuple) -> dict:
    """Send one case of BAD_REQUESTS (as KEY, unless its headers say otherwise); assert the
    status, the OpenAI error schema, the parameter named and the words NAMED_IN_MESSAGE asks
    for; the error object."""
    _, path, body, headers, status, param = case
    if body is None:
        response = http.get(path, headers=headers)
    elif isinstance(body, bytes):
        response = http.post(path, content=body, headers={"Content-Type": "application/json", **headers})
    else:
        response = http.post(path, json=body, headers=headers)
    err = assert_error_schema(response, status)
    if param is not None:
        assert err["param"] == param, err
    assert NAMED_IN_MESSAGE.get(case[0], "") in err["message"], err
    return err
