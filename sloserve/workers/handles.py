"""Engine workers as the front sees them: something that starts, has a URL, can be checked
and killed, and names the engine kind the front speaks to it with (`engine_kind`, kinds/).

- `ProcessWorker`: a local child process (`python -m sloserve.server.worker`);
- `RayWorker`: a Ray actor running the same worker app in its process, placed by Ray's
  resources (`num_cpus` = the threads it gets), so instances can live on other machines;
- `AttachedWorker`: a server started elsewhere, known by its URL;
- (`vllm_process.VllmWorker`: a stock vLLM server started as a worker.)

All speak HTTP to the front, which is what keeps the front identical for all.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

from sloserve.core.config import EngineConfig
from sloserve.workers.kinds.base import SLOSERVE, EngineKind
from sloserve.workers.contract import API_KEYS_ENV, CACHE_SECRET_ENV, FLEET_SECRET_ENV, WORKER_MODULE, config_to_json

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child, before exec (`preexec_fn`): Linux sends it SIGTERM when the thread that
    started it dies, so a killed front never leaves workers holding a model's memory behind (the
    tests start their servers so too)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class WorkerSpec:
    """What every worker of a fleet is started with."""

    engine: EngineConfig
    qos_config: Optional[str] = None
    api_keys: list[str] = field(default_factory=list)
    served_model_names: list[str] = field(default_factory=list)
    max_queue: int = 256
    log_level: str = "warning"
    fleet_secret: Optional[str] = None  # authenticates the front on the workers' /internal/* routes
    # One prefix-cache salt secret for the whole fleet, so every worker (and the front's
    # prefix-affinity router) computes the same block keys for the same tenant's prefix.
    cache_secret: Optional[str] = None
    # Per-worker server options beyond the above (see worker.WORKER_OPTIONS), as plain JSON data.
    options: dict = field(default_factory=dict)

    def __repr__(self) -> str:  # never print the keys or the secret in a log line
        return f"WorkerSpec(engine={self.engine!r}, max_queue={self.max_queue}, api_keys=<{len(self.api_keys)}>)"


class WorkerHandle(ABC):
    kind: str = "?"  # how it runs: process, ray, vllm, attached
    engine_kind: "EngineKind" = SLOSERVE  # how the front speaks to it (workers/kinds/)

    @property
    @abstractmethod
    def url(self) -> Optional[str]:
        """Base URL once known (a Ray actor learns its port after starting)."""

    @abstractmethod
    def is_running(self) -> bool:
        """False once the worker's process is known to be gone."""

    @abstractmethod
    def kill(self) -> None:
        """Stop it now (a hung worker, or shutdown). May block while it reaps the process: the
        front calls it in a thread."""

    def describe(self) -> dict:
        return {"kind": self.kind, "url": self.url}


class AttachedWorker(WorkerHandle):
    """A server started elsewhere (`sloserve serve --workers URL,...`): the front neither starts nor
    stops it; it is alive while it answers its polls, and a replacement is the same URL, polled
    until it answers again. `engine_kind`: how to speak to it (kinds/)."""

    kind = "attached"

    def __init__(self, url: str, engine_kind=None):
        self._url = url.rstrip("/")
        self.engine_kind = engine_kind or SLOSERVE

    @property
    def url(self) -> str:
        return self._url

    def is_running(self) -> bool:
        return True  # judged over HTTP, by the polls

    def kill(self) -> None:
        self.engine_kind.close(self)


class NoWorker(WorkerHandle):
    """The handle of a slot whose instance is stopped (autoscaling): nothing runs, nothing to kill."""

    kind = "none"

    @property
    def url(self) -> Optional[str]:
        return None

    def is_running(self) -> bool:
        return False

    def kill(self) -> None:
        pass


class ProcessWorker(WorkerHandle):
    kind = "process"

    def __init__(self, spec: WorkerSpec, host: str = "127.0.0.1", port: Optional[int] = None):
        self.host = host
        self.port = port or free_port(host)
        cmd = [sys.executable, "-m", WORKER_MODULE, "--config", config_to_json(spec.engine),
               "--host", host, "--port", str(self.port), "--max-queue", str(spec.max_queue),
               "--log-level", spec.log_level, "--options", json.dumps(spec.options)]
        if spec.qos_config:
            cmd += ["--qos-config", spec.qos_config]
        for name in spec.served_model_names:
            cmd += ["--served-model-name", name]
        env = dict(os.environ)
        if spec.api_keys:  # through the environment, not the command line where `ps` shows it
            env[API_KEYS_ENV] = "\n".join(spec.api_keys)
        env.pop(FLEET_SECRET_ENV, None)
        if spec.fleet_secret:
            env[FLEET_SECRET_ENV] = spec.fleet_secret
        if spec.cache_secret:
            env[CACHE_SECRET_ENV] = spec.cache_secret
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        logger.info("started worker pid %d on port %d", self.proc.pid, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.error("worker pid %d did not exit after SIGKILL", self.proc.pid)

    def terminate(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def describe(self) -> dict:
        return {"kind": self.kind, "url": self.url, "pid": self.proc.pid, "exit_code": self.proc.poll()}


def _actor_class():
    import ray

    class WorkerActor:
        """Runs one worker app (engine + HTTP) inside a Ray actor process."""

        def __init__(self, config_json: str, qos_config: Optional[str], api_keys: list[str],
                     served_model_names: list[str], max_queue: int, fleet_secret: Optional[str] = None,
                     cache_secret: Optional[str] = None, options: Optional[dict] = None):
            import threading

            import uvicorn

            import importlib

            from sloserve.workers.contract import config_from_json

            worker = importlib.import_module(WORKER_MODULE)  # the worker program, in this actor's process
            settings = worker.settings_from_args(qos_config, api_keys, served_model_names, max_queue, options or {},
                                          cache_secret)
            self.engine, app = worker.build_worker_app(config_from_json(config_json), settings, fleet_secret)
            self.host = ray.util.get_node_ip_address()
            self.port = free_port(self.host)
            config = uvicorn.Config(app, host=self.host, port=self.port, lifespan="off", access_log=False,
                                    log_config=None, timeout_keep_alive=30)
            self.server = uvicorn.Server(config)
            self.thread = threading.Thread(target=self.server.run, name="sloserve-worker-http", daemon=True)
            self.thread.start()

        def address(self) -> str:
            return f"http://{self.host}:{self.port}"

        def pid(self) -> int:
            return os.getpid()

    return ray.remote(WorkerActor)


class RayWorker(WorkerHandle):
    """A worker as a Ray actor; `ray.init` must have run (the launcher does it)."""

    kind = "ray"

    def __init__(self, spec: WorkerSpec, num_cpus: float = 1.0, num_gpus: float = 0.0):
        import ray

        cls = _actor_class().options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0)
        self.actor = cls.remote(config_to_json(spec.engine), spec.qos_config, list(spec.api_keys),
                                list(spec.served_model_names), spec.max_queue, spec.fleet_secret,
                                spec.cache_secret, dict(spec.options))
        self._ray = ray
        self._url: Optional[str] = None
        self._dead = False
        self._address_ref = self.actor.address.remote()

    @property
    def url(self) -> Optional[str]:
        if self._url is None and not self._dead:
            ready, _ = self._ray.wait([self._address_ref], timeout=0)
            if ready:
                try:
                    self._url = self._ray.get(self._address_ref)
                except Exception:  # the actor died while starting
                    logger.exception("ray worker failed to start")
                    self._dead = True
        return self._url

    def is_running(self) -> bool:
        if self._url is None:
            _ = self.url  # notices an actor that died while starting
        return not self._dead  # past startup, liveness is judged over HTTP, like any worker

    def kill(self) -> None:
        self._dead = True
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:
            logger.debug("ray.kill failed (already gone?)", exc_info=True)

    def describe(self) -> dict:
        return {"kind": self.kind, "url": self._url}
