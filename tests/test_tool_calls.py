"""Tool calling on the chat endpoint (server/tool_calls.py, tool_parsers.ToolCallStream): the prompt a
template with and without its own tool rendering gets, streamed deltas that add up to the parsed
answer (also when a stream resumes elsewhere), and the real server through the official `openai`
client: forced calls (required, a named function) parse and hold their schemas, streamed and whole,
and a conversation carries earlier calls and their results back in."""
from __future__ import annotations

import json

import jsonschema
import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st

from sloserve.engine.structured import TOOL_CALL_FORMATS
from sloserve.engine.tokenizer import Tokenizer
from sloserve.server.tool_calls import ToolUse, prompt_messages, resolve_parser
from sloserve.server.tool_parsers import ToolCallStream, make_tool_parser

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                           "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": {"city": "Paris", "days": 1}}}]},
           {"role": "tool", "content": '{"forecast": "sunny"}', "tool_call_id": "call_1"},
           {"role": "tool", "content": '{"uv": 3}', "tool_call_id": "call_2"}]


def test_a_template_without_tools_gets_sloserves_tool_prompt_and_the_calls_written_back():
    fmt = TOOL_CALL_FORMATS["hermes"]
    messages, template_tools = prompt_messages(HISTORY, TOOLS, template_renders_tools=False, fmt=fmt)
    assert template_tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert all(json.dumps(t["function"]) in system for t in TOOLS) and "<tool_call>" in system
    call = make_tool_parser("hermes").parse(messages[2]["content"]).calls  # written as the model would write it
    assert [(c.name, json.loads(c.arguments)) for c in call] == [("get_weather", {"city": "Paris", "days": 1})]
    assert messages[3]["content"] == ('<tool_response>\n{"forecast": "sunny"}\n</tool_response>\n'
                                      '<tool_response>\n{"uv": 3}\n</tool_response>')  # two results, one turn
    assert all(set(m) == {"role", "content"} for m in messages)
    # a system turn of the client's own keeps its text first
    again, _ = prompt_messages([{"role": "system", "content": "Be brief."}, *HISTORY[:1]], TOOLS, False, fmt)
    assert again[0]["content"].startswith("Be brief.\n\n") and len(again) == 2
    # a template that renders tools itself gets them, and the turns untouched
    same, passed = prompt_messages(HISTORY, TOOLS, template_renders_tools=True, fmt=fmt)
    assert same == HISTORY and passed == TOOLS


def test_the_template_says_whether_it_renders_tools_and_which_parser_it_needs():
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0}, unk_token="a"))
    qwen_like = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
                 "{% for m in messages %}{{ m.content }}<tool_call>{% endfor %}")
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert Tokenizer(backend, chat_template=qwen_like).template_reads("tools")
    assert not Tokenizer(backend, chat_template=chatml).template_reads("tools")
    assert not Tokenizer(backend).template_reads("tools")
    assert resolve_parser("auto", qwen_like).name == "hermes"
    assert resolve_parser("auto", "{{ '<|python_tag|>' }}").name == "llama3_json"
    assert resolve_parser("auto", "[TOOL_CALLS] {{ x }}").name == "mistral"
    assert resolve_parser("auto", chatml).name == "hermes"  # sloserve's own prompt asks for hermes
    assert resolve_parser("mistral", chatml).name == "mistral"


def replay(stream: ToolCallStream, text: str, cuts: list[int], finish: bool = True,
           sent: tuple[str, list[dict]] = ("", [])) -> tuple[str, list[dict]]:
    """Feed `text` cut at `cuts` (the last piece finishing the output when `finish`); (content
    sent, calls assembled from their deltas), added to what `sent` already holds."""
    content, calls = sent[0], [dict(c) for c in sent[1]]
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        piece, deltas = stream.update(text[a:b], finished=finish and k == len(bounds) - 2)
        content += piece
        for d in deltas:
            if d["index"] == len(calls):
                assert d["id"].startswith("call_") and d["type"] == "function"
                calls.append({"name": d["function"]["name"], "arguments": d["function"]["arguments"]})
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, calls


OUTPUTS = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'),
    ("hermes", "  It is sunny in Paris.  "),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"tz": }}\n</tool_call>'),  # broken: stays content
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}; '
                    '{"name": "get_time", "parameters": {"tz": "CET"}}'),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "PST"}}]'),
]


@pytest.mark.parametrize("parser, text", OUTPUTS)
@given(cuts=st.lists(st.integers(0, 200), max_size=30), resume_at=st.integers(0, 200))
def test_streamed_deltas_add_up_to_the_whole_answer_even_resumed_elsewhere(parser, text, cuts, resume_at):
    """Under tool_choice auto every output, a broken call included; forced (fragments as they are
    written) every output the grammar allows."""
    mode = "required" if make_tool_parser(parser).parse(text).calls else "auto"
    tools = ToolUse(mode, True, make_tool_parser(parser))
    whole = tools.parse(text)
    expected = [{"name": c.name, "arguments": c.arguments} for c in whole.calls]
    content, calls = replay(tools.stream(), text, cuts)
    assert calls == expected and content == (whole.content or "")
    # a stream moved after `resume_at` characters: the new instance sends only what the client lacks
    resume_at = min(resume_at, len(text) - 1)
    before = replay(tools.stream(), text[:resume_at], cuts, finish=False)
    moved = tools.stream()
    moved.resume_from(text[:resume_at])
    content, calls = replay(moved, text[resume_at:], [c - resume_at for c in cuts], sent=before)
    assert calls == expected and content == (whole.content or "")


def test_a_stream_without_parallel_calls_keeps_the_first():
    tools = ToolUse("required", False, make_tool_parser("hermes"))
    text = OUTPUTS[0][1]
    assert [c.name for c in tools.parse(text).calls] == ["get_weather"]
    _, calls = replay(tools.stream(), text, list(range(0, len(text), 7)))
    assert [c["name"] for c in calls] == ["get_weather"]
    # forced calls stream their arguments as they are written; free ones whole
    for mode, fragments in (("required", lambda n: n > 2), ("auto", lambda n: n == 0)):
        stream = ToolUse(mode, True, make_tool_parser("hermes")).stream()
        sent = [stream.update(ch)[1] for ch in text]
        assert fragments(sum(1 for deltas in sent for d in deltas if "id" not in d)), mode
    assert tools.finish_reason("stop", 1) == "tool_calls" and tools.finish_reason("length", 1) == "length"
    assert ToolUse("named", False, make_tool_parser("hermes")).finish_reason("stop", 1) == "stop"


# ---- the OpenAI server ---------------------------------------------------------------------------

ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days, and the time in Berlin?"}]


@pytest.fixture(scope="module")
def client(default_server):
    import openai

    return openai.OpenAI(base_url=default_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(calls, names: set[str]) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def assembled(stream) -> tuple[str, list[dict], str]:
    content, calls, finish = "", [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index == len(calls):
                calls.append({"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""})
            else:
                calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.slow
def test_forced_calls_through_the_openai_client_whole_and_streamed(client):
    model = client.models.list().data[0].id
    for choice, names, finish in [("required", {"get_weather", "get_time"}, "tool_calls"),
                                  ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}, "stop")]:
        for _ in range(2):  # the second call finds the prompt cached, as the stream does (docs/configuration.md:
            # in the default precision a full prefill and a cached one's few rows may round differently)
            whole = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                   max_tokens=200, temperature=0)
            c = whole.choices[0]
            assert c.finish_reason == finish and c.message.tool_calls, c
            calls = check_calls(c.message.tool_calls, names)
        stream = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                max_tokens=200, temperature=0, stream=True)
        content, streamed, streamed_finish = assembled(stream)
        assert streamed_finish == finish and (content or None) == c.message.content
        assert [(s["name"], json.loads(s["arguments"])) for s in streamed] == calls  # the same answer, in deltas
    # parallel_tool_calls false: one call
    one = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=200, temperature=0)
    assert len(one.choices[0].message.tool_calls) == 1


@pytest.mark.slow
def test_a_conversation_carries_calls_and_results_back_and_tool_choice_none_answers_in_words(client):
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    turns = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": "sunny, 21 C"})}]
    prompt_tokens = {}
    for tool_choice in ("auto", "none"):
        reply = client.chat.completions.create(model=model, messages=turns, tools=TOOLS, tool_choice=tool_choice,
                                               max_tokens=40, temperature=0)
        c, prompt_tokens[tool_choice] = reply.choices[0], reply.usage.prompt_tokens
        assert c.finish_reason in ("stop", "length", "tool_calls")
        if tool_choice == "none":
            assert c.message.tool_calls is None and c.message.content
        else:
            check_calls(c.message.tool_calls or [], set(SCHEMAS))  # any call it makes names a declared tool
    # /tokenize renders tools and turns as generation does; under tool_choice none the tools stay in the prompt
    import httpx

    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    with_tools = httpx.post(base + "/tokenize", json={"messages": turns, "tools": TOOLS}).json()["count"]
    without = httpx.post(base + "/tokenize", json={"messages": turns}).json()["count"]
    assert prompt_tokens == {"auto": with_tools, "none": with_tools} and with_tools > without + 50


@pytest.mark.slow
def test_the_bench_client_runs_an_agents_round_trip_against_the_server(default_server):
    """`sloserve bench --structured agent`: each workload request is a forced call and, once it is
    answered, the conversation with the call and its result sent back for the answer in words."""
    import asyncio

    from sloserve.bench.client import BenchClient, ClientConfig
    from sloserve.workload.types import WorkloadRequest

    cfg = ClientConfig(default_server.base_url, endpoint="chat", structured="agent")
    asks = ["Find documents about solar panels.", "What is the weather in Oslo this week?",
            "Open a high-priority ticket: the login page is down."]
    # 160 output tokens: room for a forced call's arguments (on some machines the model writes a 60-token query)
    run = asyncio.run(BenchClient(cfg).run([WorkloadRequest(0.1 * i, 20, 160, prompt_text=a, request_id=f"s{i}",
                                                            structured=True) for i, a in enumerate(asks)]))
    assert len(run.records) == 6 and all(r.success for r in run.records), [(r.request_id, r.finish_reason, r.error)
                                                                           for r in run.records]
    by_id = {r.request_id: r for r in run.records}
    for i in range(3):
        call, answer = by_id[f"s{i}"], by_id[f"s{i}/answer"]
        assert call.finish_reason == "tool_calls" and answer.finish_reason in ("stop", "length")
        assert answer.prompt_tokens > call.prompt_tokens + call.output_tokens  # the call and its result came back
        assert answer.dispatch_s >= call.send_s + call.e2e_s  # sent once the call was answered
