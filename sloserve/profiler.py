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
import math
import platform
import statistics
import time
from dataclasses import asdict
from typing import Callable, Iterable, Optional

from sloserve.engine.llm_engine import LLMEngine
from sloserve.kv.manager import KVCacheManager
from sloserve.sched.plan import ScheduledRequest, StepPlan
from sloserve.sched.costs import StepLoad
from sloserve.sim.cost import Profile, choose_knots, features, fit_nonnegative, is_decode_only
from sloserve.core.types import Request, SamplingParams

logger = logging.getLogger(__name__)

# (decodes, decode context, prefill chunk, prefill start)
# Decode-only steps dominate TPOT and their kernels run rows in small tiles (a step of 5 decodes
# cost 1.13-1.36x one of 4 on a 2-vCPU Zen4), so every small row count is measured, at one context.
DECODE_SWEEP = [(d, 256, 0, 0) for d in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 48)]
QUICK_GRID = [*itertools.product((0, 4, 16), (64, 256), (0, 32, 128), (0, 128)),
              *((d, 256, 0, 0) for d in (1, 2, 5, 8))]
# Short prompts and the tails of chunked ones make small prefill chunks, usually beside a few
# decodes: with none measured below 64 tokens, such steps were priced 20-36% low.
SMALL_PREFILL_SWEEP = [(d, 256, n, 0) for d in (0, 2, 6) for n in (4, 8, 16, 32)]
FULL_GRID = [*itertools.product((0, 1, 8, 32, 64), (128, 512, 1024), (0, 64, 256, 512), (0, 512)), *DECODE_SWEEP,
             *SMALL_PREFILL_SWEEP]
FINE_DECODE_ROWS = 16  # decode-only knots keep every measured row count up to this


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


def jump_points(jumps: Iterable[int], context: int = 256) -> list[tuple[int, int, int, int]]:
    """Grid points either side of each row count where the engine changes how it runs a step:
    decode-only steps and lone prefill chunks of j and j + 1 rows."""
    return [p for j in jumps for n in (j, j + 1) for p in ((n, context, 0, 0), (0, 0, n, 0))]


MIN_POINT_S = 0.1  # each pass times a point at least this long (cheap decode steps: 5-15 repeats)
MAX_REPEATS = 20


def profile_engine(engine: LLMEngine, grid: Iterable[tuple[int, int, int, int]] = QUICK_GRID, repeats: int = 3,
                   on_point: Optional[Callable[[int, int], None]] = None, passes: int = 2,
                   min_point_s: float = MIN_POINT_S) -> Profile:
    """Time every grid point, plus the points either side of the engine's own cost jumps, and fit
    the cost model. Each of `passes` passes over the grid runs a point (once to warm up, in the
    first pass) at least `repeats` / `passes` times and for at least `min_point_s`; a point's time is
    the median of all its runs. Passes rather than one long stay per point: a second or two of a
    slower machine (another process, a frequency dip) then touches a few of a point's runs instead
    of all of them, which once priced 3 decodes at 11.3 ms when serving ran them in 8-9 ms."""
    jumps = engine.model.cost_jumps
    points = _grid_points([*grid, *jump_points(jumps)])
    # The engine's own pool is the device memory the steps read from; a private manager
    # hands its blocks out so the engine's scheduler state is never touched.
    kv = KVCacheManager(engine.kv.num_blocks, engine.kv.block_size, enable_prefix_caching=False, watermark=0.0)
    least = max(1, math.ceil(repeats / passes))
    times: list[list[float]] = [[] for _ in points]
    shapes: list[StepLoad] = []
    for pass_index in range(passes):
        for index, (d, ctx, n, start) in enumerate(points):
            plan, requests = _build_plan(engine, kv, d, ctx, n, start, index)
            if pass_index == 0:
                engine.runner.execute(plan)  # warm-up
            began = time.perf_counter()
            runs = 0
            while runs < least or (runs < MAX_REPEATS and time.perf_counter() - began < min_point_s):
                t0 = time.perf_counter()
                engine.runner.execute(plan)
                times[index].append(time.perf_counter() - t0)
                runs += 1
            for req in requests:
                kv.free(req)
                engine.runner.release(req.request_id)
            if pass_index == 0:
                shapes.append(StepLoad.of_plan(plan))
            if on_point is not None:
                on_point(pass_index * len(points) + index + 1, passes * len(points))
    samples = [{**asdict(shape), "seconds": statistics.median(t)} for shape, t in zip(shapes, times)]
    edges = {n for j in jumps for n in (j, j + 1)}
    knots = choose_knots([sh.num_tokens for sh in shapes if not is_decode_only(sh)], keep=edges)
    decode_counts = [sh.num_tokens for sh in shapes if is_decode_only(sh)]
    decode_knots = choose_knots(decode_counts, keep=edges | {t for t in decode_counts if t <= FINE_DECODE_ROWS}) \
        if len(set(decode_counts)) > 1 else []
    overhead = measure_step_overhead(engine)
    rows = [features(sh, knots, decode_knots) for sh in shapes]
    targets = [s["seconds"] for s in samples]
    coef = fit_nonnegative(rows, targets)
    errors = [abs(sum(c * f for c, f in zip(coef, r)) - t) / t for r, t in zip(rows, targets)]
    profile = Profile(
        model=engine.model_name, machine=f"{platform.node()} {platform.processor() or platform.machine()}",
        dtype=str(engine.dtype).removeprefix("torch."), num_threads=_threads(), coefficients=coef,
        samples=samples, knots=knots, fit_error=statistics.fmean(errors), decode_knots=decode_knots,
        jumps=list(jumps), precision=engine.precision, step_overhead_s=overhead,
    )
    logger.info("profiled %d step shapes; mean relative fit error %.1f%%", len(samples), 100 * profile.fit_error)
    return profile


def measure_step_overhead(engine: LLMEngine, num_requests: int = 8, prompt_len: int = 32,
                          max_tokens: int = 24) -> float:
    """Seconds a real engine step spends outside the model runner (scheduling, the scheduler's
    update, detokenization, stop checks, outputs): the median over the decode-only steps of a
    short generation, each step's time less its runner call. The grid times the runner alone;
    without this a simulated step was ~0.3 ms short of a served one (3% of a small decode)."""
    execute = engine.runner.execute
    inside: list[float] = []

    def timed(plan):
        t0 = time.perf_counter()
        try:
            return execute(plan)
        finally:
            inside.append(time.perf_counter() - t0)

    vocab = engine.model_config.vocab_size
    engine.runner.execute = timed
    overheads = []
    try:
        for i in range(num_requests):
            ids = [(104729 * (i + 1) + 7 * k) % vocab for k in range(prompt_len)]
            engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            inside.clear()
            decode_only = not engine.scheduler.waiting  # the prompts fit one step: the rest decode
            t0 = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t0
            if decode_only and len(inside) == 1:
                overheads.append(total - inside[0])
    finally:
        engine.runner.execute = execute
    return statistics.median(overheads) if overheads else 0.0


def _threads() -> int:
    import torch

    return torch.get_num_threads()
