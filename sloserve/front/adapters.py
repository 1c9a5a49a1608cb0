"""LoRA adapters loaded and unloaded at run time across a fleet: the front's side.

`POST /v1/load_lora_adapter` at the front puts the adapter in the fleet's worker specs first
(`on_change`: a worker started from now on, by autoscaling or after a crash, starts with it), then
loads it on every healthy worker and every starting one once it answers (their own route,
authenticated by the fleet secret; a worker that already has it counts as loaded). It succeeds
only if every one took it: a worker that refuses it (a bad directory, a rank over its limit) gets
the others' loads and the spec change undone, and its answer is the front's. A worker spawned
before the load may answer requests for the adapter with 404 in the moment between its first
health poll and its load. Unloading goes to every healthy worker; each finishes the requests
already using the adapter.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable, Optional

import httpx
from fastapi.responses import JSONResponse, Response

from sloserve.engine.lora import LoraError, check_name
from sloserve.server.errors import error_body
from sloserve.workers.contract import FLEET_SECRET_HEADER
from sloserve.workers.fleet import HEALTHY, STARTING

logger = logging.getLogger(__name__)

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


class AdapterFanout:
    def __init__(self, fleet, initial: tuple[tuple[str, str], ...] = ()) -> None:
        self.fleet = fleet
        self.loaded: dict[str, str] = dict(initial)  # name -> directory, what a new worker starts with
        # Called with the new (name, path) pairs after each change (multi.py updates the worker specs).
        self.on_change: Optional[Callable[[tuple[tuple[str, str], ...]], None]] = None
        self._lock = asyncio.Lock()  # one change at a time: a load racing an unload of the same name

    async def load(self, raw: bytes) -> Response:
        body, err = _body(raw, ("lora_name", "lora_path"))
        if err is not None:
            return err
        name = body["lora_name"]
        async with self._lock:
            if name in self.loaded:
                return _error(400, f"adapter {name!r} is already loaded", "lora_adapter_exists", "lora_name")
            self.loaded[name] = body["lora_path"]
            self._changed()  # workers spawned from now on start with it
            done, failure, answer = [], None, {}
            for inst in [i for i in self.fleet.instances if i.status in (HEALTHY, STARTING)]:
                if not await self._answering(inst):
                    continue  # it did not come up: its replacement starts from the spec
                resp = await self._post(inst, LOAD_PATH, body)
                if resp is None:
                    continue  # unreachable: it restarts from the spec, which holds the adapter
                if resp.status_code != 200 and not _exists(resp):
                    failure = resp
                    break
                done.append(inst)
                if resp.status_code == 200:
                    answer = _answer(resp, name)
            if failure is not None or not done:
                del self.loaded[name]
                self._changed()
                for inst in done:  # all or nothing
                    await self._post(inst, UNLOAD_PATH, {"lora_name": name})
                if failure is None:
                    return _error(503, "no healthy instance to load the adapter on", "no_instance")
                return Response(failure.content, status_code=failure.status_code,
                                media_type=failure.headers.get("content-type"))
        logger.info("LoRA adapter %r loaded on %d workers", name, len(done))
        answer["instances"] = len(done)
        return JSONResponse(answer)

    async def unload(self, raw: bytes) -> Response:
        body, err = _body(raw, ("lora_name",))
        if err is not None:
            return err
        name = body["lora_name"]
        async with self._lock:
            answers = [r for inst in self.fleet.healthy()
                       if (r := await self._post(inst, UNLOAD_PATH, {"lora_name": name})) is not None]
            known = self.loaded.pop(name, None) is not None
            if known:
                self._changed()
        if not known and not any(r.status_code == 200 for r in answers):
            return _error(404, f"adapter {name!r} is not loaded", "model_not_found", "lora_name")
        logger.info("LoRA adapter %r unloaded from %d workers", name, sum(r.status_code == 200 for r in answers))
        return JSONResponse({"object": "lora_adapter", "id": name, "status": "unloaded",
                             "instances": sum(r.status_code == 200 for r in answers)})

    def named(self, body: dict) -> Optional[str]:
        """The adapter a call's `model` names, or None (the base model, or a name the workers judge):
        the router keys its prefix hints by it, as the workers key their caches."""
        model = body.get("model")
        return model if isinstance(model, str) and model in self.loaded else None

    async def _answering(self, inst) -> bool:
        """Wait for a starting worker's first answer (its start time-out bounds the wait)."""
        handle, deadline = inst.handle, time.monotonic() + self.fleet.config.start_timeout_s
        while inst.status == STARTING and inst.handle is handle and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return inst.status == HEALTHY and inst.handle is handle

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(tuple(self.loaded.items()))

    async def _post(self, inst, path: str, body: dict) -> Optional[httpx.Response]:
        headers = {FLEET_SECRET_HEADER: self.fleet.fleet_secret} if self.fleet.fleet_secret else {}
        try:
            return await self.fleet.client.post(inst.handle.url + path, json=body, headers=headers, timeout=120.0)
        except (httpx.TransportError, OSError) as e:
            self.fleet.suspect(inst, inst.handle, e)
            return None


def _exists(resp: httpx.Response) -> bool:
    """A worker's answer that it serves the adapter already (it started after the spec changed):
    sloserve's worker says so by code, vLLM's in its message."""
    try:
        error = resp.json()["error"]
        return resp.status_code == 400 and (error.get("code") == "lora_adapter_exists"
                                            or "already been loaded" in str(error.get("message", "")))
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def _answer(resp: httpx.Response, name: str) -> dict:
    """A worker's 200 to a load, as the front answers it: sloserve's worker answers JSON, vLLM a
    line of text."""
    try:
        answer = resp.json()
    except ValueError:
        answer = None
    return answer if isinstance(answer, dict) else {"object": "lora_adapter", "id": name, "status": "loaded"}


def _body(raw: bytes, fields: tuple[str, ...]) -> tuple[dict, Optional[Response]]:
    """The JSON object with string `fields` (a 400 naming the first bad one otherwise)."""
    try:
        body = json.loads(raw or b"null")
    except ValueError:
        return {}, _error(400, "the body must be a JSON object", "invalid_request_error")
    if not isinstance(body, dict):
        return {}, _error(400, "the body must be a JSON object", "invalid_request_error")
    for name in fields:
        if not isinstance(body.get(name), str):
            return {}, _error(400, f"{name} must be a string", "invalid_request_error", name)
    try:
        check_name(body[fields[0]])
    except LoraError as exc:
        return {}, _error(400, str(exc), "invalid_lora_adapter", fields[0])
    return {k: body[k] for k in fields}, None


def _error(status: int, message: str, code: str, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status)
