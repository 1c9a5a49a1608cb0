"""`sloserve serve`: the OpenAI-compatible HTTP server, one instance in this process or a fleet of
workers behind the multi-instance front (front/multi.py) when the fleet options ask for more."""
from __future__ import annotations

import argparse
import logging

from sloserve.cli.engine_args import add_engine_args, engine_config_from_args
from sloserve.workers.source import BACKENDS, ENGINES, VLLM_PRIORITIES, WorkerSource


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching across requests)")
    add_serve_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from sloserve.core.config import PoolSettings
    from sloserve.server.launcher import run_server

    level = logging.DEBUG if args.verbose else getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    settings, keys = server_settings(args)
    spec = args.fleet_spec
    from sloserve.front.models import parse_model_args

    models = parse_model_args(args.model or [])
    if len(models) == 1 and models[0][0] and not settings.served_model_names:
        settings.served_model_names = [models[0][0]]  # --model NAME=PATH alone: served as NAME
    if len(models) > 1 or args.models:
        from dataclasses import replace

        from sloserve.front.models import ModelEntry, load_models_file
        from sloserve.front.multi import run_models

        if args.models and args.model:
            raise ValueError("give the models either with --model NAME=PATH or in --models FILE, not both")
        base = engine_config_from_args(argparse.Namespace(**{**vars(args), "model": None}))
        entries, budget = load_models_file(args.models, base, spec) if args.models else \
            ([ModelEntry(name, replace(base, model=path), spec) for name, path in models], None)
        return run_models(entries, settings, budget=budget,
                          source=worker_source(args), host=args.host, port=args.port, qos_config=args.qos_config,
                          api_keys=keys, admin_keys=settings.admin_keys,
                          max_in_flight=args.front_max_in_flight, hang_timeout_s=args.hang_timeout,
                          cold_start_s=args.cold_start, scaling_history=_history(args))
    source = worker_source(args)
    if source.attach and args.instances is None:
        from dataclasses import replace

        spec = replace(spec, instances=len(source.attach))  # --workers URL,URL alone: one instance each
    if spec.instances > 1 or spec.fewest != spec.instances or args.backend != "process" or spec.pd \
            or source != WorkerSource() \
            or spec.decode_router or spec.mixed_handoff != "never" or spec.autoscale \
            or spec.prefill_pool != PoolSettings() or spec.decode_pool != PoolSettings():  # run_multi checks them
        from sloserve.front.multi import run_multi

        return run_multi(engine_config_from_args(args), settings, spec, source=source, host=args.host,
                         port=args.port, qos_config=args.qos_config, api_keys=keys,
                         admin_keys=settings.admin_keys, max_in_flight=args.front_max_in_flight,
                         hang_timeout_s=args.hang_timeout, cold_start_s=args.cold_start, scaling_history=_history(args))
    return run_server(engine_config_from_args(args), settings, host=args.host, port=args.port)


def worker_source(args: argparse.Namespace) -> "WorkerSource":
    """Where the fleet's workers come from (workers/source.py), as the options say."""
    return WorkerSource(engine=args.engine, backend=args.backend, ray_address=args.ray_address,
                        vllm_python=args.vllm_python, vllm_args=tuple(args.vllm_arg or ()),
                        attach=WorkerSource.parse_urls(args.workers), vllm_priority=args.vllm_priority)


def server_settings(args: argparse.Namespace):
    """(the ServerSettings `sloserve serve`'s options give, validated; the API keys: the options'
    and SLOSERVE_API_KEY's)."""
    import os

    from sloserve.server.qos import QoSRegistry, load_qos_config
    from sloserve.server.settings import ServerSettings

    registry = load_qos_config(args.qos_config) if args.qos_config else QoSRegistry()
    if args.cache_isolation:
        registry = registry.with_cache_isolation(args.cache_isolation)
    keys = list(args.api_key or [])
    if os.environ.get("SLOSERVE_API_KEY"):
        keys.append(os.environ["SLOSERVE_API_KEY"])
    settings = ServerSettings(
        served_model_names=list(args.served_model_name or []),
        registry=registry.with_keys(keys),
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        grace_period_s=args.grace_period,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        keep_alive_s=args.keep_alive,
        shed_unattainable=not args.no_shed_unattainable,
        stall_timeout_s=args.client_stall_timeout,
        cache_salt_secret=args.cache_salt_secret,
        admin_keys=list(args.admin_key or []),
        timeline_interval_s=args.dashboard_interval,
        event_loop=args.event_loop,
        tool_call_parser=args.tool_call_parser,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    settings.validate()
    return settings, keys


def _history(args: argparse.Namespace):
    """The demand series `--scaling-history` names (it trains a predictive autoscaler), or None."""
    if not args.scaling_history:
        return None
    from sloserve.workload.series import load_series

    return load_series(args.scaling_history, "requests", 600.0)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from sloserve.cli.fleet_args import add_fleet_spec_args
    from sloserve.server.settings import EVENT_LOOPS, TOOL_PARSER_CHOICES

    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, local only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--models", metavar="FILE",
                   help="several models behind one front, each with its own engine options and fleet settings "
                        "(a YAML file; see docs/fleet.md, 'Several models behind one front')")
    g.add_argument("--served-model-name", action="append", metavar="NAME",
                   help="name clients use in `model` (repeatable; the first is reported; default: the model's name)")
    g.add_argument("--api-key", action="append", metavar="KEY",
                   help="accepted API key (repeatable; also $SLOSERVE_API_KEY); none = no authentication")
    g.add_argument("--admin-key", action="append", metavar="KEY",
                   help="repeatable; when set, /metrics (and /v1/instances on a multi-instance front) need one")
    g.add_argument("--qos-config", metavar="FILE",
                   help="YAML/JSON file: QoS classes, API keys -> tenants, what each key may use, per-tenant limits")
    g.add_argument("--cache-isolation", choices=["tenant", "key", "shared"],
                   help="who shares cached prefixes (default: the QoS config's cache_isolation, else tenant)")
    g.add_argument("--cache-salt-secret", metavar="SECRET",
                   help="keys the prefix cache's per-namespace salts (also $SLOSERVE_CACHE_SECRET; default random)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait beyond one full batch (max-num-seqs); more get 429 (default 256)")
    g.add_argument("--grace-period", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds in-flight requests get to finish before they are aborted; what "
                        "they leave of it bounds writing the KV tiers' blocks to --kv-disk-dir (--kv-flush-order)")
    g.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="larger request bodies get 413")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="a request line + headers not received within S seconds: 408 and close (slowloris)")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="longest wait for each chunk of a request body: then 408 and close")
    g.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="open connections; beyond that a new one gets 503 too_many_connections and is closed")
    g.add_argument("--keep-alive", type=float, default=5.0, metavar="S", help="idle keep-alive connections close after S")
    g.add_argument("--event-loop", choices=EVENT_LOOPS, default="auto",
                   help="the HTTP server's event loop: auto = uvloop where installed (less per-token overhead)")
    g.add_argument("--tool-call-parser", choices=TOOL_PARSER_CHOICES, default="auto",
                   help="how chat outputs' tool calls are written and read: auto = the format the chat template "
                        "uses (hermes where it names none, as sloserve's own tool prompt asks)")
    g.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="S",
                   help="a constraint (JSON schema, regex, grammar, forced tool calls) not compiled within S seconds "
                        "is refused with 400 constraint_too_complex; compiles run off the event loop")
    g.add_argument("--client-stall-timeout", type=float, default=60.0, metavar="S",
                   help="end a stream (and abort its requests) whose client accepts no data for S seconds")
    g.add_argument("--no-shed-unattainable", action="store_true",
                   help="queue requests whose predicted TTFT already misses their class target (default: 429 slo_unattainable)")
    g.add_argument("--dashboard-interval", type=float, default=1.0, metavar="S",
                   help="how often /dashboard's fleet timeline samples the instances (default 1 s; the last hour is kept)")
    g.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="send a trace span per request (front and workers) to this OTLP/HTTP collector, e.g. "
                        "http://127.0.0.1:4318 (its /v1/traces); needs the tracing extra (default: no tracing)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    m = p.add_argument_group("multi-instance (the real fleet's own settings)")
    m.add_argument("--engine", default="sloserve", choices=list(ENGINES),
                   help="what each worker runs: sloserve's engine (default), or a stock vLLM server (`make vllm` sets "
                        "one up; --model is then a Hugging Face directory; docs/fleet.md, 'Driving vLLM')")
    m.add_argument("--backend", default="process", choices=list(BACKENDS),
                   help="sloserve's workers as local processes or Ray actors")
    m.add_argument("--workers", metavar="URL,URL",
                   help="attach to servers started elsewhere (sloserve workers, or vLLM with --engine vllm), one "
                        "instance each, instead of starting any")
    m.add_argument("--vllm-python", metavar="PATH",
                   help="the interpreter of the venv vLLM is installed in (default: the one `make vllm` sets up)")
    m.add_argument("--vllm-priority", choices=list(VLLM_PRIORITIES),
                   help="what each call's vLLM `priority` says: its TTFT deadline, so vLLM serves in deadline order "
                        "(default for the vLLM servers sloserve starts), or none: arrival order (default for attached)")
    m.add_argument("--vllm-arg", action="append", metavar="ARG",
                   help="one more of vLLM's own flags for every vLLM worker (repeatable; e.g. "
                        "--vllm-arg=--enforce-eager)")
    m.add_argument("--front-max-in-flight", type=int, default=None, metavar="N",
                   help="requests the front proxies at once; more get 429 (default: the workers' combined capacity)")
    m.add_argument("--hang-timeout", type=float, default=60.0, metavar="S",
                   help="a live worker that answers no health poll for S seconds is killed and replaced "
                        "(one that misses 3 polls only leaves routing until it answers)")
    m.add_argument("--ray-address", help="join this Ray cluster (e.g. auto, ray://head:10001) instead of starting one")
    m.add_argument("--cold-start", type=float, default=30.0, metavar="S",
                   help="autoscaling: worker start time assumed until one of this fleet's workers has been timed")
    add_fleet_spec_args(p)
