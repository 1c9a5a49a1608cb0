"""Fuzzing every route of the real single-instance server with schemathesis.

The server is the real app on the real engine (the embedded model, a 64-token context so any
accepted body finishes in a fraction of a second), served by uvicorn on 127.0.0.1 in a thread.
Per route, bodies come from schemathesis's coverage phase (boundary values, wrong types,
missing and unexpected fields derived from the OpenAPI schema), from its hypothesis strategies
in positive and negative mode with the X-Request-Id / X-QoS-Class / X-Priority headers fuzzed
too, from raw bytes that are not JSON, and, for the two generation routes, from valid prompts
with every sampling field fuzzed (the schema has no ranges, so these are what reach the model).
About 3,500 bodies in all (66 s on an idle 2-vCPU Zen4); target: no 5xx, no schema-violating body
accepted, no body left unanswered, every 200 complete.

Afterwards the server must still be whole: nothing in flight at the edge or in the engine,
every KV block free, and a greedy completion gives the text it gave before the fuzz.
`benchmarks/fuzz.py` runs the same driver longer (10k+ bodies) and prints a report.
"""
from __future__ import annotations

import warnings

import pytest
import requests

from fuzz_helpers import TIMEOUT, Fuzzer, KnownIssue, ServerUnderTest

pytestmark = pytest.mark.slow

ROUTES = ["GET /health", "GET /version", "GET /metrics", "GET /v1/models", "POST /v1/completions",
          "POST /v1/chat/completions", "POST /v1/responses", "POST /tokenize", "POST /detokenize",
          "POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter"]
ADMIN_KEY = "sk-fuzz-admin"  # every body goes with it: the admin routes are fuzzed past their key check
MAX_EXAMPLES = 80  # hypothesis draws per route and mode (positive, negative, raw)
ENGINE_EXAMPLES = 60  # valid-prompt bodies per generation route
TIMEOUT_S = 60.0

# Findings reported but not fixed yet: (route, predicate on the body sent). A matching 5xx is
# counted and shown as a warning instead of failing, so the rest of the fuzz keeps its teeth.
# Remove an entry once it is fixed.
# e.g. ("POST /v1/completions", lambda body: '"seed": 18446744073709551616' in body)
KNOWN_ISSUES: list[KnownIssue] = []


@pytest.fixture(scope="module")
def server():
    from sloserve.server.settings import ServerSettings

    srv = ServerUnderTest.start(max_model_len=64, num_threads=1, max_num_seqs=16,
                                settings=ServerSettings(admin_keys=[ADMIN_KEY]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def fuzzer(server):
    fuzzer = Fuzzer(server.base_url, timeout_s=TIMEOUT_S, known_issues=KNOWN_ISSUES,
                    vocab_size=server.engine.engine.model_config.vocab_size)
    fuzzer.session.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
    return fuzzer


@pytest.fixture(scope="module")
def greedy_before(server):
    return server.greedy_text()


def test_schema_lists_every_route(fuzzer):
    """A route added to the app but not here would go unfuzzed: keep ROUTES in step."""
    assert sorted(op.label for op in fuzzer.operations()) == sorted(ROUTES)


@pytest.mark.parametrize("route", ROUTES)
def test_fuzzed_route_gets_no_server_error(fuzzer, greedy_before, route):
    operation = next(op for op in fuzzer.operations() if op.label == route)
    before = len(fuzzer.report.findings), len(fuzzer.report.known)
    sent_before = fuzzer.report.sent
    fuzzer.run_all(MAX_EXAMPLES, engine_examples=ENGINE_EXAMPLES, operations=[operation])
    sent = fuzzer.report.sent - sent_before
    assert sent >= 30, f"only {sent} bodies generated for {route}"
    new = fuzzer.report.findings[before[0]:]
    known = fuzzer.report.known[before[1]:]
    if known:
        warnings.warn(f"{len(known)} known 5xx on {route}:\n" + "\n".join(f.describe() for f in known))
    timeouts = sum(n for (label, _, status), n in fuzzer.report.counts.items() if label == route and status == TIMEOUT)
    assert not new, f"{len(new)} of {sent} bodies to {route} failed:\n" + "\n".join(f.describe() for f in new[:10])
    assert timeouts == 0, f"{timeouts} bodies to {route} got no answer within {TIMEOUT_S}s"


def test_thousands_of_bodies_were_sent(fuzzer):
    """Guards the bound on test time as much as the depth of the fuzz: report what ran."""
    report = fuzzer.report
    print(f"\nfuzz: {report.sent} bodies in {report.wall_s:.0f}s; by status {dict(report.by_status())}; "
          f"by source {dict(report.by_source())}")
    assert report.sent >= 1500
    assert report.by_status()[200] >= 100  # enough bodies got through validation to run on the model


def test_server_still_whole_after_the_fuzz(server, fuzzer, greedy_before):
    held = server.wait_idle(60)
    assert not any(held.values()), f"still held after the fuzz: {held}"
    assert requests.get(server.base_url + "/health", timeout=10).json() == {"status": "ok"}
    assert server.greedy_text() == greedy_before
    assert not any(server.wait_idle(30).values())
