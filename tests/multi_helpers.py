"""A stand-in engine worker for front tests: the worker's HTTP surface (state, tokenize,
completions and chat, streamed or not) without a model, as a real process that a test can
SIGKILL or SIGSTOP. Like the real worker it answers `/internal/*` only with the fleet secret
(from the environment), refuses work beyond `--capacity` with 429 + Retry-After, and stops
generating (counting `aborted`) when the front closes a request's connection.
`--die-on-chat` makes it send a chat stream's role chunk and then die before the first token;
`--crash` makes it exit at once (a crash-looping worker).

Run: python tests/multi_helpers.py --port P [--tokens N] [--delay S] [--capacity C]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import signal

from fastapi import FastAPI, Request  # module level: FastAPI resolves the handlers' annotations here
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sloserve.sched.state import InstanceState
from sloserve.workers.contract import RELAY_COMMENT, WorkerState
from sloserve.workers.handles import WorkerHandle

ROOT = Path(__file__).resolve().parents[1]
FAKE_SECRET = "fake-fleet-secret"  # what test fronts (build_worker_fleet(fleet_secret=...)) and fake workers share


RETRY_AFTER = "7"  # what a full fake worker tells its clients
MAX_MODEL_LEN = 4096  # a fake worker's context window, in its tokens (words)


def build_fake_worker(tokens: int, delay: float, capacity: int = 1000, die_on_chat: bool = False,
                      secret: Optional[str] = None):
    app = FastAPI()
    active = {"running": 0, "served": 0, "aborted": 0}

    def full(request: Request) -> Optional[Response]:
        if active["running"] < capacity:
            return None
        return JSONResponse({"error": {"message": "full", "type": "rate_limit_error", "param": None,
                                       "code": "queue_full"}}, status_code=429,
                            headers={"Retry-After": RETRY_AFTER, "X-Request-Id": rid(request)})

    def rid(request: Request) -> str:
        return request.headers.get("x-request-id") or f"fake-{os.getpid()}-{active['served']}"

    def note(request: Request, i: int) -> str:
        """The relay annotation a real worker adds for its front: this event's token and the text
        sent so far, but no engine id, so a fake stream cannot be resumed elsewhere."""
        if secret is None or request.headers.get("x-sloserve-fleet-secret") != secret:
            return ""
        return RELAY_COMMENT + json.dumps({"t": [i + 1], "c": i + 1}) + "\n"

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/internal/state")
    async def state(request: Request):
        if secret is None or request.headers.get("x-sloserve-fleet-secret") != secret:
            return JSONResponse({"error": {"message": "no", "type": "authentication_error", "param": None,
                                           "code": "invalid_fleet_secret"}}, status_code=401)
        n = active["running"]
        state = InstanceState(num_running=n, num_waiting=0, queued_prefill_tokens=0, kv_blocks_used=n,
                              kv_blocks_free=100 - n, kv_blocks_total=100, predicted_remaining_decode_tokens=10 * n,
                              prefix_cache_hit_rate=0.0, min_ttft_slack_s=float("inf"))
        return {**WorkerState(state).to_json(), "aborted": active["aborted"], "pid": os.getpid()}

    def words(body: dict) -> list[int]:
        if isinstance(body.get("prompt"), list):  # token ids, as the real worker takes them
            return list(body["prompt"])
        text = body.get("prompt") or " ".join(m.get("content", "") for m in body.get("messages") or [])
        return list(range(1, len(text.split()) + 1)) or [1]

    @app.post("/tokenize")
    async def tokenize(request: Request):
        ids = words(await request.json())
        return {"tokens": ids, "count": len(ids), "max_model_len": MAX_MODEL_LEN}

    @app.post("/internal/tokenize")
    async def internal_tokenize(request: Request):
        if secret is None or request.headers.get("x-sloserve-fleet-secret") != secret:
            return JSONResponse({"error": {"message": "no", "type": "authentication_error", "param": None,
                                           "code": "invalid_fleet_secret"}}, status_code=401)
        body = await request.json()
        ids = words(body)
        if len(ids) >= MAX_MODEL_LEN:
            param = "messages" if "messages" in body else "prompt"
            return JSONResponse({"error": {"message": f"prompt has {len(ids)} tokens; the context window is "
                                           f"{MAX_MODEL_LEN}", "type": "invalid_request_error", "param": param,
                                           "code": "context_length_exceeded"}}, status_code=400)
        return {"tokens": ids, "count": len(ids)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        n = int(body.get("max_tokens") or tokens)
        refused = full(request)
        if refused is not None:
            return refused
        active["running"] += 1
        active["served"] += 1

        async def events():
            try:
                head = {"id": rid(request), "object": "chat.completion.chunk", "created": 1, "model": "fake"}
                role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}], "pid": os.getpid()}
                yield f"data: {json.dumps(role)}\n\n"
                if die_on_chat:  # queued here: the role is out, no token yet, and the worker dies
                    await asyncio.sleep(0.3)
                    os.kill(os.getpid(), signal.SIGKILL)
                for i in range(n):
                    await asyncio.sleep(delay)
                    tok = {**head, "choices": [{"index": 0, "delta": {"content": "y"},
                                        "finish_reason": "length" if i == n - 1 else None}], "pid": os.getpid()}
                    yield note(request, i) + f"data: {json.dumps(tok)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                active["running"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream", headers={"X-Request-Id": rid(request)})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        n = int(body.get("max_tokens") or tokens)
        refused = full(request)
        if refused is not None:
            return refused
        active["running"] += 1
        active["served"] += 1
        if not body.get("stream"):
            try:
                work = asyncio.ensure_future(asyncio.sleep(delay * n))
                while not work.done():  # as the real worker: a client that leaves aborts the request
                    if await request.is_disconnected():
                        work.cancel()
                        active["aborted"] += 1
                        return Response(status_code=499)
                    await asyncio.wait([work], timeout=0.05)
            finally:
                active["running"] -= 1
            return JSONResponse({"id": "x", "object": "text_completion", "pid": os.getpid(),
                                 "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}},
                                headers={"X-Request-Id": rid(request)})

        async def events():
            try:
                head = {"id": rid(request), "object": "text_completion", "created": 1, "model": "fake"}
                for i in range(n):
                    await asyncio.sleep(delay)
                    choice = {"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}
                    yield note(request, i) + f"data: {json.dumps({**head, 'choices': [choice], 'pid': os.getpid()})}\n\n"
                usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"
            except (asyncio.CancelledError, GeneratorExit):  # the reader left: as the real worker, abort
                active["aborted"] += 1
                raise
            finally:
                active["running"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream", headers={"X-Request-Id": rid(request)})

    return app


_HANDED_OUT: set[int] = set()  # ports given to fake workers in this test session


class FakeWorker(WorkerHandle):
    """A WorkerHandle (duck-typed) over a fake worker process."""

    kind = "fake"

    def __init__(self, tokens: int = 20, delay: float = 0.05, startup_delay: float = 0.0, *, capacity: int = 1000,
                 die_on_chat: bool = False, crash: bool = False, secret: Optional[str] = FAKE_SECRET):
        from sloserve.workers.contract import FLEET_SECRET_ENV
        from sloserve.workers.handles import free_port

        self.port = free_port()
        while self.port in _HANDED_OUT:  # bind(0) may give a port twice before either worker binds it
            self.port = free_port()
        _HANDED_OUT.add(self.port)
        cmd = [sys.executable, str(Path(__file__)), "--port", str(self.port), "--tokens", str(tokens), "--delay",
               str(delay), "--startup-delay", str(startup_delay), "--capacity", str(capacity)]
        cmd += ["--die-on-chat"] * die_on_chat + ["--crash"] * crash
        env = {k: v for k, v in os.environ.items() if k != FLEET_SECRET_ENV}
        if secret:
            env[FLEET_SECRET_ENV] = secret
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @property
    def url(self) -> Optional[str]:
        return f"http://127.0.0.1:{self.port}"

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def describe(self) -> dict:
        return {"kind": self.kind, "url": self.url, "pid": self.proc.pid}


@contextlib.asynccontextmanager
async def serving_front(workers, config, keys=(), run_loops: bool = False, registry=None):
    """A front on 127.0.0.1 over `config.fleet.instances` stand-in workers (`workers(slot) -> FakeWorker`), ready:
    (fleet, front, port). `run_loops` also runs the front's controller loops (migration,
    autoscaling, the dashboard's sampler). Everything is stopped on the way out."""
    import uvicorn

    from sloserve.front.app import Front
    from sloserve.front.multi import build_worker_fleet
    from sloserve.server.qos import QoSRegistry
    from sloserve.workers.handles import free_port

    fleet = build_worker_fleet(workers, config, fleet_secret=FAKE_SECRET)
    await fleet.start()
    front = Front(fleet, (registry or QoSRegistry()).with_keys(list(keys)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(front.build_app(), host="127.0.0.1", port=port, lifespan="off",
                                           log_config=None, access_log=False))
    task = asyncio.create_task(server.serve())
    try:
        await fleet.wait_ready(60, count=config.initial_instances)  # the slots started at first
        if run_loops:
            await front.start()
        while not server.started:
            await asyncio.sleep(0.02)
        yield fleet, front, port
    finally:
        server.should_exit = True
        await task
        if run_loops:
            await front.close()
        await fleet.close()


def sse_events(raw: bytes) -> list:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


if __name__ == "__main__":
    import time

    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--delay", type=float, default=0.05)
    p.add_argument("--startup-delay", type=float, default=0.0)
    p.add_argument("--capacity", type=int, default=1000)
    p.add_argument("--die-on-chat", action="store_true")
    p.add_argument("--crash", action="store_true")
    a = p.parse_args()
    if a.crash:
        raise SystemExit(1)
    if a.startup_delay > 0 and not math.isnan(a.startup_delay):
        time.sleep(a.startup_delay)
    app = build_fake_worker(a.tokens, a.delay, a.capacity, a.die_on_chat, os.environ.get("SLOSERVE_FLEET_SECRET"))
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning", lifespan="off")
