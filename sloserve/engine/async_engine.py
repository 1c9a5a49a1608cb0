"""The engine for servers: one background thread steps the engine; asyncio callers add
requests, iterate their outputs as they are produced, and abort them.

All engine state is touched by the loop thread only. Callers talk to it through an inbox
(adds and aborts) and receive outputs through a per-request stream, so the HTTP event loop
never blocks on a model step and the engine thread never blocks on a slow reader: outputs
the reader has not taken yet are merged into one (their deltas appended).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from typing import Any, AsyncIterator, Callable, Optional, Union

from sloserve.engine.llm_engine import LLMEngine, Prompt
from sloserve.engine.migration import ResumeState
from sloserve.engine.outputs import OutputAccumulator, RequestOutput
from sloserve.core.types import Request, SamplingParams

logger = logging.getLogger(__name__)

# Seconds a stop without a budget of its own (e.g. a worker's) gives the KV shutdown flush: the
# server's default --grace-period.
FLUSH_BUDGET_S = 30.0


class EngineDeadError(RuntimeError):
    """The engine loop failed while this request was in flight."""


class RequestFailedError(EngineDeadError):
    """The engine failed this request alone (its batch neighbours went on)."""


class RequestMigratedError(Exception):
    """The request moved to another instance, which continues its output: this stream ends here."""


class RequestStream:
    """Async iterator over one request's outputs. Leaving it early aborts the request.

    Each item is everything new since the previous item: when the reader falls behind, the
    outputs it has not taken are merged, so what a stream holds is bounded by the request's
    output, never by the number of engine steps.
    """

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._lock = threading.Lock()  # the engine thread puts, the event loop takes
        self._pending = OutputAccumulator()
        self._error: Optional[BaseException] = None
        self._wake_scheduled = False
        self._ready = asyncio.Event()
        self.finished = False

    def _put(self, item: "RequestOutput | BaseException") -> None:  # called from the engine thread
        with self._lock:
            if isinstance(item, BaseException):
                self._error = item
            else:
                self._pending.add(item)
            if self._wake_scheduled:
                return  # the reader has a wake-up coming; it will take this too
            self._wake_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the caller's event loop is gone: nobody is listening
            self._engine.abort(self.request_id)

    def _wake(self) -> None:  # on the event loop
        with self._lock:
            self._wake_scheduled = False
        self._ready.set()

    def _take(self) -> "RequestOutput | BaseException | None":
        with self._lock:
            out = self._pending.take()
            return out if out is not None else self._error

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while True:
            self._ready.clear()
            item = self._take()
            if item is not None:
                break
            try:
                await self._ready.wait()
            except BaseException:  # cancelled: the client went away
                self.abort()
                raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLMEngine:
    def __init__(self, engine: Union[LLMEngine, Callable[[], LLMEngine]]):
        """`engine`, or a function that builds it: then it is built on the engine thread itself,
        which servers want. OpenMP keeps one thread pool per thread that opens parallel regions,
        and a second pool (the loading thread's, idle) beside the stepping thread's made every
        parallel region slower: a 6.5 ms decode step took 11.5 ms when the model was loaded on
        one thread and stepped on another (two cores, measured). Loading and stepping on one
        thread leaves one pool."""
        self._cond = threading.Condition()
        self._adds: deque[tuple[Request, RequestStream, Optional[ResumeState]]] = deque()
        self._aborts: deque[str] = deque()
        self._calls: deque[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future]] = deque()
        self._streams: dict[str, RequestStream] = {}
        self._stopped = False
        built: concurrent.futures.Future = concurrent.futures.Future()
        if isinstance(engine, LLMEngine):
            built.set_result(engine)
        self._thread = threading.Thread(target=self._run, args=(engine, built), name="sloserve-engine", daemon=True)
        self._thread.start()
        self.engine: LLMEngine = built.result()  # raises what building raised

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def add_request(
        self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
        resume: Optional[ResumeState] = None, **kwargs
    ) -> RequestStream:
        """Validate now (ValueError on bad input, before any work) and queue the request;
        with `resume`, it continues a request begun on another instance."""
        if self._stopped:
            raise EngineDeadError("engine is shut down")
        request = self.engine.make_request(prompt, params, request_id=request_id, **kwargs)
        stream = RequestStream(self, request.request_id, asyncio.get_running_loop())
        with self._cond:
            if request.request_id in self._streams:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            self._streams[request.request_id] = stream
            self._adds.append((request, stream, resume))
            self._cond.notify()
        return stream

    def call(self, fn: Callable[[LLMEngine], Any]) -> "asyncio.Future[Any]":
        """Run `fn(engine)` on the engine thread between two steps (the scheduler and the KV
        pool are the loop thread's alone); await the result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopped:
                raise EngineDeadError("engine is shut down")
            self._calls.append((fn, future))
            self._cond.notify()
        return asyncio.wrap_future(future)

    async def drop_migrated(self, request_id: str, pinned: list[int]) -> bool:
        """The request lives on another instance now: free it here and end its stream."""
        def drop(engine: LLMEngine) -> bool:
            dropped = engine.drop_migrated(request_id, pinned)
            self._close(request_id, RequestMigratedError(f"request {request_id} moved to another instance"))
            return dropped

        return await self.call(drop)

    async def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None, **kwargs) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(prompt, params, **kwargs)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    @property
    def is_alive(self) -> bool:
        """False once the loop thread has stopped (shut down, or died): health checks read this."""
        return self._thread.is_alive() and not self._stopped

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 5.0, flush_budget_s: float = FLUSH_BUDGET_S) -> None:
        """Stop the loop; requests still in flight end with EngineDeadError. Then, within
        `flush_budget_s` seconds from now (the loop's stop included), write what only host
        memory and the device cache to the disk tier (LLMEngine.flush_tiers)."""
        clock = self.engine.clock
        deadline = clock() + flush_budget_s
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            try:
                self.engine.close(max(0.0, deadline - clock()))
            except Exception:  # noqa: BLE001 - a failed flush costs cache, never the stop
                logger.exception("closing the engine (the KV shutdown flush) failed")

    # ---- the engine thread -------------------------------------------------------
    def _run(self, factory, built: concurrent.futures.Future) -> None:
        if not built.done():
            try:
                built.set_result(factory())
            except BaseException as e:  # noqa: BLE001 - the constructor re-raises it
                built.set_exception(e)
                return
        self.engine = built.result()
        self._loop()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (not self._stopped and not self._adds and not self._aborts and not self._calls
                       and not self.engine.has_unfinished_requests()):
                    self._cond.wait()
                if self._stopped:
                    break
                adds, self._adds = list(self._adds), deque()
                aborts, self._aborts = list(self._aborts), deque()
                calls, self._calls = list(self._calls), deque()
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except Exception as e:  # noqa: BLE001 - the caller gets it
                        future.set_exception(e)
            for request, stream, resume in adds:
                try:
                    self.engine.add(request, resume)
                except ValueError as e:
                    self._close(request.request_id, e)
            for request_id in aborts:
                out = self.engine.abort_request(request_id)
                if out is not None:
                    self._deliver(out)
            try:
                outputs = self.engine.step()
            except Exception as e:  # keep serving: fail what was in flight, free everything
                logger.exception("engine step failed; aborting %d requests", self.engine.num_unfinished)
                for request_id in list(self._streams):
                    self.engine.abort_request(request_id)
                    self._close(request_id, EngineDeadError(f"engine step failed: {e}"))
                continue
            for out in outputs:
                self._deliver(out)
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
            self._close(request_id, EngineDeadError("engine shut down"))
        with self._cond:
            calls, self._calls = list(self._calls), deque()
        for _, future in calls:
            future.cancel()

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            with self._cond:
                self._streams.pop(out.request_id, None)
        if out.error is not None:  # the engine failed this request alone: its stream raises
            logger.warning("request %s failed in the engine: %s", out.request_id, out.error)
            stream._put(RequestFailedError(f"the engine failed request {out.request_id}: {out.error}"))
            return
        stream._put(out)

    def _close(self, request_id: str, error: BaseException) -> None:
        with self._cond:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._put(error)
