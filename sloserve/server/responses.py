"""The Responses API's core (`POST /v1/responses`) over the chat path.

A Responses call is a chat call in other words: `input` (a string, or items: messages, earlier
`function_call`s and their `function_call_output`s) and `instructions` become the conversation,
flat function `tools` and `tool_choice` the chat ones, `text.format` the response format,
`max_output_tokens` the token limit. So it runs exactly as a chat call does (the same prompt
rendering, constraints, admission, QoS and metrics), and only its answer is written differently:
a `response` object whose `output` holds a `message` item (output_text) and one `function_call`
item per call; streamed, the typed events (`response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed`), each with its `sequence_number`.

Nothing is stored: `store: true` and `previous_response_id` are refused (a client keeps its own
conversation, as with chat). Only function tools; `reasoning` and `include` are accepted and
ignored (the model does not reason in a separate channel).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator, Optional, Union

from pydantic import ValidationError

from sloserve.server.errors import bad_request, validation_message
from sloserve.server.protocol import ChatCompletionRequest, Usage, _Strict

# Chat parameters an error may name, as the Responses call spells them.
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "messages": "input"}


def responses_param(param: Optional[str]) -> Optional[str]:
    """The Responses field behind a chat parameter an error names."""
    if param is None:
        return None
    return _PARAMS.get(param.split(".", 1)[0], param)


class ResponsesRequest(_Strict):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stream: Optional[bool] = False
    text: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    # sloserve extensions, as on the other endpoints
    priority: Optional[int] = None
    qos_class: Optional[str] = None
    # accepted and ignored
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    include: Optional[list[str]] = None
    service_tier: Optional[str] = None

    def to_chat(self) -> ChatCompletionRequest:
        """The chat call this Responses call is; 400s name the Responses field."""
        try:
            return ChatCompletionRequest.model_validate(self.chat_body())
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            raise bad_request(message, responses_param(param)) from None

    def chat_body(self) -> dict[str, Any]:
        """The chat call's JSON body (what a fleet front forwards to a worker)."""
        if self.store:
            raise bad_request("responses are not stored here: send store false (or leave it out) and keep the "
                              "conversation on the client", "store", "unsupported_parameter")
        if self.previous_response_id is not None:
            raise bad_request("responses are not stored here, so none can be continued: send the whole input",
                              "previous_response_id", "unsupported_parameter")
        body: dict[str, Any] = {"messages": self._messages(), "stream": bool(self.stream)}
        for name in ("model", "temperature", "top_p", "seed", "parallel_tool_calls", "priority", "qos_class", "user"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [self._tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = self._tool_choice()
        if self.text is not None:
            body["response_format"] = self._format()
        return body

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        if not self.input:
            raise bad_request("input must not be empty", "input")
        for i, item in enumerate(self.input):
            if not isinstance(item, dict):
                raise bad_request(f"input[{i}] must be an object", f"input.{i}")
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise bad_request(f"input[{i}].role must be user, system, developer or assistant, got {role!r}",
                                      f"input.{i}.role")
                messages.append({"role": role, "content": self._text(i, item.get("content"))})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                if not isinstance(output, str):
                    raise bad_request(f"input[{i}].output must be a string", f"input.{i}.output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
            else:
                raise bad_request(f"input[{i}]: items of type {kind!r} are not supported (message, function_call "
                                  "and function_call_output are)", f"input.{i}.type", "unsupported_parameter")
        return messages

    @staticmethod
    def _text(i: int, content: Any) -> str:
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                        or not isinstance(part.get("text"), str):
                    raise bad_request(f"input[{i}].content[{j}]: only input_text and output_text parts are "
                                      "supported", f"input.{i}.content")
                texts.append(part["text"])
            return "".join(texts)
        raise bad_request(f"input[{i}].content must be a string or a list of text parts", f"input.{i}.content")

    @staticmethod
    def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
        if tool.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported, got {tool.get('type')!r}", "tools",
                              "unsupported_parameter")
        fields = {k: v for k, v in tool.items() if k != "type"}
        return {"type": "function", "function": fields}

    def _tool_choice(self) -> Union[str, dict[str, Any]]:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                                  "tool_choice")
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice  # type: ignore[return-value]

    def _format(self) -> dict[str, Any]:
        fmt = (self.text or {}).get("format", {"type": "text"})
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise bad_request("text.format.type must be text, json_object or json_schema", "text.format")
        if fmt["type"] != "json_schema":
            return {"type": fmt["type"]}
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _usage(usage: Usage) -> dict[str, Any]:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


class ResponseWriter:
    """One Responses call's answer: the `response` object, and its stream of typed events."""

    def __init__(self, request_id: str, model: str, body: ResponsesRequest) -> None:
        self.id = request_id
        self.model = model
        self.body = body
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self._seq = 0
        self._message: Optional[dict[str, Any]] = None  # the message item being streamed
        self._call: Optional[dict[str, Any]] = None  # the function_call item being streamed

    def response(self, status: str, usage: Optional[Usage] = None, incomplete: Optional[str] = None,
                 error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "output": [dict(item) for item in self.output], "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "parallel_tool_calls": b.parallel_tool_calls is not False, "temperature": b.temperature,
            "top_p": b.top_p, "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
            "text": b.text or {"format": {"type": "text"}}, "store": False, "metadata": b.metadata or {},
            "usage": _usage(usage) if usage is not None else None,
        }

    # -- a whole answer
    def whole(self, content: Optional[str], calls: list[dict[str, Any]], finish: Optional[str],
              usage: Usage) -> dict[str, Any]:
        if content:
            self.output.append(self._message_item(content, "completed"))
        for call in calls:
            self.output.append(self._call_item(call["id"], call["function"]["name"], call["function"]["arguments"],
                                               "completed"))
        return self.finished(finish, usage)

    def finished(self, finish: Optional[str], usage: Usage) -> dict[str, Any]:
        if finish == "length":
            return self.response("incomplete", usage, incomplete="max_output_tokens")
        return self.response("completed", usage)

    @staticmethod
    def _message_item(text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    # -- a stream
    def event(self, kind: str, **fields: Any) -> str:
        self._seq += 1
        data = {"type": kind, "sequence_number": self._seq, **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def opening(self) -> str:
        start = self.response("in_progress")
        return self.event("response.created", response=start) + self.event("response.in_progress", response=start)

    def deltas(self, content: str, calls: list[dict[str, Any]]) -> Iterator[str]:
        """Events for one step's content delta and tool-call deltas (tool_parsers.ToolCallStream's)."""
        if content:
            if self._message is None:
                yield from self._close_call()
                self._message = self._message_item("", "in_progress")
                self.output.append(self._message)
                index = len(self.output) - 1
                yield self.event("response.output_item.added", output_index=index, item=dict(self._message,
                                                                                           content=[]))
                yield self.event("response.content_part.added", item_id=self._message["id"], output_index=index,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            self._message["content"][0]["text"] += content
            yield self.event("response.output_text.delta", item_id=self._message["id"], output_index=self._index(
                self._message), content_index=0, delta=content)
        for delta in calls:
            function = delta.get("function", {})
            if "id" in delta:  # a new call
                yield from self._close_message()
                yield from self._close_call()
                self._call = self._call_item(delta["id"], function.get("name", ""), "", "in_progress")
                self.output.append(self._call)
                yield self.event("response.output_item.added", output_index=len(self.output) - 1,
                                 item=dict(self._call))
            piece = function.get("arguments", "")
            if piece and self._call is not None:
                self._call["arguments"] += piece
                yield self.event("response.function_call_arguments.delta", item_id=self._call["id"],
                                 output_index=self._index(self._call), delta=piece)

    def closing(self, finish: Optional[str], usage: Usage) -> Iterator[str]:
        yield from self._close_message()
        yield from self._close_call()
        final = self.finished(finish, usage)
        yield self.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                         response=final)

    def failed(self, code: str, message: str) -> str:
        return self.event("response.failed", response=self.response("failed", error={"code": code,
                                                                                      "message": message}))

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.output) if it is item)

    def _close_message(self) -> Iterator[str]:
        item, self._message = self._message, None
        if item is None:
            return
        item["status"] = "completed"
        index, part = self._index(item), item["content"][0]
        yield self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                         text=part["text"])
        yield self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                         part=dict(part))
        yield self.event("response.output_item.done", output_index=index, item=dict(item))

    def _close_call(self) -> Iterator[str]:
        item, self._call = self._call, None
        if item is None:
            return
        item["status"] = "completed"
        index = self._index(item)
        yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                         arguments=item["arguments"])
        yield self.event("response.output_item.done", output_index=index, item=dict(item))
