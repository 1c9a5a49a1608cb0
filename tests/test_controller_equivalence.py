"""One fleet controller, two kinds of fleet: the same `FleetController` (router + migration
policies) over a real two-worker fleet and over a simulated one, on the same constructed
scenario, decides the same moves.

Scenario: two streamed requests, A (max_tokens 200) and B (max_tokens 300), decode on
instance 0; instance 1 is idle; an operator drains instance 0. The controller (at most one
move out of an instance at a time) must move B, the one with more work left, to instance 1.
The real fleet shows the controller its instances through the front's view of the workers
(polled states + relayed streams, GET /v1/migrations/plan: a dry run); the simulated fleet
through the simulator's (live scheduler states + running requests)."""
from __future__ import annotations

import dataclasses
import json
import threading

import httpx
import pytest

from server_helpers import ServerProcess, wait_for
from sloserve.cluster.controller import FleetController
from sloserve.cluster.migration import MoveCosts, make_migration_policy
from sloserve.cluster.routers import make_router
from sloserve.core.config import SchedulerConfig
from sloserve.sched.live_state import Moment
from sloserve.sim.catalog import get_model
from sloserve.sim.cost import RooflineCostModel
from sloserve.sim.hardware import get_hardware
from sloserve.sim.instance import SimInstance
from sloserve.sim.migration import SimMigrator
from sloserve.core.types import Request, SamplingParams

ADMIN = "equivalence-admin"
PROMPTS = {"A": "Tell me a story about a cat.", "B": "Tell me a story about a dog who learns to sail."}
MAX_TOKENS = {"A": 200, "B": 300}


def controller() -> FleetController:
    return FleetController(make_router("round-robin"), make_migration_policy("drain"))


def simulated_decisions(prompt_lens: dict[str, int]) -> list[tuple]:
    model = get_model("smollm2-135m")
    cost = RooflineCostModel(get_hardware("cpu"), model, dtype_bytes=4)
    sched = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8)
    instances = [SimInstance(i, cost, 400, 8192, sched, fast_forward=False) for i in range(2)]
    for rid in ("A", "B"):
        params = SamplingParams(max_tokens=MAX_TOKENS[rid], temperature=0, ignore_eos=True)
        instances[0].add_request(Request(rid, list(range(1, prompt_lens[rid] + 1)), params))
    now = 0.0
    sched0 = instances[0].scheduler
    while len(sched0.running) < 2 or min(len(r.output_token_ids) for r in sched0.running) < 3:  # both decoding
        now = instances[0].start_step(now)
        instances[0].finish_step(now)
    moment = Moment(now)
    states = [i.live_view(moment) for i in instances]
    ctl = controller()
    migrator = SimMigrator(ctl, instances, states, MoveCosts.uniform(model.kv_bytes_per_token(4), 1e9),
                           schedule=lambda t, transfer: None, touch=lambda instance: None)
    views = migrator.views(now)
    views[0] = dataclasses.replace(views[0], draining=True, accepting=False)  # the operator's drain
    moves = ctl.plan_migrations(now, views, migrator.costs)
    return [(m.request_id, m.source, m.target, m.reason) for m in moves]


@pytest.mark.slow
def test_the_controller_decides_the_same_on_a_real_and_a_simulated_fleet(tmp_path):
    server = ServerProcess(["--instances", "2", "--router", "round-robin", "--predictor", "none",
                            "--migration-interval", "3600", "--admin-key", ADMIN, "--max-num-seqs", "4",
                            "--kv-cache-gib", "0.1", "--log-level", "warning"], tmp_path / "front.log",
                           startup_timeout=300)
    base = server.base_url
    auth = {"Authorization": f"Bearer {ADMIN}"}
    streams: dict[str, threading.Thread] = {}
    tokens = {"A": 0, "B": 0}
    stop = threading.Event()

    def read(rid: str) -> None:
        body = {"prompt": PROMPTS[rid], "max_tokens": MAX_TOKENS[rid], "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, headers={"X-Request-Id": rid},
                          timeout=300) as r:
            for line in r.iter_lines():
                if stop.is_set():
                    return
                if line.startswith("data: {"):
                    tokens[rid] += bool(json.loads(line[6:]).get("choices"))

    try:
        info = lambda: httpx.get(base + "/v1/instances", headers=auth, timeout=30).json()  # noqa: E731
        wait_for(lambda: [d["status"] for d in info()["data"]] == ["healthy", "healthy"], 240, interval=0.5,
                 what="both workers healthy")
        lens = {rid: httpx.post(base + "/tokenize", json={"prompt": p}, timeout=30).json()["count"]
                for rid, p in PROMPTS.items()}
        # A and B onto instance 0: instance 1 leaves routing while they arrive, then comes back.
        assert httpx.post(base + "/v1/instances/1/drain", headers=auth, timeout=30).status_code == 200
        for rid in ("A", "B"):
            streams[rid] = threading.Thread(target=read, args=(rid,), daemon=True)
            streams[rid].start()
        wait_for(lambda: min(tokens.values()) >= 3, 120, interval=0.05, what="A and B decoding")
        assert httpx.delete(base + "/v1/instances/1/drain", headers=auth, timeout=30).status_code == 200
        assert httpx.post(base + "/v1/instances/0/drain", headers=auth, timeout=30).status_code == 200
        wait_for(lambda: all(d["load"] and d["load"]["num_running"] == (2 if d["instance"] == 0 else 0)
                             for d in info()["data"]), 30, interval=0.1, what="the workers' reports")
        plan = httpx.get(base + "/v1/migrations/plan", headers=auth, timeout=30).json()["moves"]
        real = [(m["client_request_id"], m["source"], m["target"], m["reason"]) for m in plan]
    finally:
        stop.set()
        server.kill()
    simulated = simulated_decisions(lens)
    assert real == simulated == [("B", 0, 1, "drain")]
