"""Speculative decoding with prompt-lookup drafts: the proposer, the SLO-aware gate, the
scheduler's accounting (against a deterministic stand-in model), and the real engine, whose
greedy output must not change by a single token with speculation on."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import EXACT
from sched_helpers import EOS, VOCAB
from sloserve.core.config import SchedulerConfig
from sloserve.kv.manager import KVCacheManager
from sloserve.sched.costs import StepLoad
from sloserve.sched.drafts import PromptLookupProposer, lookup, make_proposer
from sloserve.sched.plan import StepPlan, StepResult
from sloserve.sched.scheduler import Scheduler
from sloserve.sched.speculation import Speculator
from sloserve.core.types import Request, SamplingParams

# ---------------------------------------------------------------------- the proposer


def test_lookup_continues_the_latest_occurrence_of_the_longest_suffix():
    #        0  1  2  3  4  5  6  7  8  9 10
    prompt = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 9]
    # suffix [6, 7] occurs at 1 and 6; the latest (6) continues with 3, 4, 9
    assert lookup(prompt, [5, 6, 7], 3, max_ngram=3, min_ngram=2) == [3, 4, 9]
    # the 3-gram [9, 5, 6] is new, the 2-gram [5, 6] continues at index 7
    assert lookup(prompt + [9, 5, 6], [], 2, max_ngram=3, min_ngram=2) == [7, 3]


def test_lookup_prefers_longer_ngrams_and_respects_k_and_the_end():
    tokens = [1, 2, 3, 8, 9, 2, 3, 7, 1, 2, 3]
    # 3-gram [1, 2, 3] -> continues with 8 (a 2-gram [2, 3] alone would give the later 7)
    assert lookup(tokens, [], 4, 3, 2) == [8, 9, 2, 3]
    assert lookup(tokens, [], 1, 3, 2) == [8]
    assert lookup([1, 2, 1, 2], [], 5, 3, 2) == [1, 2]  # the continuation runs into the suffix: fewer tokens
    assert lookup([1, 2, 3, 4], [], 3, 3, 2) == []  # no earlier occurrence
    assert lookup([7], [], 3, 3, 1) == []


def test_lookup_ignores_byte_matches_that_straddle_tokens():
    # Little-endian 4-byte words: 256 = 00 01 00 00, 1 = 01 00 00 00. The bytes of [1, 0]
    # (01 00 00 00 00 00 00 00) appear starting inside [256, 0, 0], at no token boundary.
    tokens = [256, 0, 0, 5, 1, 0]
    assert lookup(tokens, [], 2, 2, 2) == []
    assert lookup([1, 0, 42, 256, 0, 0, 1, 0], [], 1, 2, 2) == [42]


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.integers(1, 6))
@settings(max_examples=200, deadline=None)
def test_lookup_matches_a_plain_search(tokens, k):
    def reference():
        for n in range(min(3, len(tokens) - 1), 1, -1):
            suffix = tokens[-n:]
            for i in range(len(tokens) - n - 1, -1, -1):
                if tokens[i:i + n] == suffix:
                    return tokens[i + n:i + n + k]
        return []

    assert lookup(tokens[:3], tokens[3:], k, 3, 2) == reference()


def test_make_proposer_by_name():
    assert isinstance(make_proposer("prompt-lookup"), PromptLookupProposer)
    with pytest.raises(ValueError, match="unknown draft proposer"):
        make_proposer("medusa")
    with pytest.raises(ValueError, match="unknown draft proposer"):
        Scheduler(SchedulerConfig(speculative="nope"), KVCacheManager(8, 16), 64)


# ---------------------------------------------------------------------- the gate


class LinearCost:
    """seconds = fixed + per_token * tokens: fixed-dominated is memory-bound, the other compute-bound."""

    def __init__(self, fixed: float, per_token: float):
        self.fixed, self.per_token = fixed, per_token

    def estimate(self, load: StepLoad) -> float:
        return self.fixed + self.per_token * load.num_tokens


def repeating_request(rid: str, greedy: bool = True, logprobs=None) -> Request:
    prompt = [1, 2, 3, 4] * 8
    params = SamplingParams(max_tokens=100, temperature=0.0 if greedy else 1.0, logprobs=logprobs)
    request = Request(rid, prompt, params)
    request.num_computed_tokens = len(prompt) - 1
    return request


def test_speculates_when_the_step_is_memory_bound():
    rows = [repeating_request("a"), repeating_request("b")]
    room = {"a": 10, "b": 10}
    free = Speculator(PromptLookupProposer(), 4, max_batch=8, estimator=LinearCost(0.010, 0.00005))
    assert free.plan(rows, budget=64, slack_s=math.inf, room=room) == {"a": [1, 2, 3, 4],
                                                                                   "b": [1, 2, 3, 4]}
    # Each row costs 2% of the step: the 4th draft (expected 0.5^4 tokens) no longer pays, the 3rd does.
    cheap = Speculator(PromptLookupProposer(), 4, max_batch=8, estimator=LinearCost(0.010, 0.0002))
    assert cheap.plan(rows, budget=64, slack_s=math.inf, room=room) == {"a": [1, 2, 3], "b": [1, 2, 3]}


def test_no_drafts_when_compute_bound_late_or_too_many():
    rows = [repeating_request("a"), repeating_request("b")]
    room = {"a": 10, "b": 10}
    compute_bound = Speculator(PromptLookupProposer(), 4, max_batch=8, estimator=LinearCost(0.001, 0.005))
    assert compute_bound.plan(rows, 64, math.inf, room) == {}
    assert compute_bound.stats.num_skipped_steps == 1
    cheap = Speculator(PromptLookupProposer(), 4, max_batch=8, estimator=LinearCost(0.010, 0.0002))
    # plain 10.4 ms; a single draft makes it 10.6 ms: a slack between them rules drafts out
    assert cheap.plan(rows, 64, slack_s=0.0105, room=room) == {}
    assert cheap.plan(rows, 64, slack_s=0.02, room=room) != {}
    assert Speculator(PromptLookupProposer(), 4, max_batch=1).plan(rows, 64, math.inf, room) == {}


def test_no_drafts_for_sampled_or_logprob_requests_and_within_room_and_budget():
    spec = Speculator(PromptLookupProposer(), 4, max_batch=8)
    rows = [repeating_request("s", greedy=False), repeating_request("l", logprobs=2), repeating_request("g")]
    assert spec.plan(rows, 64, math.inf, {"s": 9, "l": 9, "g": 2}) == {"g": [1, 2]}
    assert spec.plan(rows, 3, math.inf, {"s": 9, "l": 9, "g": 9}) == {"g": [1, 2, 3]}
    assert spec.plan(rows, 64, math.inf, {"s": 9, "l": 9, "g": 0}) == {}


def test_acceptance_history_steers_the_gate():
    spec = Speculator(PromptLookupProposer(), 4, max_batch=8, estimator=LinearCost(0.010, 0.0015))
    rows = [repeating_request("a")]
    assert spec.plan(rows, 64, math.inf, {"a": 10}) != {}  # prior acceptance 0.5 pays
    for _ in range(10):
        spec.observe("a", 4, 0)  # every first draft rejected
    assert spec._acceptance["a"] < 0.05
    assert spec.plan(rows, 64, math.inf, {"a": 10}) == {}
    spec.forget("a")
    assert spec.plan(rows, 64, math.inf, {"a": 10}) != {}
    assert spec.stats.num_draft_tokens == 40 and spec.stats.acceptance_rate == 0.0


def test_measured_row_costs_override_the_linear_estimate():
    rows = [repeating_request("a"), repeating_request("b")]
    room = {"a": 10, "b": 10}
    spec = Speculator(PromptLookupProposer(), 4, max_batch=8, estimator=LinearCost(0.010, 0.00005))
    assert spec.plan(rows, 64, math.inf, room) != {}  # the estimate: rows nearly free
    for n, seconds in ((2, 0.010), (4, 0.016), (10, 0.040)):  # measured: each extra row costs 3 ms
        spec.observe_step(StepLoad.decodes(n, 100 * n), seconds)
    spec.observe_step(StepLoad.prefill(64) + StepLoad.decodes(2, 200), 1.0)  # a prefill step teaches nothing
    assert spec.row_costs.estimate(3) == pytest.approx(0.013) and spec.row_costs.estimate(11) is None
    assert spec.plan(rows, 64, math.inf, room) == {}
    assert spec.stats.num_skipped_steps == 1


# ---------------------------------------------------------------------- the scheduler


def next_token(context: list[int], period: int) -> int:
    """The stand-in model: mostly repeats the token `period` back (so prompt lookup hits),
    sometimes breaks the pattern (so drafts get rejected mid-way), ends on EOS rarely."""
    h = hash(tuple(context[-6:])) % 97
    if h == 0:
        return EOS
    if h < 20:
        return h * 7 % (VOCAB - 1)
    return context[-period]


class VerifyingExecutor:
    """Computes every position of a step exactly as a model would (its next token depends on
    the whole context, drafts included) and accepts drafts like engine/runner.py does; checks
    that the scheduler never skips or repeats KV."""

    def __init__(self, period: int):
        self.period = period
        self.computed: dict[str, list[int]] = {}
        self.verified = 0

    def execute(self, plan: StepPlan) -> StepResult:
        sampled, more = {}, {}
        for s in plan.scheduled:
            req = s.request
            seen = self.computed.setdefault(req.request_id, [])
            del seen[s.start:]  # rejected drafts, a recompute or a prefix hit: rewritten from `start`
            seen[len(seen):] = [None] * (s.start - len(seen))
            pending = req.token_slice(s.start, s.start + s.num_new_tokens - len(s.draft_token_ids))
            seen.extend(pending + list(s.draft_token_ids))
            assert len(s.block_table) * 16 >= s.start + s.num_new_tokens
            if not s.samples:
                continue
            context = req.token_slice(0, s.start) + pending
            out = [next_token(context, self.period)]
            for d in s.draft_token_ids:
                if out[-1] != d:
                    break
                context.append(d)
                out.append(next_token(context, self.period))
            sampled[req.request_id] = out[0]
            if s.draft_token_ids:
                self.verified += 1
                more[req.request_id] = out[1:]
        return StepResult(sampled, 0.01, more_token_ids=more)


def run(sched: Scheduler, requests: list[Request], executor: VerifyingExecutor) -> dict[str, tuple]:
    for r in requests:
        sched.add_request(r)
    done, now = {}, 0.0
    for _ in range(5000):
        if not sched.has_unfinished():
            return done
        plan = sched.schedule(now)
        assert plan.num_batched_tokens <= sched.config.max_num_batched_tokens
        now += 0.01
        for r in sched.update(plan, executor.execute(plan), now):
            if r.is_finished:
                done[r.request_id] = (list(r.output_token_ids), r.finish_reason)
    raise AssertionError("did not finish")


def make_requests(n: int, prompt_len: int, max_tokens: int, seed: int) -> list[Request]:
    out = []
    for i in range(n):
        base = [(seed * 131 + i * 17 + j) % 50 for j in range(5)]
        prompt = (base * (prompt_len // 5 + 1))[:prompt_len]
        out.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    return out


@given(n=st.integers(1, 6), prompt_len=st.integers(6, 60), max_tokens=st.integers(1, 60), k=st.integers(1, 6),
       budget=st.sampled_from([8, 32, 128]), num_blocks=st.sampled_from([12, 64]), seed=st.integers(0, 99))
@settings(max_examples=60, deadline=None)
def test_scheduler_output_with_drafts_equals_plain_decoding(n, prompt_len, max_tokens, k, budget, num_blocks, seed):
    def scheduler(speculative: str) -> Scheduler:
        kv = KVCacheManager(num_blocks, 16, enable_prefix_caching=True, watermark=0.0)
        cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, speculative=speculative,
                              num_speculative_tokens=k)
        return Scheduler(cfg, kv, max_model_len=128, eos_token_ids=(EOS,))

    plain_sched, spec_sched = scheduler("off"), scheduler("prompt-lookup")
    plain = run(plain_sched, make_requests(n, prompt_len, max_tokens, seed), VerifyingExecutor(5))
    executor = VerifyingExecutor(5)
    spec = run(spec_sched, make_requests(n, prompt_len, max_tokens, seed), executor)
    assert spec == plain
    kv = spec_sched.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.num_pinned_blocks == 0  # no block outlives its request
    stats = spec_sched.speculator.stats
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert spec_sched.speculator._acceptance == {}  # per-request state dies with the request


def test_no_drafts_in_a_step_that_carries_a_prefill_chunk():
    kv = KVCacheManager(64, 16, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, speculative="prompt-lookup"), kv, 512,
                      eos_token_ids=())
    first, second = make_requests(2, 40, 50, seed=1)
    executor, now = VerifyingExecutor(5), 0.0

    def step():
        nonlocal now
        plan = sched.schedule(now)
        now += 0.01
        sched.update(plan, executor.execute(plan), now)
        return plan

    sched.add_request(first)
    step()  # its prefill
    # pure-decode steps of a repeating text: drafts come once the output repeats too
    assert any(any(s.draft_token_ids for s in step().scheduled) for _ in range(20))
    sched.add_request(second)
    mixed = step()
    assert any(s.is_prefill for s in mixed.scheduled) and not any(s.draft_token_ids for s in mixed.scheduled)


def test_scheduler_accepts_drafts_and_saves_steps():
    def steps(speculative: str) -> tuple[int, Scheduler]:
        kv = KVCacheManager(64, 16, watermark=0.0)
        cfg = SchedulerConfig(max_num_batched_tokens=64, speculative=speculative, num_speculative_tokens=4)
        sched = Scheduler(cfg, kv, max_model_len=256, eos_token_ids=())
        run(sched, make_requests(2, 20, 80, seed=3), VerifyingExecutor(5))
        return sched.stats.num_steps, sched

    plain_steps, _ = steps("off")
    spec_steps, sched = steps("prompt-lookup")
    stats = sched.speculator.stats
    assert stats.num_verify_steps > 0 and stats.num_accepted_tokens > 0
    assert spec_steps < plain_steps * 0.7, (spec_steps, plain_steps)


# ---------------------------------------------------------------------- the real engine


CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n")


@pytest.fixture(scope="module")
def engines():
    from sloserve.core.config import EngineConfig
    from sloserve.engine.llm_engine import LLMEngine

    def make(speculative: str) -> LLMEngine:
        return LLMEngine(EngineConfig(**EXACT, num_threads=1,
                                      scheduler=SchedulerConfig(speculative=speculative, num_speculative_tokens=4)))

    return make("off"), make("prompt-lookup")


def generate(engine, prompts, params) -> list[tuple]:
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.tokenizer.encode_chat([{"role": "user", "content": prompt}]), params,
                           request_id=f"q{i}")
    results = {}
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.delta_token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + out.delta_text
            if out.finished:
                results[out.request_id] = (results[out.request_id], texts[out.request_id], out.finish_reason,
                                           out.stop_reason)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [results[f"q{i}"] for i in range(len(prompts))]


PROMPTS = [f"Add a docstring to each function:\n{CODE}", "Repeat this sentence three times: the cat sat on the mat.",
           "What is the capital of France?"]


@pytest.mark.slow
def test_engine_greedy_output_is_identical_with_speculation(engines):
    plain, spec = engines
    params = SamplingParams(max_tokens=96, temperature=0.0)
    expected = generate(plain, PROMPTS, params)
    assert generate(spec, PROMPTS, params) == expected
    stats = spec.scheduler.speculator.stats
    assert stats.num_accepted_tokens > 0, stats
    assert spec.scheduler.stats.num_steps < plain.scheduler.stats.num_steps


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=0.0, stop=["return"]),
    SamplingParams(max_tokens=40, temperature=0.0, stop=["b\n"], include_stop_str_in_output=True),
    SamplingParams(max_tokens=7, temperature=0.0),
    SamplingParams(max_tokens=50, temperature=0.0, repetition_penalty=1.3, min_tokens=30),
], ids=["stop-string", "stop-included", "max-tokens", "penalty-min-tokens"])
@pytest.mark.slow
def test_engine_stops_and_penalties_are_exact_with_speculation(engines, params):
    plain, spec = engines
    assert generate(spec, PROMPTS[:2], params) == generate(plain, PROMPTS[:2], params)


def test_engine_sampled_and_logprob_requests_never_speculate(engines):
    _, spec = engines
    before = spec.scheduler.speculator.stats.num_draft_tokens
    generate(spec, PROMPTS[:1], SamplingParams(max_tokens=30, temperature=0.8, seed=1))
    generate(spec, PROMPTS[:1], SamplingParams(max_tokens=30, temperature=0.0, logprobs=1))
    assert spec.scheduler.speculator.stats.num_draft_tokens == before


# ---------------------------------------------------------------------- the real server


@pytest.mark.slow
def test_server_with_speculation_streams_what_the_engine_generates_without_it(engines, tmp_path):
    """`sloserve serve --speculative prompt-lookup` over loopback with the official client: the
    streamed chat completion (several tokens may arrive in one chunk) equals the non-streamed one
    and the plain engine's greedy output, and /metrics counts the accepted drafts."""
    from openai import OpenAI

    from server_helpers import ServerProcess, metric, scrape

    plain, _ = engines
    messages = [{"role": "user", "content": PROMPTS[0]}]
    expected = generate(plain, PROMPTS[:1], SamplingParams(max_tokens=80, temperature=0.0))[0]
    server = ServerProcess(["--speculative", "prompt-lookup", "--num-speculative-tokens", "4"], tmp_path / "srv.log")
    try:
        client = OpenAI(base_url=server.v1, api_key="none")
        model = client.models.list().data[0].id
        whole = client.chat.completions.create(model=model, messages=messages, max_tokens=80, temperature=0)
        chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=80, temperature=0,
                                                stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert whole.choices[0].message.content == streamed == expected[1]
        assert whole.usage.completion_tokens == len(expected[0])
        samples = scrape(server.base_url)
        assert metric(samples, "sloserve:spec_decode_num_accepted_tokens_total") > 0
        assert (metric(samples, "sloserve:spec_decode_num_draft_tokens_total")
                >= metric(samples, "sloserve:spec_decode_num_accepted_tokens_total"))
    finally:
        server.kill()
