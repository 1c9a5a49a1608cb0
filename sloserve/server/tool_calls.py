"""Tool calling on the chat endpoint: how a call's tools and earlier calls reach the prompt, and
how its output becomes OpenAI's `tool_calls`.

The prompt. A chat template that reads `tools` renders them itself (the Qwen, Hermes, Llama 3.1+
and Mistral templates do): it gets the tool list as transformers passes it, and the turns as they
are (an assistant turn's `tool_calls` with decoded arguments, a `tool` turn with its call id). A
template that does not (the embedded SmolLM2's ChatML) gets sloserve's own tool prompt: a system
turn listing the functions' JSON schemas and showing how to write a call in the server's format,
earlier calls written back into their assistant turns in that format, and tool results as user
turns in <tool_response> tags.

The tools are in the prompt whatever tool_choice says (under "none" too: an agent's answer turn
then starts with the same prompt as its calls, cached).

The answer. With tool_choice not "none", the server's parser (`--tool-call-parser`; auto = the one
the template's own format calls for) splits the output into content and calls; `required` and a
named function are enforced by the grammar engine (protocol.py builds the constraint in the
parser's format), so their calls always parse. `parallel_tool_calls: false` keeps the first call.
finish_reason is "tool_calls" when an answer that ended by itself made calls, except under a named
tool_choice, where OpenAI answers "stop".
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from sloserve.engine.structured import ToolCallFormat
from sloserve.server.protocol import ChatCompletionRequest
from sloserve.server.tool_parsers import ParsedOutput, ToolCall, ToolCallStream, ToolParser, make_tool_parser, \
    parser_for_template

def resolve_parser(name: str, chat_template: Optional[str]) -> ToolParser:
    """The parser `--tool-call-parser NAME` selects; auto reads the model's chat template."""
    return make_tool_parser(parser_for_template(chat_template) if name == "auto" else name)


def tool_prompt(tools: list[dict[str, Any]], fmt: ToolCallFormat) -> str:
    """sloserve's own system prompt for a template that does not render tools."""
    schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    example = fmt.prefix + '{"name": "<function name>", "' + fmt.args_key + '": {<its arguments>}}' + fmt.suffix
    return ("You can call functions to answer. Each function you may call is described by one JSON schema "
            f"per line:\n{schemas}\n\nTo call a function, answer with the call and nothing else, written as\n"
            f"{example}\nwith arguments that follow the function's parameters. More than one call: write them "
            f"one after another, separated by {json.dumps(fmt.separator)}. When no call is needed, answer in words.")


def written_calls(calls: list[dict[str, Any]], fmt: ToolCallFormat) -> str:
    """Calls of an earlier assistant turn as the model writes them in `fmt`."""
    objs = [json.dumps({"name": c["function"]["name"], fmt.args_key: c["function"]["arguments"]},
                       ensure_ascii=False) for c in calls]
    return fmt.prefix + fmt.separator.join(objs) + fmt.suffix


def prompt_messages(conversation: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]],
                    template_renders_tools: bool, fmt: ToolCallFormat
                    ) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
    """(messages, tools for the template): what the chat template renders for this call."""
    if template_renders_tools:
        return conversation, tools or None
    messages: list[dict[str, Any]] = []
    for m in conversation:
        if m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if messages and messages[-1].get("tool_results"):
                messages[-1]["content"] += "\n" + result
            else:
                messages.append({"role": "user", "content": result, "tool_results": True})
        elif m.get("tool_calls"):
            text = written_calls(m["tool_calls"], fmt)
            messages.append({"role": m["role"], "content": f"{m['content']}\n{text}" if m["content"] else text})
        else:
            messages.append({"role": m["role"], "content": m["content"]})
    for m in messages:
        m.pop("tool_results", None)
    if tools:
        prompt = tool_prompt(tools, fmt)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages, None


def tool_definitions(body: Any) -> Optional[list[dict[str, Any]]]:
    """A call's tools as the prompt shows them: whatever its tool_choice, so the prompt of an agent's
    next turn (tool_choice none for an answer in words) starts as its last one did, cached."""
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None


def calls_json(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


@dataclass(frozen=True)
class ToolUse:
    """One chat call's tools as the server serves them."""

    mode: str  # "auto", "required" or "named" (a call with mode "none" has no ToolUse)
    parallel: bool
    parser: ToolParser

    @classmethod
    def of(cls, body: ChatCompletionRequest, parser: ToolParser) -> Optional["ToolUse"]:
        mode = body.tool_mode()
        if mode == "none":
            return None
        return cls(mode, body.parallel_tool_calls is not False and mode != "named", parser)

    def parse(self, text: str) -> ParsedOutput:
        """A finished output's content and calls (content stripped; None beside calls when empty)."""
        parsed = self.parser.parse(text)
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        if not calls:
            return ParsedOutput(text.strip())
        return ParsedOutput(parsed.content, calls)

    def finish_reason(self, engine_reason: Optional[str], num_calls: int) -> Optional[str]:
        if num_calls and engine_reason == "stop" and self.mode != "named":
            return "tool_calls"
        return engine_reason

    def stream(self) -> ToolCallStream:
        """Argument fragments as they are written where the grammar forces the calls; whole calls otherwise."""
        return ToolCallStream(self.parser, self.parallel, incremental=self.mode in ("required", "named"))
