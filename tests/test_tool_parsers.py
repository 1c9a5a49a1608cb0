"""Tool-call parsers by model family (server/tool_parsers.py) on outputs in each family's format:
calls with their arguments as JSON text, the rest as content, a broken call left as content,
and how much of a growing output a stream may send before a call could begin."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sloserve.server.tool_parsers import TOOL_PARSERS, ParsedOutput, make_tool_parser


def calls_of(parsed: ParsedOutput) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


WEATHER = {"city": "Paris", "unit": "celsius"}

# (parser, output as the family writes it, expected content, expected calls)
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     "Let me check both.", [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # EOS before the tag
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {oops}}\n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {oops}}\n</tool_call>', []),
    ("hermes", "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"tz": "CET"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_time", {"tz": "CET"}), ("get_weather", WEATHER)]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ("llama3_json", "It is sunny.", "It is sunny.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}]',
     None, [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "CET"}}]', "Sure.",
     [("get_time", {"tz": "CET"})]),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_each_family_format_parses_into_content_and_calls(parser, text, content, calls):
    parsed = make_tool_parser(parser).parse(text)
    assert parsed.content == content
    assert calls_of(parsed) == calls
    assert len({c.id for c in parsed.calls}) == len(parsed.calls) and all(c.id.startswith("call_") for c in parsed.calls)


def test_a_stream_sends_content_only_up_to_where_a_call_could_begin():
    hermes, llama, mistral = (make_tool_parser(n) for n in ("hermes", "llama3_json", "mistral"))
    assert hermes.may_start("Let me check") == len("Let me check")
    assert hermes.may_start("Let me check <tool_") == len("Let me check ")  # could be the start tag
    assert hermes.may_start("Sure <tool_call>{") == len("Sure ")
    assert mistral.may_start("Sure. [TOOL") == len("Sure. ")
    assert llama.may_start('{"na') == 0 and llama.may_start("<|python") == 0
    assert llama.may_start("It is sunny") == len("It is sunny")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_tool_parser("nope")


@given(st.text(max_size=200))
def test_no_parser_loses_or_invents_text_on_plain_prose(text):
    """Text that holds no call comes back whole as content (stripped) whatever it contains."""
    for name in TOOL_PARSERS:
        parsed = make_tool_parser(name).parse(text)
        if not parsed.calls:
            assert parsed.content == (text.strip() or None)
        else:  # hypothesis wrote a valid call by chance: it must then be a real one
            assert all(c.name for c in parsed.calls)
        assert 0 <= make_tool_parser(name).may_start(text) <= len(text)
