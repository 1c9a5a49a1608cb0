"""The instance scheduler on a deterministic stand-in executor (no model needed)."""
from __future__ import annotations

import pytest

from sched_helpers import EOS, ContextHashExecutor, make_request, make_scheduler, run_to_completion
from sloserve.sched.live_state import LiveInstanceState, Moment
from sloserve.sched.plan import StepResult
from sloserve.core.types import FinishReason, QoSClass, Request, RequestStatus, SamplingParams


def test_continuous_batching_finishes_everything_within_budget():
    sched = make_scheduler(num_blocks=400, budget=64)
    for i in range(8):
        sched.add_request(make_request(f"r{i}", 10 + 29 * i, max_tokens=12, arrival=i))
    out = run_to_completion(sched)
    assert sorted(out) == [f"r{i}" for i in range(8)]
    assert all(len(v) == 12 for v in out.values())
    assert sched.stats.max_batch_size > 1
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_decodes_are_never_stalled_by_a_long_prefill():
    sched = make_scheduler(num_blocks=400, budget=32)
    sched.add_request(make_request("short", 5, max_tokens=30, arrival=0))
    executor = ContextHashExecutor()
    now, saw_long_chunk = 0.0, False
    for step in range(60):
        if step == 3:
            sched.add_request(make_request("long", 300, max_tokens=2, arrival=1))
        decoding = {r.request_id for r in sched.running if r.num_tokens - r.num_computed_tokens == 1}
        plan = sched.schedule(now)
        ids = {s.request_id for s in plan.scheduled}
        assert decoding <= ids, f"step {step}: decodes {decoding - ids} were starved"
        for s in plan.scheduled:
            if s.request_id == "long" and s.num_new_tokens > 1:
                saw_long_chunk = True
                assert s.num_new_tokens <= 31  # the decode took one token of the 32 budget
                assert s.samples == (s.start + s.num_new_tokens == 300)
        result = executor.execute(plan)
        sched.update(plan, result, now)
        if not sched.has_unfinished():
            break
    assert saw_long_chunk


def test_long_prefill_threshold_caps_chunks():
    sched = make_scheduler(num_blocks=400, budget=128)
    sched.config.long_prefill_token_threshold = 40
    sched.add_request(make_request("a", 200, max_tokens=1))
    plan = sched.schedule(0.0)
    assert plan.scheduled[0].num_new_tokens == 40


def test_preemption_by_recompute_keeps_outputs_and_frees_everything():
    prompts = [(f"r{i}", 20 + 37 * i) for i in range(6)]
    big = make_scheduler(num_blocks=400, budget=64)
    small = make_scheduler(num_blocks=15, budget=64, max_model_len=15 * 16)
    for sched in (big, small):
        for i, (rid, n) in enumerate(prompts):
            sched.add_request(make_request(rid, n, max_tokens=20, arrival=i))
    expected = run_to_completion(big)
    got = run_to_completion(small)
    assert small.stats.num_preemptions > 0
    assert got == expected
    assert small.kv.num_free_blocks == small.kv.num_blocks
    small.kv.check_invariants()


def test_priority_policy_admits_and_keeps_the_urgent_request():
    sched = make_scheduler(num_blocks=8, budget=256, policy="priority", max_model_len=128)
    sched.add_request(make_request("low", 60, max_tokens=40, arrival=0, priority=5))
    executor = ContextHashExecutor()
    plan = sched.schedule(0.0)
    sched.update(plan, executor.execute(plan), 0.0)
    sched.add_request(make_request("high", 60, max_tokens=40, arrival=1, priority=0))
    now, order = 1.0, []
    while sched.has_unfinished():
        plan = sched.schedule(now)
        for r in sched.update(plan, executor.execute(plan), now):
            if r.is_finished:
                order.append(r.request_id)
        now += 1
    assert order == ["high", "low"]
    assert sched.stats.num_preemptions >= 1


def test_fcfs_waiting_order_is_arrival_order():
    sched = make_scheduler(num_blocks=400, budget=16, max_seqs=1)
    for i, rid in enumerate(["c", "a", "b"]):
        sched.add_request(make_request(rid, 8, max_tokens=2, arrival=[3, 1, 2][i]))
    assert [r.request_id for r in sched.waiting] == ["a", "b", "c"]


def test_prefix_cache_hit_skips_computed_blocks():
    sched = make_scheduler(num_blocks=100, budget=256)
    first = make_request("a", 70, max_tokens=3)
    sched.add_request(first)
    run_to_completion(sched)
    second = Request("a2", list(first.prompt_token_ids), SamplingParams(max_tokens=3, temperature=0.0))
    sched.add_request(second)
    plan = sched.schedule(1.0)
    assert plan.scheduled[0].start == 64  # four full 16-token blocks reused
    assert second.num_cached_tokens == 64
    assert sched.kv.stats.hits == 64


def test_abort_frees_blocks_wherever_the_request_is():
    sched = make_scheduler(num_blocks=100, budget=32, max_seqs=1)
    sched.add_request(make_request("run", 50, max_tokens=10))
    sched.add_request(make_request("wait", 50, max_tokens=10))
    plan = sched.schedule(0.0)
    assert sched.kv.num_free_blocks < sched.kv.num_blocks
    assert sched.abort_request("run") and sched.abort_request("wait")
    assert not sched.abort_request("unknown")
    # The step that was in flight comes back after the abort: it must be ignored.
    assert sched.update(plan, StepResult({}), 0.1) == []
    assert not sched.has_unfinished()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_stop_conditions():
    sched = make_scheduler(num_blocks=100, budget=64, max_model_len=40)
    sched.add_request(make_request("ctx", 30, max_tokens=None))
    req = sched.requests["ctx"]
    assert req.max_output_tokens == 10
    run_to_completion(sched)
    assert req.finish_reason is FinishReason.LENGTH and req.num_tokens == 40

    class EOSExecutor(ContextHashExecutor):
        def execute(self, plan):
            res = super().execute(plan)
            return StepResult({k: EOS for k in res.sampled_token_ids})

    for ignore_eos, min_tokens, want in [(False, 0, 1), (True, 0, 5), (False, 3, 3)]:
        sched = make_scheduler()
        r = make_request("e", 10, max_tokens=5)
        r.sampling_params.ignore_eos = ignore_eos
        r.sampling_params.min_tokens = min_tokens
        sched.add_request(r)
        run_to_completion(sched, EOSExecutor())
        assert r.num_output_tokens == want and r.status is RequestStatus.FINISHED


def test_bad_requests_are_rejected_before_any_work():
    sched = make_scheduler(max_model_len=64)
    with pytest.raises(ValueError):
        sched.add_request(make_request("empty", 0))
    with pytest.raises(ValueError):
        sched.add_request(make_request("long", 64))
    sched.add_request(make_request("ok", 10))
    with pytest.raises(ValueError):
        sched.add_request(make_request("ok", 10))
    assert list(sched.requests) == ["ok"] and sched.kv.num_free_blocks == sched.kv.num_blocks


def test_live_view_recomputes_queue_fields_at_each_moment():
    """One view lives for a whole simulation: counters are always current, fields that walk a
    queue are kept within a moment and recomputed once the moment advances."""
    sched = make_scheduler(num_blocks=100, budget=32)
    moment = Moment(0.0)
    view = LiveInstanceState(sched, moment)
    sched.add_request(make_request("a", 50, max_tokens=10))
    assert view.num_requests == 1 and view.kv_blocks_waiting == 4 and view.kv_blocks_used == 0
    sched.schedule(0.0)  # admits "a" with a 32-token chunk: 2 blocks
    assert view.num_running == 1 and view.num_waiting == 0  # counters: current at once
    assert view.kv_blocks_used == 0 and view.kv_blocks_waiting == 4  # kept for this moment
    moment.advance(0.0)
    assert view.kv_blocks_used == 2 and view.kv_blocks_waiting == 0


def test_snapshot_reports_load():
    sched = make_scheduler(num_blocks=100, budget=32)
    sched.add_request(make_request("a", 50, max_tokens=10, qos=QoSClass("i", ttft_target_s=2.0)))
    sched.add_request(make_request("b", 20, max_tokens=5, arrival=1.0, qos=QoSClass("i", ttft_target_s=2.0)))
    state = sched.snapshot(now=0.5)
    assert state.num_waiting == 2 and state.queued_prefill_tokens == 70
    assert state.predicted_remaining_decode_tokens == 15
    assert state.min_ttft_slack_s == pytest.approx(1.5)
    sched.schedule(0.5)
    state = sched.snapshot(now=0.5)
    assert state.num_running == 1 and state.kv_blocks_used == 2


def test_without_chunked_prefill_a_prompt_that_no_step_can_hold_is_refused_not_left_waiting_forever():
    from sloserve.core.config import SchedulerConfig
    from sloserve.kv.manager import KVCacheManager
    from sloserve.sched.scheduler import Scheduler

    kv = KVCacheManager(64, 16, enable_prefix_caching=True, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, enable_chunked_prefill=False),
                      kv, 1024, eos_token_ids=(EOS,))
    # 60 prompt tokens + 8 outputs: a recompute after a preemption would need 68 > 64 in one step.
    with pytest.raises(ValueError, match="without chunked prefill"):
        sched.add_request(make_request("long", 60, max_tokens=8))
    assert not sched.has_unfinished() and kv.num_free_blocks == 64
    sched.add_request(make_request("fits", 50, max_tokens=8))
    assert set(run_to_completion(sched)) == {"fits"}
