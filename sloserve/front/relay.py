"""One client stream relayed by the front, across changes of instance.

A streamed single-choice request can continue on another instance: its worker annotates
each SSE event with a comment (`RELAY_COMMENT`: the event's token ids and the characters of
text sent so far; the first also the response id, creation time and engine id). The front
strips those comments and keeps the sum, so it always knows what the client has received.
With that it can:
- fail over: the worker dies mid-stream; another instance resumes the call from the tokens
  already sent (it recomputes their KV), and the client sees a pause, not an error;
- migrate: the source copies the request's KV to the target while it keeps decoding, then
  suspends it and hands back its state; the front reads the source's last events, opens the
  resumed stream on the target (which adopts the copied KV), and once the target's first
  token arrives tells the source to free the request. If the target fails first, the source
  is told to go on and the client notices nothing.
Whatever happens, the client gets each token once, one usage chunk and one [DONE].
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Optional, Protocol

import httpx

from sloserve.front.stream import Interrupted, SSESplitter, Stop, carries_output
from sloserve.workers.contract import (FLEET_SECRET_HEADER, KV_PUSH_HEADER, RELAY_COMMENT, ContractError,
                                       MigrationSnapshot)

if TYPE_CHECKING:
    from sloserve.workers.fleet import Instance, WorkerFleet
    from sloserve.core.types import Request

logger = logging.getLogger(__name__)

_COMMENT = RELAY_COMMENT.rstrip().encode()
_FINISHED = b'"finish_reason":"'
_TRANSPORT_ERRORS = (httpx.TransportError,)
SWITCH_READ_TIMEOUT_S = 10.0  # the source's last events are already sent when it suspends


class _SwitchRequested(Exception):
    """A migration's snapshot is in: hand the stream over between two events."""


class _UpstreamStalled(Exception):
    """The upstream's worker stopped answering its health polls; another instance can resume."""


@dataclass
class Upstream:
    inst: "Instance"
    generation: int
    response: httpx.Response
    chunks: AsyncIterator[bytes]

    @property
    def url(self) -> str:
        return self.inst.handle.url or ""

    @property
    def alive(self) -> bool:
        return self.inst.generation == self.generation and self.inst.handle.is_running()


@dataclass(frozen=True)
class EarlyTarget:
    """The decode instance a pipelined hand-off sends to from the start, and the migration id
    both workers know the transfer by."""

    inst: "Instance"
    generation: int
    migration_id: str

    def header(self) -> dict[str, str]:
        return {KV_PUSH_HEADER: f"{self.inst.handle.url} {self.migration_id}"}

    @property
    def usable(self) -> bool:
        """Still the same worker, and still taking requests."""
        inst = self.inst
        return inst.generation == self.generation and inst.status == "healthy" and not inst.draining


@dataclass
class MigrationOutcome:
    ok: bool
    reason: str = ""
    kv_bytes: int = 0
    downtime_s: float = 0.0  # the request paused: the source's stop-and-copy until the target's first token
    rounds: int = 0  # pre-copy rounds
    copy_s: float = 0.0  # the whole copy, pre-copy rounds included (the request decoded meanwhile)
    early_bytes: int = 0  # of kv_bytes, those a pipelined hand-off sent while the prompt was computed
    code: str = ""  # the refusing worker's error code (`finished`, `no_room`, ...), when a worker refused


@dataclass
class _Switch:
    target: "Instance"
    migration_id: str
    snapshot: MigrationSnapshot
    snapshot_at: float
    done: asyncio.Future


class RelayOwner(Protocol):
    """What a relayed stream reports to the front that made it."""

    fleet: "WorkerFleet"

    def learn(self, routed: "Request", content: bytes) -> None: ...

    def forget(self, session: "RelaySession") -> None: ...

    def started(self, session: "RelaySession") -> None: ...


class RelaySession:
    def __init__(self, front: RelayOwner, routed: "Request", path: str, body: dict, headers: dict, chat: bool,
                 resumable: bool, upstream: Upstream, abort: Optional[asyncio.Event]) -> None:
        self.front = front
        self.fleet = front.fleet
        self.routed = routed
        self.path = path
        self.body = body
        self.headers = headers
        self.chat = chat
        self.resumable = resumable
        self.upstream = upstream
        self.tokens: list[int] = []
        self.chars = 0
        self.head: dict = {}  # id, created, engine_id, prompt_tokens (from the first annotation)
        self.first_token_at: Optional[float] = None
        self.finished = False  # a finish_reason (or [DONE]) reached the client
        self.migrating = False
        self.answered_whole = False  # the client asked for no stream: the front answers it at the end
        self.num_instances = 1
        self.early_target: Optional[EarlyTarget] = None  # a pipelined hand-off's decode instance
        self._splitter = SSESplitter()
        # reads the upstream's events for what the client has (None: sloserve's annotations, read here)
        self._reader = upstream.inst.handle.engine_kind.stream_reader(body)
        self._tail = b""
        self._read: Optional[asyncio.Future] = None
        self._switch: Optional[_Switch] = None
        self._switch_ready = asyncio.Event()
        self._stop = Stop(abort=abort)
        self._released = False
        self._source_lost = False  # a migration found its source dead and the target unwilling
        self._token_times: collections.deque[float] = collections.deque(maxlen=9)

    # ---- what the controller reads ----------------------------------------------------
    @property
    def engine_id(self) -> Optional[str]:
        return self.head.get("engine_id")

    @property
    def movable(self) -> bool:
        return (self.resumable and not self.finished and not self.migrating and self.engine_id is not None
                and bool(self.tokens) and self.upstream.inst.handle.engine_kind.contract)

    @property
    def last_token_at(self) -> Optional[float]:
        return self._token_times[-1] if self._token_times else None

    def recent_tbt_s(self) -> float:
        """Mean gap between the last few token events (0 until there are two)."""
        times = self._token_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0

    @property
    def max_tokens(self) -> Optional[int]:
        value = self.body.get("max_completion_tokens", self.body.get("max_tokens"))
        return value if type(value) is int and value > 0 else None

    @property
    def num_tokens(self) -> int:
        return int(self.head.get("prompt_tokens", self.routed.num_prompt_tokens)) + len(self.tokens)

    # ---- the client's stream ------------------------------------------------------------
    async def stream(self, head: bytes) -> AsyncIterator[bytes]:
        """Everything the client receives (annotations stripped)."""
        try:
            first = self._filter(head)
            self.front.started(self)
            if first:
                yield first
            while True:
                try:
                    chunk = await self._next_chunk()
                except StopAsyncIteration:
                    rest = self._splitter.rest()
                    if rest:
                        yield rest
                    break
                except Interrupted:
                    yield _sse_error("the server is shutting down; the output is incomplete", "draining")
                    return
                except _SwitchRequested:
                    async for piece in self._hand_over():
                        yield piece
                    if not self._source_lost:
                        continue
                    error: BaseException = httpx.ReadError("the source died during a migration")
                except _TRANSPORT_ERRORS as e:
                    error = e
                except _UpstreamStalled:
                    error = TimeoutError("the worker stopped answering its health polls")
                    self.fleet.counters["moved_stalled"] += 1
                else:
                    out = self._filter(chunk)
                    if out:
                        yield out
                    continue
                up = self.upstream
                self.fleet.suspect(up.inst, up.inst.handle, error)
                logger.warning("instance %d failed while streaming request %s: %r", up.inst.slot,
                               self.routed.request_id, error)
                resumed = await self._fail_over() if self.can_resume else None
                if resumed is None:
                    if not self.answered_whole:  # an answer not yet sent starts again elsewhere (front.py)
                        self.fleet.counters["failed_midstream"] += 1
                    yield _sse_error(f"instance {up.inst.slot} failed while generating this response; the "
                                     f"output is incomplete", "instance_failed")
                    return
                self.fleet.counters["resumed_midstream"] += 1
                self.front.started(self)
                if resumed:
                    yield resumed
            self.front.learn(self.routed, self._tail)
        finally:
            await self.release()

    @property
    def can_resume(self) -> bool:
        return self.resumable and not self.finished and self.engine_id is not None

    async def _next_chunk(self) -> bytes:
        """The current upstream's next chunk; _SwitchRequested when a migration is ready first;
        _UpstreamStalled when its worker stops answering health polls (frozen, hung) and the
        stream can resume elsewhere: waiting it out would stall the client for as long."""
        if self._read is None:
            self._read = asyncio.ensure_future(self.upstream.chunks.__anext__())
        while not self._read.done():
            up = self.upstream
            stalled = up.inst.stalled
            # An answer sent whole can also start again elsewhere (its client has nothing yet).
            watch_stall = (self.can_resume or self.answered_whole) and up.inst.generation == up.generation
            if watch_stall and stalled.is_set():
                if self.fleet.has_alternative({(up.inst.slot, up.generation)}):
                    raise _UpstreamStalled()
                watch_stall = False  # nowhere else to go: wait it out
            waits = [self._read, asyncio.ensure_future(self._switch_ready.wait())]
            if watch_stall:
                waits.append(asyncio.ensure_future(stalled.wait()))
            try:
                await self._stop.run(asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED))
            finally:
                for waiter in waits[1:]:
                    waiter.cancel()
            if not self._read.done() and self._switch_ready.is_set():
                raise _SwitchRequested()
        read, self._read = self._read, None
        return read.result()

    def _filter(self, chunk: bytes) -> bytes:
        """Strip and record the annotations of the complete events in `chunk`."""
        out = []
        for event in self._splitter.feed(chunk):
            if event.startswith(_COMMENT):
                line, _, event = event.partition(b"\n")
                self._note(line[len(_COMMENT):])
            elif self._reader is not None:
                event, note = self._reader.event(event)
                if note:
                    self._record(note)
            if _FINISHED in event or event.startswith(b"data: [DONE]"):
                self.finished = True
            out.append(event)
        data = b"".join(out)
        self._tail = (self._tail + data)[-512:]
        return data

    def _note(self, raw: bytes) -> None:
        try:
            note = json.loads(raw)
        except ValueError:
            return
        if isinstance(note, dict):
            self._record(note)

    def _record(self, note: dict) -> None:
        """What an event says the client now has: sloserve's annotation, or a reader's note."""
        for key in ("id", "created", "engine_id", "prompt_tokens", "prompt_ids"):
            if key in note and key not in self.head:
                self.head[key] = note[key]
        tokens = note.get("t")
        if isinstance(tokens, list):
            if tokens:
                now = self.fleet.clock()
                self._token_times.append(now)
                if self.first_token_at is None:
                    self.first_token_at = now
            self.tokens.extend(t for t in tokens if type(t) is int)
        if type(note.get("c")) is int:
            self.chars = note["c"]

    # ---- resuming elsewhere ---------------------------------------------------------------
    def _resume_state(self, snapshot: Optional[MigrationSnapshot] = None) -> dict:
        if snapshot is not None:
            return dict(snapshot.resume, sent_text_len=self.chars)
        now = self.fleet.clock()
        return {"output_token_ids": self.tokens, "sent_text_len": self.chars,
                "age_s": max(0.0, now - self.routed.arrival_time),
                "first_token_age_s": None if self.first_token_at is None else now - self.first_token_at}

    async def _open_resumed(self, inst: "Instance", state: dict,
                            migration_id: Optional[str] = None) -> Optional[tuple[Upstream, bytes]]:
        """Resume the call on `inst`; its upstream and the bytes up to its first token, or None.
        A sloserve worker resumes it (its /internal/resume route, with the KV a migration sent);
        another kind of worker (a vLLM server) continues it as a new call from the prompt plus the
        tokens sent (workers/kinds/vllm_stream.py), its events made the original call's."""
        headers = {k: v for k, v in self.headers.items() if k not in ("content-type", "x-request-id")}
        if inst.handle.engine_kind.contract:
            payload = {"request": self.body, "resume": state, "id": self.head.get("id"),
                       "created": self.head.get("created"), "migration_id": migration_id}
            secret = {FLEET_SECRET_HEADER: self.fleet.fleet_secret or ""}
            return await self._open_stream(inst, f"/internal/resume{self.path}", payload, {**headers, **secret},
                                           self.chat)
        from sloserve.workers.kinds.vllm_stream import ResumedReader, resume_call

        call = resume_call(self.body, self.chat, self.head, self.tokens)
        if call is None:
            return None
        if self.routed.cache_salt:  # as the first call was sent (workers/kinds/vllm.py)
            call["cache_salt"] = self.routed.cache_salt
        opened = await self._open_stream(inst, "/v1/completions", call, headers, chat=False)
        if opened is not None:
            usage_asked = bool((self.body.get("stream_options") or {}).get("include_usage"))
            sent_text = getattr(self._reader, "text", "")
            self._reader = ResumedReader(self.chat, self.head, len(self.tokens), usage_asked, self.body.get("model"),
                                         client_asked_ids=bool(self.body.get("return_token_ids")), sent_text=sent_text)
        return opened

    async def _open_stream(self, inst: "Instance", route: str, payload: dict, headers: dict,
                           chat: bool) -> Optional[tuple[Upstream, bytes]]:
        """POST `payload` to `inst`'s `route` as a stream: its upstream and the bytes up to its first
        output event, or None when it refuses, fails or ends before producing anything."""
        client = self.fleet.client
        generation = inst.generation
        inst.in_flight += 1
        response: Optional[httpx.Response] = None
        try:
            request = client.build_request("POST", f"{inst.handle.url}{route}", json=payload, headers=headers)
            response = await self._stop.run(client.send(request, stream=True))
            if response.status_code != 200:
                body = await response.aread()
                logger.info("instance %d refused to resume %s: %d %s", inst.slot, self.routed.request_id,
                            response.status_code, body[:200])
                raise _Refused()
            chunks = response.aiter_raw()
            head = b""
            splitter = SSESplitter()
            async with asyncio.timeout(SWITCH_READ_TIMEOUT_S * 3):
                async for chunk in chunks:
                    head += chunk
                    if any(carries_output(e, chat) for e in splitter.feed(chunk)):
                        break
                else:
                    raise _Refused()  # ended before producing anything
            return Upstream(inst, generation, response, chunks), head
        except (_Refused, TimeoutError, *_TRANSPORT_ERRORS) as e:
            if isinstance(e, httpx.TransportError):
                self.fleet.suspect(inst, inst.handle, e)
            inst.in_flight -= 1
            if response is not None:
                await response.aclose()
            return None
        except BaseException:
            inst.in_flight -= 1
            if response is not None:
                await response.aclose()
            raise

    async def _fail_over(self) -> Optional[bytes]:
        """The upstream died: resume the call elsewhere from the tokens the client has.
        The first bytes of the new upstream, or None when no instance could take it."""
        dead = self.upstream
        tried = {(dead.inst.slot, dead.generation)}
        await self._drop_upstream()
        state = self._resume_state()
        for _ in range(self.fleet.config.max_attempts):
            inst = self.fleet.pick(self.routed, tried)
            if inst is None:
                return None
            tried.add((inst.slot, inst.generation))
            opened = await self._open_resumed(inst, state)
            if opened is not None:
                self.upstream, head = opened
                self.num_instances += 1
                logger.info("request %s resumed on instance %d after %d tokens", self.routed.request_id,
                            inst.slot, len(self.tokens))
                return self._filter(head)
        return None

    # ---- migration -------------------------------------------------------------------------
    async def migrate(self, target: "Instance", precopy: bool = True,
                      migration_id: Optional[str] = None) -> MigrationOutcome:
        """Move the stream's request to `target` (live pre-copy by the source, then a switch
        between two events). Never raises; the outcome says what happened."""
        if not self.movable:
            return MigrationOutcome(False, "not movable")
        source = self.upstream
        self.migrating = True
        mid = migration_id or uuid.uuid4().hex
        try:
            try:
                resp = await self.fleet.client.post(
                    f"{source.url}/internal/migrate", json={"request_id": self.engine_id, "target": target.handle.url,
                                                            "migration_id": mid, "precopy": precopy},
                    headers={FLEET_SECRET_HEADER: self.fleet.fleet_secret or ""}, timeout=120.0)
            except _TRANSPORT_ERRORS as e:
                await self._release_target(target, mid)
                return MigrationOutcome(False, f"source unreachable: {type(e).__name__}")
            if resp.status_code != 200:
                return _refused(resp)
            try:
                snapshot = MigrationSnapshot.from_json(resp.json())
            except (ContractError, ValueError) as e:
                await self._tell(source, "abort")
                await self._release_target(target, mid)
                return MigrationOutcome(False, f"unreadable snapshot: {e}")
            if self._released:  # the client left during the copy
                await self._tell(source, "abort")
                await self._release_target(target, mid)
                return MigrationOutcome(False, "client gone")
            done = asyncio.get_running_loop().create_future()
            self._switch = _Switch(target, mid, snapshot, self.fleet.clock(), done)
            self._switch_ready.set()
            return await done
        finally:
            self.migrating = False

    async def _hand_over(self) -> AsyncIterator[bytes]:
        """Between two events: read the source's last tokens, start the target, switch."""
        switch, self._switch = self._switch, None
        self._switch_ready.clear()
        assert switch is not None
        source = self.upstream
        snapshot = switch.snapshot
        want = snapshot.num_output_tokens
        outcome = MigrationOutcome(False, "stream ended")
        try:
            try:
                async with asyncio.timeout(SWITCH_READ_TIMEOUT_S):
                    while len(self.tokens) < want:
                        out = self._filter(await self._stop.run(self._read_source()))
                        if out:
                            yield out
            except (StopAsyncIteration, TimeoutError, *_TRANSPORT_ERRORS):
                pass  # the source is gone or silent: the snapshot has all we need
            if len(self.tokens) != want:
                logger.warning("request %s: the client has %d tokens, the migration snapshot %d; not switching",
                               self.routed.request_id, len(self.tokens), want)
                outcome = MigrationOutcome(False, "token count mismatch")
                return
            opened = await self._open_resumed(switch.target, self._resume_state(snapshot), switch.migration_id)
            if opened is None:
                outcome = MigrationOutcome(False, "target refused or failed")
                return
            await self._tell(source, "commit")
            await self._drop_upstream()
            self.upstream, head = opened
            self.num_instances += 1
            downtime = snapshot.stop_copy_s + (self.fleet.clock() - switch.snapshot_at)
            outcome = MigrationOutcome(True, "", snapshot.bytes, downtime, snapshot.rounds, snapshot.copy_s,
                                       snapshot.early_bytes)
            out = self._filter(head)
            if out:
                yield out
        finally:
            if not outcome.ok:  # the source goes on (or, dead, leaves the stream to a failover)
                resumed_here = await self._tell(source, "abort")
                await self._release_target(switch.target, switch.migration_id)
                self._source_lost = not resumed_here and not source.alive
            switch.done.set_result(outcome)

    async def _read_source(self) -> bytes:
        if self._read is None:
            self._read = asyncio.ensure_future(self.upstream.chunks.__anext__())
        read = self._read
        try:
            return await asyncio.shield(read)
        finally:
            if read.done():
                self._read = None

    async def _tell(self, up: Upstream, verb: str) -> bool:
        """Commit or abort a migration on its source (False when the source cannot hear it)."""
        if not up.alive or self.engine_id is None:
            return False
        try:
            resp = await self.fleet.client.post(f"{up.url}/internal/migrate/{self.engine_id}/{verb}",
                                                headers={FLEET_SECRET_HEADER: self.fleet.fleet_secret or ""},
                                                timeout=10.0)
            return resp.status_code == 200 and any(resp.json().values())
        except (*_TRANSPORT_ERRORS, ValueError):
            return False

    async def _release_target(self, target: "Instance", mid: str) -> None:
        with contextlib.suppress(*_TRANSPORT_ERRORS):
            await self.fleet.client.post(f"{target.handle.url}/internal/kv/{mid}/release",
                                         headers={FLEET_SECRET_HEADER: self.fleet.fleet_secret or ""}, timeout=5.0)

    async def _drop_upstream(self) -> None:
        """Close the current upstream (its worker aborts what is left of the request there)."""
        up = self.upstream
        if self._read is not None:
            self._read.cancel()
            with contextlib.suppress(BaseException):
                await self._read
            self._read = None
        up.inst.relay_ended(self.fleet.clock())
        with contextlib.suppress(Exception):
            await up.response.aclose()

    async def release(self) -> None:
        """However the stream ends: close the upstream, settle a pending switch, once."""
        if self._released:
            return
        self._released = True
        self._stop.close()
        switch, self._switch = self._switch, None
        if switch is not None and not switch.done.done():
            await self._tell(self.upstream, "abort")
            await self._release_target(switch.target, switch.migration_id)
            switch.done.set_result(MigrationOutcome(False, "stream ended"))
        await self._drop_upstream()
        self.front.forget(self)


class _Refused(Exception):
    pass


def _refused(resp: httpx.Response) -> MigrationOutcome:
    """A worker's refusal as an outcome: its status, error code and message as the reason, its
    code (else the status) as the outcome's code."""
    try:
        err = resp.json()["error"]
        reason = f"{resp.status_code} {err.get('code')}: {err.get('message', '')}"[:300]
        return MigrationOutcome(False, reason, code=str(err.get("code") or resp.status_code))
    except (ValueError, KeyError, TypeError, AttributeError):
        return MigrationOutcome(False, f"{resp.status_code}", code=str(resp.status_code))


def _sse_error(message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error", "code": code, "param": None}})
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()

