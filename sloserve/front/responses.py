"""`POST /v1/responses` at a fleet front: the chat call it is, routed, relayed and answered as a response.

The front forwards the Responses call as its chat call (responses.ResponsesRequest.chat_body), so
it goes the way every chat call goes: judged before forwarding, routed, failed over, live-migrated,
handed off, answered whole from a relayed stream. Only the answer is rewritten: a whole chat
answer becomes the `response` object; a chat stream (asked with its usage chunk) becomes the
Responses events, chunk by chunk, since a chat delta's content and tool-call deltas are exactly
what ResponseWriter takes. An error names the Responses field.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from sloserve.server.errors import APIError, bad_request, validation_message
from sloserve.front.stream import SSESplitter, event_data
from sloserve.server.protocol import Usage
from sloserve.server.responses import ResponsesRequest, ResponseWriter, responses_param

Generate = Callable[[HTTPRequest, str, bool, bytes], Awaitable[Response]]


def judge(raw: bytes) -> ResponsesRequest:
    """The Responses call, judged as a worker judges it (400s naming its fields)."""
    try:
        body = ResponsesRequest.model_validate(json.loads(raw))
    except ValueError as exc:
        if isinstance(exc, ValidationError):
            message, param = validation_message(exc.errors())
            raise bad_request(message, param) from None
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    body.to_chat()
    return body


async def answer(request: HTTPRequest, generate: Generate) -> Response:
    raw = await request.body()
    body = judge(raw)
    chat = body.chat_body()
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    try:
        upstream = await generate(request, "/v1/chat/completions", True, json.dumps(chat).encode())
    except APIError as err:  # judged at the front
        err.param = responses_param(err.param)
        raise
    rid = request.headers.get("x-request-id") or f"resp-{uuid.uuid4().hex}"
    headers = {"x-request-id": rid}
    if upstream.status_code != 200:
        return _renamed_error(upstream)
    if isinstance(upstream, StreamingResponse):
        return _TranslatedStream(_events(upstream.body_iterator, rid, body), upstream, headers=headers,
                                 media_type="text/event-stream")
    whole = json.loads(upstream.body)
    choice = whole["choices"][0]
    message = choice.get("message") or {}
    writer = ResponseWriter(rid, whole.get("model", ""), body)
    usage = Usage.model_validate(whole.get("usage") or {})
    return JSONResponse(writer.whole(message.get("content"), message.get("tool_calls") or [],
                                     choice.get("finish_reason"), usage), headers=headers)


def _renamed_error(upstream: Response) -> Response:
    """A worker's (or the front's) error for the chat call, naming the Responses field."""
    try:
        payload = json.loads(upstream.body)  # type: ignore[attr-defined]
        payload["error"]["param"] = responses_param(payload["error"].get("param"))
    except (AttributeError, ValueError, KeyError, TypeError):
        return upstream
    keep = {k: v for k, v in upstream.headers.items() if k.lower() in ("retry-after", "x-request-id")}
    return JSONResponse(payload, status_code=upstream.status_code, headers=keep)


async def _events(chunks: AsyncIterator[Any], rid: str, body: ResponsesRequest) -> AsyncIterator[bytes]:
    """A relayed chat stream's chunks, as the Responses events of the same answer."""
    splitter = SSESplitter()
    writer: Optional[ResponseWriter] = None
    finish: Optional[str] = None
    usage: Optional[Usage] = None
    async for chunk in chunks:
        out = []
        for event in splitter.feed(chunk if isinstance(chunk, bytes) else chunk.encode()):
            data = event_data(event)
            if data is None or data == b"[DONE]":
                continue
            obj = json.loads(data)
            if writer is None:
                writer = ResponseWriter(rid, obj.get("model", ""), body)
                out.append(writer.opening())
            if isinstance(obj.get("error"), dict):
                out.append(writer.failed(obj["error"].get("code") or "server_error", obj["error"].get("message", "")))
                finish = None
                continue
            if isinstance(obj.get("usage"), dict):
                usage = Usage.model_validate(obj["usage"])
            for choice in obj.get("choices") or []:
                delta = choice.get("delta") or {}
                out.extend(writer.deltas(delta.get("content") or "", delta.get("tool_calls") or []))
                finish = choice.get("finish_reason") or finish
        if writer is not None and usage is not None and finish is not None:
            out.extend(writer.closing(finish, usage))
            finish = None
        if out:
            yield "".join(out).encode()


class _TranslatedStream(StreamingResponse):
    """The translated events; the relayed chat stream is released however the response ends."""

    def __init__(self, content: AsyncIterator[bytes], upstream: StreamingResponse, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._upstream = upstream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self._upstream, "close", None)
            if close is not None:
                await close()
