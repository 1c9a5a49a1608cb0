"""`sloserve top --url URL`: the dashboard in a terminal, for a server reached over SSH.

It polls the server's `/dashboard/data` (the same JSON the page reads) and redraws with rich's
Live: one row per instance from the newest frame, one per QoS class (totals since the server
started, latency of the last interval with requests), and the latest events.
"""
from __future__ import annotations

import argparse
import os
import time
from datetime import datetime
from typing import Optional

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from sloserve.dashboard import DATA_ROUTE

MAX_EVENTS = 8


def add_top_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="a live terminal view of a running server's fleet (its /dashboard data)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (single instance or front)")
    p.add_argument("--key", default=os.environ.get("SLOSERVE_ADMIN_KEY") or os.environ.get("SLOSERVE_API_KEY"),
                   metavar="KEY", help="an admin key when the server has some, else an API key when it has some "
                                       "(also $SLOSERVE_ADMIN_KEY, $SLOSERVE_API_KEY)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between two polls")
    p.add_argument("--once", action="store_true", help="print one view and exit (1 if the server cannot be read)")
    p.set_defaults(func=cmd_top)


class TopView:
    """What the server has sent so far; `render()` draws it."""

    def __init__(self) -> None:
        self.data: dict = {}
        self.frame: Optional[dict] = None
        self.events: list[dict] = []
        self.last_classes: dict[str, dict] = {}  # class -> its newest interval with requests
        self.error: Optional[str] = None

    def since(self) -> dict:
        params = {"after_event": self.events[-1]["seq"] if self.events else 0}
        if self.frame is not None:
            params["since"] = self.frame["t"]
        else:
            params["last"] = 60  # a minute of history: the classes' last latencies, not the whole hour
        return params

    def absorb(self, data: dict) -> None:
        self.data, self.error = data, None
        for frame in data["frames"]:
            self.frame = frame
            for c in frame["classes"]:
                if c["finished"]:
                    self.last_classes[c["qos_class"]] = c
        self.events = (self.events + data["events"])[-MAX_EVENTS:]

    def _time(self, t: float) -> str:
        if self.data.get("source") == "live":
            return datetime.fromtimestamp(t).strftime("%H:%M:%S")
        return f"{t:.0f} s"

    def render(self, url: str) -> Group:
        head = Text(f"sloserve top · {url}", style="bold")
        if self.frame is not None:
            meta = " · ".join(f"{k}: {v}" for k, v in self.data.get("meta", {}).items())
            head.append(f" · {self._time(self.frame['t'])}" + (f" · {meta}" if meta else ""), style="dim")
        parts: list = [head]
        if self.error:
            parts.append(Text(self.error, style="bold red"))
        parts += [self._instances(), self._classes(), self._events()]
        return Group(*parts)

    def _instances(self) -> Table:
        t = Table(title="instances (run: running, wait: waiting, pre: of those, preempted; hit%: prefix cache)",
                  title_justify="left", expand=True)
        # Short headers: the rows must fit an 80-column terminal.
        for col in ("inst", "role", "state", "run", "wait", "pre", "KV blocks", "KV%", "tiers", "hit%", "tok/s"):
            t.add_column(col, justify="left" if col in ("role", "state", "tiers") else "right")
        for i in (self.frame or {}).get("instances", []):
            total = i["kv_blocks_total"]
            tiers = ", ".join(f"{k} {v}" for k, v in i["tier_blocks"].items()) or "-"
            hit = i["prefix_hit_rate"]
            t.add_row(str(i["instance"]), i["role"], _state(i["status"]), str(i["running"]), str(i["waiting"]),
                      str(i["preempted"]), f"{i['kv_blocks_used']}/{total}",
                      f"{100 * i['kv_blocks_used'] / total:.1f}" if total else "-", tiers,
                      "-" if hit is None else f"{100 * hit:.1f}", f"{i['tokens_per_s']:.1f}")
        return t

    def _classes(self) -> Table:
        t = Table(title="QoS classes (finished since the start; latency of the last interval with requests)",
                  title_justify="left", expand=True)
        for col in ("class", "done", "met", "SLO%", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"):
            t.add_column(col, justify="left" if col == "class" else "right")
        quantiles = self.data.get("quantiles", [50.0, 90.0, 99.0])
        p50, p99 = quantiles.index(50.0), quantiles.index(99.0)
        for name, totals in sorted(self.data.get("totals", {}).items()):
            last = self.last_classes.get(name)
            done, met = totals["finished"], totals["attained"]
            share = met / done if done else None
            t.add_row(name, str(done), str(met),
                      Text("-" if share is None else f"{100 * share:.1f}%",
                           style="" if share is None else "green" if share >= 0.9 else "red"),
                      *(_seconds(last and last[key][q]) for key in ("ttft_s", "tpot_s") for q in (p50, p99)))
        return t

    def _events(self) -> Table:
        t = Table(title="events", title_justify="left", expand=True)
        for col in ("time", "event", "instance", "detail"):
            t.add_column(col, justify="right" if col == "instance" else "left")
        for e in reversed(self.events):
            t.add_row(self._time(e["t"]), e["kind"], "-" if e["instance"] is None else str(e["instance"]), e["detail"])
        return t


def _state(status: str) -> Text:
    return Text(status, style={"ready": "green", "starting": "yellow", "draining": "yellow",
                               "unresponsive": "red", "dead": "red"}.get(status, "dim"))


def _seconds(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.0f} ms" if value < 10 else f"{value:.1f} s"


def poll(client: httpx.Client, view: TopView) -> bool:
    """One poll; False (and `view.error` set) when the server could not be read."""
    try:
        resp = client.get(DATA_ROUTE, params=view.since())
    except httpx.HTTPError as e:
        view.error = f"cannot reach the server: {type(e).__name__}: {e}"
        return False
    if resp.status_code in (401, 403):
        view.error = f"HTTP {resp.status_code}: the dashboard data needs a key (--key: an admin key, or an API key)"
        return False
    if resp.status_code == 404:
        view.error = "HTTP 404: this server has no /dashboard/data (not sloserve, or an older version)"
        return False
    if resp.status_code != 200:
        view.error = f"HTTP {resp.status_code} from {DATA_ROUTE}"
        return False
    view.absorb(resp.json())
    return True


def cmd_top(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise ValueError(f"--interval must be > 0, got {args.interval}")
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    view = TopView()
    console = Console()
    with httpx.Client(base_url=url, headers=headers, timeout=5.0) as client:
        if args.once:
            ok = poll(client, view)
            if not ok:
                console.print(f"sloserve top: {view.error}", style="red", highlight=False)
                return 1
            console.print(view.render(url))
            return 0
        with Live(view.render(url), console=console, screen=False, auto_refresh=False) as live:
            while True:
                poll(client, view)
                live.update(view.render(url), refresh=True)
                time.sleep(args.interval)
