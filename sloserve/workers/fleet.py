"""The workers behind a multi-instance front: their health, their load, and the routing decision.

Health: each slot has its own poll loop on `/internal/state` (which doubles as the load
report), over an httpx client of its own: the proxy's pool can be full of long streams
without a poll ever waiting for a connection. Statuses:
- `starting`: spawned, has not answered yet (replaced after `start_timeout_s`);
- `healthy`: answers; takes requests;
- `unresponsive`: a live process that missed `fail_after` polls in a row. It is only taken
  out of routing: a worker busy enough to miss polls (or paused) keeps its streams, and it
  rejoins at its next answer. Only after `hang_timeout_s` without an answer is it killed;
- `dead`: its process exited, or it hung: killed (in a thread, so the event loop never waits
  for the reaping) and replaced in the same slot (`generation` + 1), with back-off for a slot
  whose workers keep dying before they ever answer.

Between polls the fleet adds what it routed to each worker's last snapshot (counts, prompt
tokens, predicted decode), so a burst does not all land on the instance that looked idle, and
takes off the requests whose relays ended since (finished, failed or moved), so a client that
sends its next request the moment its last one ends is not routed as if both were running.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import httpx

from sloserve.cluster.spec import FleetSpec
from sloserve.timeline import (DEAD as SHOWN_DEAD, DRAINING as SHOWN_DRAINING, FAILURE, INSTANCE_READY,
                               READING_FIELDS, READY as SHOWN_READY, START, STOP, InstanceReading)
from sloserve.sched.state import InstanceState, KeySetIndex
from sloserve.workers.handles import NoWorker, WorkerHandle
from sloserve.core.types import Request

logger = logging.getLogger(__name__)

STARTING, HEALTHY, UNRESPONSIVE, DEAD = "starting", "healthy", "unresponsive", "dead"
STOPPED = "stopped"  # an autoscaled slot with no worker: nothing is polled, routed or replaced


@dataclass(slots=True)  # slots: setting a field it does not have (one of its spec's) fails
class FrontConfig:
    """The real fleet's settings: the controller's (`fleet`, the FleetSpec the simulator runs
    too), then the front's own."""

    fleet: FleetSpec = field(default_factory=FleetSpec)
    poll_interval_s: float = 0.25
    fail_after: int = 3  # polls in a row without an answer before a live worker leaves routing
    poll_timeout_s: float = 2.0
    hang_timeout_s: float = 60.0  # a live worker silent this long is killed and replaced
    start_timeout_s: float = 600.0  # a replacement that is not up by then is replaced again
    max_attempts: int = 3  # instances one request may be tried on before it fails
    replace_dead: bool = True
    max_backoff_s: float = 30.0  # a slot whose workers keep dying while starting waits 1, 2, 4, ... s up to this
    # Autoscaling (front/autoscale.py): slots started at first (None: all of a fixed fleet; the
    # fewest of an autoscaled one, and at least one, which proves the model loads and times the
    # cold start before the fleet may scale to zero); the rest stay stopped.
    initial_instances: Optional[int] = None
    cold_start_guess_s: float = 30.0  # until a worker of this fleet has started and been timed
    scaling_history: Optional[Any] = None  # workload.series.Series of past demand (predictive, hybrid)
    # The front's edge (front/edge.py)
    max_in_flight: Optional[int] = None  # requests proxied at once; beyond: 429 at the front. None = no bound
    max_body_bytes: int = 4 * 2**20
    body_timeout_s: float = 30.0
    retry_after_s: int = 1
    admin_keys: tuple[str, ...] = ()  # when set, /v1/instances, /metrics and /dashboard/data need one of them
    timeline_interval_s: float = 1.0  # the dashboard's sampling interval


@dataclass
class Instance:
    slot: int
    handle: WorkerHandle
    role: str = "mixed"  # prefill instances hand each stream to a decode instance after its first token
    status: str = STARTING
    generation: int = 0  # how many times this slot's worker was replaced
    state: Optional[InstanceState] = None
    reading: dict = field(default_factory=dict)  # the worker's own counters (timeline.READING_FIELDS), last poll
    prefix_keys: frozenset = frozenset()
    polled_at: float = 0.0
    answered_at: Optional[float] = None  # last poll this worker answered (None: never, this generation)
    failures: int = 0
    routed: int = 0
    in_flight: int = 0
    pending: list = field(default_factory=list)  # (routed at, prompt tokens, predicted tokens) not yet polled
    departures: list = field(default_factory=list)  # when relays here ended since the last poll was sent
    started_at: float = 0.0
    last_error: Optional[str] = None
    failed_starts: int = 0  # workers in a row that died before ever answering (crash loop: back off)
    draining: bool = False  # an operator asked to empty it: out of routing, its requests move off
    respawn_at: Optional[float] = None  # when a dead slot gets its replacement
    # Set when this worker stops answering (unresponsive or dead): requests waiting on it that
    # have sent the client nothing yet move to another instance instead of waiting it out.
    stalled: asyncio.Event = field(default_factory=asyncio.Event)

    def relay_ended(self, now: float) -> None:
        """A request relayed to this instance left it (answered, failed, or moved elsewhere)."""
        self.in_flight -= 1
        self.departures.append(now)

    def routing_state(self, block_size: int) -> InstanceState:
        """The last snapshot plus what was routed here since it was taken, less the requests that
        left since. (One routed and gone between two polls is in both lists: it counts for nothing.)"""
        state = self.state or InstanceState(0, 0, 0, 0, 1, 1, 0, 0.0, float("inf"), block_size)
        if self.pending:
            prompt = sum(p for _, p, _ in self.pending)
            decode = sum(d for _, _, d in self.pending)
            bs = state.block_size
            state = dataclasses.replace(
                state, num_waiting=state.num_waiting + len(self.pending),
                queued_prefill_tokens=state.queued_prefill_tokens + prompt,
                kv_blocks_waiting=state.kv_blocks_waiting + sum(-(-p // bs) for _, p, _ in self.pending),
                predicted_remaining_decode_tokens=state.predicted_remaining_decode_tokens + decode)
        if self.departures:  # off the running first (requests end running), then the waiting
            gone = len(self.departures)
            running = max(0, state.num_running - gone)
            state = dataclasses.replace(state, num_running=running, num_waiting=max(
                0, state.num_waiting - (gone - (state.num_running - running))))
        return dataclasses.replace(state, prefix_index=KeySetIndex(self.prefix_keys))

    def timeline_reading(self) -> InstanceReading:
        """This slot for the dashboard: the worker's last reported counters, the front's view of its state."""
        status = {HEALTHY: SHOWN_READY, DEAD: SHOWN_DEAD}.get(self.status, self.status)
        if self.draining and self.status == HEALTHY:
            status = SHOWN_DRAINING
        counters = {k: v for k, v in self.reading.items() if k in READING_FIELDS} if self.state is not None else {}
        return InstanceReading(self.slot, self.role, status, **counters)

    def describe(self) -> dict:
        s = self.state
        return {
            "instance": self.slot, "role": self.role, "status": self.status, "generation": self.generation,
            "draining": self.draining,
            **self.handle.describe(),
            "routed": self.routed, "in_flight": self.in_flight, "pending": len(self.pending),
            "consecutive_poll_failures": self.failures, "failed_starts": self.failed_starts,
            "last_error": self.last_error,
            "load": None if s is None else {
                "num_running": s.num_running, "num_waiting": s.num_waiting,
                "queued_prefill_tokens": s.queued_prefill_tokens, "kv_usage": round(s.kv_usage, 4),
                "kv_blocks_used": s.kv_blocks_used, "kv_blocks_total": s.kv_blocks_total,
                "predicted_remaining_decode_tokens": s.predicted_remaining_decode_tokens,
                "prefix_cache_hit_rate": round(s.prefix_cache_hit_rate, 4), "cached_prefix_blocks": len(self.prefix_keys)},
        }


class WorkerFleet:
    """The worker processes (or Ray actors): their health and their load; the controller decides."""

    def __init__(self, spawn: Callable[[int], WorkerHandle], config: FrontConfig, controller: Any,
                 predictions: Any = None, clock: Callable[[], float] = time.monotonic,
                 fleet_secret: Optional[str] = None):
        """A slot per instance of `config.fleet`; `controller`: the fleet controller
        (cluster.assembly.build_controller, from the same spec); `predictions`: the output-length
        prediction book the router reads (None: no predictor)."""
        self.spawn = spawn
        self.config = config
        self.clock = clock
        self.fleet_secret = fleet_secret
        spec = config.fleet
        roles = spec.roles
        if config.initial_instances is not None:
            first = config.initial_instances
        else:
            first = max(1, spec.fewest) if spec.autoscale else spec.instances
        started = set(range(first))
        if spec.pd is not None and spec.autoscale:  # the fewest of each pool
            started = set()
            for role, (count, _) in spec.pool_bounds.items():
                started |= set([i for i, r in enumerate(roles) if r == role][:count])
        self.instances = [Instance(i, spawn(i), role, started_at=clock()) if i in started
                          else Instance(i, NoWorker(), role, status=STOPPED) for i, role in enumerate(roles)]
        self.start_times: list[float] = []  # spawn -> first healthy poll, per worker (the cold start, measured)
        self.predictions = predictions
        self.controller = controller
        self.block_size = 16
        self.counters = {"retries": 0, "failed_midstream": 0, "resumed_midstream": 0, "replacements": 0,
                         "no_instance": 0, "moved_unstarted": 0, "moved_stalled": 0, "pd_fallback": 0,
                         "split_calls": 0}
        self._client: Optional[httpx.AsyncClient] = None
        self._health: Optional[httpx.AsyncClient] = None
        self._monitors: list[asyncio.Task] = []
        # What happened to an instance (timeline.EVENT_KINDS, slot, detail): the front records it.
        self.on_event: Callable[[str, Optional[int], str], None] = lambda kind, slot, detail: None
        self._kills: set[asyncio.Task] = set()

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self, wait_ready_s: Optional[float] = None) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=30.0),
                                         limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256))
        n = len(self.instances)
        self._health = httpx.AsyncClient(timeout=httpx.Timeout(self.config.poll_timeout_s),  # each kind adds its auth
                                         limits=httpx.Limits(max_connections=2 * n, max_keepalive_connections=n))
        self._monitors = [asyncio.create_task(self._watch(inst)) for inst in self.instances]
        if wait_ready_s is not None:
            await self.wait_ready(wait_ready_s)

    async def wait_ready(self, timeout_s: float, count: Optional[int] = None) -> None:
        """Until `count` workers (default: all) are healthy; TimeoutError after `timeout_s`."""
        want = len(self.instances) if count is None else count
        deadline = self.clock() + timeout_s
        while sum(i.status == HEALTHY for i in self.instances) < want:
            if self.clock() > deadline:
                raise TimeoutError(f"only {sum(i.status == HEALTHY for i in self.instances)} of {want} workers "
                                   f"became healthy in {timeout_s:.0f} s")
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        for task in self._monitors:
            task.cancel()
        for task in self._monitors:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(asyncio.to_thread(i.handle.kill) for i in self.instances), *self._kills,
                             return_exceptions=True)
        for client in (self._client, self._health):
            if client is not None:
                await client.aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        """The proxy's client (requests to workers); health polls never use it."""
        assert self._client is not None, "fleet not started"
        return self._client

    # ---- health and load ---------------------------------------------------------------
    async def _watch(self, inst: Instance) -> None:
        while True:
            try:
                await self._poll(inst)
            except Exception:  # noqa: BLE001 - a bug in one poll must not stop watching the slot
                logger.exception("polling instance %d failed", inst.slot)
            await asyncio.sleep(self.config.poll_interval_s)

    async def _poll(self, inst: Instance) -> None:
        if inst.status == STOPPED:
            return
        if inst.status == DEAD:
            if inst.respawn_at is not None and self.clock() >= inst.respawn_at:
                self._respawn(inst)
            return
        handle = inst.handle
        if not handle.is_running():
            self.mark_dead(inst, "worker process exited")
            return
        url = handle.url
        if url is None:  # still starting (a Ray actor that has not reported its port)
            self._check_start_timeout(inst)
            return
        assert self._health is not None, "fleet not started"
        sent = self.clock()
        try:
            published = await handle.engine_kind.read_state(handle, self._health, self.fleet_secret)
            state, keys, reading = published.state, published.prefix_keys, published.reading
        except Exception as e:  # noqa: BLE001 - any failure to answer counts the same
            if handle is inst.handle:
                self._missed(inst, e)
            return
        if handle is not inst.handle or inst.status == DEAD:  # replaced while the poll was in flight
            return
        inst.state, inst.prefix_keys, inst.reading = state, keys, reading
        self.block_size = state.block_size
        inst.pending = [p for p in inst.pending if p[0] > sent]
        inst.departures = [t for t in inst.departures if t > sent]
        inst.polled_at = inst.answered_at = sent
        inst.failures = 0
        if inst.status == STARTING:
            inst.status, inst.failed_starts = HEALTHY, 0
            self.start_times.append(sent - inst.started_at)
            logger.info("instance %d (generation %d) is healthy at %s after %.1f s", inst.slot, inst.generation, url,
                        sent - inst.started_at)
            self.on_event(INSTANCE_READY, inst.slot, f"generation {inst.generation}, started in "
                                                     f"{sent - inst.started_at:.1f} s")
        elif inst.status == UNRESPONSIVE:
            inst.status = HEALTHY
            inst.stalled = asyncio.Event()
            logger.warning("instance %d (generation %d) answers again: back in routing", inst.slot, inst.generation)
            self.on_event(INSTANCE_READY, inst.slot, "answers again")

    def _missed(self, inst: Instance, error: BaseException) -> None:
        if inst.status == STARTING:
            self._check_start_timeout(inst)
            return
        inst.failures += 1
        inst.last_error = f"poll failed: {type(error).__name__}: {error}"
        silent_s = self.clock() - (inst.answered_at if inst.answered_at is not None else inst.started_at)
        if silent_s > self.config.hang_timeout_s:
            self.mark_dead(inst, f"no answer for {silent_s:.0f} s ({inst.failures} polls)")
        elif inst.status == HEALTHY and inst.failures >= self.config.fail_after:
            inst.status = UNRESPONSIVE
            inst.stalled.set()
            logger.warning("instance %d (generation %d) missed %d polls: out of routing until it answers",
                           inst.slot, inst.generation, inst.failures)

    def _check_start_timeout(self, inst: Instance) -> None:
        if self.clock() - inst.started_at > self.config.start_timeout_s:
            self.mark_dead(inst, f"not healthy after {self.config.start_timeout_s:.0f} s")

    def mark_dead(self, inst: Instance, reason: str) -> None:
        """Out of routing, killed, and (by default) replaced by a fresh worker in the same slot."""
        if inst.status == DEAD:
            return
        logger.warning("instance %d (generation %d) is out: %s", inst.slot, inst.generation, reason)
        self.on_event(FAILURE, inst.slot, reason)
        never_answered = inst.status == STARTING
        inst.status, inst.last_error = DEAD, reason
        inst.stalled.set()
        inst.state, inst.prefix_keys, inst.pending, inst.departures = None, frozenset(), [], []
        self._kill(inst.handle)
        if not self.config.replace_dead:
            return
        inst.failed_starts = inst.failed_starts + 1 if never_answered else 0
        if inst.failed_starts == 0:
            self._respawn(inst)
        else:
            delay = min(self.config.max_backoff_s, 2.0 ** (inst.failed_starts - 1))
            logger.warning("instance %d: %d worker(s) in a row died while starting; next try in %.0f s",
                           inst.slot, inst.failed_starts, delay)
            inst.respawn_at = self.clock() + delay

    def _kill(self, handle: WorkerHandle) -> None:
        """Kill and reap in a thread: `kill` may wait for the process (seconds), the loop must not."""
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(handle.kill))
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    # ---- autoscaling -----------------------------------------------------------------
    def start_slot(self, inst: Instance) -> None:
        """Start a worker in a stopped slot (autoscaling: scale up)."""
        if inst.status != STOPPED:
            raise ValueError(f"instance {inst.slot} is {inst.status}, not stopped")
        self._respawn(inst)
        self.counters["replacements"] -= 1  # a start asked for, not a replacement
        logger.warning("instance %d: starting a worker (scale up)", inst.slot)
        self.on_event(START, inst.slot, "scale up")

    def stop_slot(self, inst: Instance, reason: str) -> None:
        """Stop a slot's worker (a drained instance, or one cancelled while starting) and keep it stopped."""
        logger.warning("instance %d (generation %d) stops: %s", inst.slot, inst.generation, reason)
        self.on_event(STOP, inst.slot, reason)
        inst.status, inst.draining, inst.last_error = STOPPED, False, None
        inst.stalled.set()
        inst.state, inst.prefix_keys, inst.pending, inst.departures = None, frozenset(), [], []
        self._kill(inst.handle)
        inst.handle = NoWorker()

    def measured_start_s(self, default: float) -> float:
        """Mean spawn-to-healthy time of this fleet's workers so far (`default` before any)."""
        return sum(self.start_times) / len(self.start_times) if self.start_times else default

    def _respawn(self, inst: Instance) -> None:
        inst.handle = self.spawn(inst.slot)
        inst.draining = False
        inst.generation += 1
        inst.status, inst.respawn_at = STARTING, None
        inst.stalled = asyncio.Event()
        inst.failures, inst.started_at, inst.answered_at = 0, self.clock(), None
        self.counters["replacements"] += 1

    def suspect(self, inst: Instance, handle: WorkerHandle, error: BaseException) -> None:
        """A proxied call to `handle` broke: if its process is gone, take it out now rather
        than at the next poll."""
        if inst.handle is handle and not handle.is_running():
            self.mark_dead(inst, f"worker process exited ({type(error).__name__})")

    # ---- routing ---------------------------------------------------------------------
    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.status == HEALTHY]

    def routable(self) -> list[Instance]:
        """Healthy and not draining: what new requests may go to."""
        return [i for i in self.instances if i.status == HEALTHY and not i.draining]

    def has_alternative(self, exclude: set) -> bool:
        """Whether a healthy instance outside `exclude` ((slot, generation) pairs) could take a request."""
        return any((i.slot, i.generation) not in exclude for i in self.routable())

    @property
    def disaggregated(self) -> bool:
        return any(i.role != "mixed" for i in self.instances)

    def pick(self, request: Request, exclude: set) -> Optional[Instance]:
        """Where a new request (or a stream resumed after a failure: its prompt is computed
        again) goes: a prefill or mixed instance. With none of those routable, a decode
        instance serves it whole (`pd_fallback`): degraded, but served."""
        candidates = [i for i in self.routable() if (i.slot, i.generation) not in exclude]
        arrival = [i for i in candidates if i.role != "decode"]
        if not arrival and candidates:
            self.counters["pd_fallback"] += 1
            logger.warning("no prefill instance can take %s: a decode instance serves it whole", request.request_id)
        return self._choose(request, arrival or candidates, self.controller.route, request.num_prompt_tokens)

    def pick_decode(self, request: Request, exclude: set) -> Optional[Instance]:
        """The decode instance a prefilled request is handed to (the controller's decode router)."""
        candidates = [i for i in self.routable() if i.role == "decode" and (i.slot, i.generation) not in exclude]
        return self._choose(request, candidates, self.controller.route_decode, 0)

    def pick_mixed(self, request: Request, source: Instance, exclude: set) -> Optional[Instance]:
        """Another mixed instance for a request that just got its first token on `source`, when
        the controller's mixed hand-off policy says moving pays; else None (it stays)."""
        if source.state is None:
            return None
        candidates = [i for i in self.routable() if i.role == "mixed" and i is not source
                      and (i.slot, i.generation) not in exclude]
        source_state = source.routing_state(self.block_size)
        return self._choose(request, candidates,
                            lambda r, states: self.controller.route_mixed_handoff(r, source_state, states), 0)

    @property
    def hands_off(self) -> bool:
        """Whether requests change instance after their first token: prefill/decode pools, or
        a mixed hand-off policy."""
        return self.disaggregated or self.controller.mixed_handoff.hands_off_anything

    def _choose(self, request: Request, candidates: list[Instance], route, prompt_tokens: int) -> Optional[Instance]:
        if not candidates:
            return None
        states = [i.routing_state(self.block_size) for i in candidates]
        k = route(request, states)
        if k is None:
            return None
        chosen = candidates[k]
        chosen.pending.append((self.clock(), prompt_tokens, request.predicted_output_len or 0))
        chosen.routed += 1
        return chosen
