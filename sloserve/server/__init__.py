"""The OpenAI-compatible HTTP server (`sloserve serve`).

Layout: `protocol` (wire format), `errors` (OpenAI error schema), `qos` (classes and API
keys), `admission` (in-flight bound, draining), `middleware` (auth, body limit, counting),
`serving` (requests to the engine and back), `metrics` (Prometheus), `app` (routes),
`launcher` (uvicorn with drain-on-signal).
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
