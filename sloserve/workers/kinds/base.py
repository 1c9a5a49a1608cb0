"""An engine kind: how the front and the fleet speak to one kind of worker server. sloserve's own
worker is the default (`SloserveKind`); a stock vLLM server is another (kinds/vllm.py). Each
worker handle names its kind (`WorkerHandle.kind_of`), so one fleet code drives either, and a
further engine (SGLang's server, whose metrics and cache events differ) is one more kind.

A kind answers four questions: what the worker's load and cache are (`read_state`, once a
health poll), how to ask it for a prompt's token ids (`tokenize_call`), what body a generation
call sends it (`upstream_body`), and whether it speaks sloserve's worker contract (`contract`:
workers/contract.py's /internal/ routes and headers, and streams annotated for the relay, which
is what lets a stream fail over, migrate or hand off from prefill to decode)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import httpx

    from sloserve.core.types import Request
    from sloserve.workers.contract import WorkerState


class EngineKind:
    """sloserve's own worker (server/worker.py): its /internal/ routes, as the contract says."""

    name = "sloserve"
    contract = True

    async def read_state(self, handle: Any, client: "httpx.AsyncClient",
                         secret: Optional[str]) -> "WorkerState":
        """The worker's load and cached prefixes now (`secret`: the fleet's, which a sloserve
        worker's /internal/ routes ask for); raises on no answer or a malformed one."""
        from sloserve.workers.contract import FLEET_SECRET_HEADER, WorkerState

        resp = await client.get(f"{handle.url}/internal/state",
                                headers={FLEET_SECRET_HEADER: secret} if secret else None)
        resp.raise_for_status()
        return WorkerState.from_json(resp.json())

    def tokenize_call(self, payload: dict) -> Optional[tuple[str, dict]]:
        """(path, JSON body) that asks the worker for `payload`'s token ids (the front's tokenize
        payload: `prompt` or `messages`, `max_tokens`, `model`; the answer holds `tokens`), or
        None when the ids are the prompt itself and nothing needs asking."""
        return "/internal/tokenize", payload

    def upstream_body(self, body: dict, raw: bytes, routed: "Request", epoch: float) -> bytes:
        """The generation call's body as this worker takes it (`raw`: `body` serialized)."""
        return raw

    def resumable(self, body: dict) -> bool:
        """Whether another worker of this kind can continue this single-choice streamed call."""
        return True

    def stream_reader(self, body: dict) -> Any:
        """What reads this kind's stream events for the relay (None: sloserve's annotations,
        which the relay reads itself)."""
        return None

    def close(self, handle: Any) -> None:
        """Release what this kind holds for `handle` (the handle is being killed)."""


SLOSERVE = EngineKind()
