"""The load generator: an asyncio streaming client for any OpenAI-compatible server.

It sends each workload request at its scheduled time (open loop; an optional concurrency cap
turns it into a bounded closed loop), streams the response and records, per request, when it
was due, released and sent, the time to the first token chunk, every gap between token chunks,
the end-to-end time, the server's token counts from `usage`, the finish reason, the HTTP status
and any error. It is the measuring instrument, so it reads `time.monotonic` (injectable).

Bounds, so a run can never hang: every request has a total timeout (not only httpx's
per-read one, which a server trickling bytes would defeat); with a duration, no request is
released after it and requests still in flight `drain_timeout_s` later are cut off.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

import httpx

from sloserve.bench.structured import answer_turn, structured_fields
from sloserve.core.records import RequestRecord, error_kind_for_status
from sloserve.workload.types import DEFAULT_CLASS, WorkloadRequest

log = logging.getLogger(__name__)

Endpoint = Literal["completions", "chat"]
Backend = Literal["openai", "llamacpp"]
MAX_ERROR_CHARS = 500


@dataclass
class ClientConfig:
    """How to talk to the server and how long to wait.

    `backend` only adds fields some servers need to honour an exact output length:
    `openai` sends `max_tokens` + `ignore_eos` (sloserve, vLLM, SGLang); `llamacpp` also sends
    `n_predict`. Anything else goes in `extra_body`.
    """

    base_url: str
    model: Optional[str] = None
    endpoint: Endpoint = "completions"
    backend: Backend = "openai"
    api_key: Optional[str] = None
    tenant_keys: Mapping[str, str] = field(default_factory=dict)
    send_qos_class: bool = False
    max_concurrency: Optional[int] = None
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    duration_s: Optional[float] = None
    drain_timeout_s: float = 60.0
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    extra_headers: Mapping[str, str] = field(default_factory=dict)
    structured: Optional[str] = None  # chat only: "json" or "tools" (bench/structured.py)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            raise ValueError("request timeout must be > 0")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, got {self.endpoint!r}")
        if self.backend not in ("openai", "llamacpp"):
            raise ValueError(f"backend must be openai or llamacpp, got {self.backend!r}")
        if self.structured is not None:
            structured_fields(self.structured)  # a bad name fails here
            if self.endpoint != "chat":
                raise ValueError("structured requests need the chat endpoint")

    @property
    def api_root(self) -> str:
        """`http://host:port/v1` whether or not the user wrote the /v1."""
        return self.base_url if self.base_url.endswith("/v1") else self.base_url + "/v1"

    @property
    def url(self) -> str:
        return self.api_root + ("/completions" if self.endpoint == "completions" else "/chat/completions")


@dataclass
class RunResult:
    """The records of one run, in workload order, and what the client itself observed."""

    records: list[RequestRecord]
    duration_s: float
    num_unsent: int = 0  # released but still waiting for a concurrency slot when the duration ended
    model: Optional[str] = None


def request_body(req: WorkloadRequest, cfg: ClientConfig, model: Optional[str]) -> dict[str, Any]:
    """The JSON body for one request (pure: tested without a server)."""
    max_tokens = max(1, req.output_len)
    body: dict[str, Any] = {}
    if model:
        body["model"] = model
    if cfg.endpoint == "completions":
        body["prompt"] = req.prompt_token_ids if req.prompt_token_ids is not None else (req.prompt_text or "")
    else:
        if req.prompt_text is None:
            raise ValueError(f"request {req.request_id}: the chat endpoint needs a text prompt")
        body["messages"] = [{"role": "user", "content": req.prompt_text}]
    body.update(max_tokens=max_tokens, temperature=cfg.temperature, stream=True,
                stream_options={"include_usage": True})
    if cfg.structured is not None and req.structured:
        body.update(structured_fields(cfg.structured))  # ends when the constraint completes: no ignore_eos
    elif cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.backend == "llamacpp":
        body["n_predict"] = max_tokens
    body.update(cfg.extra_body)
    return body


def request_headers(req: WorkloadRequest, cfg: ClientConfig) -> dict[str, str]:
    headers = {"Accept": "text/event-stream", **cfg.extra_headers}
    key = cfg.tenant_keys.get(req.tenant) or cfg.api_key
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if cfg.send_qos_class and req.qos_class and req.qos_class != DEFAULT_CLASS:
        headers["X-QoS-Class"] = req.qos_class
    return headers


def _is_token_chunk(choice: Mapping[str, Any], endpoint: Endpoint) -> bool:
    """Whether a streamed choice reports generated tokens. Its text may be empty (a special
    token, or bytes of a character not complete yet): the token exists, so it counts for TTFT
    and ITL, as in `vllm bench serve`. A chat stream's opening role chunk (role, empty content)
    carries no token: servers may send it before the prefill has run. A tool-call delta carries
    tokens, with or without a content field beside it."""
    if endpoint == "completions":
        return isinstance(choice.get("text"), str)
    delta = choice.get("delta") or {}
    if delta.get("tool_calls"):
        return True
    if "content" not in delta and "reasoning_content" not in delta:
        return False
    return not ("role" in delta and not delta.get("content") and not delta.get("reasoning_content"))


def _assemble(answer: dict, delta: Mapping[str, Any]) -> None:
    """Fold a chat delta into `answer`: content, and calls from their deltas (id and name, then arguments)."""
    answer["content"] = answer.get("content", "") + (delta.get("content") or "")
    calls = answer.setdefault("calls", [])
    for d in delta.get("tool_calls") or []:
        function = d.get("function") or {}
        if d.get("index") == len(calls):
            calls.append({"id": d.get("id"), "type": "function",
                          "function": {"name": function.get("name"), "arguments": function.get("arguments") or ""}})
        elif isinstance(d.get("index"), int) and 0 <= d["index"] < len(calls):
            calls[d["index"]]["function"]["arguments"] += function.get("arguments") or ""


def _error_message(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    try:
        err = json.loads(text).get("error")
        if isinstance(err, Mapping) and err.get("message"):
            text = str(err["message"])
        elif isinstance(err, str):
            text = err
    except (ValueError, AttributeError):
        pass
    return text[:MAX_ERROR_CHARS]


class BenchClient:
    """Runs one workload against one server. Create one per run (it holds the run's clock)."""

    def __init__(self, cfg: ClientConfig, clock: Callable[[], float] = time.monotonic,
                 on_record: Optional[Callable[[RequestRecord], None]] = None,
                 transport: Optional[httpx.AsyncBaseTransport] = None) -> None:
        self.cfg = cfg
        self.clock = clock
        self.on_record = on_record
        self.transport = transport
        self._t0 = 0.0

    def _now(self) -> float:
        return self.clock() - self._t0

    async def resolve_model(self, http: httpx.AsyncClient) -> Optional[str]:
        """The configured model, else the first one the server lists (None if it lists none)."""
        if self.cfg.model:
            return self.cfg.model
        try:
            resp = await http.get(self.cfg.api_root + "/models", headers=request_headers(
                WorkloadRequest(0.0, 0, 0), self.cfg), timeout=self.cfg.connect_timeout_s)
            resp.raise_for_status()
            data = resp.json().get("data") or []
            return data[0]["id"] if data else None
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            log.warning("could not list models at %s (%s); sending no model name", self.cfg.api_root, exc)
            return None

    async def run(self, requests: Sequence[WorkloadRequest]) -> RunResult:
        """Send `requests` on their schedule (arrival_s from now) and wait for all of them."""
        cfg = self.cfg
        limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s, pool=None)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False,
                                     transport=self.transport) as http:
            model = await self.resolve_model(http)
            sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
            self._t0 = self.clock()
            stop_at = math.inf if cfg.duration_s is None else cfg.duration_s
            hard_stop = stop_at + cfg.drain_timeout_s
            tasks: list[asyncio.Task] = []
            for i, req in enumerate(requests):
                if req.arrival_s >= stop_at:
                    break
                await self._sleep_until(req.arrival_s)
                if self._now() >= stop_at:
                    break
                dispatch = self._now()
                tasks.append(asyncio.create_task(self._one(http, sem, model, i, req, dispatch, stop_at, hard_stop)))
            results = await asyncio.gather(*tasks)
            duration = self._now()
        records = [r for rs in results if rs is not None for r in rs]
        return RunResult(records, duration, num_unsent=sum(rs is None for rs in results), model=model)

    async def _sleep_until(self, t: float) -> None:
        """Sleep until run time t; never returns early (asyncio may wake a hair before)."""
        while True:
            delay = t - self._now()
            if delay <= 0:
                return
            await asyncio.sleep(delay)

    async def _one(self, http: httpx.AsyncClient, sem: Optional[asyncio.Semaphore], model: Optional[str], index: int,
                   req: WorkloadRequest, dispatch_s: float, stop_at: float,
                   hard_stop: float) -> Optional[list[RequestRecord]]:
        if sem is None:
            return await self._session(http, model, index, req, dispatch_s, hard_stop)
        async with sem:
            if self._now() >= stop_at:
                return None  # the run is over; this one was never sent
            return await self._session(http, model, index, req, dispatch_s, hard_stop)

    async def _session(self, http: httpx.AsyncClient, model: Optional[str], index: int, req: WorkloadRequest,
                       dispatch_s: float, hard_stop: float) -> list[RequestRecord]:
        """The calls one workload request makes: one, or an agent's two (bench/structured.py), the
        second sent as soon as the first is answered."""
        def first_body() -> dict:
            return request_body(req, self.cfg, model)

        if self.cfg.structured != "agent" or not req.structured:
            return [await self._send(http, index, req, first_body, dispatch_s, hard_stop)]
        answer: dict = {}
        first = await self._send(http, index, req, first_body, dispatch_s, hard_stop, answer)
        if not first.success or first.finish_reason != "tool_calls" or not answer.get("calls"):
            return [first]  # a call cut by max_tokens has no complete arguments to answer
        second = await self._send(http, index, replace(req, request_id=f"{req.request_id}/answer"),
                                  lambda: answer_turn(first_body(), answer["content"], answer["calls"]), self._now(),
                                  hard_stop)
        return [first, second]

    async def _send(self, http: httpx.AsyncClient, index: int, req: WorkloadRequest, make_body: Callable[[], dict],
                    dispatch_s: float, hard_stop: float, answer: Optional[dict] = None) -> RequestRecord:
        cfg = self.cfg
        rec = RequestRecord(index=index, request_id=req.request_id, tenant=req.tenant, qos_class=req.qos_class,
                            scheduled_s=req.arrival_s, dispatch_s=dispatch_s, prompt_len=req.prompt_len,
                            output_len=max(1, req.output_len))
        rec.send_s = self._now()
        budget = min(cfg.request_timeout_s, hard_stop - rec.send_s)
        try:
            body = make_body()
            await asyncio.wait_for(self._stream(http, body, request_headers(req, cfg), rec, answer),
                                   timeout=max(budget, 0))
        except asyncio.TimeoutError:
            cut_by_run = budget < cfg.request_timeout_s
            rec.error_kind = "cancelled" if cut_by_run else "timeout"
            rec.error = (f"still running when the run ended ({cfg.drain_timeout_s:g}s after its duration)"
                         if cut_by_run else f"no complete response within {cfg.request_timeout_s:g}s")
        except httpx.TimeoutException as exc:
            rec.error_kind, rec.error = "timeout", f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        except (httpx.TransportError, httpx.StreamError) as exc:
            rec.error_kind, rec.error = "connection", f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        except ValueError as exc:
            rec.error_kind, rec.error = "other", str(exc)[:MAX_ERROR_CHARS]
        if rec.error_kind is not None:
            rec.e2e_s = None
        if self.on_record is not None:
            self.on_record(rec)
        return rec

    async def _stream(self, http: httpx.AsyncClient, body: dict, headers: dict, rec: RequestRecord,
                      answer: Optional[dict] = None) -> None:
        """POST, then read server-sent events until [DONE] or the end of the body; with `answer`,
        the chat answer's content and tool calls are assembled into it from the deltas."""
        endpoint = self.cfg.endpoint
        async with http.stream("POST", self.cfg.url, json=body, headers=headers) as resp:
            rec.http_status = resp.status_code
            if resp.status_code != 200:
                rec.error_kind = error_kind_for_status(resp.status_code)
                rec.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                return
            last_choice_at: Optional[float] = None
            last_token_at: Optional[float] = None
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = self._now()
                try:
                    event = json.loads(data)
                except ValueError:
                    rec.error_kind, rec.error = "stream_error", f"bad event: {data[:200]}"
                    return
                if event.get("error"):
                    rec.error_kind = "stream_error"
                    rec.error = _error_message(json.dumps(event).encode())
                    return
                if not rec.request_id and event.get("id"):
                    rec.request_id = str(event["id"])
                choices = event.get("choices") or []
                if choices:
                    choice = choices[0]
                    last_choice_at = now
                    if answer is not None:
                        _assemble(answer, choice.get("delta") or {})
                    if _is_token_chunk(choice, endpoint):
                        if rec.ttft_s is None:
                            rec.ttft_s = now - rec.send_s
                        else:
                            rec.itl_s.append(now - last_token_at)  # type: ignore[operator]
                        last_token_at = now
                        rec.num_chunks += 1
                    if choice.get("finish_reason"):
                        rec.finish_reason = str(choice["finish_reason"])
                usage = event.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
                    rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
            end = self._now()
            if not done and rec.finish_reason is None:
                rec.error_kind, rec.error = "incomplete", "stream ended without a finish reason or [DONE]"
                return
            if rec.output_tokens is None:
                rec.output_tokens = rec.num_chunks
            rec.e2e_s = (last_choice_at if last_choice_at is not None else end) - rec.send_s
