"""A stand-in engine worker for front tests: the worker's HTTP surface (state, tokenize,
completions streamed or not) without a model, as a real process that a test can SIGKILL.

Run: python tests/multi_helpers.py --port P [--tokens N] [--delay S]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Request  # module level: FastAPI resolves the handlers' annotations here
from fastapi.responses import JSONResponse, StreamingResponse

ROOT = Path(__file__).resolve().parents[1]


def build_fake_worker(tokens: int, delay: float):
    app = FastAPI()
    active = {"running": 0, "served": 0}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/internal/state")
    async def state():
        n = active["running"]
        return {"state": {"num_running": n, "num_waiting": 0, "queued_prefill_tokens": 0, "kv_blocks_used": n,
                          "kv_blocks_free": 100 - n, "kv_blocks_total": 100,
                          "predicted_remaining_decode_tokens": 10 * n, "prefix_cache_hit_rate": 0.0,
                          "min_ttft_slack_s": None, "block_size": 16, "kv_blocks_waiting": 0},
                "prefix_keys": [], "num_cached_blocks": 0, "pid": os.getpid()}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        text = body.get("prompt") or " ".join(m.get("content", "") for m in body.get("messages") or [])
        ids = list(range(1, len(text.split()) + 1)) or [1]
        return {"tokens": ids, "count": len(ids), "max_model_len": 4096}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        n = int(body.get("max_tokens") or tokens)
        active["running"] += 1
        if not body.get("stream"):
            try:
                await asyncio.sleep(delay * n)
            finally:
                active["running"] -= 1
            return JSONResponse({"id": "x", "object": "text_completion", "pid": os.getpid(),
                                 "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})

        async def events():
            try:
                for i in range(n):
                    await asyncio.sleep(delay)
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}], 'pid': os.getpid()})}\n\n"
                usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"
            finally:
                active["running"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class FakeWorker:
    """A WorkerHandle (duck-typed) over a fake worker process."""

    kind = "fake"

    def __init__(self, tokens: int = 20, delay: float = 0.05, startup_delay: float = 0.0):
        from sloserve.server.instances import free_port

        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), "--port", str(self.port), "--tokens",
                                      str(tokens), "--delay", str(delay), "--startup-delay", str(startup_delay)],
                                     cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

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
    a = p.parse_args()
    if a.startup_delay > 0 and not math.isnan(a.startup_delay):
        time.sleep(a.startup_delay)
    uvicorn.run(build_fake_worker(a.tokens, a.delay), host="127.0.0.1", port=a.port, log_level="warning",
                lifespan="off")
