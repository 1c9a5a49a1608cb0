#!/usr/bin/env python3
"""Chaos run against a real `sloserve serve --instances 2`: does any request get lost silently?

A front with two engine workers (embedded model, `--num-threads 2`, one thread each) on a free
127.0.0.1 port, a QoS class with a TTFT target, and a bounded steady load of streamed
completions throughout. Phases, in order:

  baseline    steady load only
  kill        SIGKILL a worker (3 times, each after the fleet is whole again)
  stop        SIGSTOP a worker for 30 s, then SIGCONT (the front must route around it while it is
              frozen, then take it back or replace it)
  overload    open-loop arrivals at 3x the throughput measured in the baseline
  disconnect  thousands of clients that leave at every stage: before the request line, inside the
              headers, before / in the middle of the body, right after the request, after the status
              line, after the first SSE chunk, mid-stream, while a non-streamed answer is generated;
              plus malformed requests (their answers must be 4xx, never 5xx)
  slow        slow readers: streams with fat chunks read a few hundred bytes at a time, with pauses

Every request the load sends ends in one of: completed (a 200 whose stream has [DONE] and a
finish reason), an explicit error (an HTTP error status or an SSE error event, by code), or lost
silently (no response, a connection reset, a stream that stops without [DONE] or error, a
client-side timeout). Target: 0 lost, 0 5xx from client input, KV blocks back to 0 on every
worker once the load stops, the same greedy text at the end as at the start.

Output: a table per phase, benchmarks/results/chaos/chaos-STAMP.json (summary, events, every
request) and benchmarks/figures/chaos.png (outcomes over time with the phases, TTFT against the
target, RSS of front and workers).

    python benchmarks/chaos.py            # ~5-6 minutes
    python benchmarks/chaos.py --quick    # ~2 minutes
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import struct
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import httpx
import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sloserve.bench.local_server import LocalServer

REPO = Path(__file__).resolve().parents[1]
TTFT_TARGET_S = 2.0
TBT_TARGET_S = 1.0
QOS_CONFIG = {"default_class": "standard",
              "classes": {"standard": {"ttft_s": TTFT_TARGET_S, "tbt_s": TBT_TARGET_S, "priority": 1}}}
GREEDY = {"prompt": "The three primary colors are", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
COMPLETED, LOST = "completed", "lost"


# ---------------------------------------------------------------------------- settings


@dataclass
class Plan:
    """Durations and sizes of the phases; `quick()` shrinks them to about two minutes."""

    baseline_s: float = 30.0
    kills: int = 3
    kill_gap_s: float = 15.0  # load after the fleet is whole again, before the next kill
    stop_s: float = 30.0
    overload_s: float = 60.0
    overload_factor: float = 3.0
    disconnect_clients: int = 4000
    disconnect_concurrency: int = 16  # low enough that most streams are admitted before they are dropped
    bad_requests: int = 300
    slow_readers: int = 8
    slow_pause_s: float = 1.5
    slow_budget_s: float = 60.0
    concurrency: int = 4  # steady streams in flight
    max_tokens: int = 24
    request_timeout_s: float = 120.0
    recover_timeout_s: float = 240.0

    @classmethod
    def quick(cls) -> "Plan":
        return cls(baseline_s=10.0, kills=2, kill_gap_s=3.0, stop_s=15.0, overload_s=15.0, disconnect_clients=900,
                   bad_requests=60, slow_readers=3, slow_budget_s=15.0, recover_timeout_s=180.0)


# ---------------------------------------------------------------------------- records


@dataclass
class Outcome:
    """One request the load generator sent, and how it ended."""

    phase: str
    kind: str  # steady, overload, slow, bad
    sent_at: float
    ended_at: float = 0.0
    status: Optional[int] = None
    outcome: str = LOST  # completed, error:<code>, lost
    detail: str = ""
    ttft_s: Optional[float] = None
    tokens: int = 0

    @property
    def meets_slo(self) -> bool:
        return self.outcome == COMPLETED and self.ttft_s is not None and self.ttft_s <= TTFT_TARGET_S


@dataclass
class Event:
    t: float
    what: str


@dataclass
class Recorder:
    """Everything observed, on one clock (seconds since the run started)."""

    t0: float = field(default_factory=time.monotonic)
    phase: str = "startup"
    outcomes: list[Outcome] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    phases: list[tuple[str, float, float]] = field(default_factory=list)
    disconnects: Counter = field(default_factory=Counter)  # stage -> clients
    disconnect_statuses: Counter = field(default_factory=Counter)  # status seen by clients that read one
    rss: list[tuple[float, float, float]] = field(default_factory=list)  # t, front MiB, max worker MiB
    on_outcome: Optional[Callable[[Outcome], None]] = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def event(self, what: str, console: Optional[Console] = None) -> None:
        self.events.append(Event(round(self.now(), 2), what))
        if console is not None:
            console.log(what)

    def add(self, o: Outcome) -> None:
        self.outcomes.append(o)
        if self.on_outcome is not None:
            self.on_outcome(o)

    @contextlib.contextmanager
    def in_phase(self, name: str):
        self.phase, start = name, self.now()
        try:
            yield
        finally:
            self.phases.append((name, start, self.now()))


# ---------------------------------------------------------------------------- the fleet


class FleetProbe:
    """The front's view of its workers (`GET /v1/instances`) and signals to their processes."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    async def instances(self, http: httpx.AsyncClient) -> list[dict]:
        r = await http.get(self.base_url + "/v1/instances", timeout=10)
        r.raise_for_status()
        return r.json()["data"]

    async def wait_whole(self, http: httpx.AsyncClient, timeout: float) -> bool:
        """Every slot healthy (a replaced worker has rejoined)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                if all(d["status"] == "healthy" for d in await self.instances(http)):
                    return True
            await asyncio.sleep(0.5)
        return False

    async def wait_slot(self, http: httpx.AsyncClient, slot: int, old_pid: int, timeout: float,
                        replaced: bool = True) -> Optional[dict]:
        """The slot healthy again: with a new pid (`replaced`), or with any pid once the front has
        noticed (a resumed process keeps its pid). None on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError, StopIteration):
                d = next(d for d in await self.instances(http) if d["instance"] == slot)
                if d["status"] == "healthy" and (d["pid"] != old_pid or not replaced):
                    return d
            await asyncio.sleep(0.5)
        return None

    async def victim(self, http: httpx.AsyncClient, turn: int) -> dict:
        """A healthy worker, alternating slots, preferring one with requests in flight."""
        healthy = [d for d in await self.instances(http) if d["status"] == "healthy" and d.get("pid")]
        healthy.sort(key=lambda d: (d["instance"] != turn % 2, -d.get("in_flight", 0)))
        return healthy[0]

    async def idle(self, http: httpx.AsyncClient) -> dict:
        """Per instance: requests in flight at the front, KV blocks used (front's last poll), and the
        worker's own /metrics kv_cache_usage_perc (open on workers)."""
        out = {}
        for d in await self.instances(http):
            load = d.get("load") or {}
            entry = {"status": d["status"], "in_flight": d.get("in_flight"), "kv_blocks_used": load.get("kv_blocks_used"),
                     "kv_usage_metric": None}
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if d.get("url"):
                    text = (await http.get(d["url"] + "/metrics", timeout=5)).text
                    entry["kv_usage_metric"] = next((float(line.split()[-1]) for line in text.splitlines()
                                                     if line.startswith("sloserve:kv_cache_usage_perc")), None)
            out[f"instance {d['instance']} (gen {d['generation']})"] = entry
        return out


def leaks(state: dict) -> int:
    """Instances still holding requests or KV blocks."""
    return sum(1 for e in state.values() if e["in_flight"] or e["kv_blocks_used"] or (e["kv_usage_metric"] or 0) > 0)


class RssSampler(threading.Thread):
    """Peak resident memory of the front and of its workers (children), sampled every 0.5 s."""

    def __init__(self, pid: int, rec: Recorder) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.front = psutil.Process(pid)
        self.rec = rec
        self.stop_event = threading.Event()
        self.peak_front = 0.0
        self.peak_worker = 0.0

    def run(self) -> None:
        while not self.stop_event.wait(0.5):
            with contextlib.suppress(psutil.Error):
                front = self.front.memory_info().rss / 2**20
                workers = []
                for child in self.front.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        workers.append(child.memory_info().rss / 2**20)
                worst = max(workers, default=0.0)
                self.peak_front, self.peak_worker = max(self.peak_front, front), max(self.peak_worker, worst)
                self.rec.rss.append((round(self.rec.now(), 2), round(front, 1), round(worst, 1)))


# ---------------------------------------------------------------------------- the load


def prompt(rng: random.Random, words: int = 24) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def stream_one(http: httpx.AsyncClient, url: str, body: dict, o: Outcome, rec: Recorder,
                     read_pause_s: float = 0.0, timeout_s: float = 120.0) -> Outcome:
    """POST a streamed completion and classify how it ended (see the module docstring)."""
    start = time.monotonic()

    async def consume() -> None:
        async with http.stream("POST", url, json=body) as r:
            o.status = r.status_code
            if r.status_code != 200:
                raw = await r.aread()
                o.outcome, o.detail = f"error:{error_code(raw, r.status_code)}", raw[:200].decode(errors="replace")
                return
            done = finished = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if read_pause_s and o.ttft_s is not None:  # a slow reader: pause between events
                    await asyncio.sleep(read_pause_s)
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    err = event["error"] or {}
                    o.outcome, o.detail = f"error:{err.get('code') or 'stream_error'}", str(err.get("message"))[:200]
                    return
                for choice in event.get("choices") or []:
                    if o.ttft_s is None:
                        o.ttft_s = time.monotonic() - start
                    o.tokens += 1
                    finished = finished or bool(choice.get("finish_reason"))
            if done and finished:
                o.outcome = COMPLETED
            else:
                o.outcome, o.detail = LOST, f"stream ended: [DONE]={done} finish_reason={finished}"

    try:
        await asyncio.wait_for(consume(), timeout_s)
    except asyncio.TimeoutError:
        o.outcome, o.detail = LOST, f"no complete answer within {timeout_s:g}s"
    except (httpx.HTTPError, ValueError) as exc:
        o.outcome, o.detail = LOST, f"{type(exc).__name__}: {exc}"[:200]
    finally:
        o.ended_at = rec.now()
        rec.add(o)
    return o


def error_code(raw: bytes, status: int) -> str:
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return json.loads(raw)["error"]["code"] or str(status)
    return str(status)


class SteadyLoad:
    """`concurrency` streams in flight at all times, until stopped (bounded by count and time)."""

    def __init__(self, http: httpx.AsyncClient, url: str, rec: Recorder, plan: Plan, seed: int = 0) -> None:
        self.http, self.url, self.rec, self.plan = http, url, rec, plan
        self.rng = random.Random(seed)
        self.running = True
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._loop()) for _ in range(self.plan.concurrency)]

    async def stop(self) -> None:
        self.running = False
        await asyncio.gather(*self.tasks)

    async def _loop(self, max_requests: int = 100_000) -> None:
        for _ in range(max_requests):
            if not self.running:
                return
            body = {"prompt": prompt(self.rng), "max_tokens": self.plan.max_tokens, "stream": True, "ignore_eos": True}
            o = Outcome(self.rec.phase, "steady", self.rec.now())
            await stream_one(self.http, self.url, body, o, self.rec, timeout_s=self.plan.request_timeout_s)
            if o.outcome != COMPLETED:
                await asyncio.sleep(0.2)  # an error is instant: do not spin


# ---------------------------------------------------------------------------- disconnecting clients


STAGES = ("before_request_line", "mid_headers", "before_body", "mid_body", "after_request", "after_status",
          "after_first_chunk", "mid_stream", "waiting_non_stream")


async def disconnect_client(host: str, port: int, stage: str, rng: random.Random, rec: Recorder) -> None:
    """One raw-socket client that goes away at `stage` (abruptly: the socket is closed, maybe reset)."""
    stream = stage in ("after_status", "after_first_chunk", "mid_stream")
    body = json.dumps({"prompt": prompt(rng, 12), "max_tokens": 48, "ignore_eos": True, "stream": stream}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        if stage == "before_request_line":
            return
        if stage == "mid_headers":
            writer.write(head[: rng.randint(1, len(head) - 5)])
            await writer.drain()
            return
        writer.write(head)
        if stage == "before_body":
            await writer.drain()
            return
        if stage == "mid_body":
            writer.write(body[: rng.randint(1, len(body) - 1)])
            await writer.drain()
            return
        writer.write(body)
        await writer.drain()
        if stage == "after_request":
            return
        if stage == "waiting_non_stream":
            await asyncio.sleep(rng.uniform(0.05, 0.6))
            return
        status_line = await asyncio.wait_for(reader.readline(), 60)
        status = int(status_line.split()[1]) if status_line.startswith(b"HTTP/") else 0
        rec.disconnect_statuses[status] += 1
        if stage == "after_status" or status != 200:
            return
        chunks_wanted = 1 if stage == "after_first_chunk" else rng.randint(3, 12)
        seen = 0
        while seen < chunks_wanted:
            line = await asyncio.wait_for(reader.readline(), 60)
            if not line:
                return
            seen += line.startswith(b"data: ")
    finally:
        rec.disconnects[stage] += 1
        if rng.random() < 0.5:  # half of them reset the connection (RST) instead of closing it (FIN)
            with contextlib.suppress(OSError):
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await writer.wait_closed()


BAD_BODIES: list[tuple[str, bytes, dict]] = [
    ("not json", b"{not json", {}),
    ("truncated json", b'{"prompt": "hi", "max_tok', {}),
    ("unknown field", json.dumps({"prompt": "hi", "max_token": 3}).encode(), {}),
    ("string for int", json.dumps({"prompt": "hi", "max_tokens": "3"}).encode(), {}),
    ("negative max_tokens", json.dumps({"prompt": "hi", "max_tokens": -1}).encode(), {}),
    ("context exceeded", json.dumps({"prompt": "hi " * 3000, "max_tokens": 8}).encode(), {}),
    ("empty prompt", json.dumps({"prompt": ""}).encode(), {}),
    ("array body", b"[1, 2, 3]", {}),
    ("bad request id", json.dumps({"prompt": "hi", "max_tokens": 1}).encode(), {"X-Request-Id": "a b"}),
    ("bad priority", json.dumps({"prompt": "hi", "max_tokens": 1}).encode(), {"X-Priority": "high"}),
    ("unknown class", json.dumps({"prompt": "hi", "max_tokens": 1, "qos_class": "gold"}).encode(), {}),
    ("n too large", json.dumps({"prompt": "hi", "max_tokens": 1, "n": 65}).encode(), {}),
    ("token id out of vocab", json.dumps({"prompt": [10**9], "max_tokens": 1}).encode(), {}),
    ("seed beyond 64 bits", json.dumps({"prompt": "hi", "max_tokens": 1, "seed": 2**64}).encode(), {}),
    ("body over 4 MiB", b'{"prompt": "' + b"a" * (4 * 2**20 + 10) + b'"}', {}),
]


async def bad_request(http: httpx.AsyncClient, url: str, index: int, rec: Recorder) -> None:
    name, body, headers = BAD_BODIES[index % len(BAD_BODIES)]
    o = Outcome(rec.phase, "bad", rec.now(), detail=name)
    try:
        r = await http.post(url, content=body, headers={"Content-Type": "application/json", **headers}, timeout=60)
        o.status = r.status_code
        o.outcome = COMPLETED if r.status_code == 200 else f"error:{error_code(r.content, r.status_code)}"
    except httpx.HTTPError as exc:
        o.outcome, o.detail = LOST, f"{name}: {type(exc).__name__}: {exc}"[:200]
    o.ended_at = rec.now()
    rec.add(o)


# ---------------------------------------------------------------------------- phases


class Chaos:
    def __init__(self, server: LocalServer, plan: Plan, console: Console, rec: Recorder) -> None:
        self.server, self.plan, self.console, self.rec = server, plan, console, rec
        self.url = server.base_url + "/v1/completions"
        self.fleet = FleetProbe(server.base_url)
        self.rng = random.Random(1)
        self.baseline_rps = 0.0

    async def greedy(self, http: httpx.AsyncClient) -> str:
        r = await http.post(self.url, json=GREEDY, timeout=120)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    async def wait_phase(self, progress: Progress, name: str, seconds: float) -> None:
        task = progress.add_task(name, total=round(seconds))
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(1.0, left))
            progress.update(task, completed=round(seconds - max(0.0, end - time.monotonic())))
        progress.update(task, completed=round(seconds))

    async def baseline(self, http, progress) -> None:
        start = self.rec.now()
        await self.wait_phase(progress, "baseline", self.plan.baseline_s)
        done = [o for o in self.rec.outcomes if o.kind == "steady" and o.outcome == COMPLETED and o.ended_at >= start]
        self.baseline_rps = len(done) / max(self.rec.now() - start, 1e-9)
        self.rec.event(f"baseline throughput {self.baseline_rps:.2f} req/s at concurrency {self.plan.concurrency}",
                       self.console)

    async def kill(self, http, progress) -> None:
        task = progress.add_task("kill (SIGKILL a worker)", total=self.plan.kills)
        for k in range(self.plan.kills):
            victim = await self.fleet.victim(http, k)
            os.kill(victim["pid"], signal.SIGKILL)
            self.rec.event(f"SIGKILL worker {victim['instance']} pid {victim['pid']} "
                           f"({victim.get('in_flight', 0)} in flight)", self.console)
            t_kill = time.monotonic()
            back = await self.fleet.wait_slot(http, victim["instance"], victim["pid"], self.plan.recover_timeout_s)
            whole = back is not None and await self.fleet.wait_whole(http, self.plan.recover_timeout_s)
            self.rec.event(f"kill {k + 1}: slot {victim['instance']} "
                           + (f"replaced by pid {back['pid']} (generation {back['generation']}) in "
                              f"{time.monotonic() - t_kill:.1f}s" if back else "NOT replaced")
                           + ("" if whole else "; fleet NOT whole"), self.console)
            progress.advance(task)
            await asyncio.sleep(self.plan.kill_gap_s)

    async def stop(self, http, progress) -> None:
        victim = await self.fleet.victim(http, 1)
        pid = victim["pid"]
        os.kill(pid, signal.SIGSTOP)
        self.rec.event(f"SIGSTOP worker {victim['instance']} pid {pid}", self.console)
        try:
            await self.wait_phase(progress, f"stop (worker {victim['instance']} frozen)", self.plan.stop_s)
        finally:
            try:
                alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                os.kill(pid, signal.SIGCONT)
            except (ProcessLookupError, psutil.NoSuchProcess):
                alive = False
            self.rec.event(f"SIGCONT pid {pid}: " + ("still alive" if alive else "already gone (the front killed it)"),
                           self.console)
        back = await self.fleet.wait_slot(http, victim["instance"], pid, self.plan.recover_timeout_s, replaced=False)
        whole = back is not None and await self.fleet.wait_whole(http, self.plan.recover_timeout_s)
        self.rec.event(f"after SIGCONT: slot {victim['instance']} " + (
            f"{'resumed' if back['pid'] == pid else 'replaced'}: pid {back['pid']} generation {back['generation']}"
            if back else "NOT healthy") + ("" if whole else "; fleet NOT whole"), self.console)

    async def overload(self, http, progress) -> None:
        rate = max(self.plan.overload_factor * self.baseline_rps, 1.0)
        count = int(rate * self.plan.overload_s)
        self.rec.event(f"overload: {count} requests at {rate:.1f} req/s for {self.plan.overload_s:g}s", self.console)
        task = progress.add_task(f"overload ({self.plan.overload_factor:g}x)", total=count)
        tasks = []
        start = time.monotonic()
        for i in range(count):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            body = {"prompt": prompt(self.rng), "max_tokens": self.plan.max_tokens, "stream": True, "ignore_eos": True}
            o = Outcome(self.rec.phase, "overload", self.rec.now())
            t = asyncio.create_task(stream_one(http, self.url, body, o, self.rec, timeout_s=self.plan.request_timeout_s))
            t.add_done_callback(lambda _: progress.advance(task))
            tasks.append(t)
        await asyncio.gather(*tasks)

    async def disconnect(self, http, progress) -> None:
        host, port = "127.0.0.1", self.server.port
        n = self.plan.disconnect_clients
        task = progress.add_task("disconnecting clients", total=n + self.plan.bad_requests)
        sem = asyncio.Semaphore(self.plan.disconnect_concurrency)

        async def one(i: int) -> None:
            async with sem:
                with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError, IndexError):
                    await disconnect_client(host, port, STAGES[i % len(STAGES)], self.rng, self.rec)
                progress.advance(task)

        await asyncio.gather(*(one(i) for i in range(n)))
        # Malformed requests once the storm is over, so a 5xx can only come from the input itself.
        bad_sem = asyncio.Semaphore(8)

        async def bad(i: int) -> None:
            async with bad_sem:
                await bad_request(http, self.url, i, self.rec)
                progress.advance(task)

        await asyncio.gather(*(bad(i) for i in range(self.plan.bad_requests)))

    async def slow(self, http, progress) -> None:
        """Fat streams (top-20 logprobs per token) read one line at a time with pauses."""
        n = self.plan.slow_readers
        task = progress.add_task("slow readers", total=n)
        pause = self.plan.slow_pause_s
        tokens = max(4, int(self.plan.slow_budget_s / pause))
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.plan.request_timeout_s), limits=limits,
                                     trust_env=False) as slow_http:
            async def one() -> None:
                body = {"prompt": prompt(self.rng), "max_tokens": tokens, "stream": True, "ignore_eos": True,
                        "logprobs": 20}
                o = Outcome(self.rec.phase, "slow", self.rec.now())
                await stream_one(slow_http, self.url, body, o, self.rec, read_pause_s=pause,
                                 timeout_s=self.plan.slow_budget_s * 3 + 60)
                progress.advance(task)

            await asyncio.gather(*(one() for _ in range(n)))


# ---------------------------------------------------------------------------- report


def summarize(rec: Recorder) -> list[dict]:
    rows = []
    for name, start, end in rec.phases:
        mine = [o for o in rec.outcomes if o.phase == name]
        errors = Counter(o.outcome.split(":", 1)[1] for o in mine if o.outcome.startswith("error:"))
        completed = [o for o in mine if o.outcome == COMPLETED and o.kind != "bad"]
        ttfts = sorted(o.ttft_s for o in completed if o.ttft_s is not None)
        admitted = [o for o in mine if o.kind == "overload" and o.status == 200]
        rows.append({
            "phase": name, "start_s": round(start, 1), "end_s": round(end, 1), "sent": len(mine),
            "completed": len(completed), "errors": dict(errors), "lost": sum(o.outcome == LOST for o in mine),
            "5xx": sum(1 for o in mine if (o.status or 0) >= 500 or o.outcome in ("error:internal_error",
                                                                                  "error:engine_error")),
            # 503 says "unavailable, retry" (no instance, draining): not a verdict on the input
            "5xx_from_client_input": sum(1 for o in mine if o.kind == "bad" and (
                ((o.status or 0) >= 500 and o.status != 503) or o.outcome == LOST)),
            "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3) if ttfts else None,
            "admitted_within_slo": (f"{sum(o.meets_slo for o in admitted)}/{len(admitted)}" if admitted else None),
        })
    return rows


def table(rows: list[dict]) -> Table:
    t = Table(title="chaos: outcomes per phase (requests sent in that phase)")
    for col in ("phase", "sent", "completed", "explicit errors (by code)", "lost", "5xx", "5xx client input",
                "TTFT p50/p99 s", "admitted in SLO"):
        t.add_column(col, justify="left" if col in ("phase", "explicit errors (by code)") else "right")
    for r in rows:
        errs = ", ".join(f"{k}={v}" for k, v in sorted(r["errors"].items())) or "-"
        ttft = f"{r['ttft_p50_s']}/{r['ttft_p99_s']}" if r["ttft_p50_s"] is not None else "-"
        t.add_row(r["phase"], str(r["sent"]), str(r["completed"]), errs, str(r["lost"]), str(r["5xx"]),
                  str(r["5xx_from_client_input"]), ttft, r["admitted_within_slo"] or "-")
    return t


def plot(rec: Recorder, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(13, 9), sharex=True, layout="constrained")
    end = max([o.ended_at for o in rec.outcomes] + [rec.now()])
    width = max(1.0, end / 120)
    bins = [i * width for i in range(int(end / width) + 2)]
    groups: dict[str, list[float]] = {}
    for o in rec.outcomes:
        label = "completed" if o.outcome == COMPLETED else ("LOST" if o.outcome == LOST else o.outcome)
        groups.setdefault(label, []).append(o.ended_at)
    order = sorted(groups, key=lambda k: (k != "completed", k == "LOST", k))
    colors = {"completed": "tab:green", "LOST": "black"}
    ax1.hist([groups[k] for k in order], bins=bins, stacked=True, label=order,
             color=[colors.get(k) for k in order] if all(k in colors for k in order) else None)
    ax1.set_ylabel(f"requests ended per {width:.1f}s")
    ax1.legend(fontsize="small", ncol=3)
    done = [o for o in rec.outcomes if o.ttft_s is not None and o.outcome == COMPLETED]
    for kind, marker in (("steady", "."), ("overload", "x"), ("slow", "s")):
        pts = [o for o in done if o.kind == kind]
        ax2.scatter([o.sent_at + o.ttft_s for o in pts], [o.ttft_s for o in pts], s=8, marker=marker, label=kind)
    ax2.axhline(TTFT_TARGET_S, color="red", linestyle="--", label="TTFT target")
    ax2.set_yscale("log")
    ax2.set_ylabel("TTFT (s)")
    ax2.legend(fontsize="small")
    if rec.rss:
        ts, front, worker = zip(*rec.rss)
        ax3.plot(ts, front, label="front RSS")
        ax3.plot(ts, worker, label="largest worker RSS")
    ax3.set_ylabel("MiB")
    ax3.set_xlabel("seconds since start")
    ax3.legend(fontsize="small")
    for ax in (ax1, ax2, ax3):
        for i, (name, start, stop) in enumerate(rec.phases):
            ax.axvspan(start, stop, color=f"C{i % 10}", alpha=0.08)
            if ax is ax1:
                ax.text((start + stop) / 2, ax.get_ylim()[1] * 0.95, name, ha="center", va="top", fontsize=8)
        for e in rec.events:
            if e.what.startswith(("SIGKILL", "SIGSTOP", "SIGCONT")):
                ax.axvline(e.t, color="red", alpha=0.4, linewidth=0.8)
    fig.suptitle("sloserve --instances 2 under chaos: outcomes, TTFT and memory over time (red lines: signals)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main


def log_count(server: LocalServer, needle: str) -> int:
    """Occurrences in the server's log (front and workers write to it)."""
    with contextlib.suppress(OSError):
        return Path(server._log.name).read_text(errors="replace").count(needle)
    return -1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter phases (~2 minutes)")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "chaos")
    p.add_argument("--figure", type=Path, default=REPO / "benchmarks" / "figures" / "chaos.png")
    return p.parse_args()


async def run(server: LocalServer, plan: Plan, console: Console, rec: Recorder) -> dict:
    chaos = Chaos(server, plan, console, rec)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(plan.request_timeout_s, connect=10), limits=limits,
                                 trust_env=False) as http:
        greedy_before = await chaos.greedy(http)
        load = SteadyLoad(http, chaos.url, rec, plan)
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console)
        counts: Counter = Counter()
        rec.on_outcome = lambda o: counts.update([o.outcome.split(":")[0]])
        status = progress.add_task("requests ended", total=None)
        with progress:
            load.start()
            try:
                for name, phase in (("baseline", chaos.baseline), ("kill", chaos.kill), ("stop", chaos.stop),
                                    ("overload", chaos.overload), ("disconnect", chaos.disconnect),
                                    ("slow", chaos.slow)):
                    with rec.in_phase(name):
                        await phase(http, progress)
                    progress.update(status, completed=sum(counts.values()),
                                    description=f"requests ended ({dict(counts)})")
            finally:
                await load.stop()
        rec.phase = "after"
        rec.event("load stopped", console)
        state: dict = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                state = await chaos.fleet.idle(http)
                if state and not leaks(state):
                    break
            await asyncio.sleep(1.0)  # the front polls every 0.25 s; the workers' aborts need a step
        greedy_after = await chaos.greedy(http)
    return {"greedy_before": greedy_before, "greedy_after": greedy_after, "idle_state": state,
            "baseline_rps": chaos.baseline_rps}


def main() -> int:
    args = parse_args()
    plan = Plan.quick() if args.quick else Plan()
    console = Console(width=max(150, Console().width))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    qos = args.out / f"qos-{stamp}.json"
    qos.write_text(json.dumps(QOS_CONFIG))
    server_args = ["--instances", "2", "--num-threads", str(args.num_threads), "--router", "least-requests",
                   "--max-num-seqs", "8", "--max-queue", "8", "--kv-cache-gib", "0.1", "--max-model-len", "512",
                   "--qos-config", str(qos)]
    rec = Recorder()
    console.rule("starting `sloserve serve --instances 2` on 127.0.0.1")
    server = LocalServer(server_args, args.out / f"server-{stamp}.log")
    sampler = RssSampler(server.proc.pid, rec)
    sampler.start()
    try:
        server.wait_ready(timeout=300)
        rec.event(f"front ready on {server.base_url}", console)
        extra = asyncio.run(run(server, plan, console, rec))
    finally:
        sampler.stop_event.set()
        code = server.stop()
        console.log(f"server exited with {code}")

    rows = summarize(rec)
    console.print(table(rows))
    lost = sum(r["lost"] for r in rows)
    client_5xx = sum(r["5xx_from_client_input"] for r in rows)
    leaked = leaks(extra["idle_state"]) if extra["idle_state"] else -1
    overload = next((r for r in rows if r["phase"] == "overload"), {})
    lines = [
        f"requests sent {len(rec.outcomes)}, completed {sum(o.outcome == COMPLETED for o in rec.outcomes)}, "
        f"explicit errors {sum(o.outcome.startswith('error:') for o in rec.outcomes)}, lost silently {lost} (target 0)",
        f"5xx caused by client input: {client_5xx} (target 0)",
        f"disconnecting clients: {sum(rec.disconnects.values())} by stage {dict(rec.disconnects)}; statuses they "
        f"read {dict(rec.disconnect_statuses)}",
        f"admitted requests within SLO (TTFT <= {TTFT_TARGET_S:g}s) under overload: {overload.get('admitted_within_slo')}",
        f"peak RSS: front {sampler.peak_front:.0f} MiB, largest worker {sampler.peak_worker:.0f} MiB",
        f"after the load: instances still holding requests or KV blocks: {leaked} (target 0) {extra['idle_state']}",
        f"server log: {log_count(server, 'Traceback')} tracebacks, "
        f"{log_count(server, 'Exception in ASGI application')} unhandled ASGI exceptions",
        f"greedy text {'unchanged' if extra['greedy_before'] == extra['greedy_after'] else 'CHANGED'}: "
        f"{extra['greedy_before']!r} -> {extra['greedy_after']!r}",
    ]
    for line in lines:
        console.print(line, highlight=False, markup=False)
    lost_examples = [asdict(o) for o in rec.outcomes if o.outcome == LOST][:20]
    for o in lost_examples[:5]:
        console.print(f"lost: {o['phase']}/{o['kind']} at {o['sent_at']:.1f}s: {o['detail']}", markup=False)
    result = {
        "started_utc": stamp, "quick": args.quick, "plan": asdict(plan), "qos": QOS_CONFIG, "server_args": server_args,
        "phases": rows, "events": [asdict(e) for e in rec.events], "summary": lines,
        "lost_examples": lost_examples, "peak_rss_mib": {"front": sampler.peak_front, "worker": sampler.peak_worker},
        "disconnects": dict(rec.disconnects), "disconnect_statuses": {str(k): v for k, v in rec.disconnect_statuses.items()},
        **extra, "requests": [asdict(o) for o in rec.outcomes],
    }
    path = args.out / f"chaos-{stamp}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    plot(rec, args.figure)
    console.print(f"wrote {path} and {args.figure}")
    ok = lost == 0 and client_5xx == 0 and leaked == 0 and extra["greedy_before"] == extra["greedy_after"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
