"""Helpers for tests that move streams between real workers: an admin client and a streamed
completion read on a thread that asks the front to migrate it at given token counts."""
from __future__ import annotations

import contextlib
import json
import time
from typing import Callable, Iterator, Optional

import httpx

from server_helpers import ServerProcess, wait_for

ADMIN = "admin-key-for-tests"
FLEET_ARGS = ["--router", "round-robin", "--max-num-seqs", "8", "--kv-cache-gib", "0.1", "--admin-key", ADMIN,
              "--log-level", "warning"]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def admin(method: str, url: str, **kw) -> httpx.Response:
    return httpx.request(method, url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120, **kw)


def instances(base: str) -> dict:
    return admin("GET", base + "/v1/instances").json()


class Stream:
    """One streamed completion read event by event on a thread; `migrate_at` token counts
    trigger a move to the other instance while it streams.

    It asks for logprobs, so each chunk names its tokens: a worker merges the outputs its reader
    has not taken yet into one chunk (a busy machine), so chunks do not count tokens, but the
    tokens the chunks list show any token sent twice or never."""

    def __init__(self, base: str, rid: str, params: dict, migrate_at: tuple[int, ...] = (),
                 prompt: str = PROMPT) -> None:
        self.base, self.rid, self.params, self.migrate_at, self.prompt = base, rid, params, list(migrate_at), prompt
        self.on_chunk: Optional[Callable[["Stream"], None]] = None  # called after each chunk with text
        self.texts: list[str] = []
        self.tokens: list[str] = []  # from each chunk's logprobs
        self.events: list = []
        self.usage: Optional[dict] = None
        self.moves: list[dict] = []

    def run(self) -> "Stream":
        body = {"prompt": self.prompt, "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0,
                **self.params}
        with httpx.stream("POST", self.base + "/v1/completions", json=body, timeout=180,
                          headers={"X-Request-Id": self.rid}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    assert not line.startswith(":"), "relay annotations must never reach the client"
                    continue
                data = line[6:]
                self.events.append(data if data == "[DONE]" else json.loads(data))
                event = self.events[-1]
                if isinstance(event, dict) and event.get("choices"):
                    choice = event["choices"][0]
                    self.texts.append(choice["text"])
                    self.tokens.extend((choice.get("logprobs") or {}).get("tokens") or [])
                    if self.on_chunk is not None:
                        self.on_chunk(self)
                if isinstance(event, dict) and event.get("usage"):
                    self.usage = event["usage"]
                if self.migrate_at and len(self.tokens) >= self.migrate_at[0]:
                    self.migrate_at.pop(0)
                    self.moves.append(self.move())
        return self

    def move(self) -> dict:
        for target in (0, 1):  # the one it is not on
            r = admin("POST", self.base + "/v1/migrations", json={"request_id": self.rid, "target": target})
            if r.status_code == 200:
                return r.json()
            assert r.status_code == 409, r.text
        raise AssertionError("no instance took the move")

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def assert_complete(self, max_tokens: int) -> None:
        errors = [e for e in self.events if isinstance(e, dict) and "error" in e]
        assert not errors, errors
        assert self.events[-1] == "[DONE]" and self.events.count("[DONE]") == 1
        assert sum(1 for e in self.events if isinstance(e, dict) and e.get("usage")) == 1
        assert self.usage["completion_tokens"] == max_tokens
        # every token listed once: none sent twice, none skipped
        assert len(self.tokens) == max_tokens, (len(self.tokens), len(self.texts))


def pools_free(base: str) -> bool:
    data = instances(base)["data"]
    return all(d["load"] and d["load"]["kv_blocks_used"] == 0 and d["in_flight"] == 0 for d in data)


# ---- prefill/decode fleets (test_pd_server.py, test_pd_live.py) ----
def start_fleet(args: list[str], tmp_path_factory, n: int) -> ServerProcess:
    server = ServerProcess([*args, *FLEET_ARGS], tmp_path_factory.mktemp("pd") / "front.log", startup_timeout=300)
    all_healthy(server.base_url, n)
    return server


@contextlib.contextmanager
def running_fleet(args: list[str], tmp_path_factory, n: int) -> Iterator[ServerProcess]:
    """start_fleet for a fixture: the fleet is killed however the tests using it end."""
    server = start_fleet(args, tmp_path_factory, n)
    try:
        yield server
    finally:
        server.kill()


def all_healthy(base: str, n: int) -> None:
    wait_for(lambda: [d["status"] for d in instances(base)["data"]] == ["healthy"] * n, 240, interval=0.5,
             what=f"{n} workers healthy")


def colocated(base: str, prompt: str, params: dict, *, whole: bool = False):
    """The answer computed on one worker, asked directly (the front neither relays, hands off
    nor moves it): its first choice's text, or with `whole` the worker's JSON."""
    url = next(d["url"] for d in instances(base)["data"] if d["status"] == "healthy")
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, **params}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json() if whole else r.json()["choices"][0]["text"]


def stream(base: str, prompt: str, params: dict) -> tuple[str, dict]:
    """A streamed completion: (its text, its usage); checks the stream's shape on the way."""
    body = {"prompt": prompt, "stream": True, "stream_options": {"include_usage": True}, **params}
    texts, usage, done = [], [], 0
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            assert not line.startswith(":"), "relay annotations must never reach the client"
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done += 1
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("choices"):
                texts.append(event["choices"][0]["text"])
            if event.get("usage"):
                usage.append(event["usage"])
    assert done == 1 and len(usage) == 1
    assert usage[0]["completion_tokens"] == params["max_tokens"]
    return "".join(texts), usage[0]


def handoffs(base: str) -> dict:
    return instances(base)["handoffs"]


# ---- a front in this process, on a clock the test moves (test_autoscale_server.py) ----
class ShiftedClock:
    """time.monotonic plus an offset the test moves forward: the fleet's timers (autoscaling
    windows, the scale-down delay) pass when the test says, not by sleeping through them."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@contextlib.contextmanager
def front_in_thread(argv: list[str], clock: Callable[[], float], startup_timeout: float = 300.0) -> Iterator[str]:
    """`sloserve serve ARGV` (one thread a worker, the exact precision, 127.0.0.1) as run_multi
    assembles it, its front on a thread of this process reading `clock`, its workers processes;
    yields its base URL, and stops the front and its workers on the way out."""
    import asyncio
    import threading

    import uvicorn

    from engine_helpers import EXACT
    from server_helpers import free_port
    from sloserve.cli import build_parser
    from sloserve.cli.engine_args import engine_config_from_args
    from sloserve.cli.fleet_args import resolve_fleet_args
    from sloserve.cli.serve import server_settings
    from sloserve.front.multi import _secrets, build_front, check_fleet_spec

    port = free_port()
    exact = [flag for key, value in EXACT.items() for flag in (f"--{key}", value)]
    args = build_parser().parse_args(["serve", "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1",
                                      *exact, *argv])
    resolve_fleet_args(args)
    settings, keys = server_settings(args)
    engine, spec = engine_config_from_args(args), args.fleet_spec
    check_fleet_spec(engine, spec, None, None, args.hang_timeout)
    fleet_secret, salt_secret = _secrets(settings)
    front = build_front(engine, settings, spec, threads_per_worker=1, fleet_secret=fleet_secret,
                        salt_secret=salt_secret, api_keys=keys, admin_keys=settings.admin_keys,
                        hang_timeout_s=args.hang_timeout, cold_start_s=args.cold_start, clock=clock)
    server = uvicorn.Server(uvicorn.Config(front.build_app(), host="127.0.0.1", port=port, lifespan="off",
                                           log_config=None, access_log=False))
    failed: list[BaseException] = []

    async def serve() -> None:
        await front.fleet.start()
        await front.start()
        try:
            await front.fleet.wait_ready(startup_timeout, count=1)
            await server.serve()
        finally:
            await front.close()
            await front.fleet.close()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            failed.append(e)

    thread = threading.Thread(target=run, name="front", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: failed or server.started, startup_timeout, interval=0.2, what="the front serving")
        assert not failed, failed
        yield base
    finally:
        server.should_exit = True
        thread.join(120)
        assert not thread.is_alive(), "the front did not stop"
