"""Tool calls out of a model's text, one parser per model family, selected by name.

A model asked to call tools writes the calls in its family's own format; a parser splits a
finished output into the text meant for the user (`content`, None when there is none) and the
calls, each a function name and its arguments as JSON text (what OpenAI's `tool_calls` carry).
A call that does not parse (broken JSON, no name) stays in the content: the client sees what the
model wrote rather than a call the model did not make.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
  (Hermes 2/3, Qwen2.5 and Qwen3, and the format sloserve's own tool prompt asks for);
- `llama3_json`: a JSON object `{"name": ..., "parameters": {...}}` as the whole output, after
  an optional `<|python_tag|>`, several separated by `;` (Llama 3.1-3.3);
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name": ..., "arguments": {...}}`.

`may_start(text)` tells a streaming writer how much of a growing output it may send as content
now: everything before the first place a call could begin.
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from sloserve.engine.structured import TOOL_CALL_FORMATS


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ParsedOutput:
    content: Optional[str]
    calls: tuple[ToolCall, ...] = ()


def _call_of(obj: object, args_key: str) -> Optional[ToolCall]:
    """A ToolCall from a decoded {"name": ..., args_key: {...}} object; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _content(text: str) -> Optional[str]:
    text = text.strip()
    return text or None


class ToolParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The content and the calls of a finished output."""

    @abstractmethod
    def may_start(self, text: str) -> int:
        """The length of `text`'s prefix that no call can be part of (a streamed writer may send it)."""


def _held_back(text: str, marker: str) -> int:
    """Length of `text` before `marker`, or before a tail of `text` that could begin it."""
    at = text.find(marker)
    if at >= 0:
        return at
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


class HermesParser(ToolParser):
    name = "hermes"
    # the tags a forced call is generated with (engine/structured.py), whitespace around them optional here
    START, END = (tag.strip() for tag in TOOL_CALL_FORMATS["hermes"])
    _BLOCK = re.compile(rf"{re.escape(START)}\s*(.*?)\s*(?:{re.escape(END)}|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        calls, kept, last = [], [], 0
        for m in self._BLOCK.finditer(text):
            try:
                call = _call_of(json.loads(m.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue
            kept.append(text[last:m.start()])
            last = m.end()
            calls.append(call)
        kept.append(text[last:])
        return ParsedOutput(_content("".join(kept)), tuple(calls))

    def may_start(self, text: str) -> int:
        return _held_back(text, self.START)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].strip()
        if not body.startswith("{"):
            return ParsedOutput(_content(text))
        calls, decoder, pos = [], json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return ParsedOutput(_content(text))
            call = _call_of(obj, "parameters")
            if call is None:
                return ParsedOutput(_content(text))
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ParsedOutput(None, tuple(calls))

    def may_start(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped[0] == "{" or self.TAG.startswith(stripped[:len(self.TAG)]):
            return 0  # an output that opens like a call is held back whole
        return len(text)


class MistralParser(ToolParser):
    name = "mistral"
    START = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParsedOutput:
        at = text.find(self.START)
        if at < 0:
            return ParsedOutput(_content(text))
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[at + len(self.START):].lstrip())
        except json.JSONDecodeError:
            return ParsedOutput(_content(text))
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call_of(item, "arguments") for item in items]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(_content(text))
        return ParsedOutput(_content(text[:at]), tuple(c for c in calls if c is not None))

    def may_start(self, text: str) -> int:
        return _held_back(text, self.START)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def make_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(sorted(TOOL_PARSERS))}") from None
