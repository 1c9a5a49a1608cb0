"""The CUDA code path, run where a GPU exists (CI and the developers' machines have none, so
these skip there; `benchmarks/BENCHMARKS.md` says when they last ran on one and what they saw).

A tiny random-weight Llama checkpoint keeps them fast and free of downloads: our forward on
the GPU must give transformers' greedy tokens, swapping KV through pinned host memory must not
change them, and seeded sampling must be reproducible on the device generator."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import transformers

    from test_hf_models import build
    from test_weights import save_tiny_tokenizer

    directory = tmp_path_factory.mktemp("tiny-llama-cuda")
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(build("llama")).eval()
    model.save_pretrained(directory, safe_serialization=True)
    save_tiny_tokenizer(directory)
    return directory, model.to("cuda")


def _prompts() -> list[list[int]]:
    from test_weights import TINY_VOCAB

    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (5, 23, 40, 64, 9)]


def _reference(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_fp32_on_cuda_matches_transformers(tiny_llama):
    from sloserve import LLM, SamplingParams

    directory, model = tiny_llama
    llm = LLM(model=str(directory), device="cuda", dtype="float32", max_num_batched_tokens=8, num_blocks=128,
              block_size=4)
    assert llm.engine.device.type == "cuda" and llm.engine.kv_cache.data.device.type == "cuda"
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(_prompts(), outs):
        assert out.token_ids == _reference(model, prompt), len(prompt)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks  # cached blocks stay evictable (free)


def test_swap_preemption_on_cuda_keeps_greedy_output(tiny_llama):
    from sloserve import SamplingParams
    from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig
    from sloserve.engine.llm_engine import LLMEngine

    directory, _ = tiny_llama
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    def run(num_blocks: int, mode: str) -> tuple[list[list[int]], int]:
        engine = LLMEngine(EngineConfig(
            model=str(directory), device="cuda", dtype="float32",
            cache=CacheConfig(block_size=4, num_blocks=num_blocks, num_host_blocks=256, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, preemption_mode=mode)))
        ids = [engine.add_request(p, params) for p in _prompts()]
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.delta_token_ids)
        assert engine.kv.num_free_blocks == num_blocks
        assert engine.kv.num_free_host_blocks == (0 if mode == "recompute" else 256)
        return [done[i] for i in ids], engine.scheduler.stats.num_swaps_out

    roomy, _ = run(256, "recompute")
    tight, swaps = run(40, "swap")  # 5 prompts of up to 76 tokens cannot all fit in 40 x 4 slots
    assert tight == roomy
    assert swaps > 0


def test_seeded_sampling_is_reproducible_on_cuda(tiny_llama):
    from sloserve import LLM, SamplingParams

    directory, _ = tiny_llama
    llm = LLM(model=str(directory), device="cuda", max_num_batched_tokens=64, num_blocks=128, block_size=4)
    assert llm.engine.dtype == torch.bfloat16  # auto = bf16 on CUDA
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=20, seed=7 + i, ignore_eos=True)
              for i in range(len(_prompts()))]
    first = [o.token_ids for o in llm.generate(_prompts(), params)]
    again = [o.token_ids for o in llm.generate(_prompts(), params)]
    assert first == again
    assert len({tuple(t) for t in first}) > 1  # different seeds and prompts give different samples


def test_a_request_failing_on_cuda_fails_alone(tiny_llama):
    """The isolation re-run (one request at a time, KV ops not repeated, seeded generators
    restored) on the device: the neighbours keep their exact greedy tokens."""
    from sloserve import LLM, SamplingParams
    from sloserve.engine.outputs import OutputAccumulator

    directory, model = tiny_llama
    llm = LLM(model=str(directory), device="cuda", dtype="float32", max_num_batched_tokens=64, num_blocks=128,
              block_size=4)
    engine = llm.engine
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    good = [engine.make_request(p, greedy, request_id=f"good-{i}") for i, p in enumerate(_prompts())]
    bad = engine.make_request(_prompts()[0], SamplingParams(max_tokens=4, temperature=0.7, seed=1), request_id="bad")
    bad.sampling_params.seed = "not a seed"  # validated, then corrupted: fails for real in the runner
    for request in [*good, bad]:
        engine.add(request)
    folds: dict[str, OutputAccumulator] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            folds.setdefault(out.request_id, OutputAccumulator()).add(out)
    for request, prompt in zip(good, _prompts()):
        assert folds[request.request_id].completed().token_ids == _reference(model, prompt)
    failed = folds["bad"].completed()
    assert failed.finish_reason == "abort" and failed.error and failed.token_ids == []
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
