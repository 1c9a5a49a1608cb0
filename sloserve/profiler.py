"""`sloserve profile`: measure the real engine's step time over a grid of batch compositions
and fit the simulator's profiled cost model to it.

Steps are built directly (a private KV manager hands out blocks; their contents are whatever
the pool holds), because a step's time depends on its shape, not on the numbers in the cache.
That makes a 64 x 1024-token decode batch cost one step to measure instead of 64k tokens of
prefill to set up.
"""
from __future__ import annotations

import itertools
import logging
import platform
import statistics
import time
from dataclasses import asdict
from typing import Callable, Iterable, Optional

from sloserve.engine.llm_engine import LLMEngine
from sloserve.kv.manager import KVCacheManager
from sloserve.sched.plan import ScheduledRequest, StepPlan
from sloserve.sched.costs import StepLoad
from sloserve.sim.cost import Profile, choose_knots, features, fit_nonnegative
from sloserve.types import Request, SamplingParams

logger = logging.getLogger(__name__)

# (decodes, decode context, prefill chunk, prefill start)
QUICK_GRID = list(itertools.product((0, 4, 16), (64, 256), (0, 32, 128), (0, 128)))
FULL_GRID = list(itertools.product((0, 1, 8, 32, 64), (128, 512, 1024), (0, 64, 256, 512), (0, 512)))


def _grid_points(grid: Iterable[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    points = []
    for d, ctx, n, start in grid:
        if d == 0 and n == 0:
            continue
        if d == 0:
            ctx = 0  # the decode context does not matter without decodes
        if n == 0:
            start = 0
        if (d, ctx, n, start) not in points:
            points.append((d, ctx, n, start))
    return points


def _build_plan(engine: LLMEngine, kv: KVCacheManager, decodes: int, ctx: int, chunk: int, start: int,
                step_id: int) -> tuple[StepPlan, list[Request]]:
    vocab = engine.model_config.vocab_size
    scheduled, requests = [], []

    def request(num_tokens: int, computed: int, i: int) -> Request:
        ids = [(7919 * (i + 1) + 31 * k) % vocab for k in range(num_tokens)]
        req = Request(f"profile-{step_id}-{i}", ids, SamplingParams(max_tokens=1, temperature=0))
        if kv.allocate_slots(req, num_tokens) is None:
            raise ValueError("profile grid does not fit in the KV pool; lower the grid or raise --kv-cache-gib")
        req.num_computed_tokens = computed
        requests.append(req)
        return req

    for i in range(decodes):
        req = request(ctx, ctx - 1, i)
        scheduled.append(ScheduledRequest(req, ctx - 1, 1, kv.block_table(req.request_id), True))
    if chunk:
        req = request(start + chunk, start, decodes)
        scheduled.append(ScheduledRequest(req, start, chunk, kv.block_table(req.request_id), True))
    return StepPlan(step_id, 0.0, scheduled), requests


def profile_engine(engine: LLMEngine, grid: Iterable[tuple[int, int, int, int]] = QUICK_GRID, repeats: int = 3,
                   on_point: Optional[Callable[[int, int], None]] = None) -> Profile:
    """Time every grid point (median of `repeats` after one warm-up) and fit the cost model."""
    points = _grid_points(grid)
    # The engine's own pool is the device memory the steps read from; a private manager
    # hands its blocks out so the engine's scheduler state is never touched.
    kv = KVCacheManager(engine.kv.num_blocks, engine.kv.block_size, enable_prefix_caching=False, watermark=0.0)
    samples: list[dict] = []
    for index, (d, ctx, n, start) in enumerate(points):
        plan, requests = _build_plan(engine, kv, d, ctx, n, start, index)
        engine.runner.execute(plan)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.runner.execute(plan)
            times.append(time.perf_counter() - t0)
        for req in requests:
            kv.free(req)
            engine.runner.release(req.request_id)
        shape = StepLoad.of_plan(plan)
        samples.append({**asdict(shape), "seconds": statistics.median(times)})
        if on_point is not None:
            on_point(index + 1, len(points))
    shapes = [StepLoad(**{k: v for k, v in s.items() if k != "seconds"}) for s in samples]
    knots = choose_knots([sh.num_tokens for sh in shapes])
    rows = [features(sh, knots) for sh in shapes]
    targets = [s["seconds"] for s in samples]
    coef = fit_nonnegative(rows, targets)
    errors = [abs(sum(c * f for c, f in zip(coef, r)) - t) / t for r, t in zip(rows, targets)]
    profile = Profile(
        model=engine.model_name, machine=f"{platform.node()} {platform.processor() or platform.machine()}",
        dtype=str(engine.dtype).removeprefix("torch."), num_threads=_threads(), coefficients=coef,
        samples=samples, knots=knots, fit_error=statistics.fmean(errors),
    )
    logger.info("profiled %d step shapes; mean relative fit error %.1f%%", len(samples), 100 * profile.fit_error)
    return profile


def _threads() -> int:
    import torch

    return torch.get_num_threads()
