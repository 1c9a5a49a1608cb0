"""A tiny misbehaving OpenAI-compatible server, for testing the client and for dry runs.

Real servers fail in ways a client must survive: they answer slowly, refuse with 429, crash
with 500, drop the connection mid-stream, or stop sending without closing. This server does
each on demand, so tests can show the client counts every failure and still finishes within
its bound. It speaks just enough HTTP/1.1 (keep-alive, chunked SSE) by hand, on asyncio
streams, because dropping a connection mid-body is exactly what a framework would hide.

The behaviour of a request is chosen by its prompt: a text prompt starting with `mode:NAME`
selects NAME (ok, slow, drop, 429, 500, hang, trickle); anything else gets `default_mode`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger(__name__)

MODES = ("ok", "slow", "drop", "429", "500", "hang", "trickle")
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error"}


@dataclass
class FakeServerConfig:
    default_mode: str = "ok"
    token_delay_s: float = 0.001  # between streamed tokens
    slow_first_token_s: float = 0.5  # extra wait before the first token in "slow" mode
    drop_after_tokens: int = 2  # tokens sent before "drop" closes the connection
    model: str = "fake-model"


@dataclass
class ReceivedRequest:
    """What the server saw (tests compare the client's records with it)."""

    received_at: float  # time.monotonic() on arrival
    path: str
    headers: dict
    body: Optional[dict]
    mode: str


class FakeOpenAIServer:
    """Runs on its own thread and event loop; use as a context manager.

    >>> with FakeOpenAIServer() as srv:  # doctest: +SKIP
    ...     srv.base_url  # 'http://127.0.0.1:PORT'
    """

    def __init__(self, config: Optional[FakeServerConfig] = None, host: str = "127.0.0.1") -> None:
        self.config = config or FakeServerConfig()
        self.host = host
        self.port = 0
        self.received: list[ReceivedRequest] = []
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._server: Optional[asyncio.AbstractServer] = None
        self._tasks: set[asyncio.Task] = set()
        self._closing: Optional[asyncio.Event] = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "FakeOpenAIServer":
        self._thread = threading.Thread(target=self._run, name="fake-openai-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._open())
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _open(self) -> None:
        self._closing = asyncio.Event()
        self._server = await asyncio.start_server(self._on_connection, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            assert self._server is not None and self._closing is not None
            self._server.close()
            self._closing.set()  # hanging and trickling handlers return; idle ones see their socket close
            for w in list(self._writers):
                w.close()
            await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), 10)
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None

    def __enter__(self) -> "FakeOpenAIServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ HTTP

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                keep_open = await self._handle(method, path, headers, raw, writer)
                if not keep_open:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            if not writer.is_closing():
                writer.close()

    async def _respond(self, writer: asyncio.StreamWriter, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        writer.write(f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()

    async def _handle(self, method: str, path: str, headers: dict, raw: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection must not be reused."""
        if method == "GET" and path.rstrip("/").endswith("/models"):
            await self._respond(writer, 200, {"object": "list", "data": [{"id": self.config.model, "object": "model"}]})
            return True
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            await self._respond(writer, 400, {"error": {"message": "body is not JSON", "type": "invalid_request"}})
            return True
        mode = self._mode(body)
        with self._lock:
            self.received.append(ReceivedRequest(time.monotonic(), path, headers, body, mode))
        if mode in ("429", "500"):
            status = int(mode)
            await self._respond(writer, status, {"error": {"message": f"fake {status}", "type": "server_error",
                                                           "code": status}})
            return True
        assert self._closing is not None
        if mode == "hang":
            await self._closing.wait()
            return False
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        if mode == "trickle":
            while not self._closing.is_set():  # bytes keep coming, so only a total timeout ends this
                writer.write(b"1\r\n:\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)
            return False
        await self._stream(body, path, mode, writer)
        return mode != "drop"

    def _mode(self, body: dict) -> str:
        prompt = body.get("prompt")
        if prompt is None and body.get("messages"):
            prompt = body["messages"][-1].get("content")
        if isinstance(prompt, str) and prompt.startswith("mode:"):
            name = prompt[5:].split()[0] if prompt[5:].split() else ""
            if name in MODES:
                return name
        return self.config.default_mode

    async def _stream(self, body: dict, path: str, mode: str, writer: asyncio.StreamWriter) -> None:
        chat = path.rstrip("/").endswith("/chat/completions")
        n = int(body.get("max_tokens") or 16)
        prompt = body.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt or body.get("messages")).split())

        async def event(payload: Any) -> None:
            data = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        def chunk(text: str, finish: Optional[str]) -> dict:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
            return {"id": "fake-1", "object": "chat.completion.chunk" if chat else "text_completion",
                    "model": self.config.model, "choices": [choice]}

        if mode == "slow":
            await asyncio.sleep(self.config.slow_first_token_s)
        for i in range(n):
            if mode == "drop" and i == self.config.drop_after_tokens:
                writer.transport.abort()  # mid-body: no terminating chunk, no [DONE]
                return
            if i:
                await asyncio.sleep(self.config.token_delay_s)
            await event(chunk(f" t{i}", "length" if i == n - 1 else None))
        if (body.get("stream_options") or {}).get("include_usage"):
            await event({"id": "fake-1", "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                                   "completion_tokens": n,
                                                                   "total_tokens": prompt_tokens + n}})
        await event("[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
