"""OpenTelemetry traces (sloserve/tracing.py, `serve --otlp-traces-endpoint`): the real server,
the official openai client with a W3C traceparent, and an OTLP/HTTP collector on loopback that
decodes what the server exports. A span per engine request joins the caller's trace, with usage
equal to what the API answered and latencies in order; a fleet's front span sits between the
caller and its workers' spans."""
from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from openai import OpenAI
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from server_helpers import ServerProcess
from sloserve.server.settings import ServerSettings
from sloserve.tracing import traces_url

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1: every span it got, flattened."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                data = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    data = gzip.decompress(data)
                request = ExportTraceServiceRequest()
                request.ParseFromString(data)
                with lock:
                    for rs in request.resource_spans:
                        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                spans.append({"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                              "parent_id": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                                              "end": s.end_time_unix_nano, "status": s.status.code,
                                              "service": resource.get("service.name"),
                                              "attributes": {a.key: _value(a.value) for a in s.attributes},
                                              "events": {e.name: e.time_unix_nano for e in s.events}})
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, predicate, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in list(self.spans) if predicate(s)]
            if found:
                return found
            time.sleep(0.2)
        raise AssertionError(f"no matching span within {timeout}s; got {[s['name'] for s in self.spans]}")

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


def test_each_request_is_a_span_of_the_callers_trace_with_the_usage_it_answered(collector, tmp_path):
    server = ServerProcess(["--otlp-traces-endpoint", collector.url], tmp_path / "server.log", exact=False)
    try:
        client = OpenAI(base_url=server.v1, api_key="none", default_headers={"traceparent": TRACEPARENT})
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                              max_tokens=8, temperature=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt="One, two,", max_tokens=5, temperature=0, stream=True) if c.choices)
        assert streamed
        chat_span = collector.wait_for(lambda s: s["attributes"].get("gen_ai.response.id") == chat.id)[0]
        stream_span = collector.wait_for(lambda s: s["attributes"].get("gen_ai.operation.name") == "text_completion")[0]
    finally:
        server.kill()
    for span in (chat_span, stream_span):
        assert span["name"] == "llm_request" and span["service"] == "sloserve"
        assert (span["trace_id"], span["parent_id"]) == (TRACE_ID, PARENT_ID)  # joined the caller's trace
    a = chat_span["attributes"]
    assert a["gen_ai.usage.input_tokens"] == chat.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == chat.usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == [chat.choices[0].finish_reason]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.max_tokens"] == 8
    assert a["sloserve.qos.class"] == "default" and a["http.response.status_code"] == 200
    assert 0 < a["sloserve.latency.ttft_s"] <= a["sloserve.latency.e2e_s"]
    e = chat_span["events"]
    assert chat_span["start"] <= e["scheduled"] <= e["first_token"] <= chat_span["end"]
    assert abs((e["first_token"] - chat_span["start"]) / 1e9 - a["sloserve.latency.ttft_s"]) < 0.01
    assert stream_span["attributes"]["gen_ai.usage.output_tokens"] == 5


def test_a_fleets_front_span_parents_its_workers_spans(collector, tmp_path):
    server = ServerProcess(["--instances", "2", "--otlp-traces-endpoint", collector.url], tmp_path / "server.log")
    try:
        client = OpenAI(base_url=server.v1, api_key="none", default_headers={"traceparent": TRACEPARENT})
        out = client.completions.create(model=client.models.list().data[0].id, prompt="The sky is", max_tokens=4, temperature=0)
        worker = collector.wait_for(lambda s: s["name"] == "llm_request")[0]
        front = collector.wait_for(lambda s: s["name"] == "sloserve.front")[0]
    finally:
        server.kill()
    assert (front["service"], worker["service"]) == ("sloserve-front", "sloserve-worker")
    assert front["trace_id"] == worker["trace_id"] == TRACE_ID
    assert front["parent_id"] == PARENT_ID and worker["parent_id"] == front["span_id"]
    assert front["attributes"]["http.response.status_code"] == 200
    assert worker["attributes"]["gen_ai.usage.output_tokens"] == out.usage.completion_tokens == 4
    assert front["start"] <= worker["start"]


def test_an_endpoint_that_is_not_a_url_is_one_clear_error():
    assert traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("https://otel.example:4318/custom/path") == "https://otel.example:4318/custom/path"
    with pytest.raises(ValueError, match="OTLP collector"):
        ServerSettings(otlp_traces_endpoint="127.0.0.1:4318").validate()
