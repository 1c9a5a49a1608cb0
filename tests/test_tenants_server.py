"""Tenants against a real `sloserve serve`: what a key may ask for, its limits, its request-id
namespace and its prefix-cache partition, all from the QoS config (the units are in test_tenants.py)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_helpers import ServerProcess, assert_error_schema, wait_for

pytestmark = pytest.mark.slow

ALICE, BOB, CAROL = "sk-alice-123", "sk-bob-456", "sk-carol-789"
ADMIN = "sk-admin-000"
CONFIG = {
    "default_class": "standard",
    "classes": {
        "interactive": {"priority": 0},
        "standard": {"priority": 1},
        "batch": {"priority": 2},
    },
    "api_keys": {
        ALICE: {"tenant": "alice"},  # no list: her default class and anything less urgent
        BOB: {"tenant": "bob", "classes": ["interactive"]},
        CAROL: {"tenant": "carol"},
    },
    "tenants": {"carol": {"max_concurrent_requests": 1}},
}
# Long enough for several full 16-token blocks once tokenized.
SHARED_PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat. " * 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    cfg = tmp / "qos.json"
    cfg.write_text(json.dumps(CONFIG))
    srv = ServerProcess(["--qos-config", str(cfg), "--admin-key", ADMIN], tmp / "server.log")
    yield srv
    srv.kill()


def _post(server, key: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(server.v1 + "/completions", json={"max_tokens": 2, "temperature": 0, **body}, timeout=60,
                      headers={"Authorization": f"Bearer {key}", **headers})


def test_a_key_uses_only_the_classes_and_priorities_its_config_allows(server):
    err = assert_error_schema(_post(server, ALICE, {"prompt": "hi", "qos_class": "interactive"}), 403)
    assert err["type"] == "permission_error" and err["param"] == "qos_class"
    assert _post(server, ALICE, {"prompt": "hi", "qos_class": "batch"}).status_code == 200  # less urgent: fine
    err = assert_error_schema(_post(server, ALICE, {"prompt": "hi", "priority": 0}), 403)  # standard is 1
    assert err["param"] == "priority"
    err = assert_error_schema(_post(server, ALICE, {"prompt": "hi"}, **{"X-Priority": "-5"}), 403)
    assert _post(server, ALICE, {"prompt": "hi", "priority": 7}).status_code == 200
    assert _post(server, BOB, {"prompt": "hi", "qos_class": "interactive", "priority": 0}).status_code == 200
    err = assert_error_schema(_post(server, BOB, {"prompt": "hi", "priority": 2**40}), 400)
    assert err["param"] == "priority"
    assert assert_error_schema(_post(server, BOB, {"prompt": "hi", "qos_class": "nope"}), 400)["param"] == "qos_class"


def test_tenant_concurrency_limit_and_request_ids_scoped_per_tenant(server):
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.v1, timeout=120) as c:
        with c.stream("POST", "/completions", json=body,
                      headers={"Authorization": f"Bearer {CAROL}", "X-Request-Id": "same-id"}) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # carol's one request is running
            # carol is at her limit of one request in flight; other tenants are not
            err = assert_error_schema(_post(server, CAROL, {"prompt": "hi"}), 429)
            assert err["code"] == "tenant_concurrency_limit"
            # another tenant may use the same X-Request-Id: ids are a namespace per tenant
            other = _post(server, ALICE, {"prompt": "hi"}, **{"X-Request-Id": "same-id"})
            assert other.status_code == 200 and other.headers["x-request-id"] == "same-id"
            assert other.json()["id"] == "same-id"
    # once her stream is gone, carol may send again
    wait_for(lambda: _post(server, CAROL, {"prompt": "hi"}).status_code == 200, 30, what="carol's slot back")


def test_prefix_cache_is_partitioned_by_tenant(server):
    client = {k: openai.OpenAI(base_url=server.v1, api_key=k, max_retries=0, timeout=60) for k in (ALICE, BOB)}

    model = client[ALICE].models.list().data[0].id

    def cached(key: str) -> int:
        out = client[key].completions.create(model=model, prompt=SHARED_PROMPT, max_tokens=1, temperature=0)
        return out.usage.prompt_tokens_details.cached_tokens

    cached(ALICE)
    assert cached(ALICE) >= 64  # her own prefix is cached
    assert cached(BOB) == 0  # the same prefix from another tenant is not served from alice's cache
    assert cached(BOB) >= 64


def test_metrics_need_an_admin_key_when_one_is_configured(server):
    url = server.base_url + "/metrics"
    assert assert_error_schema(httpx.get(url, timeout=10), 401)["code"] == "invalid_api_key"
    assert assert_error_schema(httpx.get(url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=10), 403)
    ok = httpx.get(url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert ok.status_code == 200 and "sloserve:num_requests_running" in ok.text
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200  # health stays open
