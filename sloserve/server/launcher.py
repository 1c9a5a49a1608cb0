"""Run the app under uvicorn with sloserve's shutdown semantics.

uvicorn's own SIGTERM handling closes the listener at once and then waits for open
connections. A serving system wants a drain instead: keep answering (503 for new work, so
clients and load balancers retry elsewhere), let in-flight generations finish within a
grace period, abort the rest, and then exit with status 0. A second signal skips the wait.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Optional

import uvicorn

from sloserve.config import EngineConfig
from sloserve.server.app import ServerState, build_app
from sloserve.server.connections import uvicorn_config
from sloserve.server.settings import ServerSettings

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float) -> None:
        super().__init__(config)
        self._state = state
        self._grace_s = grace_s
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._drain: Optional[asyncio.Future] = None
        self._signalled = False

    async def serve(self, sockets=None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it at exit and the
        # process would die by the signal instead of exiting 0 after a clean drain.
        if self._signalled or self._loop is None or not self.started:
            logger.warning("signal %s again: exiting without waiting", signal.Signals(sig).name)
            self._state.admission.start_draining()
            for request_id in self._state.admission.in_flight_ids():
                self._state.engine.abort(request_id)
            self.should_exit = True
            self.force_exit = self._signalled
            self._signalled = True
            return
        self._signalled = True
        logger.info("%s: draining (grace period %.1fs)", signal.Signals(sig).name, self._grace_s)
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._state.drain(self._grace_s)
        except Exception:
            logger.exception("drain failed; exiting anyway")
        finally:
            self.should_exit = True


def run_server(engine_config: EngineConfig, settings: ServerSettings, host: str = "127.0.0.1",
               port: int = 8000) -> int:
    """Load the model, serve until a signal, drain, and return the exit status."""
    from sloserve.engine.async_engine import AsyncLLMEngine
    from sloserve.engine.llm_engine import LLMEngine

    settings.validate()
    engine = AsyncLLMEngine(LLMEngine(engine_config))
    try:
        app = build_app(engine, settings)
        config = uvicorn_config(app, host=host, port=port, limits=settings.connection_limits())
        server = DrainingServer(config, app.state.sloserve, settings.grace_period_s)
        names = settings.served_model_names or [engine.engine.model_name]
        logger.info("serving %s on http://%s:%d (max in flight %d)", names[0], host, port,
                    app.state.sloserve.admission.capacity)
        server.run()
        return 0
    finally:
        engine.shutdown()
