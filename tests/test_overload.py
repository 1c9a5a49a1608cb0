"""Shedding under overload: the TTFT predictor on constructed loads (fast), and a real server
at ~3x its capacity with and without shedding (slow).

The integration test needs serving.py to call `admission.check_deadline(...)` after
tokenization (see sloserve/server/admission.py); without that call nothing is shed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from server_helpers import ROOT, free_port, stop_process
from sloserve.sched.costs import OnlineStepEstimator, StepLoad
from sloserve.server.admission import Admission
from sloserve.server.errors import APIError
from sloserve.server.shedding import EngineShape, Load, Shedder, Work, predict_ttft
from sloserve.core.types import QoSClass, Request, SamplingParams

# A machine where a step costs 10 ms + 0.1 ms per token + 1e-7 s per attended pair.
TRUE = (0.01, 1e-4, 1e-7)


def fitted_estimator() -> OnlineStepEstimator:
    est = OnlineStepEstimator(warmup=4)
    for tokens, decodes, ctx in [(8, 8, 800), (64, 2, 200), (256, 0, 0), (1, 1, 50), (128, 16, 4000),
                                 (32, 32, 3200), (512, 4, 400), (16, 16, 1600)] * 4:
        load = StepLoad.prefill(tokens - decodes) + StepLoad.decodes(decodes, ctx)
        attended = load.decode_context + load.prefill_attention
        est.observe(load, TRUE[0] + TRUE[1] * load.num_tokens + TRUE[2] * attended)
    return est


SHAPE = EngineShape(max_num_seqs=4, step_tokens=256)


def test_estimator_fit_is_what_the_predictor_prices_with():
    est = fitted_estimator()
    for c, t in zip(est.coefficients, TRUE):
        assert math.isclose(c, t, rel_tol=0.05, abs_tol=1e-9)


def test_empty_engine_predicts_the_prompts_own_prefill():
    est = fitted_estimator()
    assert math.isclose(predict_ttft(Load(), 100, SHAPE, est), est.estimate(StepLoad.prefill(100)), rel_tol=1e-9)
    # 600 tokens take three chunks of the 256-token budget
    assert math.isclose(predict_ttft(Load(), 600, SHAPE, est), 3 * est.estimate(StepLoad.prefill(256)), rel_tol=1e-9)


def test_queued_prefill_ahead_adds_its_steps():
    est = fitted_estimator()
    alone = predict_ttft(Load(), 50, SHAPE, est)
    # two requests ahead with free slots: all three prefill together (chunked), 3 x 200 + 50 tokens
    ahead = Load(ahead=(Work(200, 10), Work(200, 10)))
    behind = predict_ttft(ahead, 50, SHAPE, est)
    assert behind > alone
    assert math.isclose(behind, 2 * est.estimate(StepLoad.prefill(256)), rel_tol=1e-9)  # 450 tokens: 2 steps


def test_full_batch_waits_for_the_first_decoder_to_finish():
    est = fitted_estimator()
    running = tuple(Work(0, n, 100) for n in (40, 80, 120, 160))  # 4 slots taken
    t = predict_ttft(Load(running=running), 10, SHAPE, est)
    # 40 decode steps of 4 requests, then a step with the 10-token prefill beside 3 decoders
    decodes = sum(est.estimate(StepLoad.decodes(4, 400 + 4 * i)) for i in range(40))
    assert t == pytest.approx(decodes + est.estimate(StepLoad.prefill(10) + StepLoad.decodes(3, 3 * 140)),
                              rel=0.02)
    # a queue ahead needs more slots to free: monotone in the work ahead
    longer = predict_ttft(Load(running=running, ahead=(Work(10, 50), Work(10, 50))), 10, SHAPE, est)
    assert longer > t + 40 * est.estimate(StepLoad.decodes(4, 400))


def test_prediction_grows_with_work_and_count():
    est = fitted_estimator()
    loads = [Load(running=(Work(0, 30, 50),) * 4, ahead=(Work(40, 30),) * k) for k in (0, 2, 4, 8, 16)]
    times = [predict_ttft(load, 40, SHAPE, est) for load in loads]
    assert times == sorted(times) and times[-1] > 3 * times[0]
    assert predict_ttft(loads[2], 40, SHAPE, est, count=3) > predict_ttft(loads[2], 40, SHAPE, est)


def test_a_big_queue_is_predicted_in_events_not_steps():
    """The prediction jumps between events (a prefill batch done, a decoder finished): its step
    cost estimates grow with the requests, not with the thousands of steps they take."""
    est = fitted_estimator()
    calls = []
    real = est.estimate
    est.estimate = lambda load: calls.append(load) or real(load)  # type: ignore[method-assign]
    running, queued = 64, 512
    load = Load(running=tuple(Work(0, 100 + i, 200) for i in range(running)),
                ahead=tuple(Work(300, 200) for _ in range(queued)))
    ttft = predict_ttft(load, 100, EngineShape(64, 2048), est)
    steps = ttft / real(StepLoad.decodes(64, 64 * 300))  # at least this many full-batch steps pass first
    assert steps > 2000 and 0 < len(calls) <= 2 * (running + queued + 1)


# ---------------------------------------------------------------------- the shedder on a scheduler view


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_core(policy: str = "fcfs", max_num_seqs: int = 2):
    sched = SimpleNamespace(running=[], waiting=[], requests={})
    return SimpleNamespace(scheduler=sched, step_estimator=fitted_estimator(), max_model_len=2048,
                           config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=max_num_seqs,
                                                                            max_num_batched_tokens=256,
                                                                            policy=policy)),
                           clock=FakeClock())


def engine_request(rid: str, prompt: int, max_tokens: int, outputs: int = 0, computed: int = 0,
                   qos: QoSClass = QoSClass(), arrival: float = 100.0) -> Request:
    r = Request(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens), arrival_time=arrival, qos=qos)
    r.output_token_ids = [1] * outputs
    r.num_computed_tokens = computed
    return r


FAST = QoSClass("fast", ttft_target_s=0.5)
SLOW = QoSClass("slow", ttft_target_s=60.0, priority=1)


def test_shedder_refuses_what_cannot_meet_its_target_and_says_when_to_retry():
    core = make_core()
    adm = Admission(max_running=2, max_queue=100, shedder=Shedder(core))
    adm.check_deadline(20, FAST, max_tokens=100)  # idle engine: admitted
    # two decoders with 200 tokens left hold both slots: ~200 steps (~2 s) before a slot frees
    for i in range(2):
        r = engine_request(f"run{i}", 20, 220, outputs=20, computed=39)
        core.scheduler.running.append(r)
        core.scheduler.requests[r.request_id] = r
    with pytest.raises(APIError) as shed:
        adm.check_deadline(20, FAST, max_tokens=100)
    err = shed.value
    assert err.status == 429 and err.code == "slo_unattainable"
    predicted = adm.shedder.predict(20, FAST)
    # the message names the threshold it applied (a share of the target), so 4.6 s against 5 s reads right
    assert f"({predicted:.1f}s) is past 90% of the 'fast' class's target ({FAST.ttft_target_s:g}s)" in str(err)
    assert int(err.headers["Retry-After"]) == max(1, math.ceil(predicted - FAST.ttft_target_s))
    adm.check_deadline(20, SLOW, max_tokens=100)  # a looser target still fits
    adm.check_deadline(20, QoSClass("none"), max_tokens=100)  # no TTFT target: counts only


def test_shedder_ledger_sees_a_burst_the_scheduler_has_not_picked_up():
    core = make_core(max_num_seqs=4)
    shedder = Shedder(core)
    adm = Admission(max_running=4, max_queue=100, shedder=shedder)
    target = QoSClass("t", ttft_target_s=1.0)
    admitted = 0
    for i in range(50):  # one step in flight: the engine thread sees none of these yet
        try:
            adm.check_deadline(30, target, max_tokens=100)
        except APIError as err:
            assert err.code == "slo_unattainable"
            break
        adm.admit([f"b{i}"])
        admitted += 1
    assert 4 <= admitted < 50, admitted  # the first batch fits; the ledger stops the burst
    # once the scheduler holds them, the ledger hands over: the same load, counted once
    for i in range(admitted):
        r = engine_request(f"b{i}", 30, 100)
        core.scheduler.waiting.append(r)
        core.scheduler.requests[r.request_id] = r
    with_sched = shedder.predict(30, target)
    assert len(shedder._ledger) == 0
    for i in range(admitted):
        adm.release(f"b{i}")
        core.scheduler.waiting.clear()
    assert shedder.predict(30, target) < with_sched


def test_shedder_under_priority_policy_only_counts_requests_ranked_ahead():
    core = make_core(policy="priority", max_num_seqs=1)
    shedder = Shedder(core)
    for i in range(20):
        r = engine_request(f"w{i}", 200, 200, qos=SLOW)  # low priority (1) backlog
        core.scheduler.waiting.append(r)
        core.scheduler.requests[r.request_id] = r
    urgent = QoSClass("urgent", ttft_target_s=0.5, priority=0)
    assert shedder.predict(20, urgent) < 0.5 < shedder.predict(20, SLOW)
    shedder.check(20, urgent)  # not refused: the backlog ranks behind it


def test_shedder_learns_how_far_off_its_predictions_run_from_first_tokens():
    """An engine 1.5x slower than its step estimator says (the time between steps is not priced): the first
    tokens of admitted requests teach the shedder the ratio, and it then refuses what it admitted before."""
    core = make_core(max_num_seqs=2)
    adm = Admission(max_running=2, max_queue=100, shedder=Shedder(core))
    shedder = adm.shedder
    target = QoSClass("t", ttft_target_s=1.0)
    for i in range(2):  # two decoders hold both slots: a new request waits for the first to finish
        r = engine_request(f"run{i}", 20, 80 + 10 * i, outputs=10, computed=29)
        core.scheduler.running.append(r)
        core.scheduler.requests[r.request_id] = r
    raw = shedder.predict(20, target)
    assert 0.2 < raw < 0.9 and shedder.calibration == 1.0  # admitted as things stand
    assert 1.5 * raw > shedder.headroom * target.ttft_target_s  # ...and would not be at its true cost
    admitted = 0
    with pytest.raises(APIError) as shed:
        for i in range(12):
            adm.check_deadline(20, target, max_tokens=8)
            adm.admit([f"a{i}"])
            admitted += 1
            core.clock.now += 1.5 * raw  # its first token comes 1.5x later than predicted
            adm.first_token(f"a{i}")
            adm.release(f"a{i}")
    assert shed.value.code == "slo_unattainable" and admitted >= 1
    assert shedder.calibration == pytest.approx(1.5)
    assert shedder.predict(20, target) == pytest.approx(1.5 * raw)
    # a request whose wait was negligible teaches nothing (fixed costs would dominate its ratio)
    idle = make_core()
    quiet = Admission(max_running=2, max_queue=100, shedder=Shedder(idle))
    quiet.check_deadline(20, target, max_tokens=8)
    quiet.admit(["q"])
    idle.clock.now += 0.5
    quiet.first_token("q")
    assert quiet.shedder.calibration == 1.0


def test_shedder_tightens_within_a_few_late_first_tokens_and_relaxes_slowly():
    """A machine that slows down mid-burst (a neighbour takes a core): the last few first tokens
    override a window of on-time ones, so admission tightens before a whole window of late requests
    has been admitted; when speed returns, the longer window decides."""
    core = make_core(max_num_seqs=2)
    adm = Admission(max_running=2, max_queue=1000, shedder=Shedder(core))
    shedder = adm.shedder
    target = QoSClass("t", ttft_target_s=1.0)
    for i in range(2):
        r = engine_request(f"run{i}", 20, 80 + 10 * i, outputs=10, computed=29)
        core.scheduler.running.append(r)
        core.scheduler.requests[r.request_id] = r
    raw = shedder.predict(20, target)
    lax = QoSClass("lax", ttft_target_s=2.0)  # admitted at every calibration below, learnt from (raw >= 0.2 x 2 s)

    def feed(n: int, ratio: float, tag: str) -> None:
        for i in range(n):
            adm.check_deadline(20, lax, max_tokens=8)
            adm.admit([f"{tag}{i}"])
            core.clock.now += ratio * raw
            adm.first_token(f"{tag}{i}")
            adm.release(f"{tag}{i}")

    feed(32, 0.6, "fast")  # a full window, all early: predictions are scaled down
    assert shedder.calibration == pytest.approx(0.6)
    adm.check_deadline(20, target, max_tokens=8)  # admitted...
    adm.admit(["before"])
    adm.release("before")
    feed(5, 1.8, "slow")  # five late first tokens of 32: the window's median alone would not move
    assert shedder.calibration == pytest.approx(1.8)
    with pytest.raises(APIError):  # ...refused now
        adm.check_deadline(20, target, max_tokens=8)
    feed(8, 0.6, "back")  # speed returns: the last 8 are early again, the window's median decides
    assert shedder.calibration == pytest.approx(0.6)


# ---------------------------------------------------------------------- a real server at 3x its capacity

# `bulk` (no TTFT target, never shed) measures capacity; the burst is all `interactive`, whose TTFT target is
# set from the measured capacity: 2.5 batches' worth of service time (at least 1.5 s), so the queueing regime is
# the same on a fast and a slow machine (a fixed 1.5 s was 2.4 batches on the AMX Xeon and 0.7 on a slow EPYC,
# where only the tail of the running batch could be waited for).
MAX_NUM_SEQS = 4


def qos_config(ttft_s: float) -> dict:
    return {"default_class": "interactive",
            "classes": {"interactive": {"ttft_s": ttft_s, "priority": 0}, "bulk": {"priority": 0}}}


def ttft_target_for(capacity: float) -> float:
    return max(1.5, 2.5 * MAX_NUM_SEQS / capacity)

MAX_TOKENS = 24
BURST_S = 8.0  # at 3x capacity the unshed queue waits ~16 s at its end; a 5 s burst failed once in CI (57.7% shed attainment)
LAUNCH = """
import json, logging, sys
from sloserve.core.config import EngineConfig, SchedulerConfig
from sloserve.server.launcher import run_server
from sloserve.server.qos import parse_qos_config
from sloserve.server.settings import ServerSettings
a = json.loads(sys.argv[1])
logging.basicConfig(level=logging.WARNING)
settings = ServerSettings(registry=parse_qos_config(a["qos"]), max_queue=a["max_queue"],
                          shed_unattainable=a["shed"], grace_period_s=0.0)
config = EngineConfig(num_threads=1, scheduler=SchedulerConfig(max_num_seqs=a["max_num_seqs"]))
sys.exit(run_server(config, settings, host="127.0.0.1", port=a["port"]))
"""


class Server:
    """The real server in its own process (its own GIL), with settings the CLI may not expose."""

    def __init__(self, shed: bool, log: Path, ttft_s: float = 1.5) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = json.dumps({"qos": qos_config(ttft_s), "max_queue": 48, "max_num_seqs": MAX_NUM_SEQS, "shed": shed,
                           "port": self.port})
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self._log = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCH, args], cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                raise AssertionError(log.read_text())
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.close()  # a server that did not come up must not live on beside the next test
        raise TimeoutError(log.read_text())

    def close(self) -> None:
        stop_process(self.proc)
        self._log.close()


async def _one(client: httpx.AsyncClient, i: int, qos_class: str = "interactive") -> tuple[int, float]:
    """(status, client-side TTFT) of one streamed completion."""
    body = {"prompt": f"Request {i}: write a short story about a cat named {i}.", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True, "qos_class": qos_class}
    start = time.monotonic()
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            if resp.status_code == 429:
                assert resp.headers["retry-after"].isdigit() and int(resp.headers["retry-after"]) >= 1
            return resp.status_code, math.nan
        ttft = math.nan
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and math.isnan(ttft):
                ttft = time.monotonic() - start
        return 200, ttft


async def _calibrate(url: str) -> float:
    """Requests per second the server completes with a full batch."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(_one(client, -i, "bulk") for i in range(1, 5)))  # warm up, fit the estimator
        start = time.monotonic()
        results = await asyncio.gather(*(_one(client, i, "bulk") for i in range(8)))
        assert all(status == 200 for status, _ in results), results
        return 8 / (time.monotonic() - start)


async def _burst(url: str, rate: float, duration_s: float) -> list[tuple[int, float]]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=400)) as client:
        tasks = []
        start = time.monotonic()
        for i in range(int(rate * duration_s)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(_one(client, 1000 + i)))
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)


@pytest.mark.slow
@pytest.mark.alone  # a neighbour whose load changes mid-burst moved the attainment from 100% to 72-78% in CI
def test_shedding_keeps_admitted_requests_within_their_ttft_target(tmp_path):
    outcomes, results = {}, {}
    capacity = target = None
    for shed in (False, True):  # unshed first: its capacity sets the target (it sheds nothing, whatever its own)
        server = Server(shed, tmp_path / f"server-shed-{shed}.log", ttft_s=target or 1.5)
        try:
            if capacity is None:
                capacity = asyncio.run(_calibrate(server.url))
                target = ttft_target_for(capacity)
            else:
                asyncio.run(_calibrate(server.url))  # the same warm-up for a fair comparison
            results[shed] = asyncio.run(_burst(server.url, 3 * capacity, BURST_S))
        finally:
            server.close()
        ok = [ttft for status, ttft in results[shed] if status == 200]
        assert all(status in (200, 429) for status, _ in results[shed]), results[shed]
        assert ok, f"nothing admitted (shed={shed})"
        within = sum(ttft <= target for ttft in ok)
        outcomes[shed] = (within / len(ok), within, len(ok), len(results[shed]))
    logging.getLogger(__name__).warning(
        "capacity %.1f req/s, TTFT target %.2f s; (attainment, within target, admitted, sent): unshed %s, shed %s",
        capacity, target, outcomes[False], outcomes[True])
    # in arrival order, those over the target marked: a failure shows when in the burst they missed
    admitted_ttfts = [f"{t:.2f}{'!' if t > target else ''}" for status, t in results[True] if status == 200]
    # at 3x capacity the unshed queue's wait grows ~2 s a second: far past 2.5 batches' service time
    assert outcomes[False][0] < 0.5, outcomes
    assert outcomes[True][0] >= 0.8, (outcomes, admitted_ttfts)
    assert outcomes[True][1] > outcomes[False][1], outcomes  # more goodput, not only fewer requests
    # it refuses the excess, not what it could serve: at least half of capacity x duration
    assert outcomes[True][2] >= 0.5 * capacity * BURST_S, (capacity, outcomes)
