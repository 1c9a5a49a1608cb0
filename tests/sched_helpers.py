"""A deterministic stand-in model for scheduler tests: the next token is a function of the
whole context, so any scheduling bug that loses or repeats KV shows up as different output."""
from __future__ import annotations

from sloserve.core.config import SchedulerConfig
from sloserve.kv.manager import KVCacheManager
from sloserve.sched.plan import StepPlan, StepResult
from sloserve.sched.scheduler import Scheduler
from sloserve.core.types import Request, SamplingParams

VOCAB = 1000
EOS = 999


class ContextHashExecutor:
    """Tracks, per request, the tokens whose 'KV' it has computed and checks that every
    step continues exactly where the previous one stopped (or restarts after preemption)."""

    def __init__(self) -> None:
        self.computed: dict[str, list[int]] = {}
        self.plans: list[tuple] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan.composition)
        out = {}
        for s in plan.scheduled:
            req = s.request
            seen = self.computed.setdefault(req.request_id, [])
            if s.start < len(seen):  # recompute after preemption, or prefix hit
                del seen[s.start:]
            assert s.start <= len(seen) or s.start % 16 == 0, "gap in computed tokens"
            seen[len(seen):] = [None] * (s.start - len(seen))  # prefix-cache hit tokens
            seen.extend(req.token_slice(s.start, s.start + s.num_new_tokens))
            assert len(s.block_table) * 16 >= s.context_len
            if s.samples:
                out[req.request_id] = hash(tuple(req.all_token_ids)) % (VOCAB - 1)
        return StepResult(out, duration_s=0.01)


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_seqs: int = 16, policy: str = "fcfs",
                   max_model_len: int = 1024, caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, 16, enable_prefix_caching=caching, watermark=0.0)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, policy=policy)
    return Scheduler(cfg, kv, max_model_len, eos_token_ids=(EOS,))


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, arrival: float = 0.0, **kw) -> Request:
    prompt = [(hash((rid, i)) % (VOCAB - 1)) for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival_time=arrival, **kw)


def run_to_completion(sched: Scheduler, executor=None, max_steps: int = 10_000) -> dict[str, list[int]]:
    executor = executor or ContextHashExecutor()
    done: dict[str, list[int]] = {}
    now = 0.0
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return done
        plan = sched.schedule(now)
        assert not plan.is_empty, "scheduler stalled with unfinished requests"
        assert plan.num_batched_tokens <= sched.config.max_num_batched_tokens
        result = executor.execute(plan)
        now += result.duration_s
        for r in sched.update(plan, result, now):
            if r.is_finished:
                done[r.request_id] = list(r.output_token_ids)
    raise AssertionError("did not finish")
