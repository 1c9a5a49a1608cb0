"""Structured outputs (engine/structured.py): the embedded model at its default precision generates
only what a JSON schema, a regex, a choice list or a grammar allows, greedy or sampled, alone or
beside unconstrained requests (whose tokens do not change), through preemption and a migration to
another engine; the OpenAI server takes response_format and vLLM's guided_* / structured_outputs
fields through the official client, streamed or not, and refuses a constraint it cannot compile
with a 400 naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sloserve.core.config import EngineConfig
from sloserve.engine.llm import LLM
from sloserve.engine.llm_engine import LLMEngine
from sloserve.engine.outputs import OutputAccumulator
from sloserve.engine.structured import StructuredOutputError, choice_grammar
from sloserve.core.types import SamplingParams, StructuredOutput

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                          "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                   "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
# An ask the model answers with a short object under json_object (asked for "a person", it nests objects past any
# max_tokens on some machines: the constraint holds, but the object never closes)
ASK_OBJECT = [{"role": "user", "content": 'Write a JSON object with the key "name" set to "Ann".'}]
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the embedded model's id


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def person(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=120, structured=StructuredOutput("json", json.dumps(PERSON)), **kw)


def test_every_kind_of_constraint_holds_greedy_and_sampled(llm):
    for params in (person(temperature=0), person(temperature=1.0, seed=7)):
        out = llm.chat(ASK, params)[0]
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    out = llm.chat(ASK_OBJECT, SamplingParams(max_tokens=200, temperature=0.7, seed=2,
                                              structured=StructuredOutput("json_object")))[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)
    phone = llm.generate("Call me at", SamplingParams(max_tokens=20, temperature=1.0, seed=3,
                                                     structured=StructuredOutput("regex", r"\d{3}-\d{4}")))[0]
    assert re.fullmatch(r"\d{3}-\d{4}", phone.text) and phone.finish_reason == "stop"
    choices = ("red", "green", "blue \"quoted\"")
    picked = llm.generate("My favourite colour is", SamplingParams(
        max_tokens=10, temperature=1.0, seed=5, structured=StructuredOutput("choice", choices)))[0]
    assert picked.text in choices
    grammar = 'root ::= "(" digit ("," digit)? ("," digit)? ")"\ndigit ::= [0-9]'
    tup = llm.generate("A tuple:", SamplingParams(max_tokens=30, temperature=0,
                                                  structured=StructuredOutput("grammar", grammar)))[0]
    assert re.fullmatch(r"\(\d(,\d){0,2}\)", tup.text) and tup.finish_reason == "stop", tup.text
    assert choice_grammar(["a\"b"]) == 'root ::= "a\\"b"'


def run_together(engine: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> list:
    """The requests added at once and stepped to the end: their completed outputs, in order."""
    folds = {engine.add_request(p, sp): OutputAccumulator() for p, sp in zip(prompts, params)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            folds[out.request_id].add(out)
    return [f.completed() for f in folds.values()]


def test_a_constrained_request_leaves_its_batch_neighbours_unchanged(llm):
    """The same batch twice, once with its middle request constrained: every other request's
    greedy tokens are the same."""
    prompts = [f"Tell me about the number {i}." for i in range(6)]
    prompts.insert(3, ASK[0]["content"])
    plain = SamplingParams(max_tokens=24, temperature=0)
    free = run_together(llm.engine, prompts, [plain] * 7)
    mixed = run_together(llm.engine, prompts, [plain] * 3 + [person(temperature=0)] + [plain] * 3)
    assert [o.token_ids for i, o in enumerate(mixed) if i != 3] == [o.token_ids for i, o in enumerate(free) if i != 3]
    jsonschema.validate(json.loads(mixed[3].text), PERSON)
    assert llm.engine.kv.pool.num_used == 0


def test_the_constraint_survives_preemption_and_a_migration():
    # 10 blocks of 16 tokens: four requests of ~100 tokens each cannot all stay resident
    small = LLM(num_blocks=10, max_num_batched_tokens=64)
    outs = small.generate(["Describe a person as JSON:"] * 4, person(temperature=1.0, seed=11))
    assert small.engine.scheduler.stats.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.text), PERSON)
    assert small.engine.kv.pool.num_used == 0
    # moved mid-output to an engine that never saw it: its matcher is rebuilt from the tokens
    from test_migration_engine import _run, _step, move

    a, b = LLMEngine(EngineConfig()), LLMEngine(EngineConfig())
    params = person(temperature=1.0, seed=4)
    fold = OutputAccumulator()
    a.add_request("Describe a person as JSON:", params, request_id="m")
    for _ in range(9):
        _step(a, fold)
    move(a, b, "m", params, fold, prompt="Describe a person as JSON:")
    text = _run(b, fold).text
    jsonschema.validate(json.loads(text), PERSON)


def test_constraints_that_cannot_hold_are_refused_before_any_work(llm):
    for bad, match in [(StructuredOutput("regex", "(unclosed"), "regex constraint does not compile"),
                       (StructuredOutput("json", "{not json"), "not valid JSON"),
                       (StructuredOutput("grammar", "root ::= undefined_rule"), "grammar constraint does not compile")]:
        with pytest.raises(StructuredOutputError, match=match):
            llm.generate("x", SamplingParams(structured=bad))
    for bad, match in [(dict(ignore_eos=True), "ignore_eos"), (dict(min_tokens=3), "min_tokens")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(structured=StructuredOutput("json_object"), **bad)
    with pytest.raises(ValueError, match="1 to 1024 non-empty strings"):
        SamplingParams(structured=StructuredOutput("choice", ()))
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.pool.num_used == 0


# ---- random schemas ------------------------------------------------------------------------------

def leaf() -> st.SearchStrategy[dict]:
    # bounded leaves (a "number" may have any count of digits: a complete output is not bounded)
    return st.sampled_from([{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "boolean"},
                            {"type": "string", "maxLength": 10}, {"enum": ["a", "b", "c"]}])


def schemas() -> st.SearchStrategy[dict]:
    def obj(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        props = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), children, min_size=1, max_size=3)
        return props.map(lambda p: {"type": "object", "properties": p, "required": sorted(p),
                                     "additionalProperties": False})

    def arr(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        return children.map(lambda c: {"type": "array", "items": c, "maxItems": 2})

    return st.recursive(leaf(), lambda children: st.one_of(obj(children), arr(children)), max_leaves=4).filter(
        lambda s: s.get("type") in ("object", "array"))


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas(), seed=st.integers(0, 2**16))
def test_random_schemas_give_outputs_that_validate(llm, schema, seed):
    params = SamplingParams(max_tokens=160, temperature=0.8, seed=seed,
                            structured=StructuredOutput("json", json.dumps(schema)))
    out = llm.generate("JSON:", params)[0]
    assert out.finish_reason == "stop", (schema, out.text)  # the schemas are small: 160 tokens hold any of them
    jsonschema.validate(json.loads(out.text), schema)


# ---- the OpenAI server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(default_server):
    import openai

    return openai.OpenAI(base_url=default_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_response_format_and_guided_fields_through_the_openai_client(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=0,
                                           response_format=fmt)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=0.9, seed=2,
                                            response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    obj = client.chat.completions.create(model=MODEL, messages=ASK_OBJECT, max_tokens=200, temperature=0.7, seed=2,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    regex = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", regex.choices[0].text)
    for body in ({"guided_choice": ["left", "right"]}, {"structured_outputs": {"choice": ["left", "right"]}}):
        picked = client.completions.create(model=MODEL, prompt="Turn", max_tokens=5, temperature=0, extra_body=body)
        assert picked.choices[0].text in ("left", "right")
    schema_as_dict = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=120, temperature=0,
                                               extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(schema_as_dict.choices[0].text), PERSON)


def test_a_constraint_the_server_cannot_hold_is_a_400_naming_its_field(client, default_server):
    import httpx
    import openai

    cases = [({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", "does not compile"),
             ({"extra_body": {"guided_grammar": "root ::= nothing_defined"}}, "guided_grammar", "does not compile"),
             ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice", "one constraint per call"),
             ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs",
              "exactly one"),
             ({"extra_body": {"guided_choice": []}}, "guided_choice", "1 to 1024"),
             ({"extra_body": {"guided_regex": "a", "ignore_eos": True}}, "ignore_eos", "ignore_eos")]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, **kwargs)
        error = info.value.body
        assert error["param"] == param and words in error["message"], (kwargs, error)
    for fmt, words in [({"type": "xml"}, "json_object or json_schema"),
                       ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, response_format=fmt)
        assert info.value.body["param"] == "response_format" and words in info.value.body["message"]
    # nothing leaked: the server still answers, with every KV block free
    ok = client.completions.create(model=MODEL, prompt="Turn", max_tokens=3, temperature=0,
                                   extra_body={"guided_choice": ["left", "right"]})
    assert ok.choices[0].text in ("left", "right")
    metrics = httpx.get(default_server.base_url + "/metrics", timeout=30).text
    usage = [line for line in metrics.splitlines() if line.startswith("sloserve:kv_cache_usage_perc")]
    assert usage and all(float(line.split()[-1]) == 0 for line in usage), usage


def test_speculation_verifies_drafts_against_the_constraint():
    """Prompt-lookup drafts copy spans of the prompt, which the schema may or may not allow next:
    every verified position is masked by the constraint after the drafts before it, so the greedy
    output is the one generated without speculation, and drafts that fit are accepted."""
    from sloserve.core.config import SchedulerConfig

    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 30}, "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}
    prompt = 'Copy this JSON exactly: {"a": "hello world hello world", "b": 12345}\nJSON:'
    params = SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutput("json", json.dumps(schema)))
    outs = {}
    for mode in ("off", "prompt-lookup"):
        engine = LLMEngine(EngineConfig(scheduler=SchedulerConfig(speculative=mode, num_speculative_tokens=4)))
        outs[mode] = run_together(engine, [prompt], [params])[0]
        if mode != "off":
            stats = engine.scheduler.speculator.stats
            assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    assert outs["prompt-lookup"].token_ids == outs["off"].token_ids
    jsonschema.validate(json.loads(outs["off"].text), schema)


def test_forced_tool_calls_parse_and_hold_their_parameter_schemas(llm):
    """tool_choice "required" / a named function, as the API will force them: the output is one
    or more calls in the hermes format, each to a declared function with valid arguments."""
    from sloserve.server.tool_parsers import make_tool_parser

    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}
    clock = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"],
             "additionalProperties": False}
    functions = [{"name": "get_weather", "parameters": weather}, {"name": "get_time", "parameters": clock}]
    hermes = make_tool_parser("hermes")
    ask = [{"role": "user", "content": "What is the weather in Paris for the next 3 days, and the time in Berlin?"}]
    for spec, names, most in [({"functions": functions[:1]}, {"get_weather"}, 1),
                              ({"functions": functions, "parallel": True}, {"get_weather", "get_time"}, 4)]:
        constraint = StructuredOutput("tool_calls", json.dumps(spec))
        for params in (SamplingParams(max_tokens=240, temperature=0, structured=constraint),  # 4 calls fit
                       SamplingParams(max_tokens=240, temperature=0.9, seed=5, structured=constraint)):
            out = llm.chat(ask, params)[0]
            assert out.finish_reason == "stop", out.text
            parsed = hermes.parse(out.text)
            assert parsed.content is None and 1 <= len(parsed.calls) <= most, out.text
            for call in parsed.calls:
                assert call.name in names
                jsonschema.validate(json.loads(call.arguments), weather if call.name == "get_weather" else clock)
    for fmt in ("llama3_json", "mistral"):  # each family's format, read back by its own parser
        spec = {"functions": functions, "parallel": True, "format": fmt}
        out = llm.chat(ask, SamplingParams(max_tokens=240, temperature=0,
                                           structured=StructuredOutput("tool_calls", json.dumps(spec))))[0]
        parsed = make_tool_parser(fmt).parse(out.text)
        assert out.finish_reason == "stop" and parsed.content is None and parsed.calls, (fmt, out.text)
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), weather if call.name == "get_weather" else clock)
    with pytest.raises(StructuredOutputError, match="format must be one of"):
        llm.generate("x", SamplingParams(structured=StructuredOutput("tool_calls", json.dumps(
            {"functions": functions, "format": "nope"}))))


def test_the_native_mask_kernel_masks_as_xgramars_does():
    """engine/kernels' apply_token_bitmask_ against xgrammar's own, on some rows of a batch, a
    vocabulary that ends mid-word and rows whose words are all ones (skipped by the vector loop)."""
    import torch
    import xgrammar as xgr

    from sloserve.engine.kernels import load_fused_ops

    native = load_fused_ops()
    if native is None or not hasattr(native, "apply_token_bitmask_"):
        pytest.skip("no native kernels on this machine")
    gen = torch.Generator().manual_seed(0)
    for vocab, dtype in ((49_152, torch.float32), (1_000, torch.float32), (49_152, torch.bfloat16),
                         (1_000, torch.bfloat16)):
        logits = torch.randn(6, vocab + 7, generator=gen).to(dtype)
        bitmask = torch.randint(-2**31, 2**31 - 1, (6, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
        bitmask[2] = -1  # every token allowed
        rows = [0, 2, 3, 5]
        ours, theirs = logits.clone(), logits.clone()
        native.apply_token_bitmask_(ours, bitmask, torch.tensor(rows), vocab)
        xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=rows)
        assert torch.equal(ours, theirs)
        assert torch.equal(ours[1], logits[1]) and torch.equal(ours[2], logits[2])  # untouched and all-allowed rows
