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
now: everything before the first place a call could begin. `progress(text)` names the calls a
growing output has begun, with as much of their arguments as is already certain (hermes streams
them as they are written; the other formats name their calls once the output is complete).
`ToolCallStream` turns a growing output into the deltas OpenAI streams: content, then each call's
id and name, then its argument fragments; what it has sent is a function of the text alone, so a
stream resumed on another instance picks up from the tokens sent so far.
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from sloserve.engine.structured import TOOL_CALL_FORMATS, ToolCallFormat


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ParsedOutput:
    content: Optional[str]
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class PartialCall:
    """A call a growing output has begun: its name, the arguments text written so far, and
    whether they are complete."""

    name: str
    arguments: str
    complete: bool = False


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

    @property
    def format(self) -> ToolCallFormat:
        """How this family writes calls: what a forced call is generated in."""
        return TOOL_CALL_FORMATS[self.name]

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The content and the calls of a finished output."""

    @abstractmethod
    def may_start(self, text: str) -> int:
        """The length of `text`'s prefix that no call can be part of (a streamed writer may send it)."""

    def progress(self, text: str) -> list[PartialCall]:
        """The calls an unfinished output has begun, as far as they are certain (none by default:
        the calls are named when the output is complete)."""
        return []


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
    START, END = TOOL_CALL_FORMATS["hermes"].prefix.strip(), TOOL_CALL_FORMATS["hermes"].suffix.strip()
    _BLOCK = re.compile(rf"{re.escape(START)}\s*(.*?)\s*(?:{re.escape(END)}|$)", re.DOTALL)
    # a call's opening as the format writes it: the name first, then the arguments object
    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
    _TAIL = re.compile(r"\s*\}\s*")

    def _written(self, body: str) -> Optional[ToolCall]:
        """A call whose arguments object is kept as the model wrote it (what a stream sent)."""
        head = self._HEAD.match(body)
        if head is None:
            return None
        try:
            name = json.loads(head.group(1))
            args, end = json.JSONDecoder().raw_decode(body, head.end())
        except json.JSONDecodeError:
            return None
        if not name or not isinstance(args, dict) or not self._TAIL.fullmatch(body, end):
            return None
        return ToolCall(name, body[head.end():end])

    def parse(self, text: str) -> ParsedOutput:
        calls, kept, last = [], [], 0
        for m in self._BLOCK.finditer(text):
            call = self._written(m.group(1))
            if call is None:
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

    def progress(self, text: str) -> list[PartialCall]:
        calls, pos = [], 0
        while (at := text.find(self.START, pos)) >= 0:
            head = self._HEAD.match(text, at + len(self.START))
            if head is None:
                break
            try:
                name = json.loads(head.group(1))
            except json.JSONDecodeError:
                break
            try:
                args, end = json.JSONDecoder().raw_decode(text, head.end())
            except json.JSONDecodeError:  # still being written: all of it is arguments so far
                calls.append(PartialCall(name, text[head.end():]))
                break
            if not isinstance(args, dict):
                break
            calls.append(PartialCall(name, text[head.end():end], True))
            pos = end
        return calls


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
# What in a chat template shows which format its model was trained to call tools in.
_TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"), ("[TOOL_CALLS]", "mistral"))


def parser_for_template(template: Optional[str]) -> str:
    """The parser a chat template's own tool format calls for; hermes (the format of sloserve's own
    tool prompt, for templates that say nothing of tools) when it names none."""
    for marker, name in _TEMPLATE_MARKERS:
        if template and marker in template:
            return name
    return "hermes"


def make_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(sorted(TOOL_PARSERS))}") from None


class ToolCallStream:
    """One streamed choice's output as OpenAI streams a tool-calling answer: content deltas up to
    where a call could begin (whitespace at either end held back, as `parse` strips it), then per
    call a delta with its index, id, type and name, then fragments of its arguments. With
    `parallel` false only the first call is kept. A call is sent as it is written only when it is
    `incremental` (the grammar forces it, so it will parse); otherwise once its arguments are
    complete, since a model writing freely can break the JSON after a fragment was sent. What has
    been sent is a function of the text alone: `resume_from` rebuilds it from the text a client
    already has."""

    def __init__(self, parser: ToolParser, parallel: bool = True, incremental: bool = False) -> None:
        self.parser = parser
        self.parallel = parallel
        self.incremental = incremental
        self.text = ""
        self.content = ""  # content sent
        self.calls: list[list[str]] = []  # per call sent: [id, arguments sent]
        self.num_calls = 0  # calls in the finished output

    def resume_from(self, text: str) -> None:
        """Mark what a client that has `text` was sent, sending nothing."""
        self.update(text)

    def update(self, delta: str, finished: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) after `delta` more text; `finished` when it is the last."""
        self.text += delta
        if finished:
            parsed = self.parser.parse(self.text)
            calls = [PartialCall(c.name, c.arguments, True) for c in parsed.calls]
            content = (parsed.content or "") if calls else self.text.strip()
        else:
            calls = [c for c in self.parser.progress(self.text) if c.complete or self.incremental]
            content = self.text[:self.parser.may_start(self.text)].strip()
        if not self.parallel:
            calls = calls[:1]
        if finished:
            self.num_calls = len(calls)
        content_delta = ""
        if content.startswith(self.content):
            content_delta, self.content = content[len(self.content):], content
        deltas = []
        for i, call in enumerate(calls):
            if i == len(self.calls):
                self.calls.append([f"call_{uuid.uuid4().hex[:24]}", call.arguments])
                deltas.append({"index": i, "id": self.calls[i][0], "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
            elif call.arguments.startswith(self.calls[i][1]) and len(call.arguments) > len(self.calls[i][1]):
                deltas.append({"index": i, "function": {"arguments": call.arguments[len(self.calls[i][1]):]}})
                self.calls[i][1] = call.arguments
        return content_delta, deltas
