#!/usr/bin/env python3
"""Prefill/decode disaggregation in the simulator: when does it win?

For each workload, SLO and link, the goodput per GPU of a colocated fleet (chunked prefill,
`--instances` mixed instances) against every prefill:decode split of the same GPU count. Goodput is
the highest request rate at which >= 90% of requests meet both TTFT and TPOT targets, found by
bisection over the rate (the routing study's `search_capacity`: bracket from the burst throughput,
then geometric bisection), each rate tried with at least `--sustain` seconds of the trace's arrivals
(default 60; `planning.sustained`); divided by the GPUs it is goodput per GPU. A rate the trace cannot hold
that long (`--max-requests`, or the trace's end) is not credited (`planning.search_rate`): that goodput is then a
lower bound, marked >= in the table and `*_lower_bound` in the JSON (with how long each answer held), a warning
says how many, and a cell whose losing layout is only bounded is not counted as decided.
Disaggregated fleets hand each request's KV to a decode instance after its first token
(`--pd-transfer`, pipelined by default), priced on the link.

Workloads are the routing study's trace windows (Azure code: long prompts, short outputs;
Azure conversation: decode-heavier; Mooncake conversation: long contexts) and ShareGPT (first
turns, Poisson arrivals), each at a tight and a loose SLO; Llama-3.1-8B (or `--model`, `--tp`)
on H100. Per cell the table says which layout wins and by how much; seven rules are checked
against every cell (`rule` to `rule7`: each written down before the run that tested it), counted over
the cells with a winner and over those whose layouts differ by more than the search's resolution.

    python benchmarks/sim_pd.py --instances 4 --requests 0.5
    python benchmarks/sim_pd.py --traces azure-code,azure-conv,mooncake-conv,sharegpt --model llama-3.1-70b --tp 4
    python benchmarks/sim_pd.py ... --sustain 0      # the window alone at each rate (runs before 2026-12-02)
    python benchmarks/sim_pd.py --rescore benchmarks/results/sim_pd-STAMP.json   # the rules again, no simulation
Writes benchmarks/results/sim_pd-STAMP-MODEL-LINKS.json and .png.
"""
from __future__ import annotations

import argparse
import heapq
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing import TRACES, Trace, longer_windows, search_capacity, window  # noqa: E402  (the routing study's
# workloads, its capacity search and the source its sustained probes draw from)

from sloserve.bench.metrics import SLO, jsonable, percentile  # noqa: E402
from sloserve.core.config import SchedulerConfig  # noqa: E402
from sloserve.planning import SUSTAIN_S, Goodput, max_rate, sustained  # noqa: E402
from sloserve.sched.costs import StepLoad  # noqa: E402
from sloserve.sim.catalog import get_model  # noqa: E402
from sloserve.sim.hardware import get_link  # noqa: E402
from sloserve.simulation import FleetConfig, build_cost_model  # noqa: E402

logger = logging.getLogger("sim_pd")
RESULTS = Path(__file__).resolve().parent / "results"
LINKS = ("nvlink-h100", "infiniband-ndr", "roce-100g", "ethernet-25g")  # NVLink-class, 400, 100, 25 Gb/s
# ShareGPT has no times: Poisson arrivals, and a longer window so that a run is more than one burst the
# fleet absorbs whole (4 instances hold ~1,000 requests at once)
STUDY_TRACES = (*TRACES, Trace("sharegpt", "ShareGPT", 4000, SLO(ttft_s=1.0, tpot_s=0.1), replay=False))
BUDGET = 2048  # the routing study's per-step token budget (routing.run)
HANDOFF_SWITCH_S = 0.005  # what a hand-off's switch costs after its copy (sim/migration.py's default `handoff_s`)


@dataclass(frozen=True)
class Cell:
    trace: str
    slo_name: str
    slo: SLO
    link: str


def slos_for(base: SLO) -> dict[str, SLO]:
    """The trace's own SLO as `loose`, and a `tight` one: TPOT 4x and TTFT 2x stricter."""
    return {"tight": SLO(ttft_s=base.ttft_s / 2, tpot_s=base.tpot_s / 4), "loose": base}


def splits(n: int) -> list[str]:
    return [f"{p}:{n - p}" for p in range(1, n)]


def rule(prefill_share: float, slo_name: str, link: str) -> str:
    """The prediction checked against every cell: disaggregation wins when decode latency is what
    the SLO squeezes (tight TPOT), the prompts are a big share of the work (prefills would stall
    colocated decodes) and the link is fast enough that a hand-off costs less than a TPOT."""
    slow_link = link.startswith("ethernet")
    return "pd" if slo_name == "tight" and prefill_share >= 0.5 and not slow_link else "colocated"


def rule2(prefill_share: float, slo_name: str, link: str, transfer: str) -> str:
    """The rule read off the first run's 12 cells (2026-12-01 04:42; `rule` got 9): prefill-dominated
    work at a tight TPOT, and the link matters only when the send is not pipelined. To be tested on
    cells that run did not have (other traces, blocking sends)."""
    if transfer == "blocking" and link.startswith("ethernet"):
        return "colocated"
    return "pd" if slo_name == "tight" and prefill_share >= 0.9 else "colocated"


def rule3(c: dict) -> str:
    """Written down 2026-12-01 06:27 UTC, before the third run (whose new cells are ShareGPT, 70B on TP 4
    and 100 Gb/s links), from the mechanism rather than fitted to cells. P:D wins when
    (1) a colocated step carrying a full prefill chunk (plus a decode batch) outlasts the TPOT target,
        so colocated decodes miss it whenever prompts are in flight;
    (2) prompts are most of the work (prompt share >= 0.9), so that is most steps; and
    (3) the part of a p90 prompt's KV hand-off not hidden behind its prefill, spread over the median
        output, stays under half the TPOT target."""
    handoff_per_token = c["exposed_handoff_s"] / max(1.0, c["median_output"] - 1)
    wins = c["chunk_step_s"] > c["tpot_s"] and c["prefill_share"] >= 0.9 and handoff_per_token < c["tpot_s"] / 2
    return "pd" if wins else "colocated"


MAX_SEQS = 256  # routing.run's max_num_seqs
MODEL_ITERS = 30  # bisection steps of the model's own rate search (it costs no simulation)


def rule4(c: dict) -> str:
    """Written down 2026-12-02 01:30 UTC, before the first grid with sustained probes (`--sustain`) ran: a model of
    each layout's steady-state goodput on the simulator's own cost model, the window's request lengths and its
    arrival pattern (`analytic`), and the layout the model ranks first wins. It was built with the third run's
    (transient) grid in view, but no constant in it is tuned to a cell; the sustained grid is its test.
    Fixed 02:00 UTC, after the 70B sustained grid was read: the colocated TPOT took a request's share of time next
    to prefill work as its share of chunk-carrying steps (a chunk step lasts several decode steps); that version is
    in the 2026-12-02 01:38 results (`sim_pd-20261202-013812.json`: 10 of 16 cells, 8 of the 14 with a winner)."""
    return "pd" if c["analytic_pd_rps"] > c["analytic_colocated_rps"] else "colocated"


def rule5(c: dict) -> str:
    """Written down 2026-12-04 15:40 UTC, before the grids it is scored on finished at this code, with the
    2026-12-02 grids' misses in view: rule4's model with the two gaps its misses named closed (`analytic` with
    `long_context` and `fallback`). (1) A prefill chunk attends to the prompt before it: chunks are priced at their
    position (a 2,048-token chunk 20k tokens into a Mooncake prompt costs an 8B H100 step 2x a chunk at the start),
    in the P:D prefill pool and in colocated chunk steps, where the decodes beside them wait for it. (2) A P:D
    request the decode pool has no KV room for decodes on its prefill instance: a decode pool at its KV
    bound passes the rest of the decode work to the prefill instances, whose steps then carry it beside their
    chunks (a colocated instance's fixed point), instead of the layout failing. Nothing fitted to a cell."""
    return "pd" if c["analytic5_pd_rps"] > c["analytic5_colocated_rps"] else "colocated"


def rule6(c: dict) -> str:
    """Written down 2026-12-04 18:35 UTC with rule5's misses in view (the four-instance grids of 2026-12-02/04),
    before any grid on the 400 and 100 Gb/s links ran: rule5's model with the fleet's dispatch (`analytic` with
    `dispatch`). Looking at 8B Mooncake tight on 25 GbE in the simulator (3:1, 1.6 req/s: 87% within the SLO
    against 91% on NVLink) showed two things rule5 lacks: the router places a prompt on an instance when it
    arrives, so a 27k-token prompt ahead on its instance delays it even while another instance idles (the model's
    shared queue put both layouts' Mooncake goodput ~2x the simulator's), and the short answers to long prompts miss
    their TPOT at any load on the slow link, each by its own copy (9 of 200 there), which eats the 10% a goodput
    allows. Nothing fitted to a cell."""
    return "pd" if c["analytic6_pd_rps"] > c["analytic6_colocated_rps"] else "colocated"


def rule7(c: dict) -> str:
    """Written down 2026-12-04 21:48 UTC, after all four grids of the issue's table (NVLink, 400, 100 and
    25 Gb/s; 8B and 70B) were read, so every cell it is scored on was in view: there is no held-out cell left.
    rule6's model with prefill steps as the scheduler packs them (`analytic` with `packed`). Its largest misses
    were ShareGPT's P:D goodput (8B 35 vs 44-53 req/s per GPU simulated, 70B 4.7 vs 7.75 at the loose SLO,
    the same at both SLOs: a capacity limit, not a target) and the 70B colocated one at the tight SLO: rule6
    priced a prefill instance's prompts one step each, so a 100-token ShareGPT prompt paid a whole step's weight
    reads alone, while the scheduler packs every prompt waiting into one step; and it priced the prompts beside
    colocated decodes as full 2,048-token chunks, while at ShareGPT's prompt lengths most such steps carry one
    short prompt. Nothing fitted to a cell: the packing is the scheduler's rule, the steps the cost model's.
    The same evening the simulator was found running decode batches past their sequence bound (hand-offs took KV
    room only; fixed: a seat too), so the table is simulated again and its cells are new to every rule; rule7's
    decode pool stops at the bound and passes the rest to the prefill instances (rule5's KV fallback)."""
    return "pd" if c["analytic7_pd_rps"] > c["analytic7_colocated_rps"] else "colocated"


def analytic(reqs, slo: SLO, instances: int, model: str, tp: int, exposed_handoff_s: float,
             long_context: bool = False, fallback: bool = False, dispatch: bool = False,
             copy_s_per_token: float = 0.0, pipelined: bool = True, packed: bool = False) -> dict:
    """Steady-state goodput (>= 90% of requests within both targets) of a colocated fleet and of the best P:D
    split, from the cost model and a replay of the window's prefill queue (no fleet simulation), per request.

    Colocated, per instance at rate L: chunked prefill fills a step's budget whenever prompts wait, so a share
    q = L*P*t/B of steps carries a full chunk (P the mean prompt, B the budget) and the rest only decodes; the
    batch is b = L*O*t by Little's law (O the mean output), and the mean step t = (1-q) step(b, 0) + q step(b, B)
    is iterated to its fixed point. A request meets its TTFT when the wait for the prompts queued ahead plus its
    own chunks fits, and its TPOT when its decode steps, at the two step times, carry chunks in the proportion its
    instance prefilled while it decoded (from the replay below; a share of time, turned into a share of steps).
    Disaggregated: the prefill pool serves prompts at the window's prefill times; a decode instance's batch
    follows from its rate by Little's law, and a request meets its TPOT when the pure-decode step plus the exposed
    hand-off spread over its output does. Batch and KV bounds apply to both. The split is the best n_p : n_d of
    `instances`. Not modelled: a P:D request the decode pool has no room for keeps decoding on its prefill
    instance (`fallback` models it); prefix reuse; where in its prompt a chunk falls (`long_context` prices it).

    Time to first token (`ttft_ok`) is a first-come-first-served queue of prompts over the c instances a router
    spreads them on, replayed on the window's own arrival pattern at the rate tried (Lindley's recursion, not the
    simulator): the Azure code window's gaps have a squared coefficient of variation of 121 against ShareGPT's
    Poisson 1.1, and at a tight TTFT its bursts, not the mean load, set the capacity.

    With `dispatch` (rule6) the replay sends each request at its arrival to the server with the fewest requests
    (the fleet's least-requests router), not to a queue all servers share: a prompt waits behind the ones already
    on its instance, even while another instance frees first, and a colocated instance counts its decoding
    requests too. And each P:D request waits for its own KV to arrive (`copy_s_per_token` times its prompt, less
    the prefill it overlapped when `pipelined`, at least the last layer's share, as the simulator's hand-off does)
    instead of every request waiting what the 90th-percentile prompt's copy exposes.

    With `packed` (rule7, implies `dispatch`) each server's prompts are replayed step by step as the scheduler
    forms them: a step starts when the last one ends and takes the prompts waiting on its instance, oldest first,
    up to the token budget (the last one chunked), priced as one step of those pieces (beside the instance's
    decodes when it has any). A short prompt then shares its step's weight reads with the others waiting, instead
    of paying a step alone (P:D) or a full chunk's share of one (colocated); and a colocated decode meets the
    steps its instance really ran while it decoded, each at its own length, instead of full chunk steps."""
    import numpy as np
    from collections import deque

    dispatch = dispatch or packed

    fleet = FleetConfig(model=model, tp=tp, hardware="h100-80g",
                        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS))
    cost, shape, blocks = build_cost_model(fleet)
    prompts = np.array([r.prompt_len for r in reqs], dtype=float)
    outputs = np.array([max(1, r.output_len) for r in reqs], dtype=float)
    P, O = prompts.mean(), outputs.mean()
    ctx = P + O / 2  # tokens a decode attends to, on average over its life
    kv_tokens = blocks * fleet.cache.block_size

    def step(b: float, k: float, start: float = 0.0) -> float:
        load = StepLoad.decodes(max(0, round(b)), round(max(0.0, b) * ctx))
        return cost.step_time(load + StepLoad.prefill(round(k), round(start)) if k >= 1 else load)

    # chunks of each prompt: (tokens, start); with `long_context` a chunk is priced where it falls, else at 0
    chunks = [[(min(BUDGET, p - d), d if long_context else 0) for d in range(0, int(p), BUDGET)] for p in prompts]
    # token-weighted mean start of a prefill token: a full chunk step's attention at the window's mean position
    mean_start = sum(n * d for cs in chunks for n, d in cs) / max(1.0, prompts.sum())
    # a request's prefill as a number of full chunk steps at its own mean position (packing short prompts)
    own_start = np.array([sum(n * d for n, d in cs) / p if p > 0 else 0.0 for cs, p in zip(chunks, prompts)])

    def chunk_service(b: float) -> np.ndarray:
        """Each prompt's share of chunk steps carrying `b` decodes, in seconds."""
        if not long_context:
            return prompts / BUDGET * step(b, BUDGET)
        return np.array([p / BUDGET * step(b, BUDGET, d) for p, d in zip(prompts, own_start)])

    def mixed_step(prompt_rate: float, token_rate: float, bound: float) -> tuple[float, float] | None:
        """(mean step, decoders) of an instance prefilling `prompt_rate` prompts/s in full chunk steps and
        decoding `token_rate` tokens/s beside them, at the fixed point; None past its chunk time, batch or KV."""
        t, b = step(1, 0), 0.0
        for _ in range(100):
            b, q = token_rate * t, prompt_rate * P * t / BUDGET
            if q >= 1 or b > bound:
                return None
            t_next = (1 - q) * step(b, 0) + q * step(b, BUDGET, mean_start)
            if abs(t_next - t) < 1e-9:
                break
            t = t_next
        return t, b

    arrivals = np.array(sorted(r.arrival_s for r in reqs))
    arrivals -= arrivals[0]
    native = (len(arrivals) - 1) / arrivals[-1] if arrivals[-1] > 0 else 1.0

    def replay(service: np.ndarray, rate: float, servers: int, hold: np.ndarray | None = None):
        """The window's arrivals squeezed to `rate` through `servers` first-come-first-served prefill servers:
        each request's time to first token, the server it was prefilled on, and each server's busy spans.
        With `dispatch`, each request joins the server with the fewest requests at its arrival, counting a
        request until `hold` seconds after its first token (its decode, or its hand-off)."""
        ttft, first = np.empty_like(service), np.empty_like(service)
        on = np.empty(len(service), dtype=int)
        spans: list[list[tuple[float, float]]] = [[] for _ in range(servers)]
        if dispatch:
            busy_until = [0.0] * servers
            counted: list[list[float]] = [[] for _ in range(servers)]  # per server: a heap of when each request leaves
            stay = np.zeros_like(service) if hold is None else hold
            for i, (t, s_i) in enumerate(zip(arrivals * (native / rate), service)):
                for heap in counted:
                    while heap and heap[0] <= t:
                        heapq.heappop(heap)
                k = min(range(servers), key=lambda j: len(counted[j]))
                start = max(t, busy_until[k])
                busy_until[k] = start + s_i
                heapq.heappush(counted[k], start + s_i + float(stay[i]))
                spans[k].append((start, start + s_i))
                ttft[i], first[i], on[i] = start + s_i - t, start + s_i, k
            return ttft, first, on, spans
        free = [(0.0, k) for k in range(servers)]
        for i, (t, s_i) in enumerate(zip(arrivals * (native / rate), service)):
            ready, k = heapq.heappop(free)
            start = max(t, ready)
            heapq.heappush(free, (start + s_i, k))
            spans[k].append((start, start + s_i))
            ttft[i], first[i], on[i] = start + s_i - t, start + s_i, k
        return ttft, first, on, spans

    def replay_packed(rate: float, servers: int, hold: np.ndarray, decoders: float):
        """`replay`'s results with each server's prompts packed into steps (`packed`): a step starting at s takes
        the prompts that arrived on its server by s, oldest first, up to BUDGET tokens; spans are those steps."""
        n = len(prompts)
        ttft, first = np.empty(n), np.empty(n)
        on = np.empty(n, dtype=int)
        spans: list[list[tuple[float, float]]] = [[] for _ in range(servers)]
        queues: list[deque] = [deque() for _ in range(servers)]  # per server: [request, tokens left, tokens done]
        free_at = [0.0] * servers
        counted: list[list[float]] = [[] for _ in range(servers)]
        decode_load = StepLoad.decodes(max(0, round(decoders)), round(max(0.0, decoders) * ctx))
        times = arrivals * (native / rate)

        def run_until(k: int, until: float) -> None:
            queue = queues[k]
            while queue and free_at[k] < until:
                load, room, done = decode_load, BUDGET, []
                for item in queue:
                    if room <= 0:
                        break
                    take = min(room, item[1])
                    load = load + StepLoad.prefill(int(take), int(item[2]) if long_context else 0)
                    item[1] -= take
                    item[2] += take
                    room -= take
                    if item[1] <= 0:
                        done.append(item[0])
                start = free_at[k]
                end = start + cost.step_time(load)
                free_at[k] = end
                spans[k].append((start, end))
                for i in done:
                    queue.popleft()
                    ttft[i], first[i] = end - times[i], end
                    heapq.heappush(counted[k], end + float(hold[i]))

        for i in range(n):
            t = times[i]
            for k in range(servers):
                run_until(k, t)
                while counted[k] and counted[k][0] <= t:
                    heapq.heappop(counted[k])
            k = min(range(servers), key=lambda j: len(counted[j]) + len(queues[j]))
            if not queues[k]:
                free_at[k] = max(free_at[k], t)
            queues[k].append([i, float(prompts[i]), 0.0])
            on[i] = k
        for k in range(servers):
            run_until(k, float("inf"))
        return ttft, first, on, spans

    def prefill_replay(service: np.ndarray, decoders: float, rate: float, servers: int,
                       hold: np.ndarray | None = None):
        """The prefill queue as the layout's model prices it: packed steps (`packed`) or one service time each."""
        if packed:
            return replay_packed(rate, servers, np.zeros_like(prompts) if hold is None else hold, decoders)
        return replay(service, rate, servers, hold)

    def ttft_ok(service: np.ndarray, rate: float, servers: int, hold: np.ndarray | None = None,
                decoders: float = 0.0) -> np.ndarray:
        return (prefill_replay(service, decoders, rate, servers, hold)[0] <= slo.ttft_s).astype(float)

    prefill_alone = np.array([sum(step(0, n, d) for n, d in cs) for cs in chunks])
    if dispatch:  # each request's own exposed hand-off (the simulator's `handoff`: 5 ms to switch, after the copy)
        copy = prompts * copy_s_per_token
        layers = get_model(model).num_layers
        exposed = (np.maximum(copy - prefill_alone, copy / layers) if pipelined else copy) + HANDOFF_SWITCH_S
    else:
        exposed = np.full_like(prompts, exposed_handoff_s)
    batch_bound = min(MAX_SEQS, kv_tokens / ctx)

    def colocated_share(rate: float) -> float:
        fixed = mixed_step(rate, rate * O, batch_bound)
        if fixed is None:
            return 0.0
        t, b = fixed
        # a request decodes beside b - 1 others
        t_dec, t_chunk = step(max(b, 1.0), 0), step(max(b, 1.0), BUDGET, mean_start)
        if t_dec > slo.tpot_s:
            return 0.0
        # each request's decode steps meet a chunk as often as its instance prefills while it decodes
        ttft, first, on, spans = prefill_replay(chunk_service(max(b, 1.0)), max(b, 1.0), rate * instances,
                                                instances, (outputs - 1) * t)
        tables = [(np.fromiter((x for x, _ in sp), float), np.fromiter((y for _, y in sp), float)) for sp in spans]
        met = 0
        for i in range(len(prompts)):
            if ttft[i] > slo.ttft_s:
                continue
            if outputs[i] <= 1:
                met += 1
                continue
            starts, ends = tables[on[i]]
            a, z = first[i], first[i] + (outputs[i] - 1) * t
            lo, hi = int(np.searchsorted(ends, a, "right")), int(np.searchsorted(starts, z, "left"))
            overlap = (np.minimum(ends[lo:hi], z) - np.maximum(starts[lo:hi], a)).clip(min=0)
            if packed:  # the steps it met, each at its own length (in part at the window's edges), decodes between
                met_steps = float((overlap / (ends[lo:hi] - starts[lo:hi])).sum())
                met += (z - a) / (met_steps + (z - a - float(overlap.sum())) / t_dec) <= slo.tpot_s
                continue
            share = float(overlap.sum()) / (z - a) if hi > lo else 0.0
            # `share` is of its time; of its steps a chunk step (t_chunk long) is the smaller part
            chunk_steps = share / t_chunk / (share / t_chunk + (1 - share) / t_dec)
            met += t_dec + chunk_steps * (t_chunk - t_dec) <= slo.tpot_s
        return met / len(prompts)

    colocated = instances * max_rate(lambda rate: colocated_share(rate) >= 0.9, 1.0, MODEL_ITERS)

    def decode_tpot_ok(rate: float) -> np.ndarray:
        t = step(1, 0)
        for _ in range(100):
            b = rate * O * t
            if b > MAX_SEQS or b * ctx > kv_tokens:
                return np.zeros_like(outputs)
            t_next = step(b, 0)
            if abs(t_next - t) < 1e-9:
                break
            t = t_next
        n = np.maximum(outputs - 1, 1)
        return np.where(outputs <= 1, 1.0, (t + exposed / n <= slo.tpot_s).astype(float))

    def split_share(total: float, n_p: int) -> float:
        if fallback:
            return split_share_fallback(total, n_p)
        return float(np.mean(ttft_ok(prefill_alone, total, n_p, exposed)
                             * decode_tpot_ok(total / (instances - n_p))))

    def split_share_fallback(total: float, n_p: int) -> float:
        """The decode pool up to its KV bound; the rest of the decode work on the prefill instances, whose
        chunk steps carry it (and so serve prompts slower). A request's TPOT mixes the two step times in the
        share of its own tokens each pool produced: all of them wait the same time for a decode slot.
        As in the simulator, a hand-off needs KV room only: past the sequence bound with KV to spare, the
        excess waits on its decode instance without decoding, and the layout fails as rule4's did.
        (The simulator did not do that: its decode instances adopted hand-offs past their sequence bound, up to
        their KV, and ran batches of 1,514 at 256 seats. Since 2026-12-04 a hand-off needs a seat as well as KV
        room; with `packed` (rule7) the decode batch stops at the sequence bound and the rest of the decode work
        goes to the prefill instances, as for KV.)"""
        n_d = instances - n_p
        kv_bound = kv_tokens / ctx
        t = step(1, 0)
        for _ in range(100):  # the decode pool's own fixed point, its batch capped at the KV bound
            b = min(kv_bound, total / n_d * O * t)
            if b > MAX_SEQS:
                if not packed:
                    return 0.0
                b = float(MAX_SEQS)
            t_next = step(max(b, 1.0), 0)
            if abs(t_next - t) < 1e-9:
                break
            t = t_next
        t_d = t
        overflow = max(0.0, total * O - n_d * b / t_d)  # tokens/s the decode pool has no room for
        service, t_p, b_p = prefill_alone, 0.0, 0.0
        if overflow > 0:
            fixed = mixed_step(total / n_p, overflow / n_p, batch_bound)
            if fixed is None:
                return 0.0
            t_p, b_p = fixed
            service = chunk_service(max(b_p, 1.0))
        n = np.maximum(outputs - 1, 1)
        on_prefill = np.zeros_like(n)
        if overflow > 0:
            # every request is offered to the full decode pool at its first token and waits W for a slot,
            # decoding on its prefill instance meanwhile (a short output may finish there): W such that the
            # tokens produced while waiting are the overflow
            def made(w: float) -> float:
                return total * float(np.minimum(w / t_p, n).mean())
            lo, hi = 0.0, float(n.max()) * t_p
            if made(hi) < overflow:
                return 0.0
            for _ in range(40):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if made(mid) < overflow else (lo, mid)
            on_prefill = np.minimum(hi / t_p, n)
        tpot = (on_prefill * t_p + (n - on_prefill) * t_d) / n + exposed / n
        ok = np.where(outputs <= 1, 1.0, (tpot <= slo.tpot_s).astype(float))
        return float(np.mean(ttft_ok(service, total, n_p, exposed + on_prefill * t_p, b_p) * ok))

    by_split = {f"{n_p}:{instances - n_p}": max_rate(lambda rate: split_share(rate, n_p) >= 0.9, 1.0, MODEL_ITERS)
                for n_p in range(1, instances)}
    best = max(by_split, key=by_split.__getitem__)
    key = "analytic7" if packed else "analytic6" if dispatch else "analytic5" if (long_context or fallback) else "analytic"
    out = {f"{key}_colocated_rps": colocated, f"{key}_pd_rps": by_split[best], f"{key}_split": best}
    if packed:  # every split's rate, to compare with the simulator's per split
        out[f"{key}_splits_rps"] = by_split
    return out


def rule_columns(reqs, slo_name: str, slo: SLO, link: str, args) -> dict:
    """What each rule predicts for a cell, with the quantities rule3 and rule4 read."""
    share = sum(r.prompt_len for r in reqs) / sum(r.prompt_len + r.output_len for r in reqs)
    c = {"prefill_share": share, "ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "rule": rule(share, slo_name, link),
         "rule2": rule2(share, slo_name, link, args.pd_transfer),
         **mechanism(reqs, args.model, args.tp, link, args.pd_transfer)}
    c["rule3"] = rule3(c)
    c.update(analytic(reqs, slo, args.instances, args.model, args.tp, c["exposed_handoff_s"]))
    c["rule4"] = rule4(c)
    c.update(analytic(reqs, slo, args.instances, args.model, args.tp, c["exposed_handoff_s"], long_context=True,
                      fallback=True))
    c["rule5"] = rule5(c)
    c.update(analytic(reqs, slo, args.instances, args.model, args.tp, c["exposed_handoff_s"], long_context=True,
                      fallback=True, dispatch=True, copy_s_per_token=c["copy_s_per_token"],
                      pipelined=args.pd_transfer == "pipelined"))
    c["rule6"] = rule6(c)
    c.update(analytic(reqs, slo, args.instances, args.model, args.tp, c["exposed_handoff_s"], long_context=True,
                      fallback=True, packed=True, copy_s_per_token=c["copy_s_per_token"],
                      pipelined=args.pd_transfer == "pipelined"))
    c["rule7"] = rule7(c)
    return c


def scored(cells: list[dict]) -> list[dict]:
    """Cells with a winner: where neither layout meets the SLO at any rate, no rule can be right or wrong."""
    return [c for c in cells if c["colocated_goodput_per_gpu"] > 0 or c["pd_goodput_per_gpu"] > 0]


def decided(cells: list[dict], iters: int) -> list[dict]:
    """Scored cells whose layouts differ by more than the search's resolution: after bracketing within 2x,
    `iters` geometric bisections leave a factor 2^(1/2^iters) (9% at 3), so a closer pair is a tie to it. A cell
    whose losing layout's goodput is a lower bound (`winner_bounded`: its sample could not hold a rate the search
    wanted to try) is not decided either."""
    resolution = 2 ** (1 / 2 ** iters)
    return [c for c in scored(cells) if not c.get("winner_bounded") and (c["colocated_goodput_per_gpu"] == 0
            or not 1 / resolution < c["pd_goodput_per_gpu"] / c["colocated_goodput_per_gpu"] < resolution)]


def rescore(path: Path) -> dict:
    """A saved grid with every rule computed again by the code as it is now (the simulations are not rerun)."""
    saved = json.loads(path.read_text())
    args = argparse.Namespace(model=saved["model"], tp=saved["tp"], instances=saved["instances"],
                              pd_transfer=saved["pd_transfer"])
    traces = {t.name: t for t in STUDY_TRACES}
    windows: dict[str, list] = {}
    for c in saved["cells"]:
        trace = traces[c["trace"]]
        if trace.name not in windows:
            windows[trace.name] = base_window(trace, saved["requests_scale"])
        c.update(rule_columns(windows[trace.name], c["slo"], SLO(ttft_s=c["ttft_s"], tpot_s=c["tpot_s"]), c["link"],
                              args))
    saved["rescored_from"] = path.name
    return saved


def base_window(trace: Trace, scale: float) -> list:
    """The trace's window for a grid: its first requests, `scale` times the routing study's count (at least 50)."""
    return window(replace(trace, num_requests=max(50, int(trace.num_requests * scale))))


def mechanism(reqs, model: str, tp: int, link: str, transfer: str) -> dict:
    """What rule3 reads, priced by the simulator's own cost model and link table."""
    cost, shape, _ = build_cost_model(FleetConfig(model=model, tp=tp, hardware="h100-80g",
                                                  scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET)))
    prompts = sorted(r.prompt_len for r in reqs)
    outputs = sorted(r.output_len for r in reqs)
    p90 = int(percentile(prompts, 90))
    chunk_step = cost.step_time(StepLoad.prefill(BUDGET) + StepLoad.decodes(32, 32 * 1024))
    copy = p90 * shape.kv_bytes_per_token(2) / (get_link(link) * tp)
    prefill = sum(cost.step_time(StepLoad.prefill(min(BUDGET, p90 - s), s)) for s in range(0, p90, BUDGET))
    exposed = copy if transfer == "blocking" else max(0.0, copy - prefill)
    return {"chunk_step_s": chunk_step, "p90_prompt": p90, "median_output": percentile(outputs, 50),
            "handoff_copy_s": copy, "exposed_handoff_s": exposed,
            "copy_s_per_token": shape.kv_bytes_per_token(2) / (get_link(link) * tp)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", default="azure-code,azure-conv")
    p.add_argument("--instances", type=int, default=4, help="instances per fleet (colocated and every split)")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of every instance (GPUs = instances x tp)")
    p.add_argument("--links", default=",".join(LINKS))
    p.add_argument("--requests", type=float, default=0.5, help="scale every trace window's request count")
    p.add_argument("--capacity-iters", type=int, default=3)
    p.add_argument("--pd-transfer", default="pipelined", choices=["pipelined", "blocking"])
    p.add_argument("--sustain", type=float, default=60.0, metavar="S",
                   help="try each rate with at least S seconds of arrivals (more of the trace; planning.sustained); "
                        "a rate the trace cannot hold that long (--max-requests, or its end) is not credited: the "
                        "goodput is then a lower bound (marked >=). 0: the window alone, squeezed to the rate, as the "
                        "runs before 2026-12-02 (a transient at high rates)")
    p.add_argument("--max-requests", type=int, default=12000, help="with --sustain: at most this many per probe")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--rescore", type=Path, metavar="JSON",
                   help="no simulations: compute every rule again on a saved grid (writes JSON-rescored.json)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=200)
    if args.rescore:
        report(rescore(args.rescore), console, args.rescore.with_name(args.rescore.stem + "-rescored.json"))
        return 0
    links = args.links.split(",")
    chosen = [t for t in STUDY_TRACES if t.name in args.traces.split(",")]
    gpus = args.instances * args.tp
    model_options = {"model": args.model, "tp": args.tp}
    cells: list[dict] = []
    jobs = []
    for trace in chosen:
        for slo_name, slo in slos_for(trace.slo).items():
            jobs.append((trace, slo_name, slo, None, None))  # colocated: the link does not matter
            for link in links:
                for split in splits(args.instances):
                    jobs.append((trace, slo_name, slo, link, split))
    t0 = time.perf_counter()
    searches: dict[tuple, Goodput] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("capacity searches", total=len(jobs))
        windows, sources = {}, {}
        for trace, slo_name, slo, link, split in jobs:
            if trace.name not in windows:
                windows[trace.name] = base_window(trace, args.requests)
                sources[trace.name] = longer_windows(trace)
            reqs = windows[trace.name]
            requests_at = sustained(sources[trace.name], len(reqs), args.sustain, args.max_requests) \
                if args.sustain > 0 else None  # 0: the window alone, every rate tried (min_duration_s 0 below)
            options = {} if split is None else {"pd": split, "link": link, "pd_transfer": args.pd_transfer}
            found, _ = search_capacity(reqs, slo, args.instances, args.capacity_iters, requests_at=requests_at,
                                       min_duration_s=0.0, **options, **model_options)
            searches[(trace.name, slo_name, link, split)] = found
            progress.advance(task)
    warn_bounds(searches, args)
    capacities = {key: found.rps for key, found in searches.items()}
    for trace in chosen:
        for slo_name, slo in slos_for(trace.slo).items():
            colocated = capacities[(trace.name, slo_name, None, None)]
            for link in links:
                best_split = max(splits(args.instances), key=lambda s: capacities[(trace.name, slo_name, link, s)])
                best = capacities[(trace.name, slo_name, link, best_split)]
                winner = "pd" if best > colocated else "colocated"
                coloc_search = searches[(trace.name, slo_name, None, None)]
                split_searches = {s: searches[(trace.name, slo_name, link, s)] for s in splits(args.instances)}
                # the winner could change when a losing layout's goodput is only a lower bound
                losers = [coloc_search] if winner == "pd" else list(split_searches.values())
                cell = {"trace": trace.name, "slo": slo_name, "ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s,
                        "link": link, "model": args.model, "tp": args.tp,
                        "colocated_goodput_per_gpu": colocated / gpus,
                        "best_split": best_split, "pd_goodput_per_gpu": best / gpus,
                        "splits": {s: capacities[(trace.name, slo_name, link, s)] / gpus
                                   for s in splits(args.instances)},
                        "winner": winner, "pd_over_colocated": best / colocated if colocated else float("inf"),
                        "colocated_lower_bound": coloc_search.limited,
                        "colocated_held_s": coloc_search.held_s if coloc_search.rps > 0 else None,
                        "pd_lower_bound": split_searches[best_split].limited,
                        "pd_held_s": split_searches[best_split].held_s if best > 0 else None,
                        "splits_lower_bound": [s for s, g in split_searches.items() if g.limited],
                        "winner_bounded": any(g.limited for g in losers),
                        "searches": {"colocated": coloc_search.as_dict(),
                                     **{s: g.as_dict() for s, g in split_searches.items()}},
                        **rule_columns(windows[trace.name], slo_name, slo, link, args)}
                cells.append(cell)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    saved = {"when": stamp, "instances": args.instances, "requests_scale": args.requests, "sustain_s": args.sustain,
             "max_requests": args.max_requests, "pd_transfer": args.pd_transfer, "hardware": "h100-80g",
             "capacity_iters": args.capacity_iters,
             "model": args.model, "tp": args.tp, "cells": cells}
    # model and links in the name: two grids started together end in the same second (one overwrote the other)
    report(saved, console, args.out / f"sim_pd-{stamp}-{args.model}-{'+'.join(links)}.json")
    console.print(f"{time.perf_counter() - t0:.0f} s")
    return 0


def warn_bounds(searches: dict[tuple, Goodput], args) -> None:
    """One warning line when some searches' goodput is a lower bound (the sample could not hold a rate they wanted
    to try for --sustain seconds), or, with --sustain 0, when some answers lasted under SUSTAIN_S of arrivals."""
    limited = [(key, g) for key, g in searches.items() if g.limited]
    if limited:
        (trace, slo_name, link, split), g = min(limited, key=lambda kv: kv[1].refused_rps)
        logger.warning("%d of %d goodput searches are lower bounds (marked >=): %g s of arrivals at %.1f req/s "
                       "(%s, %s SLO, %s) needs %d requests, the trace gave %d; raise --max-requests (%d) or lower "
                       "--sustain",
                       len(limited), len(searches), args.sustain, g.refused_rps, trace, slo_name,
                       f"{split} on {link}" if split else "colocated", math.ceil(g.refused_rps * args.sustain),
                       g.refused_requests, args.max_requests)
    short = [g for g in searches.values() if args.sustain <= 0 and g.rps > 0 and g.held_s < SUSTAIN_S]
    if short:
        logger.warning("%d of %d goodput searches held their answer under %g s of arrivals (shortest %.1f s): bursts "
                       "the fleet absorbs, not rates it sustains (run without --sustain 0)", len(short),
                       len(searches), SUSTAIN_S, min(g.held_s for g in short))


RULES = ("rule", "rule2", "rule3", "rule4", "rule5", "rule6", "rule7")


def report(saved: dict, console: Console, path: Path) -> None:
    """Print the grid with each rule's calls, count them (over the cells with a winner), save and draw it."""
    cells, gpus = saved["cells"], saved["instances"] * saved["tp"]
    counted = scored(cells)
    clear = decided(cells, saved.get("capacity_iters", 3))
    for name in RULES:
        saved[f"{name}_right"] = sum(c[name] == c["winner"] for c in counted)
        saved[f"{name}_right_decided"] = sum(c[name] == c["winner"] for c in clear)
    saved["scored_cells"], saved["decided_cells"] = len(counted), len(clear)
    table = Table(title=f"goodput per GPU (req/s at >= 90% SLO attainment), {saved['instances']} x {saved['model']} "
                        f"(TP {saved['tp']}) on H100, {saved['pd_transfer']} hand-off"
                        + (f", >= {saved.get('sustain_s'):g} s of arrivals per probe" if saved.get("sustain_s") else ""))
    for col in ("trace", "prompt share", "SLO (TTFT/TPOT)", "link", "colocated", "best P:D", "P:D", "P:D / coloc.",
                "winner", "rule", "rule2", "chunk step ms", "exposed hand-off ms", "rule3", "model coloc. / P:D",
                "rule4", "model v5", "rule5", "model v6", "rule6", "model v7", "rule7"):
        table.add_column(col, justify="right")

    def ratio(x: float | None) -> str:  # a saved inf reads back as None
        return "—" if x is None or x == float("inf") else f"{x:.2f}x"

    def bound(c: dict, layout: str) -> str:  # a goodput the sample could only bound from below
        return ">=" if c.get(f"{layout}_lower_bound") else ""

    def call(c: dict, name: str) -> str:
        mark = "" if c not in counted else (" ✓" if c[name] == c["winner"] else " ✗")
        return c[name] + mark

    for c in cells:
        table.add_row(c["trace"], f"{c['prefill_share']:.2f}", f"{c['slo']} ({c['ttft_s']:g}s/{1e3 * c['tpot_s']:g}ms)",
                      c["link"], f"{bound(c, 'colocated')}{c['colocated_goodput_per_gpu']:.2f}", c["best_split"],
                      f"{bound(c, 'pd')}{c['pd_goodput_per_gpu']:.2f}", ratio(c['pd_over_colocated']),
                      c["winner"] if c in counted else "—", call(c, "rule"), call(c, "rule2"),
                      f"{1e3 * c['chunk_step_s']:.0f}", f"{1e3 * c['exposed_handoff_s']:.0f}", call(c, "rule3"),
                      f"{c['analytic_colocated_rps'] / gpus:.2f} / {c['analytic_pd_rps'] / gpus:.2f} "
                      f"({c['analytic_split']})", call(c, "rule4"),
                      f"{c['analytic5_colocated_rps'] / gpus:.2f} / {c['analytic5_pd_rps'] / gpus:.2f} "
                      f"({c['analytic5_split']})", call(c, "rule5"),
                      f"{c['analytic6_colocated_rps'] / gpus:.2f} / {c['analytic6_pd_rps'] / gpus:.2f} "
                      f"({c['analytic6_split']})", call(c, "rule6"),
                      f"{c['analytic7_colocated_rps'] / gpus:.2f} / {c['analytic7_pd_rps'] / gpus:.2f} "
                      f"({c['analytic7_split']})", call(c, "rule7"))
    console.print(table)
    console.print(", ".join(f"{name} {saved[f'{name}_right']}/{len(counted)}" for name in RULES)
                  + f" of the cells with a winner ({len(cells) - len(counted)} where neither layout meets the SLO); "
                  + ", ".join(f"{name} {saved[f'{name}_right_decided']}/{len(clear)}" for name in RULES)
                  + " of those the search decides (layouts further apart than its resolution)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(saved), indent=1))
    plot(cells, path.with_suffix(".png"), gpus)
    console.print(f"wrote {path} and {path.with_suffix('.png')}")


def plot(cells: list[dict], path: Path, n: int) -> None:
    """Goodput per GPU of both layouts (log scale: the workloads differ by 100x) and their ratio per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c['trace']}\n{c['slo']}\n{c['link']}" for c in cells]
    xs = list(range(len(cells)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 0.9 * len(cells)), 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    top.bar([x - 0.2 for x in xs], [c["colocated_goodput_per_gpu"] for c in cells], 0.4, label="colocated")
    top.bar([x + 0.2 for x in xs], [c["pd_goodput_per_gpu"] for c in cells], 0.4, label="best P:D")
    top.set_yscale("log")
    top.set_ylabel("goodput per GPU (req/s)")
    top.set_title(f"Prefill/decode disaggregation vs colocated, {n} GPUs (simulated)")
    top.legend()
    ratios = [c["pd_goodput_per_gpu"] / c["colocated_goodput_per_gpu"] if c["colocated_goodput_per_gpu"] else float("nan")
              for c in cells]
    bottom.bar(xs, ratios, 0.6, color=["tab:orange" if r > 1 else "tab:blue" for r in ratios])
    bottom.axhline(1.0, color="black", linewidth=0.8)
    bottom.set_ylabel("best P:D / colocated")
    bottom.set_xticks(xs, labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
