"""Several models behind one front (`serve --model NAME=PATH --model NAME=PATH`, front/models.py):
the embedded SmolLM2 and a small random-weight Qwen2 (another architecture and tokenizer), each
its own worker, routed by the request's `model` through the official client."""
from __future__ import annotations

import httpx
import openai
import pytest

from engine_helpers import EXACT
from server_helpers import ServerProcess, scrape
from sloserve import LLM, SamplingParams
from sloserve.engine.weights import embedded_model_path
from sloserve.front.models import merge_metrics, parse_model_args
from test_weights import make_hf_dir

PROMPT = "The capital of France is"
KEY = "sk-models-test"
TOKENS = 6


def test_model_arguments_name_each_model_once():
    assert parse_model_args(["/m/a.gguf"]) == [("", "/m/a.gguf")]
    assert parse_model_args(["a=/m/a.gguf", "b=/m/b"]) == [("a", "/m/a.gguf"), ("b", "/m/b")]
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_model_args(["a=/m/a.gguf", "/m/b"])
    with pytest.raises(ValueError, match="given twice"):
        parse_model_args(["a=/x", "a=/y"])


def test_merged_metrics_label_each_sample_with_its_model():
    from prometheus_client.parser import text_string_to_metric_families

    text = ("# HELP sloserve:front_requests_total requests\n# TYPE sloserve:front_requests_total counter\n"
            'sloserve:front_requests_total{instance="0"} %d\n')
    merged = merge_metrics({"smol": text % 3, "tiny": text % 5}).decode()
    [family] = list(text_string_to_metric_families(merged))
    assert {(s.labels["model_name"], s.labels["instance"], s.value) for s in family.samples} == {
        ("smol", "0", 3.0), ("tiny", "0", 5.0)}
    assert merged.count("# TYPE") == 1  # one family, as Prometheus requires


@pytest.mark.slow
def test_two_models_behind_one_front_answer_as_each_alone(tmp_path):
    tiny_dir, _ = make_hf_dir(tmp_path, "qwen2", tied=False)
    smol_path = embedded_model_path()
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    want = {}
    for name, path in (("smol", smol_path), ("tiny", str(tiny_dir))):
        llm = LLM(model=path, **EXACT)
        want[name] = llm.tokenizer.decode(llm.generate([PROMPT], greedy)[0].token_ids)
    assert want["smol"] != want["tiny"]

    server = ServerProcess(["--model", f"smol={smol_path}", "--model", f"tiny={tiny_dir}", "--api-key", KEY],
                           tmp_path / "front.log")
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        api = openai.OpenAI(base_url=server.v1, api_key=KEY, max_retries=0)
        with pytest.raises(openai.AuthenticationError):  # refused before its body picks a model
            openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0).completions.create(
                model="tiny", prompt=PROMPT, max_tokens=2)
        assert {m.id for m in api.models.list().data} == {"smol", "tiny"}
        for name in ("smol", "tiny", "smol"):
            out = api.completions.create(model=name, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
            assert out.model == name and out.choices[0].text == want[name], (name, server.log()[-2000:])
            stream = api.completions.create(model=name, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in stream if c.choices) == want[name]
        chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "the"}],
                                           max_tokens=3, temperature=0)
        assert chat.model == "tiny" and chat.choices[0].finish_reason in ("length", "stop")

        with pytest.raises(openai.NotFoundError) as missing:
            api.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
        assert missing.value.body["code"] == "model_not_found" and "smol" in missing.value.body["message"]
        bad = httpx.post(server.v1 + "/completions", content=b"{not json", headers=auth, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["type"]  # the default model's front judges it

        per_model = httpx.get(server.base_url + "/models/tiny/v1/instances", headers=auth, timeout=10).json()
        assert per_model["counters"] and len(per_model["data"]) == 1
        elsewhere = httpx.get(server.base_url + "/v1/instances", timeout=10)
        assert elsewhere.status_code == 404 and "/models/" in elsewhere.json()["error"]["message"]
        health = httpx.get(server.base_url + "/health", timeout=10).json()
        assert set(health["models"]) == {"smol", "tiny"}

        text = httpx.get(server.base_url + "/metrics", timeout=10).text
        assert 'model_name="smol"' in text and 'model_name="tiny"' in text
        assert scrape(server.base_url)  # one exposition Prometheus parses
    finally:
        server.kill()


def test_a_models_file_gives_each_model_its_engine_options_and_fleet(tmp_path):
    from sloserve.cluster.spec import FleetSpec
    from sloserve.core.config import EngineConfig
    from sloserve.front.models import load_models_file

    path = tmp_path / "models.yaml"
    (tmp_path / "qos.yaml").write_text("classes:\n  interactive: {ttft_ms: 500, tbt_ms: 50, priority: 0}\n")
    path.write_text("models:\n"
                    "  smol: {path: embedded, dtype: bfloat16}\n"
                    "  tiny:\n    path: /models/tiny\n    quantization: none\n    qos_config: qos.yaml\n"
                    "    max_in_flight: 8\n    scaling_history: servegen:m-small\n"
                    "    fleet: {instances: '0:2', autoscale: reactive, capacity: 3, router: least-requests}\n")
    base_engine, base_spec = EngineConfig(dtype="float32", max_model_len=512), FleetSpec(instances=2)
    (smol_entry, tiny_entry), budget = load_models_file(str(path), base_engine, base_spec)
    smol, smol_engine, smol_spec = smol_entry.name, smol_entry.engine, smol_entry.spec
    tiny, tiny_engine, tiny_spec = tiny_entry.name, tiny_entry.engine, tiny_entry.spec
    assert budget is None and tiny_entry.qos_config == str(tmp_path / "qos.yaml") and tiny_entry.max_in_flight == 8
    assert smol_entry.qos_config is None and smol_entry.max_in_flight is None  # the command line's
    assert tiny_entry.scaling_history == "servegen:m-small" and smol_entry.scaling_history is None
    assert (smol, smol_engine.model, smol_engine.dtype, smol_engine.max_model_len) == ("smol", None, "bfloat16", 512)
    assert smol_spec == base_spec  # the command line's fleet
    assert (tiny, tiny_engine.model, tiny_engine.dtype, tiny_engine.quantization) == \
        ("tiny", "/models/tiny", "float32", "none")
    assert (tiny_spec.instances, tiny_spec.fewest, tiny_spec.autoscale, tiny_spec.router) == \
        (2, 0, "reactive", "least-requests")  # scales to zero on its own
    for text, message in (("models: {}\n", "expected `models:`"),
                          ("models:\n  a: {dtype: bfloat16}\n", "give at least its `path`"),
                          ("models:\n  a: {path: x, colour: red}\n", "unknown setting"),
                          ("models:\n  a: {path: x, fleet: {routr: x}}\n", "unknown setting 'routr'"),
                          ("budget: 4\nmodels:\n  a: {path: x}\n", "every model's fleet an autoscale policy"),
                          ("budget: 0\nmodels:\n  a: {path: x}\n", "budget is a number of workers"),
                          ("models:\n  a: {path: x, qos_config: none.yaml}\n", "is not a file"),
                          ("models:\n  a: {path: x, max_in_flight: 0}\n", "max_in_flight is a number")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_models_file(str(path), base_engine, base_spec)


def test_models_under_one_budget_never_hold_more_workers_than_it_together():
    """Two models' fronts over stand-in workers (real processes, no model), reactive autoscaling,
    3 slots each and a budget of 3: the busy model grows to 2 while the idle one keeps its one."""
    import asyncio
    import time

    from multi_helpers import FakeWorker, serving_front
    from sloserve.fleet_view import DRAINING, READY, STARTING
    from sloserve.front.budget import ModelsBudget
    from fleet_helpers import front_config

    def config():
        return front_config(instances=3, router="round-robin", poll_interval_s=0.1, autoscale="reactive",
                            min_instances=1, initial_instances=1, capacity_rps=1.0, scaling_interval_s=0.2,
                            scale_down_delay_s=0.3, stable_window_s=0.5, cold_start_guess_s=1.0)

    async def main():
        async with serving_front(lambda slot: FakeWorker(5, 0.02), config()) as (_, busy, port), \
                serving_front(lambda slot: FakeWorker(5, 0.02), config()) as (_, idle, _):
            budget = ModelsBudget({"busy": busy.autoscale, "idle": idle.autoscale}, 3, 0.2)
            with pytest.raises(ValueError, match="below the models' minimums"):
                ModelsBudget({"busy": busy.autoscale, "idle": idle.autoscale}, 1, 0.2)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                deadline = time.monotonic() + 8
                while time.monotonic() < deadline:
                    await asyncio.gather(*(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
                                           for _ in range(8)))
                    budget.tick()
                    held = budget.describe()["held"]
                    assert sum(held.values()) <= 3, held
                    await asyncio.sleep(0.1)
            statuses = {n: [d.status_of(i) for i in d.fleet.instances] for n, d in budget.drivers.items()}
            assert sum(s in (READY, STARTING) for s in statuses["busy"]) == 2, statuses
            assert sum(s in (READY, STARTING, DRAINING) for s in statuses["idle"]) == 1, statuses
            assert busy.autoscale.counters["starts"] >= 1

    asyncio.run(main())
