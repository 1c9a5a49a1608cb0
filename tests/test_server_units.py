"""Server pieces that need no model: QoS config, request validation, admission, metrics,
and the HTTP edge (auth, body limit, error schema) on an app whose engine is a stand-in."""
from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sloserve.server.admission import Admission
from sloserve.server.errors import APIError, param_from_message
from sloserve.server.metrics import VLLM_NAMES, EngineGauges, FinishedRequest, ServerMetrics
from sloserve.server.protocol import ChatCompletionRequest, CompletionRequest
from sloserve.server.qos import QoSRegistry, anonymous_tenant, parse_qos_config
from sloserve.server.settings import ServerSettings
from sloserve.core.types import QoSClass

# ------------------------------------------------------------------ QoS config


def test_qos_config_parses_classes_and_keys():
    reg = parse_qos_config({
        "default_class": "standard",
        "classes": {"interactive": {"ttft_ms": 500, "tbt_ms": 100, "priority": 0},
                    "standard": {"ttft_s": 2, "tbt_s": 0.25, "priority": 1, "weight": 0.5}},
        "api_keys": {"sk-a": {"tenant": "alice", "default_class": "interactive"}, "sk-b": "bob", "sk-c": None},
    })
    assert reg.classes["interactive"] == QoSClass("interactive", 0.5, 0.1, 0, 1.0)
    assert reg.classes["standard"].ttft_target_s == 2 and reg.classes["standard"].weight == 0.5
    assert reg.authenticate("sk-a").tenant == "alice"
    assert reg.authenticate("sk-b").tenant == "bob"
    assert reg.authenticate("sk-c").tenant == anonymous_tenant("sk-c") != "sk-c"
    assert reg.authenticate("sk-x") is None and reg.authenticate(None) is None
    assert reg.resolve(None, reg.authenticate("sk-a")).name == "interactive"
    assert reg.resolve(None, reg.authenticate("sk-b")).name == "standard"
    assert reg.resolve("standard", reg.authenticate("sk-a")).name == "standard"
    with pytest.raises(KeyError):
        reg.resolve("gold", reg.authenticate("sk-a"))


@pytest.mark.parametrize("raw, fragment", [
    ({"classes": {"a": {"ttft_ms": 1, "ttft_s": 1}}}, "not both"),
    ({"classes": {"a": {"ttft": 1}}}, "unknown key"),
    ({"classes": {"a": {"ttft_ms": -1}}}, "positive"),
    ({"classes": {"a": {"priority": "high"}}}, "priority"),
    ({"default_class": "gold"}, "default_class"),
    ({"api_keys": {"k": {"tenant": "t", "default_class": "gold"}}}, "default_class"),
    ({"clases": {}}, "unknown key"),
])
def test_qos_config_errors_name_the_entry(raw, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_qos_config(raw)


def test_no_keys_means_no_auth_and_cli_keys_add_tenants():
    reg = QoSRegistry()
    assert not reg.auth_required and reg.authenticate(None).tenant == ""
    reg2 = reg.with_keys(["k1"])
    assert reg2.auth_required and reg2.authenticate("k1").tenant == anonymous_tenant("k1")
    assert not reg.auth_required  # the original is unchanged


# ------------------------------------------------------------------ request models


def test_requests_are_strict_and_map_to_sampling_params():
    req = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 5, "temperature": 0, "stop": "x",
                                            "top_k": 3, "seed": 7})
    params = req.sampling_params()
    assert (params.max_tokens, params.temperature, params.stop, params.top_k, params.seed) == (5, 0.0, ["x"], 3, 7)
    for bad in ({"prompt": "hi", "max_tokens": "5"}, {"prompt": "hi", "temperature": True},
                {"prompt": "hi", "bogus": 1}, {"prompt": 3}):
        with pytest.raises(ValueError):
            CompletionRequest.model_validate(bad)


def test_chat_request_mapping():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                     {"role": "user", "content": "hi"}],
        "max_tokens": 9, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2})
    assert req.conversation() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    params = req.sampling_params()
    assert params.max_tokens == 4 and params.logprobs == 2
    assert ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}
                                                ).sampling_params().max_tokens is None  # up to the context
    with pytest.raises(APIError) as err:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "max_completion_tokens": 0}).sampling_params()
    assert err.value.status == 400 and err.value.param == "max_completion_tokens"


def test_param_from_message():
    assert param_from_message("top_p must be in (0, 1], got 0") == "top_p"
    assert param_from_message("prompt is empty") is None


# ------------------------------------------------------------------ admission


def test_admission_bound_is_all_or_none_and_drain_aborts_leftovers():
    async def main():
        adm = Admission(max_running=2, max_queue=1)
        adm.admit(["a", "b"])
        with pytest.raises(APIError) as full:
            adm.admit(["c", "d"])
        assert full.value.status == 429 and full.value.headers["Retry-After"] == "1"
        assert adm.num_in_flight == 2  # nothing of the refused pair was taken
        with pytest.raises(APIError) as dup:
            adm.admit(["a"])
        assert dup.value.status == 400
        adm.admit(["c"])
        adm.release("b")
        aborted = []

        def abort(rid):
            aborted.append(rid)
            adm.release(rid)

        n = await adm.drain(0.05, abort)
        assert n == 2 and sorted(aborted) == ["a", "c"] and adm.num_in_flight == 0
        with pytest.raises(APIError) as closed:
            adm.admit(["e"])
        assert closed.value.status == 503

    asyncio.run(main())


def test_admission_never_fits_is_400_not_now_is_429():
    adm = Admission(max_running=2, max_queue=1)
    with pytest.raises(APIError) as never:
        adm.check_room(4)
    assert never.value.status == 400 and never.value.code == "exceeds_capacity" and never.value.param == "n"
    adm.admit(["a", "b"])
    with pytest.raises(APIError) as later:
        adm.check_room(2)
    assert later.value.status == 429 and later.value.code == "queue_full"
    adm.check_room(1)
    slot = adm.take_slot("tokenize")
    assert adm.num_in_flight == 3
    with pytest.raises(APIError) as full:
        adm.take_slot("tokenize")
    assert full.value.status == 429
    adm.release(slot)
    assert adm.num_in_flight == 2


def test_the_event_loop_is_uvloop_where_installed_and_asyncio_on_request():
    import asyncio

    from sloserve.server.connections import ConnectionLimits, uvicorn_config

    def loop_of(choice: str) -> type:
        config = uvicorn_config(lambda *a: None, host="127.0.0.1", port=0, limits=ConnectionLimits(), loop=choice)
        loop = config.get_loop_factory()()
        try:
            return type(loop)
        finally:
            loop.close()

    uvloop = pytest.importorskip("uvloop")
    assert loop_of("auto") is uvloop.Loop and loop_of("uvloop") is uvloop.Loop
    assert issubclass(loop_of("asyncio"), asyncio.BaseEventLoop) and loop_of("asyncio") is not uvloop.Loop


def test_connection_settings_are_validated():
    for bad in (dict(header_timeout_s=0), dict(body_timeout_s=float("inf")), dict(max_connections=0)):
        with pytest.raises(ValueError):
            ServerSettings(**bad).validate()
    with pytest.raises(ValueError, match="event loop"):
        ServerSettings(event_loop="tokio").validate()
    limits = ServerSettings(header_timeout_s=3, max_connections=7).connection_limits()
    assert limits.header_timeout_s == 3 and limits.max_connections == 7 and limits.body_timeout_s == 30


# ------------------------------------------------------------------ metrics


def fake_gauges(**over):
    values = dict(num_running=1, num_waiting=2, kv_usage=0.25, prefix_queries=10, prefix_hits=4, num_preemptions=3,
                  num_steps=7, scheduled_seqs=21, max_batch_size=5, num_in_flight=3)
    values.update(over)
    return EngineGauges(**{k: (lambda v=v: v) for k, v in values.items()})


def parse(registry) -> dict:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_per_instance_registry_and_slo_attainment():
    a, b = ServerMetrics(fake_gauges(), "m"), ServerMetrics(fake_gauges(num_running=9), "m")  # no clash
    fast = QoSClass("fast", ttft_target_s=0.5, tbt_target_s=0.1)
    common = dict(tenant="t", qos=fast, num_prompt_tokens=4, num_cached_tokens=0, queue_time=0.01)
    a.observe_finished(FinishedRequest("r1", num_output_tokens=3, finish_reason="length", ttft=0.2, e2e=0.3,
                                       itls=[0.05, 0.05], **common))  # tpot 0.05: meets
    a.observe_finished(FinishedRequest("r2", num_output_tokens=3, finish_reason="stop", ttft=0.2, e2e=0.8,
                                       itls=[0.3, 0.3], **common))  # tpot 0.3: misses TBT
    a.observe_finished(FinishedRequest("r3", num_output_tokens=1, finish_reason="abort", ttft=0.9, e2e=0.9,
                                       **common))  # aborted: not an SLO sample
    a.observe_rejected("queue_full")
    a.observe_http("/v1/models", 200)
    s = parse(a.registry)
    m = (("model_name", "m"),)
    assert s[("sloserve:num_requests_running", m)] == 1 and parse(b.registry)[("sloserve:num_requests_running", m)] == 9
    assert s[("sloserve:kv_cache_usage_perc", m)] == 0.25
    assert s[("sloserve:prefix_cache_hits_total", m)] == 4
    assert s[("sloserve:prompt_tokens_total", m)] == 12
    assert s[("sloserve:generation_tokens_total", m)] == 7
    assert s[("sloserve:inter_token_latency_seconds_count", m)] == 4
    assert s[("sloserve:request_success_total", (("finished_reason", "abort"), ("model_name", "m")))] == 1
    cls = (("model_name", "m"), ("qos_class", "fast"))
    assert s[("sloserve:slo_requests_total", cls)] == 2
    assert s[("sloserve:slo_attained_requests_total", cls)] == 1
    assert s[("sloserve:slo_attainment_ratio", cls)] == 0.5
    assert s[("sloserve:requests_rejected_total", (("model_name", "m"), ("reason", "queue_full")))] == 1
    exposed = {name for name, _ in s}
    for name in VLLM_NAMES:
        assert name in exposed or f"{name}_count" in exposed or f"{name}_total" in exposed, name


def test_finished_request_slo_rules():
    q = QoSClass("c", ttft_target_s=1.0, tbt_target_s=0.1)
    base = dict(request_id="r", tenant="", qos=q, num_prompt_tokens=1, num_cached_tokens=0, finish_reason="stop",
                queue_time=None)
    assert FinishedRequest(num_output_tokens=1, ttft=0.5, e2e=0.5, **base).meets_slo  # one token: TTFT only
    assert not FinishedRequest(num_output_tokens=1, ttft=1.5, e2e=1.5, **base).meets_slo
    assert not FinishedRequest(num_output_tokens=0, ttft=None, e2e=0.1, **base).meets_slo
    r = FinishedRequest(num_output_tokens=11, ttft=0.5, e2e=1.5, **base)
    assert math.isclose(r.tpot, 0.1) and r.meets_slo


# ------------------------------------------------------------------ the HTTP edge, with a stand-in engine


class _NoAdapters:
    """The fake engine's LoRA registry: it serves none (what the server reads: `in` and names())."""

    def __contains__(self, name: object) -> bool:
        return False

    def names(self) -> tuple[str, ...]:
        return ()


@pytest.fixture
def edge_client():
    from sloserve.server.app import build_app

    stats = SimpleNamespace(num_preemptions=0, num_steps=0, total_scheduled_seqs=0, max_batch_size=0,
                            num_output_tokens=0)
    core = SimpleNamespace(
        tokenizer=SimpleNamespace(token_bytes=lambda i: b"x", encode=lambda t: [1, 2], decode=lambda ids: "ab",
                                  chat_template=None),
        model_name="fake", max_model_len=128, model_config=SimpleNamespace(vocab_size=100),
        config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=512, policy="fcfs")),
        clock=time.monotonic,
        scheduler=SimpleNamespace(num_running=0, num_waiting=0, waiting=[], stats=stats, speculator=None),
        kv=SimpleNamespace(usage=0.0, stats=SimpleNamespace(queries=0, hits=0), num_blocks=16, num_free_blocks=16,
                           tiers=SimpleNamespace(local=lambda: []), host=SimpleNamespace(num_blocks=0),
                           num_free_host_blocks=0),
        loras=_NoAdapters(),
    )
    engine = SimpleNamespace(engine=core, abort=lambda rid: None, is_alive=True)
    settings = ServerSettings(registry=QoSRegistry().with_keys(["sk-1"]), max_body_bytes=1000)
    with TestClient(build_app(engine, settings)) as c:
        yield c


def test_edge_auth_limits_and_error_schema(edge_client, caplog):
    auth = {"Authorization": "Bearer sk-1"}
    assert edge_client.get("/health").json() == {"status": "ok"}
    assert edge_client.get("/v1/models").status_code == 401
    assert edge_client.get("/v1/models", headers={"Authorization": "Bearer nope"}).json()["error"]["code"] == \
        "invalid_api_key"
    assert edge_client.get("/v1/models", headers=auth).json()["data"][0]["id"] == "fake"
    assert edge_client.get("/v1/models", headers={"X-Api-Key": "sk-1"}).status_code == 200
    big = edge_client.post("/v1/completions", headers=auth, content=b"x" * 2000)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    bad = edge_client.post("/v1/completions", headers=auth, json={"prompt": "hi", "top_p": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"
    assert edge_client.post("/v1/completions", headers=auth, json={"prompt": "hi", "model": "x"}).status_code == 404
    lost = edge_client.get("/nowhere")
    assert lost.status_code == 404 and lost.json()["error"]["code"] == "not_found"
    assert edge_client.post("/detokenize", headers=auth, json={"tokens": [1, 2]}).json() == {"prompt": "ab"}
    with caplog.at_level("ERROR", logger="sloserve.server.app"):
        boom = edge_client.post("/v1/completions", headers={**auth, "X-Request-Id": "boom-1"}, json={"prompt": "hi"})
    assert boom.status_code == 500  # the stand-in engine cannot tokenize: an unexpected exception
    assert boom.json()["error"]["code"] == "internal_error" and "boom-1" in boom.json()["error"]["message"]
    assert "boom-1" in caplog.text and "Traceback" in caplog.text
    text = edge_client.get("/metrics").text
    assert 'sloserve:http_requests_total{model_name="fake",route="/v1/models",status="401"} 2.0' in text
    # The dashboard page is public (it holds no data); its data needs the API's key (no admin keys here).
    assert "<svg" in edge_client.get("/dashboard").text
    assert edge_client.get("/dashboard/data").json()["error"]["code"] == "invalid_api_key"
    data = edge_client.get("/dashboard/data", headers=auth).json()
    assert data["source"] == "live" and data["meta"]["model"] == "fake"
    bad_since = edge_client.get("/dashboard/data?since=nan", headers=auth)
    assert bad_since.status_code == 400 and bad_since.json()["error"]["param"] == "since"


def test_qos_config_file_yaml_and_json(tmp_path):
    from sloserve.server.qos import load_qos_config

    y = tmp_path / "qos.yaml"
    y.write_text("default_class: fast\nclasses:\n  fast: {ttft_ms: 100, tbt_ms: 20}\napi_keys:\n  sk-1: team-a\n")
    reg = load_qos_config(y)
    assert reg.default_class == "fast" and reg.authenticate("sk-1").tenant == "team-a"
    j = tmp_path / "qos.json"
    j.write_text('{"classes": {"slow": {"ttft_s": 10}}}')
    assert load_qos_config(j).classes["slow"].tbt_target_s == math.inf
    broken = tmp_path / "broken.yaml"
    broken.write_text("classes: [unclosed\n")
    with pytest.raises(ValueError, match="broken.yaml"):
        load_qos_config(broken)


def test_json_nested_past_the_decoder_is_an_invalid_json_400():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from sloserve.server.errors import install_error_handlers
    from sloserve.server.protocol import CompletionRequest

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(body: CompletionRequest) -> dict:
        return {}

    r = TestClient(app).post("/echo", content=b"[" * 200_000, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json" and "nested too deeply" in r.json()["error"]["message"]
