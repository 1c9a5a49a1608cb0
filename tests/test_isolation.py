"""One request's failure in the engine never fails its batch neighbours.

The bad request is built and validated like any other, then its parameters are corrupted
before it reaches the engine, so it fails for real inside the model step (in the runner or
the sampler); nothing is mocked. Its neighbours must produce exactly the tokens they produce
without it, it must end alone with an error, and every KV block must be free afterwards.
"""
from __future__ import annotations

import asyncio

import pytest

from sloserve import SamplingParams
from sloserve.engine.async_engine import AsyncLLMEngine, RequestFailedError
from sloserve.engine.outputs import CompletedOutput, OutputAccumulator

pytestmark = pytest.mark.slow

GOOD = ["The capital of France is", "def add(a, b):", "Once upon a time, in a small village by the sea,"]
BAD_PROMPT = "Tell me about the weather today."
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _corrupt_seed(params: SamplingParams) -> None:
    params.seed = "not a seed"  # the runner seeds the request's generator with it


def _corrupt_stop_token(params: SamplingParams) -> None:
    params.min_tokens = 4
    params.stop_token_ids = ["</s>"]  # the sampler masks stop ids until min_tokens: not an int


CORRUPTIONS = {"runner-seed": _corrupt_seed, "sampler-stop-token": _corrupt_stop_token}


def _bad_request(engine, corrupt, request_id: str):
    request = engine.make_request(BAD_PROMPT, SamplingParams(max_tokens=10, temperature=0.7, seed=1),
                                  request_id=request_id)
    corrupt(request.sampling_params)
    return request


def _drain(engine, folds: dict[str, OutputAccumulator]) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            folds.setdefault(out.request_id, OutputAccumulator()).add(out)


def _assert_pool_free(engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_used == 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_invariants()


@pytest.fixture(scope="module")
def alone(llm) -> list[CompletedOutput]:
    return llm.generate(GOOD, GREEDY)


# Failing in the same step as its neighbours' prefills, and joining while they decode.
@pytest.mark.parametrize("corruption, joins_after_steps", [("runner-seed", 0), ("sampler-stop-token", 3)])
def test_a_failing_request_fails_alone(llm, alone, corruption, joins_after_steps):
    engine = llm.engine
    folds: dict[str, OutputAccumulator] = {}
    good = [engine.make_request(p, GREEDY, request_id=f"good-{i}-{corruption}-{joins_after_steps}")
            for i, p in enumerate(GOOD)]
    for request in good:
        engine.add(request)
    for _ in range(joins_after_steps):  # the bad one arrives while its neighbours decode
        for out in engine.step():
            folds.setdefault(out.request_id, OutputAccumulator()).add(out)
    bad = _bad_request(engine, CORRUPTIONS[corruption], f"bad-{corruption}-{joins_after_steps}")
    engine.add(bad)
    _drain(engine, folds)

    for request, want in zip(good, alone):
        got = folds[request.request_id].completed()
        assert got.error is None and got.finish_reason == "length"
        assert got.token_ids == want.token_ids and got.text == want.text
    failed = folds[bad.request_id].completed()
    assert failed.finished and failed.finish_reason == "abort"
    assert failed.error and "Error" in failed.error
    assert failed.token_ids == []
    _assert_pool_free(engine)


def test_a_step_of_one_failing_request_fails_that_request_only(llm):
    engine = llm.engine
    request = _bad_request(engine, _corrupt_stop_token, "bad-alone")
    engine.add(request)
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outputs] == [("bad-alone", True, "abort")]
    assert outputs[0].error and "TypeError" in outputs[0].error
    assert not engine.has_unfinished_requests()
    _assert_pool_free(engine)


def test_every_request_of_a_batch_failing_is_an_engine_fault(llm):
    engine = llm.engine
    requests = [_bad_request(engine, _corrupt_stop_token, f"bad-{i}") for i in range(2)]
    for request in requests:
        engine.add(request)
    with pytest.raises(TypeError):
        engine.step()
    for request in requests:
        engine.abort_request(request.request_id)  # what the async loop's catch-all does
    _assert_pool_free(engine)


def test_extreme_seeds_and_top_k_do_not_raise(llm):
    """Choice j of n runs with seed + j, past the validated 64-bit range; a top_k past int64."""
    engine = llm.engine
    requests = []
    for i, seed in enumerate([2**63 - 1 + 63, -(2**63), 2**70]):
        request = engine.make_request(BAD_PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=0),
                                      request_id=f"seed-{i}")
        request.sampling_params.seed = seed
        requests.append(request)
    huge_k = engine.make_request(BAD_PROMPT, SamplingParams(max_tokens=3, temperature=1.0), request_id="top-k")
    huge_k.sampling_params.top_k = 2**70
    requests.append(huge_k)
    folds: dict[str, OutputAccumulator] = {}
    for request in requests:
        engine.add(request)
    _drain(engine, folds)
    for request in requests:
        out = folds[request.request_id].completed()
        assert out.error is None and out.finish_reason in ("length", "stop") and out.token_ids
    _assert_pool_free(engine)


def test_only_the_bad_stream_raises(llm, alone):
    aengine = AsyncLLMEngine(llm.engine)

    async def consume(stream) -> CompletedOutput:
        fold = OutputAccumulator()
        async for out in stream:
            fold.add(out)
        return fold.completed()

    async def main():
        good = [aengine.add_request(p, GREEDY, request_id=f"async-good-{i}") for i, p in enumerate(GOOD)]
        params = SamplingParams(max_tokens=10, temperature=0, min_tokens=8)
        bad = aengine.add_request(BAD_PROMPT, params, request_id="async-bad")
        # Corrupted after validation, as a bug upstream would: whichever step first reads it fails.
        params.stop_token_ids = ["</s>"]
        return await asyncio.gather(*(consume(s) for s in good), consume(bad), return_exceptions=True)

    try:
        *outs, failure = asyncio.run(main())
        assert aengine.num_in_flight == 0 and aengine.is_alive
    finally:
        aengine.shutdown()
    for got, want in zip(outs, alone):
        assert isinstance(got, CompletedOutput), got
        assert got.token_ids == want.token_ids and got.text == want.text
    assert isinstance(failure, RequestFailedError) and "async-bad" in str(failure)
    _assert_pool_free(llm.engine)
