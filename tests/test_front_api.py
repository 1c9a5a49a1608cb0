"""The multi-instance front (`sloserve serve --instances 2`, real workers) judges a request as
the single server does: the same bad-request list (tests/api_cases.py) gets the same status and
parameter, before anything reaches a worker's generation route; hostile bodies never become a
500; the front keeps answering /health and /metrics while huge prompts are in flight."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from api_cases import BAD_REQUESTS, CH, KEY, MAX_BODY, QOS_CONFIG, C, send_bad_request
from server_helpers import ServerProcess, metric, scrape, wait_for
from sloserve import SamplingParams

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {KEY}"}
HUGE_PROMPT_BYTES = 1_500_000  # ~580k tokens of the embedded model: far past its 8,192-token window


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("front-api")
    cfg = tmp / "qos.json"
    cfg.write_text(json.dumps(QOS_CONFIG))
    srv = ServerProcess(["--instances", "2", "--qos-config", str(cfg), "--max-body-bytes", str(MAX_BODY),
                         "--no-shed-unattainable", "--grammar-compile-timeout", "0.5"], tmp / "front.log",
                        startup_timeout=300)
    try:
        wait_for(lambda: httpx.get(srv.base_url + "/health").json().get("healthy_instances") == 2, 240,
                 interval=0.5, what="both workers")
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def http(front):
    with httpx.Client(base_url=front.base_url, headers=AUTH, timeout=120) as client:
        yield client


def workers(http: httpx.Client) -> list[dict]:
    return http.get("/v1/instances").json()["data"]


def generation_answers(http: httpx.Client) -> dict[str, float]:
    """What the workers' generation routes answered, by status."""
    out: dict[str, float] = {}
    for w in workers(http):
        for (name, labels), value in scrape(w["url"]).items():
            labels = dict(labels)
            if name == "sloserve:http_requests_total" and labels.get("route") in ("/v1/completions",
                                                                                  "/v1/chat/completions"):
                out[labels["status"]] = out.get(labels["status"], 0.0) + value
    return out


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_the_front_refuses_what_the_single_server_refuses(http, case):
    send_bad_request(http, case)


def test_bad_requests_never_reached_a_worker_and_left_nothing_behind(front, http, llm):
    """Run after the list: no bad request reached a worker's generation route (what needs the
    model, the model's name, a prompt's length and its token ids' range, was judged by a
    worker's /internal/tokenize), no 500 was logged, nothing is left running, and the front
    still answers right."""
    assert generation_answers(http) == {}
    log = front.log()
    assert "internal_error" not in log and "Traceback" not in log, log[-3000:]
    for w in workers(http):
        load = w["load"]
        assert w["in_flight"] == 0 and load["num_running"] == 0 and load["num_waiting"] == 0, w
    client = openai.OpenAI(base_url=front.v1, api_key=KEY, max_retries=0, timeout=120)
    want = llm.generate("The capital of France is", SamplingParams(max_tokens=6, temperature=0))[0].text
    got = client.completions.create(model=client.models.list().data[0].id, prompt="The capital of France is",
                                    max_tokens=6, temperature=0)
    assert got.choices[0].text == want


HOSTILE_BODIES = {
    "text": (C, {"prompt": ("lorem ipsum dolor sit amet " * (HUGE_PROMPT_BYTES // 27 + 1))[:HUGE_PROMPT_BYTES],
                 "max_tokens": 1}, "prompt"),
    # ~40,000 short turns: every one validated and joined before the conversation is known too long
    "conversation": (CH, {"messages": [{"role": "user", "content": "hi there "}] * (HUGE_PROMPT_BYTES // 42),
                          "max_tokens": 1}, "messages"),
}


@pytest.mark.parametrize("shape", HOSTILE_BODIES)
def test_health_and_metrics_answer_while_huge_prompts_are_judged(front, shape):
    """Three clients send bodies far past the context window at once: each gets a 400
    context_length_exceeded from the front (no worker generates), /health and /metrics are
    answered throughout (they never wait behind the bodies or their judging), and every worker
    answers each of the front's polls of its state (none is taken out of routing)."""
    path, body, param = HOSTILE_BODIES[shape]

    async def main():
        async with httpx.AsyncClient(base_url=front.base_url, headers=AUTH, timeout=300) as client:
            polls: list[tuple[int, int]] = []
            fleet: list[list[tuple[str, int]]] = []
            done = asyncio.Event()

            async def poll() -> None:
                while not done.is_set():
                    health = await client.get("/health")
                    metrics = await client.get("/metrics")
                    polls.append((health.status_code, metrics.status_code))
                    listed = (await client.get("/v1/instances")).json()["data"]
                    fleet.append([(w["status"], w["consecutive_poll_failures"]) for w in listed])
                    await asyncio.sleep(0.05)

            async def hostile() -> httpx.Response:
                return await client.post(path, json=body)

            poller = asyncio.create_task(poll())
            try:
                answers = await asyncio.wait_for(asyncio.gather(*(hostile() for _ in range(3))), 240)
                await asyncio.sleep(0.6)  # the polls that were in flight meanwhile have answered
            finally:
                done.set()
                await poller
            return answers, polls, fleet

    answers, polls, fleet = asyncio.run(main())
    for r in answers:
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "context_length_exceeded", err
    assert polls and all(p == (200, 200) for p in polls), polls
    assert fleet and all(seen == [("healthy", 0)] * 2 for seen in fleet), fleet
    assert all(metric(scrape(front.base_url), "sloserve:instance_requests_in_flight", instance=str(i)) == 0
               for i in range(2))


def test_the_front_resolves_qos_once_and_a_client_cannot_forge_the_resolution(front, http):
    """The front sends its resolved class and priority to the worker (workers/contract.QOS_HEADER),
    which takes them as given; a client's own copy of that header is dropped at the front, and a
    worker reached without the fleet secret ignores it and resolves the class itself."""
    from sloserve.workers.contract import QOS_HEADER

    def served(cls: str) -> float:
        return sum(v for w in workers(http) for (name, labels), v in scrape(w["url"]).items()
                   if name == "sloserve:slo_requests_total" and dict(labels).get("qos_class") == cls)

    before = {c: served(c) for c in ("interactive", "impossible")}
    forged = {QOS_HEADER: "impossible -"}
    r = http.post("/v1/completions", headers=forged, json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    direct = httpx.post(workers(http)[0]["url"] + "/v1/completions", headers={**AUTH, **forged},
                        json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert direct.status_code == 200, direct.text
    # both counted in alice's default class, neither in the forged one
    assert served("interactive") - before["interactive"] == 2 and served("impossible") == before["impossible"]


def test_a_call_tokenized_once_at_the_front_answers_as_a_worker_tokenizing_it_itself(front, http):
    """The front routes on ids a worker tokenized and hands them on (sloserve_prompt_ids): the
    answer equals a worker's own, reached directly (which tokenizes the call itself), for a chat
    with tools and a tool result, a plain chat, a text completion, and calls of two seeded samples
    (split at the front into one-choice calls, each handed the same ids)."""
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}},
                                                               "required": ["city"]}}}
    turns = [{"role": "system", "content": "You answer briefly."},
             {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    calls = [(CH, {"messages": turns, "tools": [weather], "max_tokens": 12, "temperature": 0}),
             (CH, {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}),
             (C, {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
             (C, {"prompt": "Once upon a time", "max_tokens": 6, "n": 2, "seed": 3}),  # split at the front
             (CH, {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6, "n": 2, "seed": 5})]
    worker = workers(http)[0]["url"]
    for path, body in calls:
        via_front = http.post(path, json=body)
        direct = httpx.post(worker + path, json=body, headers=AUTH, timeout=120)
        assert via_front.status_code == direct.status_code == 200, (via_front.text, direct.text)
        mine, theirs = via_front.json()["choices"], direct.json()["choices"]
        assert [c.get("message") or c.get("text") for c in mine] == \
            [c.get("message") or c.get("text") for c in theirs], (path, body)
        assert via_front.json()["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"]


def test_structured_outputs_pass_through_the_front(front):
    """The front judges the constraint's shape and forwards it; the worker that generates compiles
    it (a 400 naming the field when it cannot) and keeps its stream within it, streamed or whole."""
    client = openai.OpenAI(base_url=front.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    ask = [{"role": "user", "content": "Name a city as JSON."}]
    whole = client.chat.completions.create(model=client.models.list().data[0].id, messages=ask, max_tokens=60,
                                           temperature=0, response_format=fmt)
    assert set(json.loads(whole.choices[0].message.content)) == {"city"}
    stream = client.chat.completions.create(model=whole.model, messages=ask, max_tokens=60, temperature=0,
                                            response_format=fmt, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=whole.model, prompt="x", max_tokens=4, extra_body={"guided_regex": "(open"})
    assert info.value.body["param"] == "guided_regex" and "does not compile" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:  # judged at the front, never forwarded
        client.completions.create(model=whole.model, prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    assert info.value.body["param"] == "guided_choice"


def test_forced_tool_calls_through_the_front_whole_and_streamed(front):
    """The front asks a worker for a stream and assembles the whole answer: the calls' deltas
    become the same message.tool_calls a worker answers itself."""
    client = openai.OpenAI(base_url=front.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    model = client.models.list().data[0].id
    whole = client.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city"}
    stream = client.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True)
    arguments = "".join(d.function.arguments or "" for c in stream if c.choices for d in c.choices[0].delta.tool_calls or [])
    assert arguments == choice.message.tool_calls[0].function.arguments


def test_the_responses_api_through_the_front_whole_and_streamed(front):
    """The front forwards a Responses call as its chat call and answers it as a response: whole, and
    as the typed events of the same answer."""
    client = openai.OpenAI(base_url=front.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    tool = {"type": "function", "name": "get_weather", "parameters": params}
    model = client.models.list().data[0].id
    for kwargs in ({}, {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}):
        whole = client.responses.create(model=model, input="What is the weather in Paris?", max_output_tokens=40,
                                        temperature=0, **kwargs)
        events = list(client.responses.create(model=model, input="What is the weather in Paris?",
                                              max_output_tokens=40, temperature=0, stream=True, **kwargs))
        final = events[-1].response
        assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                            "response.incomplete")
        strip = lambda r: [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")}
                           for item in r.output]  # noqa: E731
        assert strip(final) == strip(whole) and final.usage.output_tokens == whole.usage.output_tokens
        if kwargs:
            assert [item.type for item in whole.output] == ["function_call"]
            assert set(json.loads(whole.output[0].arguments)) == {"city"}
        else:
            assert whole.output_text
    with pytest.raises(openai.BadRequestError) as info:  # judged at the front, named as the Responses field
        client.responses.create(model=model, input="hi", max_output_tokens=-1)
    assert info.value.body["param"] == "max_output_tokens"


def test_a_constraint_too_slow_to_compile_is_a_400_and_the_workers_serve_meanwhile(front, http):
    """A schema whose compile outlasts the deadline (0.5 s here, handed on to the workers) is refused,
    while /health and other calls go on; its compile finishes off the event loop and is then cached."""
    client = openai.OpenAI(base_url=front.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    heavy = {"anyOf": [{"type": "object", "properties": {f"k{j}": {"type": "string", "maxLength": 50 + i}
                                                         for j in range(20)}} for i in range(100)]}  # ~1 s on Zen4
    fmt = {"type": "json_schema", "json_schema": {"name": "heavy", "schema": heavy}}
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       response_format=fmt)
    assert info.value.body["code"] == "constraint_too_complex" and info.value.body["param"] == "response_format"
    quick = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert quick.choices[0].finish_reason in ("stop", "length")
    assert http.get("/health").status_code == 200
