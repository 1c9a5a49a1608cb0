"""The OpenAI-compatible HTTP server of one instance (`sloserve serve`), and the same server as a
fleet's worker.

Layout: `protocol` (wire format), `errors` (OpenAI error schema), `settings` (ServerSettings),
`qos` (classes, API keys, cache salts), `tenants` (per-tenant admission limits and request-id
namespaces), `admission` (in-flight bound, draining), `shedding` (deadline admission: refuse
what cannot meet its TTFT), `middleware` (auth, body limit, counting), `connections`
(connection cap, body and header timeouts, the draining uvicorn server), `serving` (requests to
the engine and back), `logprobs`, `responses` (the Responses API), `tool_calls` and
`tool_parsers` (tool use), `metrics` (Prometheus), `dashboard` (the live page), `app` (routes),
`launcher` (uvicorn with drain-on-signal); a fleet worker adds `worker` (its internal routes:
state, tokenize) and `worker_migration` (moving a request's KV to another worker). The
multi-instance front is `sloserve/front/`.
"""
from sloserve.server.settings import ServerSettings

__all__ = ["ServerSettings", "build_app", "run_server"]


def __getattr__(name: str):
    if name == "build_app":
        from sloserve.server.app import build_app
        return build_app
    if name == "run_server":
        from sloserve.server.launcher import run_server
        return run_server
    raise AttributeError(f"module 'sloserve.server' has no attribute {name!r}")
