"""Run one instance's app under uvicorn with sloserve's connection limits and drain on a
signal (connections.DrainingServer, which the multi-instance front uses too)."""
from __future__ import annotations

import logging

from sloserve.config import EngineConfig
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
        return 0
    finally:
        engine.shutdown()
