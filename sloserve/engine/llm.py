"""The offline API: `LLM().generate(prompts, params)` and `LLM().chat(messages)`."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence, Union

from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig
from sloserve.engine.llm_engine import LLMEngine, Prompt
from sloserve.engine.outputs import CompletedOutput, OutputAccumulator
from sloserve.core.types import SamplingParams

Messages = list[dict]


class LLM:
    """Batch generation on one engine. With no `model`, the embedded SmolLM2-135M-Instruct."""

    def __init__(
        self,
        model: Optional[str] = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        quantization: str = "auto",
        seed: int = 0,
        max_model_len: Optional[int] = None,
        num_threads: Optional[int] = None,
        block_size: int = 16,
        num_blocks: Optional[int] = None,
        kv_cache_gib: float = 1.0,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        scheduling_policy: str = "fcfs",
        speculative: str = "off",
        num_speculative_tokens: int = 4,
        native_kernels: bool = True,
        attention_kernel: str = "auto",
        lora_modules: Optional[dict[str, str]] = None,
        max_loras: int = 4,
        config: Optional[EngineConfig] = None,
    ):
        """`lora_modules`: adapter name -> PEFT directory (engine/lora.py); `generate(..., lora=NAME)` uses one."""
        if config is None:
            config = EngineConfig(
                model=model, dtype=dtype, device=device, quantization=quantization, seed=seed, max_model_len=max_model_len,
                num_threads=num_threads, native_kernels=native_kernels, attention_kernel=attention_kernel,
                lora_modules=tuple((lora_modules or {}).items()), max_loras=max_loras,
                cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_cache_gib=kv_cache_gib,
                                  enable_prefix_caching=enable_prefix_caching),
                scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                          enable_chunked_prefill=enable_chunked_prefill,
                                          long_prefill_token_threshold=long_prefill_token_threshold,
                                          policy=scheduling_policy, speculative=speculative,
                                          num_speculative_tokens=num_speculative_tokens),
            )
        elif model is not None:
            config = replace(config, model=model)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        progress: bool = False,
        lora: Union[None, str, Sequence[Optional[str]]] = None,
    ) -> list[CompletedOutput]:
        """One finished output per prompt, in order. Every prompt is validated before any runs.
        `lora`: the adapter every prompt runs with, or one per prompt (None: the base model).

        A request the engine failed alone ends with `finish_reason` "abort" and its `error` set."""
        prompt_list = _as_prompt_list(prompts)
        param_list = _per_prompt(params, len(prompt_list), "SamplingParams", SamplingParams) or \
            [SamplingParams()] * len(prompt_list)
        lora_list = _per_prompt(lora, len(prompt_list), "adapters", str) or [None] * len(prompt_list)
        requests = [self.engine.make_request(p, sp, lora=a) for p, sp, a in zip(prompt_list, param_list, lora_list)]
        return self._run(requests, progress)

    def chat(
        self,
        messages: Union[Messages, Sequence[Messages]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        progress: bool = False,
    ) -> list[CompletedOutput]:
        """Apply the model's chat template and generate; one output per conversation."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.tokenize_chat(list(c)) for c in conversations]
        return self.generate(prompts, params, progress)

    def _run(self, requests, progress: bool) -> list[CompletedOutput]:
        for request in requests:
            self.engine.add(request)
        order = {r.request_id: i for i, r in enumerate(requests)}
        folds = [OutputAccumulator() for _ in requests]
        bar = _progress(len(requests)) if progress else None
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    i = order.get(out.request_id)
                    if i is None:
                        continue
                    folds[i].add(out)
                    if out.finished and bar:
                        bar[0].advance(bar[1])
        except BaseException:
            for request in requests:  # leave no request (and no KV block) behind
                self.engine.abort_request(request.request_id)
            raise
        finally:
            if bar:
                bar[0].stop()
        return [f.completed() for f in folds]


def _per_prompt(value, n: int, what: str, single: type) -> Optional[list]:
    """One value for every prompt, or a sequence of n; None stays None."""
    if value is None or isinstance(value, single):
        return None if value is None else [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{n} prompts but {len(values)} {what}")
    return values


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("no prompts given")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt of token ids
        return list(prompts)
    raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}")


def _progress(total: int):
    from rich.progress import Progress

    bar = Progress(transient=True)
    task = bar.add_task("generating", total=total)
    bar.start()
    return bar, task
