"""`sloserve serve --instances N`: N engine workers behind one router + API front.

The front process holds no model: it routes, proxies and watches. Workers are local
processes (`--backend process`, the default) or Ray actors (`--backend ray`, on a local Ray
instance or an existing cluster via `--ray-address`). CPU threads are split evenly between
the workers unless `--num-threads` says otherwise (then each worker gets that share).

The front serves as soon as one worker is healthy, drains on SIGTERM like a single instance
(launcher.py), and makes a random fleet secret per run that only it and its workers know.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import uvicorn

from sloserve.cluster.spec import FleetSpec
from sloserve.core.config import CacheConfig, EngineConfig, PoolSettings
from sloserve.server.connections import DrainingServer
from sloserve.workers.source import WorkerSource

if TYPE_CHECKING:
    from sloserve.front.models import ModelEntry  # noqa: F401
    from sloserve.workers.fleet import FrontConfig

logger = logging.getLogger(__name__)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


async def serve_front(fleet, front, config: uvicorn.Config, grace_s: float, start_timeout_s: float,
                      server_cls=DrainingServer) -> None:
    """Start the workers, serve as soon as one is healthy (the others join when they answer),
    drain on a signal, and stop the workers."""
    await fleet.start()
    await front.start()
    try:
        await fleet.wait_ready(start_timeout_s, count=1)
        server = server_cls(config, front.drain, front.stop_now, grace_s)
        logger.info("serving %d instances behind %s routing on http://%s:%d; the fleet at http://%s:%d/dashboard",
                    len(fleet.instances), fleet.config.fleet.router, config.host, config.port, config.host, config.port)
        await server.serve()
    finally:
        await front.close()
        await fleet.close()


def build_worker_fleet(spawn, config: "FrontConfig", clock=None, fleet_secret: Optional[str] = None,
                       operator_drain: bool = True):
    """The real fleet of `config.fleet` with its controller (cluster.assembly.build_controller, as
    the simulator assembles it), which also runs `drain` (`operator_drain`, for workers that can
    hand their requests on): an operator's request is honoured whatever `--migration` says."""
    import time

    from sloserve.cluster.assembly import build_controller
    from sloserve.workers.fleet import WorkerFleet

    spec = config.fleet
    predictions = None
    if spec.resolved_predictor:
        from sloserve.cluster.predict import PredictionBook, load_predictor

        predictions = PredictionBook(load_predictor(spec.resolved_predictor))  # type: ignore[arg-type]
    controller = build_controller(spec, predictions=predictions, history=config.scaling_history,
                                  operator_drain=operator_drain)
    return WorkerFleet(spawn, config, controller, predictions, clock or time.monotonic, fleet_secret)


def worker_cache(cache: CacheConfig, index: int) -> CacheConfig:
    """Worker `index`'s KV cache settings: its own subdirectory of the disk tier (one writer per
    directory; a restarted worker finds its own blocks; the shared tier is the store)."""
    if not cache.disk_tier_dir:
        return cache
    return dataclasses.replace(cache, disk_tier_dir=os.path.join(cache.disk_tier_dir, f"worker-{index}"))


def front_capacity(engine_config: EngineConfig, max_queue: int, instances: int) -> int:
    """The front's default bound on requests in flight: what all workers together admit."""
    return instances * (engine_config.scheduler.max_num_seqs + max_queue)


def check_fleet_spec(engine_config: EngineConfig, spec: FleetSpec, scaling_history, max_in_flight: Optional[int],
                     hang_timeout_s: float) -> None:
    """ValueError (one line) on what a real fleet of `spec` cannot run."""
    spec.validate()
    if engine_config.step_trace:
        raise ValueError("--step-trace needs a single instance (each worker would write the same file)")
    if spec.prefill_pool.tp or spec.decode_pool.tp:
        raise ValueError("a real worker runs on one device: pool setting tp is for `sloserve simulate` only")
    if spec.autoscale is not None:
        if spec.pd is not None:
            if spec.pd_capacity is None:
                raise ValueError("autoscaling a --pd fleet needs --pd-capacity P_RPS:D_RPS: the requests/s one "
                                 "prefill and one decode worker sustain within your SLOs")
        elif spec.capacity_rps is None:
            raise ValueError("--autoscale needs --capacity RPS: the requests/s one worker sustains within your SLOs")
        if spec.autoscale in ("predictive", "hybrid") and scaling_history is None:
            raise ValueError(f"--autoscale {spec.autoscale} needs --scaling-history (the demand that trains its "
                             "forecaster)")
    if max_in_flight is not None and max_in_flight < 1:
        raise ValueError(f"max in flight must be >= 1, got {max_in_flight}")
    if not hang_timeout_s > 0:
        raise ValueError(f"hang timeout must be > 0 s, got {hang_timeout_s}")


def build_front(engine_config: EngineConfig, settings, spec: FleetSpec, *, threads_per_worker: int,
                fleet_secret: str, salt_secret: str, source: WorkerSource = WorkerSource(),
                qos_config: Optional[str] = None, api_keys: Sequence[str] = (), log_level: str = "warning",
                admin_keys: Sequence[str] = (), max_in_flight: Optional[int] = None, hang_timeout_s: float = 60.0,
                cold_start_s: float = 30.0, scaling_history=None, clock: Optional[Callable[[], float]] = None):
    """The front of one model (a Front over its WorkerFleet, not started): the fleet `spec`
    describes, its workers from `source`, each `engine_config` on `threads_per_worker` threads. `clock` (default
    time.monotonic) is the time the fleet and its controller loops read: autoscaling windows,
    delays, health and start timeouts."""
    from sloserve.front.app import Front
    from sloserve.tracing import Tracing
    from sloserve.server.qos import CacheSalter, cache_secret
    from sloserve.server.worker import worker_options
    from sloserve.workers.fleet import FrontConfig
    from sloserve.workers.handles import WorkerSpec

    instances = spec.instances
    pools = {"prefill": spec.prefill_pool, "decode": spec.decode_pool, "mixed": PoolSettings()}
    worker_specs = [WorkerSpec(dataclasses.replace(engine_config, num_threads=threads_per_worker,
                                            scheduler=pools[role].apply(engine_config.scheduler),
                                            cache=worker_cache(engine_config.cache, index)),
                               qos_config, list(api_keys), list(settings.served_model_names), settings.max_queue,
                               log_level, fleet_secret, cache_secret=salt_secret, options=worker_options(settings))
                    for index, role in enumerate(spec.roles)]
    for worker in worker_specs:
        worker.engine.scheduler.validate()
    spawn = source.spawner(worker_specs, threads_per_worker, engine_config, settings.served_model_names)
    config = FrontConfig(spec, hang_timeout_s=hang_timeout_s, cold_start_guess_s=cold_start_s,
                         scaling_history=scaling_history,
                         max_in_flight=max_in_flight or front_capacity(engine_config, settings.max_queue, instances),
                         max_body_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s,
                         retry_after_s=settings.retry_after_s, admin_keys=tuple(admin_keys),
                         timeline_interval_s=settings.timeline_interval_s)
    fleet = build_worker_fleet(spawn, config, clock=clock, fleet_secret=fleet_secret, operator_drain=source.contract)
    front = Front(fleet, settings.registry, CacheSalter(cache_secret(salt_secret)), engine_config.lora_modules,
                  Tracing(settings.otlp_traces_endpoint, "sloserve-front"))

    def adapters_changed(modules: tuple[tuple[str, str], ...]) -> None:
        """Workers started from now on (autoscaling, restarts) load the adapters loaded at run time."""
        for slot, worker in enumerate(worker_specs):
            worker_specs[slot] = dataclasses.replace(worker, engine=dataclasses.replace(worker.engine,
                                                                                       lora_modules=modules))

    front.adapters.on_change = adapters_changed
    return front


def _secrets(settings) -> tuple[str, str]:
    """(the run's fleet secret, the cache-salt secret): one salt for the front and all its workers,
    else each draws its own and the router's prefix keys never match what the workers publish."""
    from sloserve.server.qos import CACHE_SECRET_ENV

    fleet_secret = secrets.token_urlsafe(32)  # per run: authenticates the front on the workers' /internal/*
    return fleet_secret, settings.cache_salt_secret or os.environ.get(CACHE_SECRET_ENV) or secrets.token_urlsafe(32)


def run_multi(engine_config: EngineConfig, settings, spec: FleetSpec, *, source: WorkerSource = WorkerSource(),
              host: str = "127.0.0.1", port: int = 8000, qos_config: Optional[str] = None,
              api_keys: Sequence[str] = (), log_level: str = "warning",
              admin_keys: Sequence[str] = (), max_in_flight: Optional[int] = None,
              hang_timeout_s: float = 60.0, cold_start_s: float = 30.0, scaling_history=None) -> int:
    """The fleet `spec` describes (cluster/spec.py: routing, migration, P/D, autoscaling), its
    workers from `source` (workers/source.py: sloserve's on processes or Ray actors, stock vLLM
    servers, or servers attached by URL). `settings` (ServerSettings) gives the edge: max_body_bytes,
    body and header timeouts, connection cap, retry_after_s, grace_period_s; max_queue applies to
    each worker. `cold_start_s`: the start time autoscaling assumes until a worker was timed;
    `scaling_history`: the demand (workload.series.Series) that trains a forecaster."""
    from sloserve.server.connections import uvicorn_config

    check_fleet_spec(engine_config, spec, scaling_history, max_in_flight, hang_timeout_s)
    source.check(spec, engine_config)
    settings.validate()
    instances = spec.instances
    per_worker = max(1, (engine_config.num_threads or cores()) // instances)
    fleet_secret, salt_secret = _secrets(settings)
    front = build_front(engine_config, settings, spec, threads_per_worker=per_worker, fleet_secret=fleet_secret,
                        salt_secret=salt_secret, source=source, qos_config=qos_config, api_keys=api_keys,
                        log_level=log_level, admin_keys=admin_keys,
                        max_in_flight=max_in_flight, hang_timeout_s=hang_timeout_s, cold_start_s=cold_start_s,
                        scaling_history=scaling_history)
    uv_config = uvicorn_config(front.build_app(), host=host, port=port, limits=settings.connection_limits(),
                               loop=settings.event_loop)
    logger.info("starting %d %s workers (%d threads each%s); serving once one is healthy", instances,
                "attached" if source.attach else source.engine if source.engine != "sloserve" else source.backend,
                per_worker, f"; {spec.pd_text} prefill:decode, {spec.pd_transfer} hand-off" if spec.pd else "")
    with asyncio.Runner(loop_factory=uv_config.get_loop_factory()) as runner:  # uvloop, as one instance runs
        runner.run(serve_front(front.fleet, front, uv_config, settings.grace_period_s, front.fleet.config.start_timeout_s))
    return 0


def run_models(models: Sequence["ModelEntry"], settings, *, budget: Optional[int] = None,
               source: WorkerSource = WorkerSource(), host: str = "127.0.0.1", port: int = 8000,
               qos_config: Optional[str] = None, api_keys: Sequence[str] = (),
               log_level: str = "warning", admin_keys: Sequence[str] = (), max_in_flight: Optional[int] = None,
               hang_timeout_s: float = 60.0, cold_start_s: float = 30.0, scaling_history=None) -> int:
    """Several models behind one front (front/models.py): each ModelEntry gets its own fleet (its
    own workers, router and controller), QoS classes and bound on requests in flight (the command
    line's where it gives none), served under its name; the cores are shared evenly among every
    model's workers; `budget`: the most workers all the models' pools hold together."""
    from sloserve.front.models import ModelFronts
    from sloserve.server.connections import uvicorn_config
    from sloserve.server.qos import load_qos_config

    from sloserve.workload.series import load_series

    histories = {m.name: load_series(m.scaling_history, "requests", 600.0) if m.scaling_history else scaling_history
                 for m in models}  # each model's own past demand, else the command line's
    for m in models:
        check_fleet_spec(m.engine, m.spec, histories[m.name], m.max_in_flight or max_in_flight, hang_timeout_s)
        source.check(m.spec, m.engine)
    settings.validate()
    workers = sum(m.spec.instances for m in models)
    per_worker = max(1, (models[0].engine.num_threads or cores()) // workers)
    fleet_secret, salt_secret = _secrets(settings)
    fronts = {}
    for m in models:
        own = dataclasses.replace(settings, served_model_names=[m.name])
        if m.qos_config is not None:  # its own classes, the same keys and cache isolation
            own.registry = load_qos_config(m.qos_config).with_keys(list(api_keys)) \
                .with_cache_isolation(settings.registry.cache_isolation)
        fronts[m.name] = build_front(m.engine, own, m.spec, threads_per_worker=per_worker, fleet_secret=fleet_secret,
                                     salt_secret=salt_secret, source=source, qos_config=m.qos_config or qos_config,
                                     api_keys=api_keys, log_level=log_level,
                                     admin_keys=admin_keys, max_in_flight=m.max_in_flight or max_in_flight,
                                     hang_timeout_s=hang_timeout_s, cold_start_s=cold_start_s,
                                     scaling_history=histories[m.name])
    shared = None
    if budget is not None:
        from sloserve.front.budget import ModelsBudget

        drivers = {name: front.autoscale for name, front in fronts.items()}
        if any(d is None for d in drivers.values()):
            raise ValueError("a budget is shared by autoscaled pools: every model needs an autoscale policy")
        shared = ModelsBudget(drivers, budget, min(d.interval_s for d in drivers.values()))  # type: ignore[union-attr]
    app = ModelFronts(fronts)
    uv_config = uvicorn_config(app, host=host, port=port, limits=settings.connection_limits(),
                               loop=settings.event_loop)
    logger.info("starting %d models on %d %s workers (%d threads each); serving once each has one healthy",
                len(models), workers, source.engine if source.engine != "sloserve" else source.backend, per_worker)
    with asyncio.Runner(loop_factory=uv_config.get_loop_factory()) as runner:
        runner.run(serve_fronts(list(fronts.values()), uv_config, settings.grace_period_s, budget=shared))
    return 0


async def serve_fronts(fronts, config: uvicorn.Config, grace_s: float, server_cls=DrainingServer,
                       budget=None) -> None:
    """Several models' fronts on one server: start every fleet, serve once each has a healthy
    worker, drain them together on a signal, and stop every worker. `budget`: a ModelsBudget
    (front/budget.py) whose loop scales every pool."""
    started = []
    try:
        for front in fronts:
            await front.fleet.start()
            started.append(front)
            await front.start()
        if budget is not None:
            budget.start()
        for front in fronts:
            await front.fleet.wait_ready(front.fleet.config.start_timeout_s, count=1)

        async def drain(grace: float) -> int:
            return sum(await asyncio.gather(*(f.drain(grace) for f in fronts)))

        def stop_now() -> None:
            for f in fronts:
                f.stop_now()

        server = server_cls(config, drain, stop_now, grace_s)
        logger.info("serving %d models on http://%s:%d", len(fronts), config.host, config.port)
        await server.serve()
    finally:
        if budget is not None:
            await budget.close()
        for front in started:
            await front.close()
            await front.fleet.close()
