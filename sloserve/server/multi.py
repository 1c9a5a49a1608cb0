"""`sloserve serve --instances N`: N engine workers behind one router + API front.

The front process holds no model: it routes, proxies and watches. Workers are local
processes (`--backend process`, the default) or Ray actors (`--backend ray`, on a local Ray
instance or an existing cluster via `--ray-address`). CPU threads are split evenly between
the workers unless `--num-threads` says otherwise (then each worker gets that share).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Optional, Sequence

from sloserve.config import EngineConfig

logger = logging.getLogger(__name__)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def make_spawner(spec, backend: str, threads_per_worker: int, ray_address: Optional[str] = None):
    """slot -> a started WorkerHandle of the chosen backend."""
    from sloserve.server.instances import ProcessWorker, RayWorker

    if backend == "process":
        return lambda slot: ProcessWorker(spec)
    if backend == "ray":
        try:
            import ray
        except ImportError:
            raise ValueError("--backend ray needs the `ray` package (pip install 'ray>=2.9')") from None
        if not ray.is_initialized():
            # an existing cluster (address "auto" or ray://...), else a local Ray instance on this machine
            if ray_address:
                ray.init(address=ray_address, log_to_driver=False)
            else:
                ray.init(include_dashboard=False, log_to_driver=False)
        return lambda slot: RayWorker(spec, num_cpus=threads_per_worker)
    raise ValueError(f"unknown backend {backend!r}; use process or ray")


def run_multi(engine_config: EngineConfig, settings, *, instances: int, router: str, backend: str = "process",
              host: str = "127.0.0.1", port: int = 8000, qos_config: Optional[str] = None,
              api_keys: Sequence[str] = (), ray_address: Optional[str] = None,
              predictor: Optional[str] = "default", log_level: str = "warning") -> int:
    import uvicorn

    from sloserve.cluster.routers import ROUTERS
    from sloserve.server.front import Fleet, Front, FrontConfig
    from sloserve.server.instances import WorkerSpec

    if instances < 1:
        raise ValueError("--instances must be >= 1")
    if engine_config.step_trace:
        raise ValueError("--step-trace needs a single instance (each worker would write the same file)")
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose from {sorted(ROUTERS)}")
    total = engine_config.num_threads or cores()
    per_worker = max(1, total // instances)
    spec = WorkerSpec(dataclasses.replace(engine_config, num_threads=per_worker), qos_config, list(api_keys),
                      list(settings.served_model_names), settings.max_queue, log_level)
    spawn = make_spawner(spec, backend, per_worker, ray_address)
    fleet = Fleet(spawn, instances, FrontConfig(router=router, predictor=predictor))
    app = Front(fleet, settings.registry).build_app()

    async def serve() -> None:
        await fleet.start()
        try:
            logger.info("waiting for %d %s workers (%d threads each)", instances, backend, per_worker)
            await fleet.wait_ready(FrontConfig.start_timeout_s)
            config = uvicorn.Config(app, host=host, port=port, lifespan="off", access_log=False, log_config=None,
                                    timeout_keep_alive=5)
            logger.info("serving %d instances behind %s routing on http://%s:%d", instances, router, host, port)
            await uvicorn.Server(config).serve()
        finally:
            await fleet.close()

    asyncio.run(serve())
    return 0
