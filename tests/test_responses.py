"""The Responses API's core (server/responses.py): a call becomes the chat call it is (input items,
instructions, flat function tools, text.format), its answer a `response` with message and
function_call items, streamed as typed events that add up to the same response; the real server
through the official `openai` client, whole and streamed, with forced function calls and a second
turn that carries the call and its output back."""
from __future__ import annotations

import json

import jsonschema
import pytest

from sloserve.server.errors import APIError
from sloserve.server.protocol import Usage
from sloserve.server.responses import ResponsesRequest, ResponseWriter

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
          "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": PARAMS}


def test_a_responses_call_is_the_chat_call_it_says():
    chat = ResponsesRequest.model_validate({
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                               {"type": "input_text", "text": "Paris and Oslo?"}]},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                  {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                  {"type": "function_call_output", "call_id": "c2", "output": "rain"}],
        "instructions": "Be brief.", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 40, "temperature": 0, "text": {"format": {"type": "json_schema", "name": "x",
                                                                       "schema": PARAMS}}}).to_chat()
    turns = chat.conversation()
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool", "tool"]
    assert turns[1]["content"] == "Weather in Paris and Oslo?"
    assert [c["function"]["arguments"] for c in turns[2]["tool_calls"]] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert turns[3]["tool_call_id"] == "c1" and chat.max_tokens == 40
    assert chat.tools[0].function.name == "get_weather" and chat.tool_mode() == "named"
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "x", "schema": PARAMS}}
    assert ResponsesRequest(input="Hi").to_chat().conversation() == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "store": True}, "store"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": []}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
])
def test_what_a_responses_call_cannot_ask_is_a_400_naming_its_field(body, param):
    with pytest.raises(APIError) as err:
        ResponsesRequest.model_validate(body).to_chat()
    assert err.value.status == 400 and err.value.param == param


def events_of(stream: str) -> list[dict]:
    out = []
    for block in stream.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data[6:])
        assert event["type"] == kind[7:]
        out.append(event)
    return out


def test_the_streamed_events_add_up_to_the_whole_response():
    body = ResponsesRequest(input="hi", tools=[TOOL])
    usage = Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15)
    steps = [("Let me ", []), ("check.", []),
             ("", [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                                                 "arguments": '{"ci'}}]),
             ("", [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]),
             ("", [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_weather",
                                                                                 "arguments": '{"city": "Oslo"}'}}])]
    streamed = ResponseWriter("resp_1", "m", body)
    text = streamed.opening() + "".join("".join(streamed.deltas(c, d)) for c, d in steps)
    text += "".join(streamed.closing("stop", usage))
    events = events_of(text)
    assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    final = events[-1]["response"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Let me check."
    args = {}
    for e in events:
        if e["type"] == "response.function_call_arguments.delta":
            args[e["item_id"]] = args.get(e["item_id"], "") + e["delta"]
    whole = ResponseWriter("resp_1", "m", body).whole("Let me check.", [
        {"id": "call_a", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}], "stop", usage)
    strip = lambda items: [{k: v for k, v in it.items() if k != "id"} for it in items]  # noqa: E731
    assert strip(final["output"]) == strip(whole["output"]) and final["usage"] == whole["usage"]
    assert [args[item["id"]] for item in final["output"][1:]] == ['{"city": "Paris"}', '{"city": "Oslo"}']
    done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["message", "function_call", "function_call"]
    assert ResponseWriter("r", "m", body).whole("x" * 3, [], "length", usage)["status"] == "incomplete"


# ---- the OpenAI server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(default_server):
    import openai

    return openai.OpenAI(base_url=default_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
def test_the_openai_client_gets_a_response_whole_and_streamed(client):
    model = client.models.list().data[0].id
    whole = client.responses.create(model=model, input="Name three colours.", max_output_tokens=24, temperature=0)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.input_tokens > 5 and 0 < whole.usage.output_tokens <= 24
    events = list(client.responses.create(model=model, input="Name three colours.", max_output_tokens=24,
                                          temperature=0, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    # Compared with the same call whole again: like the stream, it finds the prompt's prefix cached. (In the
    # default precision a step of few rows runs the 4-bit kernels and one of many their dense copy, so the first
    # call's full prefill and the cached calls' short one may round differently: docs/configuration.md.)
    again = client.responses.create(model=model, input="Name three colours.", max_output_tokens=24, temperature=0)
    assert events[-1].type in ("response.completed", "response.incomplete") and text == again.output_text
    assert events[-1].response.output_text == again.output_text
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model, input="hi", store=True)
    assert info.value.body["param"] == "store"


@pytest.mark.slow
def test_forced_function_calls_and_a_second_turn_with_their_output(client):
    model = client.models.list().data[0].id
    ask = "What is the weather in Paris?"
    first = client.responses.create(model=model, input=ask, tools=[TOOL], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), PARAMS)
    events = list(client.responses.create(model=model, input=ask, tools=[TOOL], tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=80, temperature=0,
                                          stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == calls[0].arguments
    turn = [{"role": "user", "content": ask},
            {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"sky": "clear"})}]
    second = client.responses.create(model=model, input=turn, tools=[TOOL], tool_choice="none",
                                     max_output_tokens=30, temperature=0)
    assert second.output_text and not [item for item in second.output if item.type == "function_call"]
