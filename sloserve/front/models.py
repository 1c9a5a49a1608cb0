"""Several models behind one address (`sloserve serve --model NAME=PATH --model NAME=PATH ...`).

Each model has its own front (front/app.Front) over its own pool of workers, with its own
router, controller and limits. This ASGI app stands before them and picks a model's front by the
`model` an OpenAI client names:
- POST /v1/completions, /v1/chat/completions, /v1/responses, /tokenize, /detokenize: the key is
  checked first (401 before a byte of the body is read), then the body is read within the
  fronts' size limit (413) and body timeout (408); its `model` (a model's name, or an adapter
  loaded on that model's workers) picks the front, which receives the same request and judges it
  as usual. An unknown model is a 404 `model_not_found` that lists the models; a body without a
  `model`, or one that is not JSON, goes to the first model's front (its answer or its 400);
- GET /v1/models: every model's list (its name and its adapters) as one list;
- GET /metrics: every model's metrics, each sample labelled `model_name` (as vLLM labels its own);
- GET /health: 200 while any model has a healthy worker, with each model's own answer;
- everything that is about one model's fleet (/v1/instances, drains, migrations, adapters, the
  dashboard) under /models/{name}/..., e.g. /models/smol/v1/instances.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

from sloserve.front.app import Front
from sloserve.front.edge import PROXIED_ROUTES
from sloserve.server.errors import APIError
from sloserve.server.middleware import bearer_token, send_error

PREFIX = "/models/"


class ModelFronts:
    """The ASGI app of a multi-model front: `fronts` by model name, the first the default."""

    def __init__(self, fronts: dict[str, Front]) -> None:
        if not fronts:
            raise ValueError("a multi-model front needs at least one model")
        self.fronts = dict(fronts)
        self.apps = {name: front.build_app() for name, front in self.fronts.items()}
        self.default = next(iter(self.fronts))
        first = self.fronts[self.default]
        self.registry = first.registry  # every model's front checks the same keys
        cfg = first.fleet.config
        self.max_body_bytes, self.body_timeout_s = cfg.max_body_bytes, cfg.body_timeout_s

    # ---- which front -------------------------------------------------------------------------
    def front_of(self, model: Optional[str]) -> Optional[str]:
        """The model whose front serves `model` (a model name or one of its adapters); None if none."""
        if model is None:
            return self.default
        if model in self.fronts:
            return model
        return next((name for name, front in self.fronts.items() if model in front.adapters.loaded), None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope.get("path", "")
        try:
            if path.startswith(PREFIX):
                await self._one_model(scope, receive, send, path)
            elif path in PROXIED_ROUTES and scope.get("method") == "POST":
                await self._by_body(scope, receive, send)
            elif path == "/v1/models" and scope.get("method") == "GET":
                await self._models(scope, send)
            elif path == "/metrics" and scope.get("method") == "GET":
                await self._metrics(scope, send)
            elif path == "/health":
                await self._health(scope, send)
            else:
                names = ", ".join(self.fronts)
                raise APIError(404, f"this front serves several models ({names}): {path} is per model, at "
                                    f"{PREFIX}{{model}}{path}", code="not_found")
        except APIError as err:
            await send_error(send, err)

    async def _one_model(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        name, _, rest = path[len(PREFIX):].partition("/")
        if name not in self.apps:
            raise APIError(404, f"no model {name!r}; models: {', '.join(self.fronts)}", code="model_not_found")
        rest = "/" + rest
        inner = dict(scope, path=rest, raw_path=rest.encode(), root_path=scope.get("root_path", "") + PREFIX + name)
        await self.apps[name](inner, receive, send)

    async def _by_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = Headers(scope=scope)
        if self.registry.authenticate(bearer_token(headers)) is None:
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
        body = await self._read_body(headers, receive)
        model: Optional[str] = None
        try:
            parsed = json.loads(body)
            if isinstance(parsed, dict) and isinstance(parsed.get("model"), str):
                model = parsed["model"]
        except ValueError:
            pass  # the default front answers it: its 400 says what is wrong
        name = self.front_of(model)
        if name is None:
            raise APIError(404, f"model {model!r} does not exist; available: {', '.join(self.fronts)}",
                           param="model", code="model_not_found")
        await self.apps[name](scope, _replay(body, receive), send)

    async def _read_body(self, headers: Headers, receive: Receive) -> bytes:
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise APIError(413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes}",
                           code="request_too_large")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise APIError(499, "the client closed the connection", code="client_closed")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise APIError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes",
                                       code="request_too_large")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise APIError(408, f"request body not received within {self.body_timeout_s:g} s",
                           code="request_timeout", headers={"Connection": "close"}) from None

    # ---- answers over every model -------------------------------------------------------------
    async def _each(self, scope: Scope, path: str) -> dict[str, httpx.Response]:
        """GET `path` from every model's front, with the caller's headers (its keys are checked there)."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])
                   if k.lower() in (b"authorization", b"x-api-key")}

        async def get(app) -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front") as client:
                return await client.get(path, headers=headers, timeout=30.0)

        answers = await asyncio.gather(*(get(app) for app in self.apps.values()))
        return dict(zip(self.apps, answers))

    async def _models(self, scope: Scope, send: Send) -> None:
        data, seen = [], set()
        for resp in (await self._each(scope, "/v1/models")).values():
            if resp.status_code != 200:
                await _send(send, resp.status_code, resp.content, resp.headers.get("content-type"))
                return
            for entry in resp.json().get("data", []):
                if entry.get("id") not in seen:
                    seen.add(entry.get("id"))
                    data.append(entry)
        await _send(send, 200, json.dumps({"object": "list", "data": data}).encode(), "application/json")

    async def _metrics(self, scope: Scope, send: Send) -> None:
        texts = {}
        for name, resp in (await self._each(scope, "/metrics")).items():
            if resp.status_code != 200:
                await _send(send, resp.status_code, resp.content, resp.headers.get("content-type"))
                return
            texts[name] = resp.text
        await _send(send, 200, merge_metrics(texts), CONTENT_TYPE_LATEST)

    async def _health(self, scope: Scope, send: Send) -> None:
        answers = await self._each(scope, "/health")
        body = {name: resp.json() for name, resp in answers.items()}
        ok = any(resp.status_code == 200 for resp in answers.values())
        await _send(send, 200 if ok else 503,
                    json.dumps({"status": "ok" if ok else "unavailable", "models": body}).encode(), "application/json")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


def merge_metrics(texts: dict[str, str]) -> bytes:
    """Several fronts' Prometheus texts as one, each sample labelled with its model's name."""
    families: dict[str, Metric] = {}
    for model, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples.extend(s._replace(labels={**s.labels, "model_name": model}) for s in family.samples)

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())  # type: ignore[arg-type]
    return generate_latest(registry)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, then the client's own messages (its disconnect)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return again


async def _send(send: Send, status: int, body: bytes, content_type: Optional[str]) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if content_type:
        headers.append((b"content-type", content_type.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def parse_model_args(values: Sequence[str]) -> list[tuple[str, Optional[str]]]:
    """`--model` values as (name, path): `NAME=PATH`, or one bare PATH (None: the embedded model)
    whose name the model itself gives. Several models must each be named; names are unique."""
    out: list[tuple[str, Optional[str]]] = []
    for value in values:
        name, sep, path = value.partition("=")
        if sep and name and "/" not in name and path:
            out.append((name, path))
        elif len(values) == 1:
            return [("", value)]
        else:
            raise ValueError(f"--model {value!r}: with several models, give each as NAME=PATH")
    names = [n for n, _ in out]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ValueError(f"--model: the name {duplicate!r} is given twice")
    return out


# What a models file may set per model beside `path`, `fleet`, `qos_config` and `max_in_flight`:
# EngineConfig fields.
MODEL_OPTIONS = ("dtype", "quantization", "max_model_len")


@dataclass(frozen=True)
class ModelEntry:
    """One model of a multi-model front: its name, engine, fleet, and its own QoS classes and bound
    on requests in flight (None: the command line's)."""

    name: str
    engine: Any  # EngineConfig
    spec: Any  # FleetSpec
    qos_config: Optional[str] = None  # a --qos-config file: this model's classes and what each key may use
    max_in_flight: Optional[int] = None
    scaling_history: Optional[str] = None  # this model's past demand (a series): its own forecaster trains on it


def load_models_file(path: str, base_engine, base_spec) -> tuple[list[ModelEntry], Optional[int]]:
    """(a ModelEntry per model, the shared budget or None) of a models file:

        budget: 6                          # optional: workers all the models' pools hold together
        models:
          smol:
            path: /models/smollm2.gguf     # GGUF or HF directory ("embedded": the packaged model)
            dtype: bfloat16                # optional: dtype, quantization, max_model_len
            fleet: {instances: "0:2", autoscale: reactive, capacity: 4}   # optional: FleetSpec settings
            qos_config: qos-smol.yaml      # optional: its own QoS classes (as --qos-config)
            max_in_flight: 64              # optional: its front's bound on requests in flight
            scaling_history: servegen:m-mid   # optional: its own demand history (predictive/hybrid train on it)

    Every model starts from the command line's engine options and fleet spec (`base_engine`,
    `base_spec`); its own settings override them."""
    import dataclasses

    import yaml

    from sloserve.cluster.spec import FleetSpec

    raw = yaml.safe_load(Path(path).read_text()) or {}
    models = raw.get("models") if isinstance(raw, dict) else None
    if not isinstance(models, dict) or not models:
        raise ValueError(f"{path}: expected `models:` mapping each model's name to its settings")
    out = []
    for name, entry in models.items():
        where = f"{path}: model {name!r}"
        if not isinstance(entry, dict) or not entry.get("path"):
            raise ValueError(f"{where}: give at least its `path`")
        known = {"path", "fleet", "qos_config", "max_in_flight", "scaling_history", *MODEL_OPTIONS}
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ValueError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        bound = entry.get("max_in_flight")
        if bound is not None and (not isinstance(bound, int) or bound < 1):
            raise ValueError(f"{where}: max_in_flight is a number of requests >= 1, got {bound!r}")
        model_path = None if entry["path"] == "embedded" else str(entry["path"])
        engine = dataclasses.replace(base_engine, model=model_path,
                                     **{k: entry[k] for k in MODEL_OPTIONS if k in entry})
        fleet = entry.get("fleet") or {}
        if not isinstance(fleet, dict):
            raise ValueError(f"{where}: `fleet` is a mapping of fleet settings")
        spec = FleetSpec.from_mapping(fleet, base_spec, where=f"{where} fleet")
        spec.validate()
        qos = entry.get("qos_config")
        if qos is not None:
            qos = str(Path(path).parent / str(qos))  # relative to the models file
            if not Path(qos).is_file():
                raise ValueError(f"{where}: qos_config {entry['qos_config']!r} is not a file")
        history = entry.get("scaling_history")
        out.append(ModelEntry(str(name), engine, spec, qos, bound, None if history is None else str(history)))
    budget = raw.get("budget")
    if budget is not None:
        if not isinstance(budget, int) or budget < 1:
            raise ValueError(f"{path}: budget is a number of workers >= 1, got {budget!r}")
        if any(m.spec.autoscale is None for m in out):
            raise ValueError(f"{path}: a budget is shared by autoscaled pools: give every model's fleet an "
                             "autoscale policy (fleet: {{instances: MIN:MAX, autoscale: ..., capacity: ...}})")
    return out, budget
