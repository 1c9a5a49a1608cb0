"""What the front needs to relay a worker's stream safely: when a stream has *started*, and
how to wait on upstream I/O without outliving the client.

A stream counts as started once the front has seen an SSE event that carries generated
output (`carries_output`); until then the front buffers what came (the client has received
nothing, not even a status line) and may retry the request on another instance.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Awaitable, Optional, TypeVar

T = TypeVar("T")


def carries_output(event: bytes, chat: bool) -> bool:
    """True for an SSE event that, once forwarded, makes a retry elsewhere unsafe.

    - no `data:` line (a comment or keep-alive): False;
    - `data: [DONE]`, an `error` object, a `usage` chunk, or data that is not JSON: True
      (ending or unknown: never replayed elsewhere);
    - completions: any chunk with choices: True (the worker sends one per generated token,
      even when its text is held back and empty);
    - chat: False only for the opening, the chunk whose choices all have a delta with a `role`,
      empty or no content, no tool calls, no logprobs and no finish_reason; any other chunk
      with choices carries a token (its content may be empty when the text is held back)."""
    data = event_data(event)
    if data is None:
        return False
    if data == b"[DONE]":
        return True
    try:
        obj = json.loads(data)
    except ValueError:
        return True
    if not isinstance(obj, dict) or "error" in obj or obj.get("usage") or not isinstance(obj.get("choices"), list):
        return True
    choices = obj["choices"]
    if not chat:
        return bool(choices)
    return any(not _is_opening(c) for c in choices)


def _is_opening(choice: object) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if not isinstance(delta, dict) or "role" not in delta:
        return False
    return (not delta.get("content") and not delta.get("tool_calls") and choice.get("finish_reason") is None
            and choice.get("logprobs") is None)


def event_data(event: bytes) -> Optional[bytes]:
    lines = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


class SSESplitter:
    """Cuts a byte stream into complete SSE events (each with its blank-line terminator)."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = (self._rest + chunk).replace(b"\r\n", b"\n")
        *events, self._rest = data.split(b"\n\n")
        return [e + b"\n\n" for e in events]

    def rest(self) -> bytes:
        return self._rest


class Interrupted(Exception):
    """The client went away, or the front aborted the request (the drain's grace period is over)."""

    def __init__(self, client_gone: bool) -> None:
        super().__init__("client disconnected" if client_gone else "aborted by the front")
        self.client_gone = client_gone


class Stop:
    """Races upstream I/O against the client's disconnect and the front's abort. Create it
    after the request body is read (it consumes `receive`), close it before a streaming
    response takes `receive` over."""

    def __init__(self, receive=None, abort: Optional[asyncio.Event] = None) -> None:
        self._gone = asyncio.ensure_future(_disconnected(receive)) if receive is not None else None
        self._signals = [f for f in (self._gone, _waiter(abort)) if f is not None]
        self._owned = list(self._signals)

    def joined(self, abort: asyncio.Event) -> "Stop":
        """A stop that also fires on `abort` (one part of a split call ended the others,
        front/fanout.py); closing it leaves this one's signals alone."""
        child = Stop()
        extra = _waiter(abort)
        child._gone, child._signals, child._owned = self._gone, [*self._signals, extra], [extra]
        return child

    async def run(self, work: Awaitable[T]) -> T:
        """`work`'s result, or Interrupted (with `work` cancelled) if a stop signal comes first."""
        task = asyncio.ensure_future(work)
        if not self._signals:
            return await task
        try:
            await asyncio.wait([task, *self._signals], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise Interrupted(client_gone=self._gone is not None and self._gone.done())

    def close(self) -> None:
        for f in self._owned:
            f.cancel()


def _waiter(event: Optional[asyncio.Event]) -> Optional[asyncio.Future]:
    return asyncio.ensure_future(event.wait()) if event is not None else None


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
