"""The real engine on the embedded model: equality with transformers, batching invariance,
prefix caching, preemption, and bad input. Greedy decoding in float32 throughout."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import EXACT
from sloserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning "
    "walked down to the harbour before sunrise. One day he found",
    "Explain, step by step, why the sky appears blue during the day and red at sunset. Start with what "
    "sunlight is made of, then describe how molecules in the atmosphere scatter light of different "
    "wavelengths, and finish with why the path length through the atmosphere changes at sunset. " * 3,
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def reference_tokens(llm, hf_reference):
    """transformers' greedy continuation of each prompt, generated one prompt at a time."""
    out = []
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        with torch.inference_mode():
            gen = hf_reference.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=2,
            )
        out.append(gen[0, len(ids):].tolist())
    return out


def test_greedy_matches_transformers(llm, reference_tokens):
    lengths = {len(llm.tokenizer.encode(p)) for p in PROMPTS}
    assert len(lengths) == 5 and max(lengths) > 150
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out, ref in zip(PROMPTS, outs, reference_tokens):
        assert out.token_ids == ref, prompt[:30]
        assert out.text == llm.tokenizer.decode(ref)


def test_alone_batched_chunked_and_cached_give_identical_tokens(llm, reference_tokens):
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
    assert alone == reference_tokens

    chunked = LLM(max_num_batched_tokens=32, enable_prefix_caching=True, **EXACT)
    first = chunked.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in first] == reference_tokens
    assert chunked.engine.scheduler.stats.max_batch_size > 1
    hits_before = chunked.engine.kv.stats.hits
    warm = chunked.generate(PROMPTS, GREEDY)  # the prompts' blocks are now cached
    assert [o.token_ids for o in warm] == reference_tokens
    assert chunked.engine.kv.stats.hits > hits_before
    assert max(o.num_cached_tokens for o in warm) >= 128
    assert chunked.engine.kv.num_free_blocks == chunked.engine.kv.num_blocks


def test_too_small_kv_pool_preempts_and_still_matches(reference_tokens):
    # 14 blocks x 16 = 224 tokens: the longest request fits alone, not beside the others.
    small = LLM(num_blocks=14, max_num_batched_tokens=64, **EXACT)
    outs = small.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference_tokens
    assert small.engine.scheduler.stats.num_preemptions > 0
    assert small.engine.kv.pool.num_used == 0
    small.engine.kv.check_invariants()


def test_token_id_prompts_and_result_order(llm):
    ids = llm.tokenizer.encode(PROMPTS[1])
    by_ids = llm.generate(ids, GREEDY)
    by_text = llm.generate(PROMPTS[1], GREEDY)
    assert len(by_ids) == 1 and by_ids[0].token_ids == by_text[0].token_ids
    outs = llm.generate([PROMPTS[0], ids, PROMPTS[2]], GREEDY)
    assert outs[1].prompt_token_ids == ids
    assert [o.finish_reason for o in outs] == [by_text[0].finish_reason] * 0 + [o.finish_reason for o in outs]
    assert all(o.finish_reason in ("stop", "length") for o in outs)


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)[0]
    assert "Paris" in out.text
    expected = llm.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert out.prompt_token_ids == expected
    assert llm.tokenizer.decode(expected[:3], skip_special_tokens=False).startswith("<|im_start|>system")


def test_sampling_controls_end_to_end(llm):
    p = PROMPTS[3]
    base = llm.generate(p, SamplingParams(max_tokens=24, temperature=0))[0]
    # stop string: cut before it, reason recorded
    word = base.text.split()[3]
    stopped = llm.generate(p, SamplingParams(max_tokens=24, temperature=0, stop=[word]))[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
    assert word not in stopped.text and base.text.startswith(stopped.text)
    # stop token id
    tok = base.token_ids[5]
    by_id = llm.generate(p, SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[tok]))[0]
    assert by_id.token_ids == base.token_ids[: base.token_ids.index(tok) + 1] and by_id.stop_reason == tok
    # max_tokens and ignore_eos
    short = llm.generate(p, SamplingParams(max_tokens=3, temperature=0))[0]
    assert short.token_ids == base.token_ids[:3] and short.finish_reason == "length"
    # seeded sampling reproduces regardless of batch neighbours
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    a = llm.generate([p], seeded)[0]
    b = llm.generate([PROMPTS[0], p, PROMPTS[2]], [GREEDY, seeded, seeded.__class__(max_tokens=8, seed=7)])[1]
    assert a.token_ids == b.token_ids
    # logprobs of the sampled token and top-N
    lp = llm.generate(p, SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0]
    assert len(lp.logprobs) == 5
    for entry, tid in zip(lp.logprobs, lp.token_ids):
        assert entry.token_id == tid and entry.logprob <= 0
        assert len(entry.top) == 3 and entry.top[0][0] == tid  # greedy picks the most likely
        assert entry.top[0][1] == pytest.approx(entry.logprob)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", None, "empty"),
        ([], None, "prompt"),
        ("hello " * 9000, None, "context window"),
        ([49152], None, "token ids"),
        ("hi", dict(max_tokens=0), "max_tokens"),
        ("hi", dict(max_tokens=-3), "max_tokens"),
        ("hi", dict(max_tokens=9000), "context window"),
        ("hi", dict(temperature=-0.5), "temperature"),
        ("hi", dict(top_p=0.0), "top_p"),
        ("hi", dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_input_is_rejected_before_any_work(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, SamplingParams(**params) if params else None)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_used == 0


def test_one_bad_prompt_fails_the_batch_before_any_work_and_engine_still_serves(llm):
    steps_before = llm.engine.scheduler.stats.num_steps
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], ""], GREEDY)
    assert llm.engine.scheduler.stats.num_steps == steps_before
    assert llm.generate(PROMPTS[1], GREEDY)[0].text.strip().startswith("Paris")


def test_missing_and_corrupt_models(tmp_path):
    with pytest.raises(FileNotFoundError):
        LLM(model=str(tmp_path / "nope.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(ValueError):
        LLM(model=str(bad))


def test_attention_kernel_names_are_checked_before_the_model_loads():
    from sloserve.engine.kernels import attention_kernels

    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        LLM(attention_kernel="fast")
    missing = [k for k in ("amx", "avx512_bf16") if k not in attention_kernels()]
    for name in missing:  # this CPU (or a failed build) lacks it: refused with what there is
        with pytest.raises(ValueError, match=f"attention kernel '{name}' is not available on this machine"):
            LLM(attention_kernel=name)


def test_portable_attention_path_gives_the_same_tokens(reference_tokens):
    portable = LLM(native_kernels=False, max_num_batched_tokens=64, **EXACT)
    assert portable.engine.model.decode_attention is None
    outs = portable.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference_tokens


def test_step_trace_records_every_step_with_its_load(tmp_path, reference_tokens):
    from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig
    from sloserve.engine.step_trace import read_step_trace

    path = tmp_path / "steps.jsonl"
    config = EngineConfig(**EXACT, step_trace=str(path), cache=CacheConfig(enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    traced = LLM(config=config)
    outs = traced.generate(PROMPTS, GREEDY)
    traced.engine.close()
    assert [o.token_ids for o in outs] == reference_tokens  # tracing changes nothing
    steps = list(read_step_trace(path))
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(o.token_ids) for o in outs)
    # every computed token is in exactly one step: prompts, then each output but the last fed back
    assert sum(s.load.num_tokens for s in steps) == prompt_tokens + output_tokens - len(outs)
    assert sum(s.load.num_sampled for s in steps) == output_tokens
    assert all(s.load.num_tokens <= 64 for s in steps)
    assert all(min(s.schedule_s, s.execute_s, s.process_s) >= 0 for s in steps)
    assert all(a.end_s <= b.start_s for a, b in zip(steps, steps[1:]))  # in order, not overlapping


def test_unset_thread_count_follows_omp_num_threads(monkeypatch):
    """A process told its share of the cores (OMP_NUM_THREADS) keeps to it; without it, all its cores."""
    from sloserve.engine.llm_engine import available_cores, default_num_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert default_num_threads() == available_cores()
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_num_threads() == available_cores()
