"""A stock vLLM server as a worker (`sloserve serve --engine vllm`, `--workers URL,...`).

What the fleet reads is what vLLM publishes, the contract llm-d and AIBrix read too: its load
from `/metrics` (kinds/vllm_metrics.py) and its cached prefixes from its KV events over ZMQ
(kinds/vllm_events.py, fed by a `KVEventFeed` per worker). Token ids come from its own
`/tokenize`. A generation call goes to its OpenAI routes unchanged, but for sloserve's own body
fields, with the tenant's cache salt as vLLM's `cache_salt` (so its prefix cache is isolated by
tenant as sloserve's engine's is), and with a `priority` that encodes the request's TTFT
deadline (milliseconds of the front's clock): vLLM started with `--scheduling-policy priority`
serves its queue in that order, which is deadline order. A priority the client gave is passed as
given.

A stream whose vLLM worker dies goes on from another one (vllm_stream.py: the call asks for its
token ids, and a greedy call continues from the prompt plus the tokens sent). What vLLM cannot do
over its API: hand a running request's KV to another server mid-stream (live migration), or take
sloserve's P/D hand-off (`contract` is False: a fleet of vLLM workers runs no migration policy)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any, Optional

from sloserve.workers.contract import FRONT_IDS_FIELD
from sloserve.workers.kinds.base import EngineKind
from sloserve.workers.kinds.vllm_events import SEQ_BYTES, KVEventIndex, decode_batch

if TYPE_CHECKING:
    import httpx

    from sloserve.core.types import Request
    from sloserve.workers.contract import WorkerState

logger = logging.getLogger(__name__)

# Body fields sloserve's API adds to OpenAI's that vLLM would not read (priority it reads: set below)
SLOSERVE_FIELDS = ("qos_class", FRONT_IDS_FIELD)
REPLAY_TIMEOUT_S = 2.0
NO_TARGET_S = 3600.0


class VllmKind(EngineKind):
    name = "vllm"
    contract = False

    def __init__(self, deadline_priority: bool = True):
        """`deadline_priority`: send each call a `priority` (workers started with
        `--scheduling-policy priority`; a vLLM without it refuses any priority but 0)."""
        self.deadline_priority = deadline_priority

    async def read_state(self, handle: Any, client: "httpx.AsyncClient",
                         secret: Optional[str]) -> "WorkerState":
        from sloserve.workers.contract import WorkerState
        from sloserve.workers.kinds.vllm_metrics import parse_metrics

        resp = await client.get(f"{handle.url}/metrics")
        resp.raise_for_status()
        load = parse_metrics(resp.text)
        feed: Optional[KVEventFeed] = getattr(handle, "kv_feed", None)
        keys: frozenset[int] = frozenset()
        if feed is not None:
            feed.start()
            keys = feed.index.prefix_keys
        state = load.instance_state()
        if getattr(handle, "lora", False):  # the adapters it holds, which adapter-aware routing reads
            models = await client.get(f"{handle.url}/v1/models")
            models.raise_for_status()
            loaded = {m["id"] for m in models.json().get("data", []) if isinstance(m, dict) and m.get("parent")}
            state = dataclasses.replace(state, adapters=state.adapters | frozenset(loaded))
        return WorkerState(state, keys, load.reading())

    def tokenize_call(self, payload: dict) -> Optional[tuple[str, dict]]:
        model = {"model": payload["model"]} if isinstance(payload.get("model"), str) else {}
        if "messages" in payload:
            body = {"messages": payload["messages"], "add_generation_prompt": True, **model}
            if payload.get("tools"):
                body["tools"] = payload["tools"]
            return "/tokenize", body
        if not isinstance(payload.get("prompt"), str):
            return None  # token ids: vLLM judges their range at generation
        return "/tokenize", {"prompt": payload["prompt"], **model}

    def upstream_body(self, body: dict, raw: bytes, routed: "Request", epoch: float) -> bytes:
        out = {k: v for k, v in body.items() if k not in SLOSERVE_FIELDS}
        if out.get("stream") is True and self.resumable(body):
            out["return_token_ids"] = True  # what the relay resumes from if this worker dies (vllm_stream.py)
        if routed.cache_salt:  # the tenant's: vLLM isolates its prefix cache by it, as sloserve's engine does
            out["cache_salt"] = routed.cache_salt
        if self.deadline_priority:
            out["priority"] = routed.priority if routed.priority is not None else deadline_priority(routed, epoch)
        else:
            out.pop("priority", None)
        return json.dumps(out).encode()

    def resumable(self, body: dict) -> bool:
        from sloserve.workers.kinds.vllm_stream import resumable

        return resumable(body)

    def stream_reader(self, body: dict) -> Any:
        from sloserve.workers.kinds.vllm_stream import StreamReader

        return StreamReader(client_asked_ids=bool(body.get("return_token_ids")))

    def close(self, handle: Any) -> None:
        feed: Optional[KVEventFeed] = getattr(handle, "kv_feed", None)
        if feed is not None:
            feed.close()


def deadline_priority(routed: "Request", epoch: float) -> int:
    """The request's TTFT deadline in milliseconds since `epoch` (the front's start, on the clock
    its arrival times are on): lower is earlier, as vLLM's priority queue orders. A class without
    a TTFT target is due NO_TARGET_S after it arrived: behind every deadline of the next hour,
    first come first served among its own."""
    target = min(routed.qos.ttft_target_s, NO_TARGET_S)
    return max(0, int((routed.arrival_time + target - epoch) * 1000))


class KVEventFeed:
    """One vLLM worker's KV events (a ZMQ SUB socket on the fleet's loop) into its KVEventIndex,
    with the replay socket asked for what a gap lost."""

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, topic: str = ""):
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.index = KVEventIndex()
        self._task: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._ctx: Any = None

    def start(self) -> None:
        """Subscribe (idempotent; needs the running loop)."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run(), name=f"kv-events {self.endpoint}")

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            if self.replay_endpoint:  # what the worker cached before this subscription
                self.index.replayed(await self._replay(0))
            while True:
                frames = await sub.recv_multipart()
                missing = self.index.receive(frames)
                if missing is not None:
                    replayed = await self._replay(missing) if self.replay_endpoint else []
                    self.index.replayed(replayed or [frames])
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the feed is a routing hint; its failure must not touch serving
            logger.exception("KV events from %s stopped", self.endpoint)
        finally:
            sub.close(linger=0)
            self._ctx.term()

    async def _replay(self, start: int) -> list[list[bytes]]:
        """The batches from `start` on, from the worker's replay buffer ([] if it does not answer)."""
        import zmq

        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        out: list[list[bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) < 4 or not frames[1]:  # [b"", b"", END_SEQ, b""]: the end
                    return out
                out.append(frames[1:4])
        except asyncio.TimeoutError:
            logger.warning("KV event replay from %s did not answer: the gap stays", self.replay_endpoint)
            return out
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        """Stop the subscription (from any thread: the fleet kills workers in threads)."""
        task, loop, self._task = self._task, self._loop, None
        if task is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed: so is the task
                loop.call_soon_threadsafe(task.cancel)


__all__ = ["VllmKind", "KVEventFeed", "deadline_priority", "decode_batch"]
