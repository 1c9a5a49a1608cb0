"""Hostile clients at the connection level, against the real app (embedded model) served by
uvicorn as `run_server` builds it, in a thread of this process on 127.0.0.1:

- idle and slowloris connections are closed after the header timeout;
- a stalled body gets 408 in the error schema after the body timeout;
- beyond `max_connections`, a new connection gets 503 + Retry-After and is closed, and the
  server serves again once the others are gone;
- /tokenize holds an admission slot (429 when full) and tokenizes off the event loop;
- more sequences than the admission bound can ever hold is a 400, not a 429 forever.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from server_helpers import assert_error_schema, free_port, metric, scrape, wait_for
from sloserve.server.connections import uvicorn_config
from sloserve.server.settings import ServerSettings

pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 60
MARGIN_S = 3.0


@pytest.fixture(scope="module")
def server():
    from sloserve.core.config import EngineConfig, SchedulerConfig
    from sloserve.engine.async_engine import AsyncLLMEngine
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.server.app import build_app

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(num_threads=1, scheduler=SchedulerConfig(max_num_seqs=2))))
    settings = ServerSettings(max_queue=2, header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S,
                              max_connections=MAX_CONNECTIONS)
    port = free_port()
    srv = uvicorn.Server(uvicorn_config(build_app(engine, settings), host="127.0.0.1", port=port,
                                        limits=settings.connection_limits()))
    thread = threading.Thread(target=srv.run, name="test-uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _healthy(url), 60, what="server start")
    yield url, port
    srv.should_exit = True
    thread.join(15)
    engine.shutdown()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setblocking(False)
    return s


def _read_until_closed(s: socket.socket, deadline: float) -> tuple[bool, bytes]:
    """(closed by the server before the deadline, what it sent)."""
    s.setblocking(True)
    data = b""
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            break
        except ConnectionResetError:
            return True, data
        if not chunk:
            return True, data
        data += chunk
    return False, data


def _is_closed_now(s: socket.socket) -> bool:
    """Reads what is there without waiting; True once the server has closed."""
    while True:
        try:
            chunk = s.recv(65536)
        except BlockingIOError:
            return False
        except ConnectionResetError:
            return True
        if not chunk:
            return True


def _parse(raw: bytes) -> tuple[int, dict, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


def test_idle_and_slowloris_connections_are_closed_after_the_header_timeout(server):
    url, port = server
    idle = [_connect(port) for _ in range(25)]
    slow = [_connect(port) for _ in range(25)]
    start = time.monotonic()
    for s in slow:
        s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    open_sockets = idle + slow
    try:
        while time.monotonic() - start < HEADER_TIMEOUT_S + MARGIN_S:
            for s in slow:  # one more header byte now and then: never a complete head
                try:
                    s.send(b"X")
                except OSError:
                    pass
            open_sockets = [s for s in open_sockets if not _is_closed_now(s)]
            if not open_sockets:
                break
            time.sleep(0.25)
        elapsed = time.monotonic() - start
        assert not open_sockets, f"{len(open_sockets)} of 50 sockets still open after {elapsed:.1f}s"
        assert elapsed >= HEADER_TIMEOUT_S * 0.9
    finally:
        for s in idle + slow:
            s.close()
    assert _healthy(url)


def test_slowloris_mid_head_gets_408_in_the_error_schema(server):
    _, port = server
    s = _connect(port)
    try:
        s.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        closed, raw = _read_until_closed(s, time.monotonic() + HEADER_TIMEOUT_S + MARGIN_S)
    finally:
        s.close()
    assert closed
    status, headers, body = _parse(raw)
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == "request_timeout" and body["error"]["message"]


def test_stalled_body_gets_408_and_the_connection_is_closed(server):
    _, port = server
    s = _connect(port)
    start = time.monotonic()
    try:
        s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        closed, raw = _read_until_closed(s, start + BODY_TIMEOUT_S + MARGIN_S)
    finally:
        s.close()
    assert closed, raw
    assert time.monotonic() - start >= BODY_TIMEOUT_S * 0.9
    status, headers, body = _parse(raw)
    assert status == 408 and headers["connection"] == "close"
    assert body["error"] == {"message": "request body not received within 1s", "type": "invalid_request_error",
                             "param": None, "code": "request_timeout"}


def test_connection_cap_refuses_with_503_then_serves_again(server):
    url, port = server
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            held.append(_connect(port))
        time.sleep(0.2)  # let the server accept them all
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        try:
            closed, raw = _read_until_closed(extra, time.monotonic() + 2.0)
        finally:
            extra.close()
        assert closed
        status, headers, body = _parse(raw)
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
        assert body["error"]["code"] == "too_many_connections" and body["error"]["type"] == "service_unavailable"
        # an ordinary client sees the same answer (no reset): it sends its request, reads the 503
        refused = httpx.get(url + "/health", timeout=5)
        assert_error_schema(refused, 503)
    finally:
        for s in held:
            s.close()
    wait_for(lambda: _healthy(url), 10, what="the server to serve again after the held sockets closed")


def test_tokenize_takes_an_admission_slot(server):
    url, _ = server
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        streams = []
        try:
            for _ in range(4):  # max_num_seqs 2 + max_queue 2: full
                stream = client.stream("POST", "/v1/completions", json=body)
                resp = stream.__enter__()
                streams.append(stream)
                assert resp.status_code == 200  # headers come once admitted; tokens follow for a while
            full = httpx.post(url + "/tokenize", json={"prompt": "hello"}, timeout=10)
            err = assert_error_schema(full, 429)
            assert err["code"] == "queue_full" and full.headers["retry-after"] == "1"
            assert assert_error_schema(httpx.post(url + "/detokenize", json={"tokens": [1, 2]}, timeout=10),
                                       429)["code"] == "queue_full"
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)  # disconnect: the engine aborts them
    wait_for(lambda: metric(scrape(url), "sloserve:num_requests_in_flight") == 0, 30,
             what="the aborted streams to release their slots")
    ok = httpx.post(url + "/tokenize", json={"prompt": "hello"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["count"] == len(ok.json()["tokens"]) > 0


def test_a_big_tokenize_does_not_block_the_event_loop(server):
    url, _ = server
    prompt = "hello world, this is a test. " * 100_000  # 2.9 MB: about a second or more of tokenizer work
    result = {}

    def big() -> None:
        start = time.monotonic()
        result["resp"] = httpx.post(url + "/tokenize", json={"prompt": prompt}, timeout=120)
        result["s"] = time.monotonic() - start

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.3)  # the body is in: the tokenizer runs
    worst = 0.0
    while thread.is_alive():
        start = time.monotonic()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.05)
    thread.join()
    assert result["resp"].status_code == 200 and result["resp"].json()["count"] > 200_000
    assert result["s"] > 0.6, "the prompt is too small to show anything"
    # on the event loop, /health would wait the whole tokenization out
    assert worst < min(0.5, result["s"] / 2), f"/health took {worst:.2f}s while /tokenize ran for {result['s']:.1f}s"


def test_more_sequences_than_capacity_is_400_not_429(server):
    url, _ = server
    resp = httpx.post(url + "/v1/completions", json={"prompt": "hi", "n": 5, "max_tokens": 1}, timeout=30)
    err = assert_error_schema(resp, 400)
    assert err["code"] == "exceeds_capacity" and err["param"] == "n"
    two = httpx.post(url + "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}, timeout=30)
    assert assert_error_schema(two, 400)["code"] == "exceeds_capacity"
    fits = httpx.post(url + "/v1/completions", json={"prompt": "hi", "n": 4, "max_tokens": 1}, timeout=60)
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 4
