"""Run one instance's app under uvicorn with sloserve's connection limits and drain on a
signal (connections.DrainingServer, which the multi-instance front uses too); what the drain
leaves of the grace period is the engine's to flush its KV tiers to disk (LLMEngine.flush_tiers)."""
from __future__ import annotations

import logging
import time
from typing import Optional

from sloserve.core.config import EngineConfig
from sloserve.server.app import build_app
from sloserve.server.connections import DrainingServer, uvicorn_config
from sloserve.server.settings import ServerSettings

logger = logging.getLogger(__name__)


def run_server(engine_config: EngineConfig, settings: ServerSettings, host: str = "127.0.0.1",
               port: int = 8000) -> int:
    """Load the model, serve until a signal, drain, and return the exit status."""
    from sloserve.engine.async_engine import AsyncLLMEngine
    from sloserve.engine.llm_engine import LLMEngine

    settings.validate()
    engine = AsyncLLMEngine(lambda: LLMEngine(engine_config))
    server: Optional[DrainingServer] = None
    drain_started: Optional[float] = None
    try:
        app = build_app(engine, settings)
        config = uvicorn_config(app, host=host, port=port, limits=settings.connection_limits(),
                                loop=settings.event_loop)
        state = app.state.sloserve
        server = DrainingServer(config, state.drain, state.stop_now, settings.grace_period_s)
        names = settings.served_model_names or [engine.engine.model_name]
        logger.info("serving %s on http://%s:%d (max in flight %d); the fleet at http://%s:%d/dashboard", names[0],
                    host, port, app.state.sloserve.admission.capacity, host, port)
        server.run()
        drain_started = state.admission.drain_started
        return 0
    finally:
        forced = server is not None and server.force_exit
        engine.shutdown(flush_budget_s=flush_budget(settings.grace_period_s, drain_started, time.monotonic(), forced))


def flush_budget(grace_s: float, drain_started: Optional[float], now: float, forced: bool) -> float:
    """Seconds the KV shutdown flush gets: what the drain left of the grace period (a stop with
    no drain, e.g. before start-up finished, has all of it), none after a second signal (exit
    without waiting)."""
    if forced:
        return 0.0
    spent = 0.0 if drain_started is None else now - drain_started
    return max(0.0, grace_s - spent)
