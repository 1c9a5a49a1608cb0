"""A non-streamed call relayed as a stream and answered whole.

Only a relayed stream can move: the front knows from its annotations which tokens the client
has, so another instance can continue it (a failover, a live migration, a prefill->decode
hand-off). A non-streamed answer arrives all at once at the end: relayed as it is, a worker
failing mid-generation would lose the work done, and a `--pd` fleet would decode it on the
prefill instance. So the front asks the worker for a stream (with the usage chunk) and
assembles the answer the worker would have sent: the same JSON, field for field, built with the
same response models. A call with several choices (n > 1, several prompts)
is split into one-choice calls first (front/fanout.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from sloserve.front.stream import SSESplitter, event_data
from sloserve.server.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)


def answers_whole(body: dict, single_choice: bool) -> bool:
    """Whether the front relays this non-streamed call as a stream: one choice of one prompt,
    and no `stream_options` (which the worker refuses without `stream`: it keeps that 400)."""
    return body.get("stream") in (None, False) and single_choice and "stream_options" not in body


def as_stream(body: dict) -> dict:
    """The body the worker gets: the same call, streamed, with the usage chunk."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


@dataclass
class _Whole:
    chat: bool
    head: dict = field(default_factory=dict)  # id, created, model, and any other top-level field the worker adds
    text: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)  # chat: tool calls, assembled from their deltas
    logprobs: Optional[dict] = None  # completions: the four lists; chat: {"content": [...]}
    finish_reason: Optional[str] = None
    stop_reason: object = None
    usage: Optional[dict] = None
    error: Optional[dict] = None

    def feed(self, event: bytes) -> None:
        data = event_data(event)
        if data is None or data == b"[DONE]":
            return
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        if isinstance(obj.get("error"), dict):
            self.error = obj["error"]
            return
        for key, value in obj.items():
            if key not in ("object", "choices", "usage"):
                self.head.setdefault(key, value)
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or []:
            self._choice(choice)

    def _choice(self, choice: dict) -> None:
        delta = choice.get("delta") or {}
        piece = delta.get("content") if self.chat else choice.get("text")
        if piece:
            self.text.append(piece)
        for call in (delta.get("tool_calls") or []) if self.chat else []:
            self._call(call)
        lp = choice.get("logprobs")
        if isinstance(lp, dict):
            if self.logprobs is None:
                self.logprobs = {key: [] for key in lp}
            for key, values in lp.items():
                if isinstance(values, list):
                    self.logprobs.setdefault(key, []).extend(values)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")

    def _call(self, delta: dict) -> None:
        """A tool-call delta: the first of a call names it (index, id, name), later ones add arguments."""
        function = delta.get("function") or {}
        if delta.get("index") == len(self.calls):
            self.calls.append({"id": delta.get("id"), "type": delta.get("type", "function"),
                               "function": {"name": function.get("name"), "arguments": function.get("arguments", "")}})
        elif isinstance(delta.get("index"), int) and 0 <= delta["index"] < len(self.calls):
            self.calls[delta["index"]]["function"]["arguments"] += function.get("arguments", "")

    def answer(self) -> tuple[int, dict]:
        """(HTTP status, JSON body): the worker's non-streamed answer, or the error that ended it."""
        if self.error is not None:
            status = 503 if self.error.get("code") == "draining" else 500
            return status, {"error": self.error}
        if self.finish_reason is None or not all(key in self.head for key in ("id", "created", "model")):
            return 500, {"error": {"message": "the stream ended before the answer was complete", "type": "server_error",
                                   "code": "incomplete", "param": None}}
        text = "".join(self.text)
        usage = Usage.model_validate(self.usage) if self.usage is not None else None
        common = dict(self.head, usage=usage)
        if self.chat:
            lp = ChatLogprobs.model_validate(self.logprobs) if self.logprobs is not None else None
            message = ChatResponseMessage(content=text or None, tool_calls=self.calls) if self.calls else \
                ChatResponseMessage(content=text)
            choice = ChatChoice(index=0, message=message, logprobs=lp,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)
            return 200, ChatCompletionResponse(choices=[choice], **common).model_dump()
        lp = CompletionLogprobs.model_validate(self.logprobs) if self.logprobs is not None else None
        choice = CompletionChoice(index=0, text=text, logprobs=lp, finish_reason=self.finish_reason,
                                  stop_reason=self.stop_reason)
        return 200, CompletionResponse(choices=[choice], **common).model_dump()


async def collect_whole(events: AsyncIterator[bytes], chat: bool) -> tuple[int, dict]:
    """Read a relayed stream (annotations already stripped) to its end; the whole answer."""
    whole = _Whole(chat)
    splitter = SSESplitter()
    async for chunk in events:
        for event in splitter.feed(chunk):
            whole.feed(event)
    if splitter.rest().strip():
        whole.feed(splitter.rest())
    return whole.answer()
