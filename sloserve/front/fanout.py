"""A call with several choices (n > 1, several prompts), split into one-choice calls.

Only a one-choice call can move between instances: the front relays it as a stream and knows
from the relay annotations which tokens its client has (front/relay.py, front/whole.py). Sent to one
worker whole, a call with several choices would decode on the prefill instance of a `--pd` fleet,
could not be migrated, and would be lost with a worker failing mid-generation. So the front splits
such a call into one call per choice, each routed, handed off, resumed and migrated like any
other, and gives the client what the
worker would have sent for the whole call: the choices in the worker's order (the j-th sample
of prompt p at index p*n + j), the j-th sample seeded as the worker seeds it
(`protocol.choice_seed`), usage counting each prompt once (its first sample's prompt and cached
tokens, as the worker does). A non-streamed call gets one JSON answer (`merge`); a stream gets
its parts' events interleaved as they come, under one id, with one usage chunk and one [DONE]
(`MergedStream`).

What a split costs: each sample prefills its prompt, as the worker's own n samples do (they
share nothing before their prompt blocks are cached); the prefix-aware routers send samples of
one prompt to the instance that has it. A split stream starts once every part has its first
token. The parts run together; the first that fails before starting ends the others and the
client gets its error (a bad body fails every part the same way); a part that ends in an error
mid-stream ends the stream with it. Calls the split cannot carry stay whole: `best_of` other
than n, and shapes the worker judges with its own 400s.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Union

from sloserve.front.stream import SSESplitter, event_data
from sloserve.server.protocol import MAX_CHOICES, MAX_REQUEST_ID, REQUEST_ID, choice_seed

logger = logging.getLogger(__name__)
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Part:
    """One choice of a split call: its index in the answer, its prompt, its own body and id."""
    index: int
    prompt_index: int
    sample: int  # j: the prompt's j-th sample
    body: dict
    request_id: str


def split(body: dict, chat: bool, client_id: Optional[str]) -> Optional[tuple[str, list[Part]]]:
    """(the call's id, its parts), or None when the call stays whole (see the module's
    docstring). The id is the client's X-Request-Id, as the worker would answer, else a new one."""
    if body.get("stream") not in (None, False, True) or ("stream_options" in body and body.get("stream") is not True):
        return None
    n = body.get("n")
    n = 1 if n is None else n
    if type(n) is not int or not 1 <= n <= MAX_CHOICES:
        return None
    if body.get("best_of") is not None and body.get("best_of") != n:
        return None
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        return None
    if client_id is not None and not REQUEST_ID.match(client_id):
        return None  # the worker refuses it (400)
    prompts = [None] if chat else _prompts(body.get("prompt"))
    if prompts is None or not 2 <= len(prompts) * n <= MAX_CHOICES:
        return None
    call_id = client_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    parts = []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            index = p * n + j
            sub = {key: value for key, value in body.items() if key != "best_of"}
            sub["n"] = 1
            if not chat:
                sub["prompt"] = prompt
            if seed is not None:
                sub["seed"] = choice_seed(seed, j)
            parts.append(Part(index, p, j, sub, _part_id(call_id, index)))
    return call_id, parts


def merge(call_id: str, parts: list[Part], answers: list[dict]) -> dict:
    """The whole call's answer from its parts' one-choice answers (in the order of `parts`)."""
    first = answers[0]
    choices = [{**answer["choices"][0], "index": part.index} for part, answer in zip(parts, answers)]
    merged = {**first, "id": call_id, "choices": choices}
    usages = [answer.get("usage") for answer in answers]
    if all(isinstance(u, dict) for u in usages):
        merged["usage"] = _usage(parts, usages)
    return merged


class MergedStream:
    """The SSE stream of a split streamed call, read from its parts' relayed streams (relay
    annotations already stripped): each event as it comes, its choices given their index in the
    call, under the call's id and one `created`; the parts' usage chunks summed into one at the
    end, then one [DONE]. A part's error event ends the stream (after it, [DONE])."""

    def __init__(self, call_id: str, parts: list[Part], sources: list[AsyncIterator[bytes]]) -> None:
        self.call_id, self.parts, self.sources = call_id, parts, sources
        self._created: object = None
        self._usage: dict[int, dict] = {}  # part -> its usage chunk
        self._failed = False

    async def events(self) -> AsyncIterator[bytes]:
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(self._pump(k, source, queue)) for k, source in enumerate(self.sources)]
        try:
            running = len(pumps)
            while running and not self._failed:
                k, event = await queue.get()
                if event is None:
                    running -= 1
                    continue
                out = self._rewrite(k, event)
                if out is not None:
                    yield out
            if not self._failed and len(self._usage) == len(self.parts):
                last = self._usage[len(self.parts) - 1]
                usage = _usage(self.parts, [self._usage[k]["usage"] for k in range(len(self.parts))])
                yield _event({**last, "id": self.call_id, "created": self._created, "usage": usage})
            yield _DONE
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    @staticmethod
    async def _pump(k: int, source: AsyncIterator[bytes], queue: asyncio.Queue) -> None:
        splitter = SSESplitter()
        try:
            async for chunk in source:
                for event in splitter.feed(chunk):
                    await queue.put((k, event))
            if splitter.rest().strip():
                await queue.put((k, splitter.rest()))
        except Exception:  # the relay ends its own failures with an error event; this is a backstop
            logger.exception("part %d of a split stream failed", k)
            await queue.put((k, _event({"error": {"message": "a part of this call failed", "type": "server_error",
                                                  "code": "instance_failed", "param": None}})))
        await queue.put((k, None))

    def _rewrite(self, k: int, event: bytes) -> Optional[bytes]:
        data = event_data(event)
        if data is None or data == b"[DONE]":
            return None
        try:
            obj = json.loads(data)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        if "error" in obj:
            self._failed = True
            return _event(obj)
        if self._created is None:
            self._created = obj.get("created")
        if obj.get("usage") and not obj.get("choices"):
            self._usage[k] = obj
            return None
        choices = [{**c, "index": self.parts[k].index} if isinstance(c, dict) else c for c in obj.get("choices") or []]
        return _event({**obj, "id": self.call_id, "created": self._created, "choices": choices})


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _usage(parts: list[Part], usages: list[dict]) -> dict:
    prompt = cached = completion = 0
    for part, usage in zip(parts, usages):
        completion += usage.get("completion_tokens") or 0
        if part.sample == 0:  # each prompt once
            prompt += usage.get("prompt_tokens") or 0
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    out = {**usages[0], "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if usages[0].get("prompt_tokens_details") is not None:
        out["prompt_tokens_details"] = {**usages[0]["prompt_tokens_details"], "cached_tokens": cached}
    return out


def _prompts(prompt: object) -> Optional[list[Union[str, list[int]]]]:
    """The prompts of a completions call (the shapes front._check_prompt let through)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and type(prompt[0]) is int):
        return [prompt]  # type: ignore[list-item]
    if isinstance(prompt, list) and prompt:
        return list(prompt)
    return None


def _part_id(call_id: str, index: int) -> str:
    """The part's X-Request-Id: the call's id and the choice's index, within the id's length limit."""
    suffix = f"-{index}"
    return call_id[:MAX_REQUEST_ID - len(suffix)] + suffix
