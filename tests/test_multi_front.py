"""The multi-instance front against stand-in workers (real processes, no model): requests
spread per policy, a worker killed or hung mid-load loses no request silently, and its
replacement joins. The same front runs real engine workers in test_multi_instance.py."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from typing import Optional

import httpx
import pytest

from multi_helpers import FakeWorker, serving_front, sse_events
from fleet_helpers import front_config
from sloserve.front.app import DEAD, HEALTHY
from sloserve.front.multi import build_worker_fleet
from sloserve.workers.contract import WorkerState
from sloserve.workers.handles import WorkerHandle


@contextlib.asynccontextmanager
async def front(num: int, router: str, tokens: int = 20, delay: float = 0.05, **config):
    cfg = front_config(instances=num, router=router, poll_interval_s=0.1, **config)
    async with serving_front(lambda slot: FakeWorker(tokens, delay), cfg) as (fleet, _, port):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            yield fleet, client


async def stream_one(client: httpx.AsyncClient, started: Optional[asyncio.Event] = None, **body) -> list:
    async with client.stream("POST", "/v1/completions", json={"prompt": "hello there", "stream": True, **body}) as r:
        assert r.status_code == 200
        raw = b""
        async for chunk in r.aiter_raw():
            raw += chunk
            if started is not None and b"data:" in raw:
                started.set()
        return sse_events(raw)


def test_requests_spread_per_policy():
    async def main():
        async with front(2, "round-robin") as (fleet, client):
            pids = []
            for _ in range(6):
                r = await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 2})
                assert r.status_code == 200
                pids.append(r.json()["pid"])
            assert pids[0::2] == [pids[0]] * 3 and pids[1::2] == [pids[1]] * 3 and pids[0] != pids[1]
            info = (await client.get("/v1/instances")).json()
            assert info["router"] == "round-robin" and [d["routed"] for d in info["data"]] == [3, 3]
            assert all(d["status"] == HEALTHY and d["load"] is not None for d in info["data"])
            metrics = (await client.get("/metrics")).text
            assert 'sloserve:instance_routed_total{instance="0"} 3.0' in metrics
            assert 'sloserve:instance_healthy{instance="1"} 1.0' in metrics
        async with front(2, "least-requests", tokens=30) as (fleet, client):
            # a long stream holds instance 0; least-requests sends the next requests to 1
            started = asyncio.Event()
            long = asyncio.create_task(stream_one(client, started, max_tokens=30))
            await started.wait()
            await asyncio.sleep(0.3)  # a poll sees it running
            for _ in range(3):
                r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert r.status_code == 200
                await asyncio.sleep(0.3)  # the next poll replaces the front's own count of what it sent
            events = await long
            assert events[-1] == "[DONE]"
            routed = [d["routed"] for d in (await client.get("/v1/instances")).json()["data"]]
            assert routed == [1, 3]

    asyncio.run(main())


def test_killing_a_worker_mid_load_loses_no_request_and_it_is_replaced():
    async def main():
        async with front(2, "round-robin", tokens=40, delay=0.05) as (fleet, client):
            started = [asyncio.Event() for _ in range(6)]
            streams = [asyncio.create_task(stream_one(client, started[i], max_tokens=40)) for i in range(6)]
            plain = [asyncio.create_task(client.post("/v1/completions", json={"prompt": "p", "max_tokens": 30}))
                     for _ in range(4)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
            victim = fleet.instances[0]
            old_pid = victim.handle.proc.pid
            os.kill(old_pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*streams), 60)
            answers = await asyncio.wait_for(asyncio.gather(*plain), 60)
            on_victim = [ev for ev in results if ev[0].get("pid") == old_pid]
            elsewhere = [ev for ev in results if ev[0].get("pid") != old_pid]
            assert on_victim and elsewhere  # round-robin put streams on both
            # streams already under way on the dead worker end with a clear error ...
            for ev in on_victim:
                assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == "instance_failed"
            for ev in elsewhere:
                assert ev[-1] == "[DONE]" and ev[-2]["usage"]["completion_tokens"] == 40
            # ... and the non-streamed ones (nothing sent yet) were retried elsewhere and completed
            assert all(a.status_code == 200 for a in answers)
            assert all(a.json()["pid"] != old_pid for a in answers)
            assert fleet.counters["retries"] >= 1 and fleet.counters["failed_midstream"] == len(on_victim)
            # the replacement joins and takes requests
            for _ in range(200):
                if victim.status == HEALTHY and victim.generation == 1:
                    break
                await asyncio.sleep(0.05)
            assert victim.status == HEALTHY and victim.generation == 1 and victim.handle.proc.pid != old_pid
            pids = {(await client.post("/v1/completions", json={"prompt": "q", "max_tokens": 1})).json()["pid"]
                    for _ in range(4)}
            assert victim.handle.proc.pid in pids
            info = (await client.get("/v1/instances")).json()
            assert info["counters"]["replacements"] == 1 and info["data"][0]["generation"] == 1

    asyncio.run(main())


def test_a_hung_worker_is_taken_out_and_nothing_hangs():
    async def main():
        async with front(2, "round-robin", tokens=40, delay=0.05, fail_after=2, poll_timeout_s=0.3,
                         hang_timeout_s=1.5) as (fleet, client):
            started = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(stream_one(client, started[i], max_tokens=40)) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
            hung = fleet.instances[1]
            os.kill(hung.handle.proc.pid, signal.SIGSTOP)  # alive, but answers nothing
            results = await asyncio.wait_for(asyncio.gather(*streams), 30)
            assert all(ev[-1] == "[DONE]" for ev in results)
            assert sum(any(isinstance(e, dict) and "error" in e for e in ev) for ev in results) == 2
            assert hung.generation == 1  # silent past hang_timeout_s: killed (SIGKILL works on a stopped process)
            r = await client.post("/v1/completions", json={"prompt": "z", "max_tokens": 1})
            assert r.status_code == 200

    asyncio.run(main())


def test_no_healthy_instance_is_a_clean_503():
    async def main():
        async with front(1, "least-requests", replace_dead=False) as (fleet, client):
            fleet.mark_dead(fleet.instances[0], "test")
            assert fleet.instances[0].status == DEAD
            r = await client.post("/v1/completions", json={"prompt": "z", "max_tokens": 1})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_instance"
            assert (await client.get("/health")).status_code == 503
            bad = await client.post("/v1/completions", content=b"{not json")
            assert bad.status_code == 400

    asyncio.run(main())


def test_worker_config_and_state_payload_round_trip():
    from types import SimpleNamespace

    from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig
    from sloserve.kv.hashing import hash_full_blocks
    from sloserve.kv.manager import KVCacheManager
    from sloserve.sched.scheduler import Scheduler
    from sloserve.server.worker import state_payload
    from sloserve.workers.contract import config_from_json, config_to_json
    from sloserve.core.types import Request, SamplingParams

    cfg = EngineConfig(num_threads=3, cache=CacheConfig(block_size=32), scheduler=SchedulerConfig(max_num_seqs=5))
    assert config_from_json(config_to_json(cfg)) == cfg

    kv = KVCacheManager(64, 16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, 1024)
    prompt = list(range(100, 150))
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=4, temperature=0)))
    plan = sched.schedule(0.0)
    from sloserve.sched.plan import StepResult

    sched.update(plan, StepResult({"a": 7}), 0.1)
    core = SimpleNamespace(scheduler=sched, kv=kv, clock=lambda: 0.2, loras=SimpleNamespace(resident=lambda: ["a1"]))
    payload = json.loads(json.dumps(state_payload(core)))
    published = WorkerState.from_json(payload)
    state = published.state
    assert state.num_running == 1 and state.kv_blocks_total == 64 and state.block_size == 16
    assert state.min_ttft_slack_s == float("inf")  # nothing waits: sent as null, read back as infinity
    assert published.prefix_keys == set(hash_full_blocks(prompt, 16))  # the 3 full prompt blocks, as the router hashes them
    assert published.reading["running"] == 1
    assert published.state.adapters == {"a1"}  # the adapters it holds in the device's form: the router reads them


def test_a_worker_message_of_another_contract_version_is_refused_with_both_versions_named():
    from sloserve.workers.contract import CONTRACT_VERSION, ContractError, MigrationSnapshot

    snapshot = MigrationSnapshot({"output_token_ids": [5, 6]}, 2, rounds=3, bytes=4096, copy_s=0.5, stop_copy_s=0.01)
    assert MigrationSnapshot.from_json(json.loads(json.dumps(snapshot.to_json()))) == snapshot
    assert "resume" not in snapshot.timings() and snapshot.timings()["rounds"] == 3
    for message in (WorkerState, MigrationSnapshot):
        with pytest.raises(ContractError, match=f"version 99.*{CONTRACT_VERSION}"):
            message.from_json({"version": 99})
    with pytest.raises(ContractError, match="malformed"):
        WorkerState.from_json({"version": CONTRACT_VERSION, "state": {"num_running": 1}})


def test_a_slot_whose_workers_die_while_starting_backs_off():
    class Gone(WorkerHandle):
        kind = "gone"
        url = None

        def is_running(self) -> bool:
            return False

        def kill(self) -> None:
            pass

        def describe(self) -> dict:
            return {"kind": self.kind, "url": None}

    async def main():
        fleet = build_worker_fleet(lambda slot: Gone(), front_config(poll_interval_s=0.05))
        await fleet.start()
        await asyncio.sleep(1.6)  # dies at once (retry in 1 s), dies again at ~1 s (retry in 2 s)
        inst = fleet.instances[0]
        info = inst.describe()
        await fleet.close()
        assert inst.status == DEAD and inst.generation == 1 and inst.failed_starts == 2
        assert info["failed_starts"] == 2 and fleet.counters["replacements"] == 1

    asyncio.run(main())


def test_the_qos_header_carries_a_class_and_a_priority_or_none():
    from sloserve.workers.contract import parse_qos_header, qos_header

    assert parse_qos_header(qos_header("interactive", None)) == ("interactive", None)
    assert parse_qos_header(qos_header("batch jobs", -3)) == ("batch jobs", -3)  # the last word is the priority
    for bad in ("interactive", " -", "x y"):
        with pytest.raises(ValueError):
            parse_qos_header(bad)
