"""Connection-level limits that uvicorn lacks, and the one place its Config is built.

What uvicorn already bounds (checked against its h11 protocol):
- an idle keep-alive connection, *after* a response: closed after `timeout_keep_alive`;
- header size: h11's `max_incomplete_event_size` (16 KiB by default) answers 400 beyond it.
What it does not:
- a connection that never completes its request line + headers: the keep-alive timer is only
  armed after a response, and any byte received cancels it, so a client that connects and
  says nothing, or trickles one header byte at a time (slowloris), holds a socket forever;
- a body that never arrives: the app's `receive()` waits as long as the client likes;
- the number of open connections: `limit_concurrency` answers a plain-text 503 (not our
  error schema) only once a connection *sends a request*; sockets beyond it stay open.

So: `LimitedH11Protocol` adds a header timeout and a connection cap, `timed_receive` a body
timeout for the app (EdgeMiddleware applies it), and `uvicorn_config` builds the Config with
them, for the single-instance server and the multi-instance front alike.

h11, not httptools, on purpose: httptools is not installed here (uvicorn's "auto" would pick
h11 anyway) and the subclass below relies on h11_impl's internals, named where used. uvicorn and
h11 are pinned to the versions tested (pyproject.toml); tests/test_pinned_internals.py fails if
what the subclass reads moves.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import signal
from dataclasses import dataclass
from types import FrameType
from typing import Any, Awaitable, Callable, Optional

import h11
import uvicorn
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive
from uvicorn.protocols.http.h11_impl import H11Protocol

from sloserve.server.errors import error_body

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0  # connect (or first byte after a response) -> request line + headers
    body_timeout_s: float = 30.0  # longest wait for the next body chunk while the app reads it
    max_connections: int = 1024  # open connections; beyond: 503 + Retry-After, then closed
    keep_alive_s: float = 5.0  # idle time after a response before uvicorn closes the connection
    max_header_bytes: int = 16 * 1024  # request line + headers (h11's incomplete-event limit)
    retry_after_s: int = 1
    # A refused connection is half-closed, then kept this long to swallow the request the client
    # may already be sending: closing a socket with unread input sends a RST, and the client's
    # kernel would drop our 503 before the client reads it.
    refuse_linger_s: float = 1.0

    def validate(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "refuse_linger_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")


def _raw_response(status: int, reason: str, code: str, message: str, extra: tuple[str, ...] = ()) -> bytes:
    """A complete HTTP/1.1 error response in our schema, written outside any h11 cycle."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            *extra, "connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class BodyTimeout(HTTPException):
    """Raised from `receive()` when the client stalls mid-body. An HTTPException because FastAPI
    turns any other exception raised while it reads the body into a 400; app.py answers it as
    408 `request_timeout` with `Connection: close` (the rest of the body will never be read)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"request body not received within {timeout_s:g}s")


def timed_receive(receive: Receive, timeout_s: float) -> Receive:
    """`receive` bounded to `timeout_s` per body chunk, until the body is complete. After that it
    is left alone: a streaming response waits on it for the disconnect, for as long as it runs."""
    body_done = False

    async def wrapped() -> Message:
        nonlocal body_done
        if body_done:
            return await receive()
        try:
            message = await asyncio.wait_for(receive(), timeout_s)
        except asyncio.TimeoutError:
            raise BodyTimeout(timeout_s) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            body_done = True
        return message

    return wrapped


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header read timeout and a cap on open connections.

    Relies on these H11Protocol internals: `self.connections` (the server's set
    of open protocols, added in `connection_made`), `self.cycle` (the current request's
    RequestResponseCycle, with `response_complete`), `self.conn` (the h11.Connection) and
    `self.transport`. uvicorn builds it as `Config.http(config=, server_state=, app_state=, _loop=)`;
    `uvicorn_config` binds `limits` with functools.partial.
    """

    def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
                 _loop: Optional[asyncio.AbstractEventLoop] = None, *, limits: ConnectionLimits) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._linger_timer: Optional[asyncio.TimerHandle] = None
        self._partial = False  # bytes of a request arrived since the header clock started
        self._refused = False

    # -- connection cap
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse()
            return
        self._start_header_clock()

    def _refuse(self) -> None:
        """Answer 503 at once and close. A refused socket does not count toward the cap."""
        self._refused = True
        self.connections.discard(self)
        logger.warning("connection limit (%d) reached: refusing %s", self.limits.max_connections,
                       "%s:%s" % self.client if self.client else "a client")
        self.transport.write(_raw_response(
            503, "Service Unavailable", "too_many_connections",
            f"server has {self.limits.max_connections} open connections; retry later",
            (f"retry-after: {self.limits.retry_after_s}",)))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger_timer = self.loop.call_later(self.limits.refuse_linger_s, self.transport.close)

    # -- header timeout
    def _between_requests(self) -> bool:
        """No request of this connection is being answered: the server waits on the client."""
        return self.cycle is None or self.cycle.response_complete

    def _start_header_clock(self) -> None:
        if self._header_timer is None:
            self._partial = False
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _stop_header_clock(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # swallowed: the 503 is already on its way
        if self._between_requests():
            # The first byte after a response cancels uvicorn's keep-alive timer; from here the
            # client has header_timeout_s to finish the request's head. Not restarted per byte.
            self._start_header_clock()
            self._partial = True
        super().data_received(data)
        if not self._between_requests():
            self._stop_header_clock()  # a request started: the app's body timeout takes over

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._between_requests():
            return
        if self._partial and self.conn.their_state is h11.IDLE:  # mid-way through a request head
            self.transport.write(_raw_response(
                408, "Request Timeout", "request_timeout",
                f"request headers not received within {self.limits.header_timeout_s:g}s"))
        logger.info("closing %s: no complete request within %.1fs",
                    "%s:%s" % self.client if self.client else "a connection", self.limits.header_timeout_s)
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass  # h11 was mid-message; the transport closes regardless
        self.transport.close()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._stop_header_clock()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)


def uvicorn_config(app: ASGIApp, *, host: str, port: int, limits: ConnectionLimits,
                   graceful_shutdown_s: Optional[float] = 5.0, loop: str = "auto") -> uvicorn.Config:
    """The uvicorn Config every sloserve HTTP server runs with (single instance and front)."""
    limits.validate()
    return uvicorn.Config(
        app, host=host, port=port, lifespan="off", access_log=False, log_config=None,
        # "auto" is uvloop where installed (a dependency on Linux and macOS): with asyncio's selector loop each
        # streamed token cost the engine thread ~0.45 ms more between steps (docs/journal/benchmarks.md, "The
        # server's step gap").
        loop=loop,
        http=functools.partial(LimitedH11Protocol, limits=limits),  # type: ignore[arg-type]
        ws="none",  # no websocket routes: do not accept upgrades
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # a float works (loop.call_later)
        h11_max_incomplete_event_size=limits.max_header_bytes,
        timeout_graceful_shutdown=graceful_shutdown_s,  # type: ignore[arg-type]
    )


class DrainingServer(uvicorn.Server):
    """uvicorn with sloserve's shutdown, for one instance and for a front alike.

    uvicorn's own SIGTERM handling closes the listener at once and then waits for open
    connections. A serving system wants a drain instead: keep answering (503 for new work, so
    clients and load balancers retry elsewhere), let in-flight requests finish within a grace
    period, end the rest, then exit with status 0. `drain(grace_s)` does that for the server it
    wraps; a second signal calls `stop_now()` and exits without waiting."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[float], Awaitable[Any]],
                 stop_now: Callable[[], None], grace_s: float) -> None:
        super().__init__(config)
        self._drain_fn = drain
        self._stop_now = stop_now
        self._grace_s = grace_s
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._drain: Optional[asyncio.Future] = None
        self._signalled = False

    async def serve(self, sockets=None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it at exit and the
        # process would die by the signal instead of exiting 0 after a clean drain.
        if self._signalled or self._loop is None or not self.started:
            logger.warning("signal %s again: exiting without waiting", signal.Signals(sig).name)
            self._stop_now()
            self.should_exit = True
            self.force_exit = self._signalled
            self._signalled = True
            return
        self._signalled = True
        logger.info("%s: draining (grace period %.1fs)", signal.Signals(sig).name, self._grace_s)
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain_fn(self._grace_s)
        except Exception:
            logger.exception("drain failed; exiting anyway")
        finally:
            self.should_exit = True
