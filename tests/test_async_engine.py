"""The asyncio engine API a server uses: add, stream, abort — against the real model."""
from __future__ import annotations

import asyncio

import pytest

from sloserve import SamplingParams
from sloserve.engine.async_engine import AsyncLLMEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def aengine(llm):
    engine = AsyncLLMEngine(llm.engine)
    yield engine
    engine.shutdown()


def test_streams_match_offline_and_batch(aengine, llm):
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    params = SamplingParams(max_tokens=16, temperature=0)
    expected = llm.generate(prompts, params)
    steps_before = llm.engine.scheduler.stats.num_steps

    async def consume(prompt):
        deltas, tokens, last = [], [], None
        async for out in aengine.generate(prompt, params):
            deltas.append(out.delta_text)
            tokens.extend(out.delta_token_ids)
            last = out
        return "".join(deltas), tokens, last

    async def main():
        return await asyncio.gather(*(consume(p) for p in prompts))

    results = asyncio.run(main())
    for (text, tokens, last), want in zip(results, expected):
        assert tokens == want.token_ids and last.num_output_tokens == len(want.token_ids)
        assert text == want.text and last.finished
    stats = llm.engine.scheduler.stats
    assert stats.num_steps - steps_before < 3 * 16  # the three streams shared steps
    assert aengine.num_in_flight == 0


def test_abort_and_client_disconnect_free_blocks(aengine, llm):
    async def main():
        stream = aengine.add_request("Tell me a long story about dragons.", SamplingParams(max_tokens=500, ignore_eos=True))
        got = 0
        async for out in stream:
            got += len(out.delta_token_ids)
            if got >= 3:
                break  # the consumer walks away without finishing
        stream.abort()

        async def slow_client():
            async for _ in aengine.generate("Count to a thousand:", SamplingParams(max_tokens=500, ignore_eos=True)):
                await asyncio.sleep(0)

        task = asyncio.create_task(slow_client())
        await asyncio.sleep(0.5)
        task.cancel()  # what a dropped HTTP connection looks like
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # freed within a step or two
            if not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)

    asyncio.run(main())
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_used == 0


def test_bad_input_raises_in_the_caller_and_engine_keeps_serving(aengine):
    async def main():
        with pytest.raises(ValueError):
            aengine.add_request("", SamplingParams())
        with pytest.raises(ValueError):
            SamplingParams(temperature=-1)
        outs = [o async for o in aengine.generate("Hello", SamplingParams(max_tokens=4, temperature=0))]
        return outs[-1]

    last = asyncio.run(main())
    assert last.finished and last.num_output_tokens >= 1


def test_liveness_follows_the_loop_thread(llm):
    engine = AsyncLLMEngine(llm.engine)
    assert engine.is_alive
    engine.shutdown()
    assert not engine.is_alive


def test_a_factory_builds_the_engine_on_the_engine_thread_and_its_errors_reach_the_caller(tmp_path):
    """Servers load and step on one thread (one OpenMP pool: a second, idle pool beside the
    stepping thread's slowed every parallel region by half); a load that fails raises here."""
    import threading

    from engine_helpers import EXACT

    from sloserve.core.config import CacheConfig, EngineConfig
    from sloserve.engine.llm_engine import LLMEngine

    built_on = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return LLMEngine(EngineConfig(**EXACT, num_threads=1, cache=CacheConfig(num_blocks=64)))

    engine = AsyncLLMEngine(build)
    try:
        assert built_on == ["sloserve-engine"] and engine.is_alive

        async def one():
            return [out async for out in engine.generate("Hello", SamplingParams(max_tokens=3, temperature=0))]

        assert sum(len(o.delta_token_ids) for o in asyncio.run(one())) == 3
    finally:
        engine.shutdown()
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        AsyncLLMEngine(lambda: LLMEngine(EngineConfig(model=str(tmp_path / "missing.gguf"))))
