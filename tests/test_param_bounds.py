"""Hostile numbers and text: every SamplingParams field is bounded to what the engine can take,
and invalid Unicode is a ValueError (a 400 over HTTP), never an error inside the engine step."""
from __future__ import annotations

import math

import httpx
import pytest
import torch

from server_helpers import ServerProcess, assert_error_schema
from sloserve import SamplingParams
from sloserve.server.errors import param_from_message
from sloserve.core.types import INT32_MAX, MAX_LOGPROBS, SEED_MAX, SEED_MIN

PROMPT = "The capital of France is"

INVALID = [
    ("seed", dict(seed=2**63)),
    ("seed", dict(seed=2**64)),
    ("seed", dict(seed=-(2**63) - 1)),
    ("seed", dict(seed=10**5000)),  # no printable repr: the message must still be built
    ("top_k", dict(top_k=2**31)),
    ("top_k", dict(top_k=2**63)),
    ("top_k", dict(top_k=-2)),
    ("max_tokens", dict(max_tokens=2**31)),
    ("max_tokens", dict(max_tokens=0)),
    ("min_tokens", dict(min_tokens=2**31)),
    ("logprobs", dict(logprobs=MAX_LOGPROBS + 1)),
    ("logprobs", dict(logprobs=-1)),
    ("stop_token_ids", dict(stop_token_ids=[2**31])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=10**400)),  # too large for a float: not an OverflowError
    ("top_p", dict(top_p=math.nan)),
    ("min_p", dict(min_p=-math.inf)),
    ("presence_penalty", dict(presence_penalty=math.inf)),
    ("frequency_penalty", dict(frequency_penalty=math.nan)),
    ("repetition_penalty", dict(repetition_penalty=math.inf)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
]


@pytest.mark.parametrize("field,kwargs", INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_out_of_range_is_a_value_error_naming_the_field(field, kwargs):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{field} must ")
    assert param_from_message(message) == field
    assert len(message) < 200


def test_the_limits_themselves_are_accepted():
    SamplingParams(seed=SEED_MAX)
    SamplingParams(seed=SEED_MIN)
    SamplingParams(top_k=INT32_MAX, max_tokens=INT32_MAX, min_tokens=INT32_MAX, logprobs=MAX_LOGPROBS,
                   stop_token_ids=[0, INT32_MAX])
    assert (SEED_MIN, SEED_MAX, INT32_MAX) == (-(2**63), 2**63 - 1, 2**31 - 1)


def test_torch_takes_every_seed_a_choice_can_get():
    """Choice j of n (j < 64) runs with seed + j; torch seeds take [-2**63, 2**64 - 1]."""
    for seed in (SEED_MIN, SEED_MAX, SEED_MAX + 63):
        torch.Generator().manual_seed(seed)
    with pytest.raises((RuntimeError, ValueError)):
        torch.Generator().manual_seed(2**64)


@pytest.mark.slow
def test_engine_runs_at_the_numeric_limits(llm):
    """Boundary values go through a real step without overflowing anything (top_k above the
    vocabulary is clamped by the sampler; extreme finite floats give tokens, not errors)."""
    params = [
        SamplingParams(max_tokens=2, seed=SEED_MAX, top_k=INT32_MAX, logprobs=MAX_LOGPROBS),
        SamplingParams(max_tokens=2, seed=SEED_MIN, stop_token_ids=[INT32_MAX]),
        SamplingParams(max_tokens=2, temperature=1e-300, repetition_penalty=1e-300, logprobs=1),
        SamplingParams(max_tokens=2, temperature=1e300, repetition_penalty=1e300, top_p=1e-300, min_p=1e-300),
    ]
    outs = llm.generate([PROMPT] * len(params), params)
    for out in outs:
        assert out.error is None and out.finish_reason == "length" and len(out.token_ids) == 2
    vocab = llm.engine.model_config.vocab_size
    assert all(0 <= t < vocab for out in outs for t in out.token_ids)
    # top_k beyond the vocabulary means "no top-k": the same draw as top_k disabled.
    same = llm.generate([PROMPT] * 2, [SamplingParams(max_tokens=4, seed=7, top_k=k) for k in (INT32_MAX, 0)])
    assert same[0].token_ids == same[1].token_ids


@pytest.mark.slow
def test_lone_surrogates_are_value_errors(llm):
    with pytest.raises(ValueError, match=r"^prompt contains invalid Unicode \(a lone surrogate at character 1\)"):
        llm.generate("a\ud800b", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"^prompt contains invalid Unicode"):
        llm.tokenizer.encode("\udfff")
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content contains invalid Unicode .* character 3\)"):
        llm.chat([{"role": "system", "content": "hi"}, {"role": "user", "content": "abc\ud800"}])
    assert llm.tokenizer.encode("caf\u00e9 \U0001F600")  # valid non-ASCII text still encodes


# ---------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("param-bounds")
    srv = ServerProcess([], tmp / "server.log")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def post_raw(http: httpx.Client, path: str, body: str) -> httpx.Response:
    """A JSON body written by hand: json.dumps would escape a lone surrogate into valid text."""
    return http.post(path, content=body, headers={"Content-Type": "application/json"})


@pytest.mark.slow
def test_http_lone_surrogate_is_a_400(http):
    err = assert_error_schema(post_raw(http, "/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}'), 400)
    assert "invalid Unicode" in err["message"] or "surrogate" in err["message"].lower(), err
    chat = '{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}'
    err = assert_error_schema(post_raw(http, "/v1/chat/completions", chat), 400)
    assert "invalid Unicode" in err["message"] or "surrogate" in err["message"].lower(), err
    assert_error_schema(post_raw(http, "/tokenize", '{"prompt": "\\udc00"}'), 400)
    # the server is still healthy and serves the next request
    ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text


@pytest.mark.slow
@pytest.mark.parametrize("field,value", [("seed", 2**64), ("top_k", 2**63), ("seed", -(2**63) - 1),
                                         ("max_tokens", 2**31), ("stop_token_ids", [2**31])])
def test_http_out_of_range_numbers_are_400_naming_the_param(http, field, value):
    resp = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, field: value})
    err = assert_error_schema(resp, 400)
    assert err["param"] == field, err
    assert err["message"].startswith(f"{field} must "), err


@pytest.mark.slow
def test_http_largest_seed_with_two_choices(http):
    """Choice 1 runs with seed 2**63, which torch accepts; serving derives it per choice."""
    resp = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "seed": SEED_MAX, "n": 2})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 2
