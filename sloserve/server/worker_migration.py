"""A worker's side of live migration: moving a running request's KV to another worker, and
taking one over. The fleet's front drives it (it relays the client's stream and decides when
to switch); the two workers move the bytes between themselves, over HTTP on a socket.

Source (`POST /internal/migrate`), Llumnix-style live pre-copy:
1. the target reserves blocks for the request's KV (or refuses: nothing changed), reusing the
   leading blocks its prefix cache already holds (same keys, so same tenant salt): not sent;
2. rounds: the full blocks computed so far are pinned and copied while the request keeps
   decoding; each round copies what the previous one did not, for as long as
   `cluster/migration/precopy.PRECOPY` (the simulator's rule too) asks for another;
3. stop-and-copy: the request is suspended (keeps its blocks, not scheduled), the rest of its
   blocks (the partial last one too) are copied, and its `ResumeState` goes back to the front.
The request stays suspended here until the front commits (the target produced a token: free
it) or aborts (it goes on here). A source that hears neither within `HOLD_S` resumes it.

Target: `/internal/kv/reserve`, `PUT /internal/kv/{id}` (block bytes in table order, from a
block index), `/internal/kv/{id}/release`; the front then resumes the call with
`/internal/resume/v1/...`, naming the reservation, and the request is adopted with its KV.
A reservation nobody claims within `HOLD_S` is released. Every path that fails leaves each
side's pool as it was: pins and reservations are dropped, whatever failed.

Pipelined (a P/D hand-off whose target the front chose when it sent the request here, named in
`KV_PUSH_HEADER`): from admission on, the target reserves blocks for the whole prompt and each
full block is sent as chunked prefill computes it, while the rest of the prompt is computed.
The move at the first token (`/internal/migrate` with the same target and migration id) goes
on from there: its stop-and-copy sends only what the early rounds did not (the last, partial
block and the first token's). A target that refuses or fails early changes nothing: the move
starts from scratch, as without the header. A request that ends here without moving lets its
reservation go at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sloserve.cluster.migration.precopy import PRECOPY
from sloserve.engine.migration import KVLayout, ResumeState, read_blocks, write_blocks
from sloserve.server.errors import APIError, bad_request
from sloserve.server.protocol import ChatCompletionRequest, CompletionRequest
from sloserve.workers.contract import FLEET_SECRET_HEADER, MigrationSnapshot

logger = logging.getLogger(__name__)

HOLD_S = 30.0  # a reservation or a suspended request nobody claims is let go after this
MAX_PUT_BYTES = 64 * 2**20  # KV bytes per request to the target: bounds memory on both sides
PREFILL_POLL_S = 0.005  # a pipelined send looks for newly computed blocks this often (and between steps)
WAIT_POLL_S = 0.2  # after the prompt: how often it checks the request is still here, until the move
UNSEEN_ROUNDS = 3  # rounds (each at least one engine step) a pipelined send waits for its request to appear


@dataclass
class _Held:
    block_ids: list[int]
    expires_at: float


@dataclass
class _Early:
    """A pipelined send in progress (source side): how far it got, and whether it can go on."""

    target: str
    mid: str
    expires_at: float
    sent: int = 0  # blocks of the table the target has (sent, or in its prefix cache)
    bytes: int = 0
    overlapped_bytes: int = 0  # of `bytes`, those sent while the prompt was still being computed
    reserved: bool = False
    failed: bool = False
    claimed: bool = False  # the move at the first token took it over (it releases nothing)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: Optional[asyncio.Task] = None


@dataclass
class MigrationStats:
    out_started: int = 0
    out_completed: int = 0
    out_aborted: int = 0
    in_reserved: int = 0
    in_adopted: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    early_started: int = 0  # pipelined sends begun at admission
    early_bytes: int = 0  # KV bytes they sent while the prompt was still being computed
    last: dict = field(default_factory=dict)  # the latest outgoing migration's timings


class Migrations:
    """Reservations (target side) and suspended requests awaiting the front's word (source side)."""

    def __init__(self, engine: Any, fleet_secret: Optional[str], clock=time.monotonic) -> None:
        self.engine = engine  # AsyncLLMEngine
        self.core = engine.engine
        self.layout = KVLayout.of(self.core.kv_cache)
        self.secret = fleet_secret
        self.clock = clock
        self.reservations: dict[str, _Held] = {}
        self.suspended: dict[str, _Held] = {}  # engine request id -> its pinned blocks
        self.early: dict[str, _Early] = {}  # engine request id -> its pipelined send
        self.stats = MigrationStats()
        self._client: Optional[httpx.AsyncClient] = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {FLEET_SECRET_HEADER: self.secret} if self.secret else {}
            self._client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(60.0, connect=5.0))
        return self._client

    async def expire(self) -> None:
        """Let go of what nobody claimed in time (a front that died mid-migration)."""
        now = self.clock()
        for mid in [m for m, h in self.reservations.items() if h.expires_at < now]:
            await self.release(mid)
        for rid in [r for r, h in self.suspended.items() if h.expires_at < now]:
            logger.warning("migration of %s was neither committed nor aborted in %.0f s: it goes on here", rid, HOLD_S)
            await self.abort_out(rid)

    # ---- target side ---------------------------------------------------------------
    async def reserve(self, mid: str, hashes: list[int], num_tokens: int, layout: dict) -> dict:
        if layout != self.layout.to_json():
            raise APIError(409, "KV layouts differ between the two instances", code="layout_mismatch")
        if mid in self.reservations:
            raise APIError(409, f"migration {mid} already has a reservation", code="duplicate_migration")
        incoming = len(self.reservations)
        held = await self.engine.call(lambda e: e.reserve_for_migration(hashes, num_tokens, incoming))
        if held is None:
            raise APIError(409, "no room for this request: not enough free KV blocks, or every batch seat "
                                "(max_num_seqs) taken", code="no_room")
        have, ids = held
        self.reservations[mid] = _Held(ids, self.clock() + HOLD_S)
        self.stats.in_reserved += 1
        return {"have_blocks": have, "blocks": len(ids)}

    async def receive(self, mid: str, start: int, payload: bytes) -> dict:
        held = self.reservations.get(mid)
        if held is None:
            raise APIError(404, f"no reservation for migration {mid}", code="unknown_migration")
        if len(payload) % self.layout.block_bytes:
            raise bad_request(f"a KV payload is whole blocks of {self.layout.block_bytes} bytes", "body")
        n = len(payload) // self.layout.block_bytes
        if start < 0 or start > len(held.block_ids):
            raise bad_request(f"start block {start} is past the {len(held.block_ids)} blocks held", "start")
        missing = start + n - len(held.block_ids)
        if missing > 0:  # the request grew while it was copied
            extra = await self.engine.call(lambda e: e.kv.reserve(missing))
            if extra is None:
                raise APIError(409, "not enough free KV blocks for the rest of this request", code="no_room")
            held.block_ids.extend(extra)
        await asyncio.to_thread(write_blocks, self.core.kv_cache, held.block_ids[start:start + n], payload)
        held.expires_at = self.clock() + HOLD_S
        self.stats.bytes_received += len(payload)
        return {"blocks": n}

    async def release(self, mid: str) -> bool:
        held = self.reservations.pop(mid, None)
        if held is None:
            return False
        await self.engine.call(lambda e: e.kv.unpin(held.block_ids))
        return True

    def claim(self, mid: str) -> list[int]:
        """The reservation's blocks, for the resumed request to adopt (the engine owns them now)."""
        held = self.reservations.pop(mid, None)
        if held is None:
            raise APIError(409, f"no reservation for migration {mid} (expired or released)", code="unknown_migration")
        self.stats.in_adopted += 1
        return held.block_ids

    # ---- source side: pipelined sends during the prefill ------------------------------
    def push_early(self, request_id: str, target: str, mid: str) -> None:
        """Send `request_id`'s KV to `target` as its prompt is computed (the serving layer calls
        this right after admitting a request whose front asked for it)."""
        if request_id in self.early:
            return
        rec = _Early(target.rstrip("/"), mid, self.clock() + HOLD_S)
        self.early[request_id] = rec
        self.stats.early_started += 1
        rec.task = asyncio.get_running_loop().create_task(self._run_early(request_id, rec))

    async def _run_early(self, request_id: str, rec: _Early) -> None:
        done = False
        misses = 0  # rounds that did not find the request before it was ever seen
        try:
            while not rec.stop.is_set() and self.clock() < rec.expires_at:
                if done:  # all of the prompt is there: wait for the move, or for the request to end
                    if not await self.engine.call(lambda e: request_id in e.scheduler.requests):
                        break
                    await _wait(rec.stop, WAIT_POLL_S)
                    continue
                progress = await self.engine.call(lambda e: e.prefill_progress(request_id, rec.sent))
                if progress is None:
                    # The engine thread runs calls before the requests added since its last step,
                    # so the first round may come before the request is there.
                    if rec.reserved or misses >= UNSEEN_ROUNDS:
                        break  # it ended (or was aborted, or refused) before moving
                    misses += 1
                    await _wait(rec.stop, PREFILL_POLL_S)
                    continue
                pinned, hashes, done = progress
                try:
                    start = rec.sent
                    if not rec.reserved:  # the target holds room for the prompt and says what it caches
                        have = await self._reserve_remote(rec.target, rec.mid, request_id, hashes)
                        rec.reserved = True
                        rec.sent = max(rec.sent, have)
                    ids = pinned[rec.sent - start:]
                    sent = await self._push(rec.target, rec.mid, rec.sent, ids)
                    rec.sent += len(ids)
                    rec.bytes += sent
                    if ids:  # the target keeps the reservation as long as blocks keep coming
                        rec.expires_at = self.clock() + HOLD_S
                    if not done:  # computed before the first token: this copy overlapped the prefill
                        rec.overlapped_bytes += sent
                        self.stats.early_bytes += sent
                finally:
                    await self.engine.call(lambda e: e.kv.unpin(pinned))
                if not done:
                    await _wait(rec.stop, PREFILL_POLL_S)
        except Exception as e:  # noqa: BLE001 - the target refused or failed: the move starts afresh
            rec.failed = True
            logger.info("pipelined KV send of %s to %s stopped: %s", request_id, rec.target, e)
        if not rec.claimed:
            if self.early.get(request_id) is rec:
                del self.early[request_id]
            if rec.reserved:
                await self._release_remote(rec.target, rec.mid)

    async def _take_early(self, request_id: str, target: str, mid: str) -> Optional[_Early]:
        """Stop the request's pipelined send; return it if the move goes where that send went
        (the move goes on from it), else let its reservation go."""
        rec = self.early.pop(request_id, None)
        if rec is None:
            return None
        rec.claimed = True
        rec.stop.set()
        if rec.task is not None:
            await asyncio.shield(rec.task)
        if rec.reserved and not rec.failed and (rec.target, rec.mid) == (target, mid):
            return rec
        if rec.reserved:
            await self._release_remote(rec.target, rec.mid)
        return None

    # ---- source side ---------------------------------------------------------------
    async def migrate_out(self, request_id: str, target: str, mid: str, precopy: bool = True) -> dict:
        """Pre-copy rounds, then stop-and-copy; the ResumeState of the suspended request.
        Without `precopy`, only the stop-and-copy (the baseline: downtime grows with the KV).
        After a pipelined send to the same target under the same id, it goes on from there."""
        self.stats.out_started += 1
        started = self.clock()
        sent, sent_bytes, rounds, reserved = 0, 0, 0, False
        early = await self._take_early(request_id, target, mid)
        if early is not None:
            sent, sent_bytes, reserved = early.sent, early.bytes, True
        try:
            while True:
                pinned = await self.engine.call(lambda e: e.pin_full_blocks(request_id, sent))
                if pinned is None:
                    raise await self._not_movable(request_id)
                ids, hashes = pinned
                block = self.layout.block_size
                try:
                    if not reserved:  # the target makes room (or refuses) and says what it caches
                        skip = min(await self._reserve_remote(target, mid, request_id, hashes), len(ids))
                        reserved = True
                        ids, sent = ids[skip:], skip
                    # Full blocks only: the partial last block always goes with the stop-and-copy.
                    another = precopy and (rounds == 0 or PRECOPY.another_round(rounds, len(ids) * block, block))
                    if another:
                        sent_bytes += await self._push(target, mid, sent, ids)
                finally:
                    await self.engine.call(lambda e: e.kv.unpin(pinned[0]))
                if not another:
                    break  # the rest is the stop-and-copy's
                sent += len(ids)
                rounds += 1
            stop_started = self.clock()
            suspended = await self.engine.call(lambda e: e.suspend(request_id))
            if suspended is None:
                raise await self._not_movable(request_id)
            state, all_ids = suspended
            self.suspended[request_id] = _Held(all_ids, self.clock() + HOLD_S)
            try:
                sent_bytes += await self._push(target, mid, sent, all_ids[sent:])
            except BaseException:
                await self._resume_here(request_id)
                raise
        except BaseException:
            self.stats.out_aborted += 1
            if reserved:
                await self._release_remote(target, mid)
            raise
        now = self.clock()
        self.stats.bytes_sent += sent_bytes - (early.bytes if early is not None else 0)
        snapshot = MigrationSnapshot(state.to_json(), len(state.output_token_ids), rounds, sent_bytes, now - started,
                                     now - stop_started, len(all_ids) - sent,
                                     early.overlapped_bytes if early is not None else 0)
        self.stats.last = snapshot.timings()
        return snapshot.to_json()

    async def _not_movable(self, request_id: str) -> APIError:
        """The 409 for a request this worker cannot move now, its code saying why
        (LLMEngine.why_not_movable: `finished`, `not_running` or `unknown_request`)."""
        code, words = await self.engine.call(lambda e: e.why_not_movable(request_id))
        return APIError(409, f"request {request_id} {words}", code=code)

    async def _reserve_remote(self, target: str, mid: str, request_id: str, hashes: list[int]) -> int:
        """Ask the target to hold blocks for the request's KV; how many leading blocks it has."""
        live = self.core.scheduler.requests.get(request_id)  # a racy read is fine: a size hint
        tokens = live.num_tokens if live is not None else len(hashes) * self.layout.block_size
        answer = await self._post(target + "/internal/kv/reserve", json={
            "migration_id": mid, "hashes": [format(h, "x") for h in hashes], "num_tokens": tokens,
            "layout": self.layout.to_json()})
        return int(answer["have_blocks"])

    async def commit_out(self, request_id: str) -> bool:
        held = self.suspended.pop(request_id, None)
        if held is None:
            return False
        self.stats.out_completed += 1
        return await self.engine.drop_migrated(request_id, held.block_ids)

    async def abort_out(self, request_id: str) -> bool:
        resumed = await self._resume_here(request_id)
        self.stats.out_aborted += resumed
        return resumed

    async def _resume_here(self, request_id: str) -> bool:
        held = self.suspended.pop(request_id, None)
        if held is None:
            return False
        await self.engine.call(lambda e: e.unsuspend(request_id, held.block_ids))
        return True

    async def _push(self, target: str, mid: str, start: int, ids: list[int]) -> int:
        """Copy blocks `ids` to the target's table from index `start`, in bounded requests."""
        per_put = max(1, MAX_PUT_BYTES // self.layout.block_bytes)
        total = 0
        for i in range(0, len(ids), per_put):
            chunk = ids[i:i + per_put]
            payload = await asyncio.to_thread(read_blocks, self.core.kv_cache, chunk)
            with _peer_errors(target):
                resp = await self.client.put(f"{target}/internal/kv/{mid}", params={"start": start + i},
                                             content=payload, headers={"content-type": "application/octet-stream"})
            _raise_for(resp)
            total += len(payload)
        return total

    async def _post(self, url: str, json: dict) -> dict:
        with _peer_errors(url):
            resp = await self.client.post(url, json=json)
        _raise_for(resp)
        return resp.json()

    async def _release_remote(self, target: str, mid: str) -> None:
        try:
            await self.client.post(f"{target}/internal/kv/{mid}/release", timeout=5.0)
        except httpx.HTTPError as e:  # it lets the reservation go by itself after HOLD_S
            logger.info("could not release migration %s on %s: %s", mid, target, e)


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    """Until `event` is set or `timeout_s` passes, whichever is first."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)


@contextlib.contextmanager
def _peer_errors(where: str) -> Iterator[None]:
    """The target unreachable or gone mid-copy: a 502 for the front, not a logged 500."""
    try:
        yield
    except httpx.HTTPError as e:
        raise APIError(502, f"the migration target {where} failed: {type(e).__name__}",
                       code="target_unreachable") from None


def _raise_for(resp: httpx.Response) -> None:
    """The peer's refusal as our answer (409 stays 409: the front treats it as 'not now')."""
    if resp.status_code < 400:
        return
    try:
        err = resp.json()["error"]
        message, code = err.get("message", ""), err.get("code")
    except (ValueError, KeyError, TypeError):
        message, code = resp.text[:200], None
    status = resp.status_code if resp.status_code in (404, 409) else 502
    raise APIError(status, f"the target answered {resp.status_code}: {message}", code=code or "migration_failed")


def add_migration_routes(app: FastAPI, engine: Any, fleet_secret: Optional[str]) -> Migrations:
    migrations = Migrations(engine, fleet_secret)
    app.state.migrations = migrations
    app.state.sloserve.serving.push_kv = migrations.push_early

    @app.post("/internal/kv/reserve")
    async def kv_reserve(request: Request) -> JSONResponse:
        body = await _json_body(request)
        try:
            hashes = [int(h, 16) for h in body["hashes"]]
            mid, num_tokens, layout = str(body["migration_id"]), int(body["num_tokens"]), dict(body["layout"])
        except (KeyError, TypeError, ValueError):
            raise bad_request("need migration_id, hashes (hex), num_tokens and layout", "body") from None
        return JSONResponse(await migrations.reserve(mid, hashes, num_tokens, layout))

    @app.put("/internal/kv/{mid}")
    async def kv_receive(mid: str, request: Request, start: int = 0) -> JSONResponse:
        return JSONResponse(await migrations.receive(mid, start, await request.body()))

    @app.post("/internal/kv/{mid}/release")
    async def kv_release(mid: str) -> JSONResponse:
        return JSONResponse({"released": await migrations.release(mid)})

    @app.post("/internal/migrate")
    async def migrate(request: Request) -> JSONResponse:
        body = await _json_body(request)
        try:
            rid, target = str(body["request_id"]), str(body["target"]).rstrip("/")
        except (KeyError, TypeError):
            raise bad_request("need request_id and target", "body") from None
        mid = str(body.get("migration_id") or uuid.uuid4().hex)
        return JSONResponse(await migrations.migrate_out(rid, target, mid, precopy=body.get("precopy", True) is not False))

    @app.post("/internal/migrate/{request_id}/commit")
    async def commit(request_id: str) -> JSONResponse:
        return JSONResponse({"committed": await migrations.commit_out(request_id)})

    @app.post("/internal/migrate/{request_id}/abort")
    async def abort(request_id: str) -> JSONResponse:
        return JSONResponse({"resumed_here": await migrations.abort_out(request_id)})

    async def resume(request: Request, model: type) -> Response:
        payload = await _json_body(request)
        try:
            body = model.model_validate(payload["request"])
            state = ResumeState.from_json(payload["resume"])
            response_id, created = str(payload["id"]), int(payload["created"])
        except (KeyError, TypeError, ValueError) as e:
            raise bad_request(f"a resume needs request, resume, id and created: {e}"[:300], "body") from None
        mid = payload.get("migration_id")
        if mid is not None:
            state.block_ids = migrations.claim(str(mid))
        try:
            return await app.state.sloserve.serving.resume(body, request, state, response_id, created)
        except BaseException:
            if state.block_ids is not None:  # never reached the engine: its holds are still ours to drop
                ids = state.block_ids
                await engine.call(lambda e: e.kv.unpin(ids))
            raise

    @app.post("/internal/resume/v1/completions")
    async def resume_completions(request: Request) -> Response:
        return await resume(request, CompletionRequest)

    @app.post("/internal/resume/v1/chat/completions")
    async def resume_chat(request: Request) -> Response:
        return await resume(request, ChatCompletionRequest)

    return migrations


async def _json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("invalid JSON body", "body") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", "body")
    return body
