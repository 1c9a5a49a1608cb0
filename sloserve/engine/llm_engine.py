"""The synchronous engine: validation, the scheduler-executor step loop, output processing.

One call to `step()` is one iteration: schedule, execute, update, then detokenize and
check stop strings for the requests that produced a token.
"""
from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from sloserve.core.config import ATTENTION_KERNELS, EngineConfig, ModelConfig
from sloserve.engine.kernels import attention_kernels, load_fused_ops, load_paged_decode_attention
from sloserve.engine.migration import ResumeState
from sloserve.engine.model import KVCache, LlamaModel, lm_head_kind
from sloserve.engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from sloserve.engine.precision_probe import choose_cpu_dtype, prepack_pays, quantized_max_rows
from sloserve.engine.quant import (can_prepack, int8_activation_kernels, resolve_quantization,
                                   takes_int8_activations)
from sloserve.engine.kv_store import KVStoreClient
from sloserve.engine.kv_tiers import DiskKVTier, FlushReport, TierMovers, kv_fingerprint, model_identity
from sloserve.engine.runner import KVTransferError, ModelRunner, TierLoadFailed
from sloserve.engine.step_trace import StepRecord, StepTraceWriter
from sloserve.engine.stop_strings import StopMatcher
from sloserve.engine.lora import LoraError, LoraRegistry
from sloserve.engine.structured import GrammarBackend, hf_view
from sloserve.engine.swap import HostKVPool, measure_link_bandwidth
from sloserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from sloserve.engine.weights import load_model
from sloserve.kv.manager import KVCacheManager
from sloserve.kv.tiers import DISK, HOST, STORE, KVTiers
from sloserve.sched.costs import LinkSwapCost, OnlineStepEstimator, StepCostEstimator, StepLoad, TierLinkCosts
from sloserve.sched.plan import ScheduledRequest, StepPlan, StepResult
from sloserve.sched.scheduler import Scheduler
from sloserve.core.types import DEFAULT_QOS, FinishReason, QoSClass, Request, RequestStatus, SamplingParams

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int]]
# First guess of the disk tier's read/write speed (bytes/s), refined from every measured move.
DISK_BANDWIDTH_PRIOR = 1e9
STORE_BANDWIDTH_PRIOR = 5e8  # the shared store, over the network (loopback is faster; refined the same way)
# Blocks a shutdown flush writes between two looks at its deadline (16 fp32 SmolLM2 blocks: 12 MB,
# tens of ms on a local disk: the most a flush overruns its budget by).
FLUSH_BATCH = 16


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch has no CUDA device")
    return torch.device(name)


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str, device: torch.device, model: Optional[ModelConfig] = None,
                  native_kernels: bool = True) -> torch.dtype:
    """`auto`: bfloat16 on CUDA; on a CPU whichever of float32 and bfloat16 runs this model's
    GEMMs faster here, on the linears the engine will run (`native_kernels`: prepacked where
    that pays; measured once per machine: engine/precision_probe.py)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        if model is None:
            return torch.float32
        return _DTYPES[choose_cpu_dtype(model.hidden_size, model.intermediate_size,
                                        native_kernels=native_kernels).dtype]
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use auto, float32 or bfloat16")
    return _DTYPES[name]


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_num_threads() -> int:
    """torch threads when none are configured: OMP_NUM_THREADS where it is set (the convention a
    process sharing its machine uses), else every core this process may run on."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return available_cores()


@dataclass
class _Tracked:
    """Engine-side state of a request the scheduler does not need."""

    request: Request
    detok: IncrementalDetokenizer
    logprobs: Optional[list[TokenLogprob]]
    sent_text_len: int = 0
    sent_token_len: int = 0
    stop_reason: Optional[Union[str, int]] = None
    final_text: Optional[str] = None
    stop_matcher: Optional[StopMatcher] = None  # None when the request has no stop strings


ENDED_REMEMBERED = 4096  # ended requests whose ids a late migration can still be told about


class ContextLengthError(ValueError):
    """The prompt (with max_tokens) does not fit the context window."""


class LLMEngine:
    def __init__(self, config: Optional[EngineConfig] = None, clock: Callable[[], float] = time.monotonic,
                 step_estimator: Optional[StepCostEstimator] = None):
        """`step_estimator` prices steps for the SLO-aware scheduling decisions; by default a
        linear model fitted online to the measured step durations."""
        self.config = config = config or EngineConfig()
        config.cache.validate()
        config.scheduler.validate()
        if config.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}, "
                             f"got {config.attention_kernel!r}")
        self.clock = clock
        self.device = resolve_device(config.device)
        resolve_dtype(config.dtype, self.device)  # a bad name fails before the model loads
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or default_num_threads())
        if config.attention_kernel not in ("auto", "portable") and config.native_kernels and self.device.type == "cpu":
            offered = attention_kernels()  # before the model loads: a path this CPU lacks fails at once
            if config.attention_kernel not in offered:
                raise ValueError(f"attention kernel {config.attention_kernel!r} is not available on this machine "
                                 f"(available: {', '.join(offered) or 'none, the native build failed'})")
        # A 4-bit file's codes are kept as stored only when they will be packed as int4.
        keep_int4 = config.quantization in ("auto", "int4") and self.device.type == "cpu"
        load_dtype = torch.float32 if config.dtype == "auto" and self.device.type == "cpu" else \
            resolve_dtype(config.dtype, self.device)
        loaded = load_model(config.model, dtype=load_dtype, keep_int4=keep_int4)
        self.dtype = resolve_dtype(config.dtype, self.device, loaded.config, config.native_kernels)
        self.quantization = resolve_quantization(config.quantization, loaded.precision_class, self.device)
        self.model_config: ModelConfig = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.model_name = loaded.config.name or "model"
        decode_attention = fused_ops = None
        if config.native_kernels and self.device.type == "cpu":
            decode_attention = load_paged_decode_attention()
            fused_ops = load_fused_ops()
        hidden, intermediate = loaded.config.hidden_size, loaded.config.intermediate_size
        prepack = (config.native_kernels and can_prepack(self.dtype, self.device)
                   and prepack_pays(hidden, intermediate, self.dtype))
        a8_ops = int8_activation_kernels(fused_ops, self.device)
        wanted = {"layers": config.layers_a8, "head": config.head_w8a8}
        dense_above: dict[str, Optional[int]] = {}
        if self.quantization != "none" and config.quantized_dense_copy:
            # the layers' kernel, and the LM head's (model.lm_head_kind), each as it will run
            head = lm_head_kind(loaded.config, loaded.weights, self.quantization, a8_ops, config.head_w8a8)
            for part, kind in (("layers", self.quantization), ("head", head)):
                if kind == "none":  # w8a8's head: dense already
                    continue
                a8 = a8_ops if wanted[part] and takes_int8_activations(part, kind) else None
                dense_above[part] = quantized_max_rows(hidden, intermediate, kind, self.dtype, prepack=prepack,
                                                       int8_activations=a8)
        self.dense_above = dense_above  # rows above which each part's dense copy runs (the probe's answer)
        self.model = LlamaModel(loaded.config, loaded.weights, self.device, self.dtype, decode_attention,
                                self.quantization, dense_above, fused_ops, prepack, config.attention_kernel,
                                config.head_w8a8, config.layers_a8)  # the model checks the kernels itself
        del loaded

        cache = config.cache
        kv_dtype = torch.int8 if cache.kv_dtype == "int8" else (
            self.dtype if cache.kv_dtype == "auto" else resolve_dtype(cache.kv_dtype, self.device))
        per_block = cache.block_size * KVCache.bytes_per_token(self.model_config, kv_dtype)
        num_blocks = cache.num_blocks or max(1, int(cache.kv_cache_gib * 2**30 // per_block))
        context = config.max_model_len or self.model_config.max_position_embeddings
        if context > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {context} exceeds the model's context window {self.model_config.max_position_embeddings}"
            )
        if num_blocks * cache.block_size < context:
            logger.warning("KV pool holds %d tokens; max_model_len lowered from %d", num_blocks * cache.block_size, context)
            context = num_blocks * cache.block_size
        self.max_model_len = context
        sched_cfg = config.scheduler
        if not sched_cfg.enable_chunked_prefill and sched_cfg.max_num_batched_tokens < context:
            raise ValueError("without chunked prefill, max_num_batched_tokens must cover max_model_len")

        num_host_blocks = 0 if sched_cfg.preemption_mode == "recompute" else cache.host_blocks(per_block)
        self.kv_cache = KVCache(self.model_config, num_blocks, cache.block_size, self.dtype, self.device, kv_dtype)
        # what a measured speed holds for (profiles and benchmarks name it)
        self.precision = (f"{str(self.dtype).removeprefix('torch.')}, "
                          f"{'dense' if self.quantization == 'none' else self.quantization} weights, "
                          f"KV {str(kv_dtype).removeprefix('torch.')}")
        link_bandwidth = measure_link_bandwidth(self.device) if num_host_blocks or cache.host_tier_gib else 0.0
        tiers, self.tier_movers, self.tier_cost = self._make_tiers(config, per_block, link_bandwidth)
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, cache.watermark,
                                 num_host_blocks=num_host_blocks, tiers=tiers)
        self.host_pool: Optional[HostKVPool] = None
        self.swap_cost: Optional[LinkSwapCost] = None
        if num_host_blocks:
            self.host_pool = HostKVPool(self.kv_cache, num_host_blocks)
            self.swap_cost = LinkSwapCost(per_block, link_bandwidth)
        self.step_estimator = step_estimator if step_estimator is not None else OnlineStepEstimator()
        eos = tuple(self.model_config.eos_token_ids)
        self.scheduler = Scheduler(sched_cfg, self.kv, context, eos, estimator=self.step_estimator,
                                   swap_cost=self.swap_cost, tier_cost=self.tier_cost)
        self.runner = ModelRunner(self.model, self.kv_cache, eos, seed=config.seed, host_pool=self.host_pool,
                                  tier_movers=self.tier_movers)
        self.loras = LoraRegistry(self.model_config, self.dtype, self.device, config.max_loras, config.max_lora_rank)
        for name, path in config.lora_modules:
            self.loras.load(name, path)
        self.runner.loras = self.loras
        self._grammar: Optional[GrammarBackend] = None
        self._grammar_lock = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}
        # the newest ended requests and how ("finished", "moved"): a migration that comes too late names why
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._ids = itertools.count()
        self._trace = StepTraceWriter(config.step_trace) if config.step_trace else None
        logger.info(
            "engine ready: %s, %s (weights %s, %.0f MB; dense above %s rows) on %s, %d KV blocks x %d tokens, "
            "context %d", self.model_name, str(self.dtype).removeprefix("torch."), self.quantization,
            self.model.weight_bytes / 1e6, dense_above or "-", self.device, num_blocks, cache.block_size, context,
        )

    def _make_tiers(self, config: EngineConfig, per_block: int,
                    link_bandwidth: float) -> tuple[KVTiers, Optional[TierMovers], Optional[TierLinkCosts]]:
        """The prefix cache's lower tiers: bookkeeping for the KV manager, byte movers for the
        runner, and the per-tier link costs the scheduler weighs loading against recomputing by."""
        cache = config.cache
        host_blocks = int(cache.host_tier_gib * 2**30 // per_block)
        disk = store = None
        disk_blocks = 0
        fingerprint = kv_fingerprint(model_identity(config.model, self.model_name), self.dtype,
                                     self.quantization, self.kv_cache)
        if cache.disk_tier_dir:
            disk = DiskKVTier(cache.disk_tier_dir, fingerprint, self.kv_cache)
            disk_blocks = int(cache.disk_tier_gib * 2**30 // per_block)
        if cache.kv_store_url:
            L, two, _, heads, dim = self.kv_cache.data.shape
            store = KVStoreClient(cache.kv_store_url, fingerprint, (L, two, cache.block_size, heads, dim),
                                  self.kv_cache.data.dtype)
        tiers = KVTiers(host_blocks, disk_blocks, store, write_back=cache.tier_write_back)
        if not tiers.enabled:
            return tiers, None, None
        links = {}
        if host_blocks:
            links[HOST] = LinkSwapCost(per_block, link_bandwidth)
        if disk is not None and tiers.disk is not None:
            stale = tiers.disk.seed(disk.stored_keys())
            disk.delete(stale)
            links[DISK] = LinkSwapCost(per_block, DISK_BANDWIDTH_PRIOR, latency_s=1e-4)
            logger.info("disk KV tier %s: %d blocks found (%d over the bound removed)", disk.dir,
                        len(tiers.disk), len(stale))
        if store is not None:
            links[STORE] = LinkSwapCost(per_block, STORE_BANDWIDTH_PRIOR, latency_s=5e-4)
        return tiers, TierMovers(self.kv_cache, host_blocks, disk, store), TierLinkCosts(links)

    # ---- requests ----------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            self._refuse_far_past_context(prompt, "prompt")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def tokenize_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                      tools: Optional[list[dict]] = None) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (`tools` passed to a
        template that renders them itself: server/tool_calls.py decides)."""
        extra = {} if tools is None else {"tools": tools}
        # a template renders every turn's text: the turns alone can show it cannot fit, before a render
        # (seconds of Python for a 4 MB conversation of 90,000 turns)
        self._refuse_far_past_context("".join(str(m.get("content") or "") for m in messages), "conversation")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt, **extra)
        self._refuse_far_past_context(text, "conversation")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _refuse_far_past_context(self, text: str, what: str) -> None:
        """ContextLengthError, before any tokenizing, for text that cannot fit the context window
        however it tokenizes (Tokenizer.min_tokens): a multi-megabyte prompt costs a server
        microseconds instead of seconds of CPU."""
        least = self.tokenizer.min_tokens(text)
        if least >= self.max_model_len:
            raise ContextLengthError(f"{what} has at least {least} tokens ({len(text)} characters); the context "
                                     f"window is {self.max_model_len}")

    def check_context(self, ids: list[int], max_tokens: Optional[int] = None) -> list[int]:
        """`ids`, or ContextLengthError when they (and `max_tokens` more) do not fit the context."""
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(f"prompt has {len(ids)} tokens; the context window is {self.max_model_len}")
        if max_tokens is not None and len(ids) + max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context window "
                f"({self.max_model_len})"
            )
        return ids

    @property
    def grammar_built(self) -> bool:
        return self._grammar is not None

    @property
    def grammar(self) -> GrammarBackend:
        """The grammar engine of structured outputs, built with the first request that has one
        (importing it and reading the vocabulary cost about a second)."""
        if self._grammar is None:
            with self._grammar_lock:
                if self._grammar is None:
                    eos = self.tokenizer.eos_token_id
                    text = self.tokenizer.id_to_token(eos) if eos is not None else None
                    self._grammar = GrammarBackend(hf_view(self.tokenizer.backend, text), self.model_config.vocab_size,
                                                   self.model_config.eos_token_ids)
                    fused = getattr(self.runner.model, "fused", None)
                    self._grammar.native = fused if hasattr(fused, "apply_token_bitmask_") else None
                    self.runner.grammar = self._grammar
        return self._grammar

    def make_request(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        qos: QoSClass = DEFAULT_QOS,
        tenant: str = "",
        priority: Optional[int] = None,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        lora: Optional[str] = None,
    ) -> Request:
        """Validate and build a Request without touching engine state (safe from any thread).
        `cache_salt` partitions the prefix cache (None: by tenant); `lora` names a loaded adapter."""
        if lora is not None and lora not in self.loras:
            raise LoraError(f"adapter {lora!r} is not loaded")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        params.validate()
        if params.structured is not None:
            self.grammar.compile(params.structured)  # StructuredOutputError (a ValueError) before any work
        ids = self.check_context(self.tokenize_prompt(prompt), params.max_tokens)
        return Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=ids,
            sampling_params=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            qos=qos,
            tenant=tenant,
            cache_salt=cache_salt,
            lora=lora,
            priority=priority,
        )

    def add(self, request: Request, resume: Optional[ResumeState] = None) -> None:
        """Queue a request built by make_request (on the thread that runs step()). With
        `resume`, the request continues one begun elsewhere (a migration or a failover)."""
        if request.request_id in self._tracked:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.lora is not None and request.lora not in self.loras:  # unloaded since make_request
            raise LoraError(f"adapter {request.lora!r} is not loaded")
        params = request.sampling_params
        # Built once here, so each step costs O(new characters) whatever the number of stop strings.
        matcher = StopMatcher(params.stop) if params.stop else None
        if resume is None:
            self.scheduler.add_request(request)
        else:
            try:
                self._admit_resumed(request, resume)
            except BaseException:
                if resume.block_ids and request.request_id not in self.scheduler.requests:
                    self.kv.unpin(resume.block_ids)  # the migrated KV's holds die with the request
                raise
        want_logprobs = params.logprobs is not None
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                       skip_special_tokens=params.skip_special_tokens)
        tracked = _Tracked(request, detok, [] if want_logprobs else None, stop_matcher=matcher)
        if resume is not None:
            for token in request.output_token_ids:  # one at a time, as they were detokenized there
                detok.add([token])
            if matcher is not None:
                matcher.feed(detok.text)
            tracked.sent_text_len = min(resume.sent_text_len, len(detok.text))
            tracked.sent_token_len = len(request.output_token_ids)
        self._tracked[request.request_id] = tracked
        if request.lora is not None:
            self.loras.acquire(request.lora)

    def _admit_resumed(self, request: Request, resume: ResumeState) -> None:
        now = self.clock()
        if not resume.output_token_ids:
            raise ValueError("a resumed request needs the tokens it has produced")
        request.output_token_ids = list(resume.output_token_ids)
        if request.num_tokens >= self.max_model_len or (
                request.max_output_tokens is not None and request.num_output_tokens >= request.max_output_tokens):
            raise ValueError("the resumed request has nothing left to generate")
        request.arrival_time = now - resume.age_s
        request.first_scheduled_time = request.arrival_time  # it was scheduled where it began
        if resume.first_token_age_s is not None:
            request.first_token_time = request.last_token_time = now - resume.first_token_age_s
        request.num_cached_tokens = resume.num_cached_tokens
        request.num_preemptions = resume.num_preemptions
        if resume.block_ids is None:
            self.scheduler.add_request(request)  # recompute prompt + output (a prefix-cache hit helps)
            return
        request.num_computed_tokens = request.num_tokens - 1
        needed = self.kv.blocks_needed(request.num_computed_tokens)
        if len(resume.block_ids) < needed:
            raise ValueError(f"the migrated KV has {len(resume.block_ids)} blocks; the request needs {needed}")
        self.kv.unpin(resume.block_ids[needed:])
        resume.block_ids = resume.block_ids[:needed]
        self.scheduler.adopt(request, resume.block_ids, now)

    # ---- migration (engine thread) ---------------------------------------------------
    def pin_full_blocks(self, request_id: str, start: int) -> Optional[tuple[list[int], list[int]]]:
        """A migration's pre-copy round: pin the request's full computed blocks from index
        `start` on, so their bytes can be read off the engine thread while it keeps decoding.
        Returns (block ids, their prefix keys from block 0), or None if the request is gone."""
        movable = self._movable(request_id)
        if movable is None:
            return None
        request, full = movable
        hashes = [int(h) for h in self.kv.request_hashes(request)[:full]]
        return self.kv.pin_request(request_id, full, start), hashes

    def prefill_progress(self, request_id: str, start: int) -> Optional[tuple[list[int], list[int], bool]]:
        """A pipelined hand-off's round while the prompt is computed: the full computed blocks
        from index `start` on, pinned (as pin_full_blocks); the prefix keys of every full block
        of the prompt, computed or not (the target reserves for all of it and says which it
        caches); and whether the prompt is done. None once the request is gone."""
        movable = self._movable(request_id)
        if movable is None:
            return None
        request, full = movable
        hashes = [int(h) for h in self.kv.request_hashes(request)]
        return self.kv.pin_request(request_id, full, start), hashes, request.num_output_tokens > 0

    def _movable(self, request_id: str) -> Optional[tuple[Request, int]]:
        """The request if it is here and not already moving, with its count of full computed blocks."""
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status is RequestStatus.MIGRATING:
            return None
        return request, min(request.num_computed_tokens // self.kv.block_size, self.kv.num_blocks_of(request_id))

    def why_not_movable(self, request_id: str) -> tuple[str, str]:
        """(code, words) of a migration's refusal of `request_id`, for the moment it was refused:
        `finished` (it ended here, or is ending: the move came too late, nothing is wrong),
        `not_running` (queued, preempted, still prefilling, moving or moved away), or
        `unknown_request` (never here, or ended long ago)."""
        tracked = self._tracked.get(request_id)
        if tracked is not None and (tracked.request.is_finished or tracked.final_text is not None):
            return "finished", "is finishing here"
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            if request.status is RequestStatus.RUNNING and request.num_tokens - request.num_computed_tokens > 1:
                return "not_running", "is still prefilling here"
            return "not_running", f"is {request.status.value} here"
        ended = self._ended.get(request_id)
        if ended == "finished":
            return "finished", "finished here before it could move"
        if ended == "moved":
            return "not_running", "has moved away from here"
        return "unknown_request", "is not known here"

    def suspend(self, request_id: str) -> Optional[tuple[ResumeState, list[int]]]:
        """The stop-and-copy: stop scheduling the request, keep (and pin) its blocks. Returns
        what continues it elsewhere and all its block ids, or None when it cannot move now
        (gone, finishing, still prefilling)."""
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.request.is_finished or tracked.final_text is not None:
            return None
        request = self.scheduler.suspend(request_id)
        if request is None:
            return None
        now = self.clock()
        ids = self.kv.pin_request(request_id, self.kv.blocks_needed(request.num_computed_tokens))
        state = ResumeState(list(request.output_token_ids), tracked.sent_text_len, now - request.arrival_time,
                            None if request.first_token_time is None else now - request.first_token_time,
                            request.num_cached_tokens, request.num_preemptions)
        return state, ids

    def unsuspend(self, request_id: str, pinned: list[int]) -> None:
        """The migration failed: the request goes on here."""
        self.kv.unpin(pinned)
        self.scheduler.unsuspend(request_id, self.clock())

    def drop_migrated(self, request_id: str, pinned: list[int]) -> bool:
        """The target took over: forget the request here and free its blocks."""
        self.kv.unpin(pinned)
        request = self.scheduler.drop_suspended(request_id, self.clock())
        if request is None:
            return False
        self._forget(request)
        return True

    def reserve_for_migration(self, hashes: list[int], num_tokens: int,
                              incoming: int = 0) -> Optional[tuple[int, list[int]]]:
        """A migration's target: hold the blocks for `num_tokens` tokens of KV, reusing the
        leading blocks of `hashes` this instance has cached (those are not sent). Returns (how
        many leading blocks are already here, every held block id in table order), or None
        when they do not fit or the batch has no seat beside the `incoming` migrations already
        holding blocks here (the migration is refused, nothing changed)."""
        if not self.scheduler.has_seat(incoming):
            return None
        have = self.kv.pin_cached(hashes)
        extra = self.kv.reserve(max(0, self.kv.blocks_needed(num_tokens) - len(have)))
        if extra is None:
            self.kv.unpin(have)
            return None
        return len(have), have + extra

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, **kwargs) -> str:
        request = self.make_request(prompt, params, **kwargs)
        self.add(request)
        return request.request_id

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Abort and free; returns the final output, or None if the id is unknown or done."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        self.scheduler.abort_request(request_id, self.clock())
        return self._emit(tracked)

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work (a request suspended for a migration has none here)."""
        return len(self._tracked) > len(self.scheduler.suspended)

    @property
    def num_unfinished(self) -> int:
        return len(self._tracked)

    # ---- the loop ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = self.clock()
        plan = self.scheduler.schedule(started)
        if plan.is_empty and not plan.has_kv_ops:
            return []
        scheduled = self.clock()
        failed: dict[str, str] = {}
        try:
            try:
                result = self.runner.execute(plan)
            except TierLoadFailed as lost:
                plan = self._recompute_lost_loads(plan, lost.failed_blocks)
                result = self.runner.execute(plan)
            self._forget_lost_prefetches()
        except KVTransferError:
            raise  # the KV pool itself is in doubt: an engine fault
        except Exception as exc:
            plan, result, failed = self._isolate_failures(plan, exc)
            now = self.clock()
        else:
            now = self.clock()
            self._learn_costs(plan, result.duration_s)
        outputs = []
        for request_id, error in failed.items():  # abort first: frees their blocks, update skips them
            self.scheduler.abort_request(request_id, now)
            outputs.append(self._emit(self._tracked[request_id], error=error))
        produced = self.scheduler.update(plan, result, now)
        for request in produced:
            tracked = self._tracked[request.request_id]
            if tracked.logprobs is not None and request.request_id in result.extras:
                lp, top = result.extras[request.request_id]  # (a request with logprobs never speculates)
                tracked.logprobs.append(TokenLogprob(request.output_token_ids[-1], lp, list(top or [])))
            self._take_tokens(tracked, now)
            outputs.append(self._emit(tracked))
        if self._trace is not None:
            self._trace.write(StepRecord(started, scheduled - started, now - scheduled, self.clock() - now,
                                         StepLoad.of_plan(plan)))
        return outputs

    def close(self, flush_budget_s: float = math.inf) -> None:
        """Flush and close the step trace (the engine stays usable, untraced), and write what
        only host memory and the device cache to the disk tier within `flush_budget_s` seconds
        (`flush_tiers`), so a restart on the same directory finds it."""
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        self.flush_tiers(flush_budget_s)

    def flush_tiers(self, budget_s: float) -> Optional[FlushReport]:
        """A clean stop: write the full blocks the disk tier lacks that host memory or the device
        pool holds (write-back owes them to the disk), best first by the configured order
        (kv/tiers.py FLUSH_ORDERS), FLUSH_BATCH blocks at a time until `budget_s` seconds have
        passed; logs one line (written, dropped and why). Unpaced: no step runs behind it. None
        without a disk tier. Run it with no step in flight (the engine's own thread, or after it)."""
        movers = self.tier_movers
        if movers is None or movers.disk is None or self.kv.tiers.disk is None:
            return None
        start = self.clock()
        deadline = start + budget_s
        # Moves planned but not run yet (a host save whose row would otherwise be flushed
        # stale), and the last step's writes behind it; a block whose load failed is no copy.
        moved = movers.run(self.kv.take_tier_ops())
        self.kv.forget_blocks(moved.failed_blocks)
        for key in moved.lost_keys:
            self.kv.tiers.lost(key)
        plan = self.kv.plan_flush(self.config.cache.tier_flush_order)
        report = FlushReport(plan.order, budget_s, disk_full=plan.disk_full, off=plan.off)
        keep = {op.key for op in plan.ops}
        tiers, done = self.kv.tiers, 0
        while done < len(plan.ops) and self.clock() < deadline:
            batch = plan.ops[done:done + FLUSH_BATCH]
            movers.disk.delete(tiers.flushed(batch, keep))
            try:
                from_host, from_device = movers.flush(batch)
            except OSError as exc:  # a full disk: what is left is lost, never the stop
                logger.warning("KV shutdown flush: writing %d blocks failed: %s", len(batch), exc)
                tiers.unflushed(op.key for op in batch)
                movers.disk.delete([op.key for op in batch])
                report.disk_full += len(plan.ops) - done
                done = len(plan.ops)
                break
            report.from_host += from_host
            report.from_device += from_device
            report.written += len(batch)
            done += len(batch)
        report.budget_out = len(plan.ops) - done
        # The restart's LRU order: the best block the newest, the first a full disk gives up last.
        movers.disk.rank([op.key for op in reversed(plan.ops[:report.written])])
        report.seconds = self.clock() - start
        logger.info(report.line())
        return report

    def _isolate_failures(self, plan: StepPlan, exc: Exception) -> tuple[StepPlan, StepResult, dict[str, str]]:
        """The step's compute failed: re-run each scheduled request alone, so one request's bad
        input never fails its neighbours. The plan's KV operations already ran and are not
        repeated. Returns the plan and result of the requests that ran, and an error per request
        that failed alone; if every one of several failed, re-raises `exc` (an engine fault: the
        caller fails everything in flight), while a step of one request fails that request only. The re-runs'
        durations are not a batch's cost, so they teach the estimators nothing."""
        logger.warning("step %d failed (%r); re-running its %d requests one at a time", plan.step_id, exc,
                       len(plan.scheduled))
        kept: list[ScheduledRequest] = []
        result = StepResult({})
        failed: dict[str, str] = {}
        for item in plan.scheduled:
            try:
                alone = self.runner.execute(StepPlan(plan.step_id, plan.now, [item]))
            except Exception as err:  # noqa: BLE001 - whatever it is, it is this request's alone
                logger.error("request %s failed in the engine: %r", item.request_id, err, exc_info=err)
                failed[item.request_id] = f"{type(err).__name__}: {err}"
                continue
            kept.append(item)
            result.sampled_token_ids.update(alone.sampled_token_ids)
            result.extras.update(alone.extras)
            result.more_token_ids.update(alone.more_token_ids)
            result.duration_s += alone.duration_s
        if not kept and len(plan.scheduled) > 1:
            raise exc  # several requests that each fail alone: the engine, not their input
        return StepPlan(plan.step_id, plan.now, kept, preempted=plan.preempted), result, failed

    def _forget_lost_prefetches(self) -> None:
        """Blocks whose prefetch into host memory failed are in no tier any more."""
        lost = self.runner.last_tier_report.lost_keys
        for key in lost:
            self.kv.tiers.lost(key)
        lost.clear()

    def _recompute_lost_loads(self, plan: StepPlan, failed_blocks: set[int]) -> StepPlan:
        """Tier loads into `failed_blocks` did not arrive: forget those blocks as cached, send
        every planned request that would read one back to the queue to recompute, and return
        the rest of the plan (its KV moves have run)."""
        self.kv.forget_blocks(failed_blocks)
        kv = self.kv
        # Every running request whose computed blocks include one of them: those scheduled in
        # this step, and those still loading their prefix over several steps.
        lost = [r for r in self.scheduler.running
                if failed_blocks.intersection(kv.block_table(r.request_id)[:kv.blocks_needed(r.num_computed_tokens)])]
        lost_ids = {r.request_id for r in lost}
        kept = [item for item in plan.scheduled if item.request_id not in lost_ids]
        self.scheduler.requeue_for_recompute(lost, self.clock())
        logger.warning("step %d: %d requests recompute a prefix whose tier load failed", plan.step_id, len(lost))
        return StepPlan(plan.step_id, plan.now, kept, preempted=plan.preempted + sorted(lost_ids))

    def _learn_costs(self, plan, duration_s: float) -> None:
        """Feed measured times back to the estimators the scheduler prices decisions with."""
        swap_s, swap_blocks = self.runner.last_swap_s, self.runner.last_swap_blocks
        if self.swap_cost is not None and swap_blocks:
            self.swap_cost.observe(swap_blocks, swap_s)
        tiers = self.runner.last_tier_report
        if self.tier_cost is not None:
            for tier, blocks in tiers.blocks.items():
                self.tier_cost.observe(tier, blocks, tiers.seconds[tier])
        observe = getattr(self.step_estimator, "observe", None)
        if observe is not None and not plan.is_empty:
            observe(StepLoad.of_plan(plan), duration_s - swap_s - tiers.total_s)

    def _take_tokens(self, tracked: _Tracked, now: float) -> None:
        """Detokenize the request's new tokens one by one (several when drafts were accepted),
        checking stop strings after each: a stop string ends the request at the very token
        plain decoding would have ended it at, and the tokens after it are dropped."""
        request = tracked.request
        tokens = request.output_token_ids
        last = len(tokens) - 1
        for index in range(tracked.detok.num_output_tokens, last + 1):
            token = tokens[index]
            tracked.detok.add([token])
            if index == last and request.is_finished:  # the scheduler ended it with this token
                if request.finish_reason is FinishReason.STOP and token in request.sampling_params.stop_token_ids:
                    tracked.stop_reason = token
                return
            if self._check_stop_strings(tracked, now):
                if index < last:
                    del tokens[index + 1:]
                    request.finish_reason = FinishReason.STOP  # (if the scheduler had ended it at a later token)
                return

    def _check_stop_strings(self, tracked: _Tracked, now: float) -> bool:
        """Feed the matcher the text added since the last check (the detokenizer's text only
        grows); True when a stop string ended the request."""
        matcher = tracked.stop_matcher
        if matcher is None:
            return False
        text = tracked.detok.text
        match = matcher.feed(text[matcher.consumed:])
        if match is None:
            return False
        include = tracked.request.sampling_params.include_stop_str_in_output
        end = match.start + len(match.stop) if include else match.start
        tracked.final_text = text[:end]
        tracked.stop_reason = match.stop
        self.scheduler.finish_request(tracked.request.request_id, FinishReason.STOP, now)
        return True

    def _visible_text(self, tracked: _Tracked) -> str:
        if tracked.final_text is not None:
            return tracked.final_text
        text = tracked.detok.text
        matcher = tracked.stop_matcher
        if matcher is not None and not tracked.request.is_finished:
            # Hold back exactly the tail that could still grow into a stop string (and anything
            # not yet matched), so a stream never shows a stop string or a part of one.
            hold = matcher.pending + (len(text) - matcher.consumed)
            text = text[: max(tracked.sent_text_len, len(text) - hold)]
        return text

    def _emit(self, tracked: _Tracked, error: Optional[str] = None) -> RequestOutput:
        """What is new since the request's previous output: O(new tokens), never a copy of it all."""
        request = tracked.request
        if request.is_finished:
            tracked.detok.flush()  # a generation may end inside a multi-byte character
        text = self._visible_text(tracked)
        tokens = request.output_token_ids
        new_logprobs = tracked.logprobs
        if new_logprobs is not None:
            tracked.logprobs = []  # handed over: the engine keeps only what it has not emitted
        out = RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            delta_text=text[tracked.sent_text_len:],
            delta_token_ids=tokens[tracked.sent_token_len:],
            delta_logprobs=new_logprobs,
            num_output_tokens=len(tokens),
            finished=request.is_finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            num_cached_tokens=request.num_cached_tokens,
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=request.first_token_time,
                finished_time=request.finished_time,
                num_preemptions=request.num_preemptions,
            ),
            stop_reason=tracked.stop_reason,
            error=error,
        )
        tracked.sent_text_len = len(text)
        tracked.sent_token_len = len(tokens)
        if request.is_finished:
            self._forget(request)
        return out

    def _forget(self, request: Request) -> None:
        """A request ended here (finished, aborted or migrated away): drop its state."""
        self._tracked.pop(request.request_id, None)
        self._ended[request.request_id] = "finished" if request.is_finished else "moved"
        if len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        self.runner.release(request.request_id)
        if request.lora is not None:
            self.loras.release(request.lora)
