"""Scale to zero on the real front (`serve --instances 0:N --autoscale ...`), with stand-in
workers (real processes, no model): with no demand the last worker drains and stops; the next
request is held (not refused) while the autoscaler, told at once, starts a worker, and then
served; a client that leaves while held is let go and nothing is left waiting."""
from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from multi_helpers import FakeWorker, serving_front
from fleet_helpers import front_config
from sloserve.workers.fleet import HEALTHY, STOPPED


def test_an_idle_fleet_scales_to_zero_and_the_next_request_waits_for_a_worker():
    async def main():
        cfg = front_config(instances=2, router="round-robin", poll_interval_s=0.1, autoscale="reactive",
                           min_instances=0, initial_instances=1, capacity_rps=1.0, scaling_interval_s=0.2,
                           scale_down_delay_s=0.3, stable_window_s=0.5, cold_start_guess_s=1.0)
        async with serving_front(lambda slot: FakeWorker(5, 0.02), cfg, run_loops=True) as (fleet, front, port):
            driver = front.autoscale
            deadline = time.monotonic() + 20
            while any(i.status != STOPPED for i in fleet.instances):  # nothing asked: everything stops
                assert time.monotonic() < deadline, [i.status for i in fleet.instances]
                await asyncio.sleep(0.1)
            assert driver.counters["stops"] >= 1
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                t0 = time.monotonic()
                r = await client.post("/v1/completions", json={"prompt": "wake up", "max_tokens": 5})
                waited = time.monotonic() - t0
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xxxxx"
                assert driver.counters["starts"] >= 1 and any(i.status == HEALTHY for i in fleet.instances)
                assert waited >= 0.2  # it waited for a worker to start (a fake one starts in well under 5 s)
                assert any("queued" in d["reason"] or "panic" in d["reason"] for d in driver.decisions)
                # scale to zero again, then a client that gives up while held leaves nothing behind
                deadline = time.monotonic() + 20
                while any(i.status != STOPPED for i in fleet.instances):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
                call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}))
                while driver.held == 0:
                    await asyncio.sleep(0.01)
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await call
                deadline = time.monotonic() + 5
                while driver.held:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)

    asyncio.run(main())


def test_a_request_whose_ttft_target_a_cold_start_cannot_meet_is_refused_at_once_and_wakes_the_pool():
    from sloserve.server.qos import QoSRegistry
    from sloserve.core.types import DEFAULT_QOS, QoSClass

    registry = QoSRegistry(classes={"default": DEFAULT_QOS, "interactive": QoSClass("interactive", 0.05, 0.1)})

    async def main():
        cfg = front_config(instances=2, router="round-robin", poll_interval_s=0.1, autoscale="reactive",
                           min_instances=0, initial_instances=1, capacity_rps=1.0, scaling_interval_s=0.2,
                           scale_down_delay_s=0.3, stable_window_s=0.5, cold_start_guess_s=1.0)
        async with serving_front(lambda slot: FakeWorker(5, 0.02), cfg, run_loops=True,
                                 registry=registry) as (fleet, front, port):
            driver = front.autoscale
            deadline = time.monotonic() + 20
            while any(i.status != STOPPED for i in fleet.instances):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            starts = driver.counters["starts"]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                t0 = time.monotonic()
                r = await client.post("/v1/completions", headers={"X-QoS-Class": "interactive"},
                                      json={"prompt": "now", "max_tokens": 2})
                assert time.monotonic() - t0 < 0.5  # refused at once, not held
                err = r.json()["error"]
                assert r.status_code == 503 and err["code"] == "cold_start" and "0.05 s" in err["message"]
                assert int(r.headers["retry-after"]) >= 1
                assert driver.counters["starts"] > starts  # it woke the pool for the requests that follow
                assert driver.held == 0
                r = await client.post("/v1/completions", json={"prompt": "later", "max_tokens": 5})
                assert r.status_code == 200  # the default class (no TTFT target) waits for the start

    asyncio.run(main())
