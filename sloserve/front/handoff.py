"""Prefill/decode disaggregation on the real fleet: handing each stream from the prefill
instance that computed its prompt and first token to a decode instance.

The front offers every relayed stream as soon as it has tokens on a new instance (when it
starts, and after a failover resumed it). One on a `prefill` instance is handed off at once:
the controller's decode router picks the target among the decode instances, and the move runs
on the migration path (one transfer mechanism for both: the source copies the request's KV
blocks into blocks the target reserved, over HTTP between the workers, and the front switches
the client's stream between two events, so the client sees one stream and each token once).
Three ways to copy (`--pd-transfer`):
- `blocking`: suspend the request at once, copy all its KV, continue on the decode instance
  (DistServe's hand-off: the second token waits for the whole copy);
- `live`: pre-copy rounds while the prefill instance keeps decoding, then a short
  stop-and-copy (Llumnix-style: hides most of the copy, at the price of decode steps on the
  prefill instance meanwhile);
- `pipelined`: the decode instance is chosen when the request is sent to the prefill instance
  (as Splitwise does), which sends each full KV block there as chunked prefill computes it; at
  the first token only the last, partial block is left for the stop-and-copy. The simulator's
  `pipelined` sends layer by layer; the real worker sends block by block, as its engine steps
  compute them. A decode instance that refuses or fails meanwhile changes nothing: the
  hand-off at the first token starts afresh, as `blocking` does.

Without prefill/decode pools, a mixed instance may play the prefill side for one request
(Llumnix): `--mixed-handoff POLICY` (cluster/mixed_handoff) is asked once, when a stream has its
first token on the instance it started on, whether it decodes on another mixed instance (the
decode router's pick); the move is the same hand-off. A stream that stays decodes where it is.

Which streams move: one whose max_tokens leaves it no more to decode than the hand-off's own
pause would cost (controller.handoff_pays: its remaining tokens at the fleet's measured time a
token, against the hand-offs' measured pause) stays and finishes where it was prefilled; moving
it would only delay it and race its end there.

Failures: a decode instance that refuses (no room) or fails is left out and the next one tried
(up to the fleet's `max_attempts`); when none takes the request it decodes where it is, on the
prefill instance (a fallback), and nothing is lost. A hand-off that finds its request finished,
not running at its source, or its stream ended is over: no other decode instance is tried. A
stream whose decode instance dies later fails over like any other (its prompt is computed again
on a prefill instance) and is handed off again. Every abort is counted by its reason (the
refusing worker's error code, or the front's own: `client_gone`, `stream_ended`, ...).
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import re
import uuid
from typing import TYPE_CHECKING, Optional

from sloserve.fleet_view import HANDOFF, Move
from sloserve.front.relay import EarlyTarget

if TYPE_CHECKING:
    from sloserve.front.migration import MigrationDriver
    from sloserve.front.relay import MigrationOutcome
    from sloserve.front.relay import RelaySession
    from sloserve.core.types import Request
    from sloserve.workers.fleet import Instance, WorkerFleet

logger = logging.getLogger(__name__)

TRANSFERS = ("blocking", "live", "pipelined")
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# outcomes (by label) that mean the request ended, changed hands or cannot leave its source now:
# no other decode instance is tried
_OVER = {"not_movable", "client_gone", "stream_ended", "token_count_mismatch", "already_migrating", "finished",
         "not_running", "unknown_request"}
# before any is measured: a token where a stream decodes, and a hand-off's pause (this host's loopback)
TOKEN_TIME_PRIOR_S = 0.03
HANDOFF_TIME_PRIOR_S = 0.1
KEPT_SHORT = "finishes_within_handoff"
# reasons /metrics shows from the start (at 0): a worker's `finished`, `not_running`, `unknown_request`
# (worker_migration), the target's `no_room`, the front's own; others appear as they happen
ABORT_REASONS = ("finished", "not_running", "unknown_request", "no_room", "client_gone", "stream_ended")


def outcome_label(outcome: "MigrationOutcome") -> str:
    """A hand-off's outcome as a metric label: the refusing worker's error code, else the
    front's reason up to its detail (`source unreachable: ConnectError` -> `source_unreachable`)."""
    if outcome.code:
        return outcome.code
    return re.sub(r"[^a-z0-9]+", "_", outcome.reason.split(":")[0].strip().lower()).strip("_") or "unknown"


class Ewma:
    """An exponentially weighted mean that starts from a prior."""

    def __init__(self, prior: float, weight: float = 0.2) -> None:
        self.value, self.weight = prior, weight

    def observe(self, x: float) -> None:
        self.value += self.weight * (x - self.value)


class HandoffLatency:
    """Seconds from a stream's first token on its prefill instance to its next one on the
    decode instance, as a cumulative histogram (the shape Prometheus wants)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*map(str, self.buckets), "+Inf"), self.counts):
            total += n
            out.append((bound, total))
        return out


class HandoffDriver:
    def __init__(self, fleet: "WorkerFleet", migration: "MigrationDriver", transfer: str = "blocking") -> None:
        if transfer not in TRANSFERS:
            raise ValueError(f"unknown P/D transfer {transfer!r}; use one of {TRANSFERS}")
        self.fleet = fleet
        self.migration = migration
        self.transfer = transfer
        self.latency = HandoffLatency()
        self.decoded_on_prefill = 0  # fallbacks: streams no decode instance took; they finished where they started
        self.pipelined = 0  # completed hand-offs that went on from KV sent during the prefill
        self.pipelined_bytes = 0  # of their bytes, those sent during the prefill
        self.aborted = collections.Counter(dict.fromkeys(ABORT_REASONS, 0))  # tries abandoned, by outcome_label
        self.kept = collections.Counter({KEPT_SHORT: 0})  # streams not offered a move, by why
        self.token_time = Ewma(TOKEN_TIME_PRIOR_S)  # seconds a token where streams decode (measured at their end)
        self.handoff_time = Ewma(HANDOFF_TIME_PRIOR_S)  # seconds of a completed hand-off's pause
        self._tasks: set[asyncio.Task] = set()

    def early_target(self, routed: "Request", inst: "Instance") -> Optional[EarlyTarget]:
        """With the `pipelined` transfer, the decode instance a stream sent to prefill instance
        `inst` will move to (the decode router's pick now), so its KV can go there as computed."""
        if self.transfer != "pipelined" or inst.role != "prefill":
            return None
        target = self.fleet.pick_decode(routed, set())
        return None if target is None else EarlyTarget(target, target.generation, uuid.uuid4().hex)

    def offer(self, session: "RelaySession") -> None:
        """`session` has tokens on a new instance: hand it off if that is a prefill instance, or
        a mixed one it started on whose hand-off policy (controller.mixed_handoff) says it pays."""
        role = session.upstream.inst.role
        mixed = role == "mixed" and session.num_instances == 1 \
            and self.fleet.controller.mixed_handoff.hands_off_anything
        if not (role == "prefill" or mixed) or not session.movable:
            return
        limit = session.max_tokens
        remaining = None if limit is None else limit - len(session.tokens)
        if remaining is not None and remaining <= 0:
            return  # nothing left to decode
        if not self.fleet.controller.handoff_pays(remaining, self.token_time.value, self.handoff_time.value):
            self.kept[KEPT_SHORT] += 1
            return
        task = asyncio.get_running_loop().create_task(self._hand_off(session, self.fleet.clock(), mixed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _hand_off(self, session: "RelaySession", offered_at: float, mixed: bool = False) -> None:
        source = session.upstream.inst
        tried: set = set()
        reason: Optional[str] = "no decode instance is healthy"
        early = session.early_target if session.num_instances == 1 else None  # after a failover: none
        for _ in range(self.fleet.config.max_attempts):
            if session.upstream.inst is not source or not session.movable:
                return  # it ended, failed over, or another move took it
            migration_id = None
            if early is not None and early.usable:  # where the KV has been going since admission
                target, migration_id = early.inst, early.migration_id
            else:
                target = self.fleet.pick_mixed(session.routed, source, tried) if mixed \
                    else self.fleet.pick_decode(session.routed, tried)
            early = None
            if target is None:
                break
            tried.add((target.slot, target.generation))
            move = Move(session.engine_id or session.routed.request_id, source.slot, target.slot, HANDOFF)
            outcome = await self.migration.carry_out(session, target, move, precopy=self.transfer == "live",
                                                     migration_id=migration_id)
            if outcome.ok:
                took = self.fleet.clock() - offered_at
                self.latency.observe(took)
                self.handoff_time.observe(took)
                if outcome.early_bytes:
                    self.pipelined += 1
                    self.pipelined_bytes += outcome.early_bytes
                return
            label = outcome_label(outcome)
            self.aborted[label] += 1
            if label in _OVER or not source.handle.is_running():
                return
            reason = f"instance {target.slot}: {outcome.reason}"
        if mixed:
            return  # it decodes where it was prefilled, as in a colocated fleet
        self.decoded_on_prefill += 1
        logger.warning("request %s decodes on prefill instance %d: no decode instance took it (%s)",
                       session.routed.request_id, source.slot, reason)

    def observe_stream(self, session: "RelaySession") -> None:
        """A stream ended: its time a token where it decoded feeds the hand-off decision."""
        tbt = session.recent_tbt_s()
        if tbt > 0:
            self.token_time.observe(tbt)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            try:
                await task
            except BaseException:  # noqa: BLE001 - cancelled or failed: closing either way
                pass

    def describe(self) -> dict:
        n = self.latency.count
        return {"transfer": self.transfer, "mixed_handoff": self.fleet.controller.mixed_handoff.name,
                **self.fleet.controller.handoff_counters,
                "decoded_on_prefill": self.decoded_on_prefill,
                "aborted_by_reason": dict(self.aborted), "kept": dict(self.kept),
                "token_time_s": round(self.token_time.value, 6), "handoff_time_s": round(self.handoff_time.value, 6),
                "pipelined": self.pipelined, "pipelined_bytes": self.pipelined_bytes,
                "mean_latency_s": round(self.latency.sum / n, 6) if n else None}
