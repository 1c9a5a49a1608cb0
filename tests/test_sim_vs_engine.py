"""The point of sharing the code: a simulated instance and the real engine, given the same
requests, plan the same steps in the same order."""
from __future__ import annotations

import itertools

import pytest

from engine_helpers import EXACT
from sloserve import LLM
from sloserve.core.config import CacheConfig, SchedulerConfig
from sloserve.profiler import profile_engine
from sloserve.sched.costs import StepLoad
from sloserve.sim.cost import ProfiledCostModel, RooflineCostModel
from sloserve.sim.hardware import get_hardware
from sloserve.sim.instance import SimInstance
from sloserve.sim.simulator import Simulator
from sloserve.cluster.routers import make_router
from sloserve.core.types import Request, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["Hi", "The capital of France is", "Write a haiku about the sea. " * 6, "Count: 1, 2, 3, " * 10,
           "Explain photosynthesis in detail. " * 12, "Count: 1, 2, 3, " * 10 + "Go on."]
MAX_TOKENS = [12, 20, 6, 15, 9, 12]


def test_simulated_instance_plans_the_same_steps_as_the_engine():
    # A small pool and budget force chunking, preemption and prefix hits on both sides.
    llm = LLM(num_blocks=14, max_num_batched_tokens=48, max_num_seqs=4, **EXACT)
    engine = llm.engine
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]

    real_plans = []
    execute = engine.runner.execute

    def recording_execute(plan):
        real_plans.append(plan.composition)
        return execute(plan)

    engine.runner.execute = recording_execute
    llm.generate(prompts, params)
    assert engine.scheduler.stats.num_preemptions > 0 and engine.kv.stats.hits > 0

    cost = RooflineCostModel(get_hardware("cpu"), engine.model_config, dtype_bytes=4)
    sim = SimInstance(0, cost, num_blocks=14, max_model_len=engine.max_model_len,
                      scheduler_config=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=4),
                      cache_config=CacheConfig(block_size=16), trace=True)
    requests = [Request(f"req-{i}", p, sp, arrival_time=0.0) for i, (p, sp) in enumerate(zip(prompts, params))]
    result = Simulator([sim], make_router("round-robin")).run(requests)
    assert len(result.finished) == len(PROMPTS)
    assert [t.composition for t in sim.traces] == real_plans


# Shapes of QUICK_GRID's kinds (decode-only, prefill-only, mixed, chunks after a prefix), smaller: QUICK_GRID's
# own take the float32 reference engine over a minute on 2 cores.
SMALL_GRID = [*itertools.product((0, 2, 8), (32, 64), (0, 16, 48), (0, 32)), *((d, 64, 0, 0) for d in (1, 3, 5))]


def test_profile_of_the_real_engine_fits_its_step_times(llm):
    profile = profile_engine(llm.engine, SMALL_GRID, repeats=1, passes=1, min_point_s=0.0)  # the structure, not the fit
    # How well the fit matches depends on how quiet the machine is (a timing property, reported by
    # `sloserve profile`, not asserted here); the structure of the profile does not.
    assert len(profile.samples) >= 20 and profile.fit_error is not None and profile.fit_error >= 0
    assert profile.knots == sorted(profile.knots) and profile.decode_knots == sorted(profile.decode_knots)
    assert len(profile.coefficients) == len(profile.knots) + len(profile.decode_knots) + 3
    model = ProfiledCostModel(profile)
    small = model.step_time(StepLoad.decodes(1, 64))
    big = model.step_time(StepLoad(128 + 16, 17, 16, 16 * 256, 128 * 64.5, 128))
    assert 0 < small < big
    assert llm.engine.kv.pool.num_used == 0 and not llm.engine.has_unfinished_requests()
