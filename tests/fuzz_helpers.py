"""Fuzzing the single-instance HTTP API with schemathesis: the server under test and the driver.

Shared by tests/test_fuzz_api.py (a bounded run in the suite) and benchmarks/fuzz.py (a long run
with a report). The server is the real one: `build_app` over a real `AsyncLLMEngine`, served by
uvicorn on 127.0.0.1 in a background thread, so every body goes through the real HTTP parser,
the edge middleware, validation, tokenization, the scheduler and the model.

Why a driver of our own instead of `@schema.parametrize()`: the pytest integration stops an
operation at its first failure and shrinks it; we want every generated body sent, the outcome
of each counted (bodies per status code), and each 5xx recorded verbatim so it can be reported
and, once known, tolerated without hiding new ones. Sources of bodies, per operation:
- `coverage`: schemathesis's coverage phase (boundary and schema-violating values, missing and
  unexpected fields, derived from the OpenAPI schema);
- `positive` / `negative`: its hypothesis strategies in each generation mode, with the headers
  the server reads (X-Request-Id, X-QoS-Class, X-Priority) fuzzed alongside;
- `raw`: bytes the schema cannot describe (not JSON, truncated, NaN, nesting past the parser's
  recursion limit, duplicate keys);
- `engine`: valid prompts with every sampling field at and beyond its edges, odd Unicode
  included, since the schema has no ranges and schemathesis alone rarely reaches the model.
Verdicts: schemathesis's `not_a_server_error` and `negative_data_rejection` checks on its own
cases; for every body, no 5xx and an answer within the timeout; a 200 from the engine source
must be complete (every choice, or a stream ending in [DONE] without an error event).
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import hypothesis
import requests
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st

log = logging.getLogger(__name__)

# Headers the server reads besides the body: fuzzed too (printable ASCII, as HTTP allows).
FUZZED_HEADERS = ("X-Request-Id", "X-QoS-Class", "X-Priority")
GREEDY_BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
TIMEOUT = "timeout"  # outcome of a body the server did not answer within the client's timeout
CONNECTION_ERROR = "connection_error"  # the server closed the connection without an answer


def header_strategy() -> st.SearchStrategy[dict[str, str]]:
    """Often none; else plausible values (a valid request id, a known class, a small integer)
    or arbitrary printable ones, so both the accepted and the refused paths are reached."""
    printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=24).map(str.strip)
    values = {
        "X-Request-Id": st.one_of(st.from_regex(r"[A-Za-z0-9._:-]{1,40}", fullmatch=True), printable),
        "X-QoS-Class": st.one_of(st.sampled_from(["default", "standard", "nope"]), printable),
        "X-Priority": st.one_of(st.integers(-10**12, 10**12).map(str), printable),
    }
    return st.one_of(st.just({}), st.fixed_dictionaries({}, optional=values))


# Strings a generator of valid Unicode never makes: lone surrogates (legal as JSON escapes,
# not as UTF-8), control and bidi characters, the model's special tokens, template syntax.
ODD_STRINGS = ["\ud800", "a\udfffb", "\ud83d", "\x00", "\u202e", "\ufeff", "\U0001f642", "<|im_start|>", "<|im_end|>",
               "<|endoftext|>", "{{ raise_exception('x') }}", "{% for %}", "\r\n\r\n", " " * 300]
NON_FINITE = [float("nan"), float("inf"), float("-inf")]  # JSON has no such numbers; Python's parser reads them


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """Valid three times in four: a body has a dozen fields, and one invalid field is enough for
    a 400, so each field must be valid most of the time for bodies to reach the model."""
    return st.one_of(valid, valid, valid, invalid)


def sampling_fields(vocab: int) -> dict[str, st.SearchStrategy]:
    """Every sampling field the server honours, at and just beyond the edges of its valid range.
    The OpenAPI schema has no ranges (the models check them in code), so schemathesis alone
    rarely builds a body that passes them all and reaches the model; these do, often."""
    penalty = mostly(st.one_of(st.sampled_from([-2.0, 0.0, 2.0, 1e-30]), st.floats(-2, 2)),
                     st.sampled_from([2.0001, -3.0, 1e30, *NON_FINITE]))
    words = st.one_of(st.text(max_size=6), st.sampled_from(ODD_STRINGS))
    return {
        "temperature": mostly(st.one_of(st.sampled_from([0.0, -0.0, 1e-30, 1e-5, 1.0, 2.0]), st.floats(0, 3)),
                              st.sampled_from([-1.0, 1e300, *NON_FINITE])),
        "top_p": mostly(st.one_of(st.sampled_from([1e-9, 0.5, 1.0]), st.floats(1e-6, 1)),
                        st.sampled_from([0.0, 1.5, *NON_FINITE])),
        "top_k": mostly(st.sampled_from([-1, 0, 1, 2, vocab - 1, vocab, vocab + 1, 2**31, 2**63 - 1]),
                        st.sampled_from([-2, 2**63, 2**64])),
        "min_p": mostly(st.one_of(st.sampled_from([0.0, 1.0, 0.999999]), st.floats(0, 1)),
                        st.sampled_from([-0.1, 1.1, *NON_FINITE])),
        "presence_penalty": penalty,
        "frequency_penalty": penalty,
        "repetition_penalty": mostly(st.one_of(st.sampled_from([1e-6, 0.5, 1.0, 2.0, 100.0]), st.floats(0.01, 3)),
                                     st.sampled_from([0.0, -1.0, 5e-324, 1e300, *NON_FINITE])),
        "seed": st.one_of(st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]),
                          st.integers(0, 1000)),
        "stop": st.one_of(words, st.lists(words, max_size=4)),
        "stop_token_ids": st.lists(st.sampled_from([0, 1, 2, vocab - 1, -1, vocab, 2**40]), max_size=3),
        "n": st.integers(1, 2),
        "stream": st.booleans(),
        "ignore_eos": st.booleans(),
        "min_tokens": mostly(st.integers(0, 8), st.sampled_from([-1, 2**40])),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "priority": st.one_of(st.integers(-10, 10), st.sampled_from([2**31, 2**63 - 1, 2**63, -(2**63) - 1])),
        "qos_class": mostly(st.just("default"), st.just("nope")),
    }


def engine_body_strategy(route: str, vocab: int) -> st.SearchStrategy[dict]:
    """Bodies with a valid prompt (or messages) and fuzzed sampling fields, streamed or not."""
    text = st.one_of(st.text(min_size=1, max_size=30), st.sampled_from(ODD_STRINGS),
                     st.tuples(st.text(max_size=10), st.sampled_from(ODD_STRINGS)).map("".join))
    ids = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)
    optional = sampling_fields(vocab)
    # Each token costs ~35 ms on one core, so the limit is always given and small (a null one,
    # which lets the answer fill the context, is among schemathesis's own bodies).
    max_tokens = mostly(st.integers(1, 6), st.sampled_from([-1, 0]))
    if route == "/v1/completions":
        required = {"prompt": st.one_of(text, ids, st.lists(text, min_size=1, max_size=2),
                                         st.lists(ids, min_size=1, max_size=2)),
                    "max_tokens": max_tokens}
        optional["logprobs"] = mostly(st.integers(0, 20), st.sampled_from([-1, 21]))
    else:
        message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant",
                                                                   "tool"]),
                                         "content": st.one_of(text, st.lists(st.fixed_dictionaries(
                                             {"type": st.just("text"), "text": text}), min_size=1, max_size=2))})
        required = {"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": max_tokens}
        optional.update(logprobs=st.booleans(), top_logprobs=mostly(st.integers(0, 20), st.sampled_from([-1, 21])),
                        max_completion_tokens=st.integers(1, 6))
    body = st.fixed_dictionaries(required, optional=optional)
    with_usage = st.fixed_dictionaries({"include_usage": st.booleans()})
    return st.tuples(body, with_usage).map(
        lambda pair: {**pair[0], "stream_options": pair[1]} if pair[0].get("stream") else pair[0])


def uvicorn_config_for(app: Any, port: int, settings: Any):
    """The uvicorn configuration `sloserve serve` runs with (its HTTP protocol limits included),
    so the fuzz meets the server's real connection handling, not uvicorn's defaults."""
    import uvicorn

    try:
        from sloserve.server.connections import uvicorn_config
    except ImportError:  # a tree without connection limits: the launcher's older plain config
        return uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_config=None, access_log=False,
                              timeout_keep_alive=5)
    return uvicorn_config(app, host="127.0.0.1", port=port, limits=settings.connection_limits())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- the server


@dataclass
class ServerUnderTest:
    """The real app on a real engine, served by uvicorn in a thread on a loopback port.

    Built in-process (not a subprocess) so the checks after the fuzz can read the engine's own
    state: requests in flight at the HTTP edge and in the engine, KV blocks in use."""

    app: Any
    engine: Any
    server: Any
    thread: threading.Thread
    base_url: str

    @classmethod
    def start(cls, *, max_model_len: int = 128, num_threads: int = 1, max_num_seqs: int = 16,
              num_blocks: int = 256, model: Optional[str] = None, settings: Any = None) -> "ServerUnderTest":
        import uvicorn

        from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig
        from sloserve.engine.async_engine import AsyncLLMEngine
        from sloserve.engine.llm_engine import LLMEngine
        from sloserve.server.app import build_app
        from sloserve.server.settings import ServerSettings

        config = EngineConfig(model=model, num_threads=num_threads, max_model_len=max_model_len,
                              cache=CacheConfig(num_blocks=num_blocks),
                              scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256))
        engine = AsyncLLMEngine(LLMEngine(config))
        settings = settings or ServerSettings()
        app = build_app(engine, settings)
        port = free_port()
        server = uvicorn.Server(uvicorn_config_for(app, port, settings))
        server.install_signal_handlers = lambda: None  # not the main thread; uvicorn < 0.29 installs them
        thread = threading.Thread(target=server.run, name="fuzz-uvicorn", daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                engine.shutdown()
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return cls(app, engine, server, thread, f"http://127.0.0.1:{port}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()

    @property
    def state(self):
        return self.app.state.sloserve

    def busy(self) -> dict[str, float]:
        """What is still held: admission slots, engine streams and requests, KV blocks in use.
        All zero once every request has ended (read from another thread: poll, don't trust one read)."""
        core = self.engine.engine
        return {
            "admission_in_flight": self.state.admission.num_in_flight,
            "engine_streams": self.engine.num_in_flight,
            "engine_unfinished": int(core.has_unfinished_requests()),
            "kv_blocks_used": core.kv.num_blocks - core.kv.num_free_blocks,
        }

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Poll until nothing is held (aborts are applied by the next engine step); returns the last read."""
        deadline = time.monotonic() + timeout
        while True:
            held = self.busy()
            if not any(held.values()) or time.monotonic() > deadline:
                return held
            time.sleep(0.1)

    def greedy_text(self) -> str:
        r = requests.post(self.base_url + "/v1/completions", json=GREEDY_BODY, timeout=120)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]


# ---------------------------------------------------------------------------- outcomes


@dataclass
class Finding:
    """One body that got a 5xx (or no answer): everything needed to replay it."""

    operation: str
    source: str
    status: Any
    body: str
    headers: dict[str, str]
    response: str

    def describe(self) -> str:
        return (f"{self.operation} [{self.source}] -> {self.status}\n  headers: {json.dumps(self.headers)}\n"
                f"  body: {self.body}\n  response: {self.response}")


@dataclass
class FuzzReport:
    """Bodies sent per (operation, source, status), and every 5xx / unanswered body verbatim."""

    counts: Counter = field(default_factory=Counter)
    findings: list[Finding] = field(default_factory=list)
    known: list[Finding] = field(default_factory=list)  # 5xx matching a known, reported issue
    wall_s: float = 0.0
    source_s: Counter = field(default_factory=Counter)  # seconds spent per source of bodies

    @property
    def sent(self) -> int:
        return sum(self.counts.values())

    def by_status(self) -> Counter:
        out: Counter = Counter()
        for (_, _, status), n in self.counts.items():
            out[status] += n
        return out

    def by_source(self) -> Counter:
        out: Counter = Counter()
        for (_, source, _), n in self.counts.items():
            out[source] += n
        return out

    @property
    def server_errors(self) -> int:
        return sum(n for (_, _, s), n in self.counts.items() if isinstance(s, int) and s >= 500)

    def to_dict(self) -> dict:
        return {
            "sent": self.sent, "wall_s": round(self.wall_s, 2), "server_errors": self.server_errors,
            "by_status": {str(k): v for k, v in sorted(self.by_status().items(), key=lambda kv: str(kv[0]))},
            "by_source": dict(self.by_source()),
            "seconds_by_source": {k: round(v, 1) for k, v in self.source_s.items()},
            "by_operation": {f"{op} [{src}] {st_}": n for (op, src, st_), n in sorted(self.counts.items(),
                                                                                     key=lambda kv: str(kv[0]))},
            "findings": [f.__dict__ for f in self.findings],
            "known_findings": [f.__dict__ for f in self.known],
        }


# A known issue: (operation label, predicate on the sent body text). Bodies matching one are
# recorded under `known` instead of failing the run, so the rest of the fuzz still counts.
KnownIssue = tuple[str, Callable[[str], bool]]


@dataclass
class Fuzzer:
    """Sends schemathesis-generated bodies to every operation of the server's OpenAPI schema."""

    base_url: str
    timeout_s: float = 30.0
    seed: int = 0
    known_issues: list[KnownIssue] = field(default_factory=list)
    vocab_size: int = 49152
    report: FuzzReport = field(default_factory=FuzzReport)
    on_sent: Optional[Callable[[], None]] = None

    def __post_init__(self) -> None:
        import schemathesis

        self.schema = schemathesis.openapi.from_url(self.base_url + "/openapi.json")
        self.session = requests.Session()

    def operations(self) -> list:
        return [result.ok() for result in self.schema.get_all_operations()]

    # ---- sources of bodies

    def coverage(self, operation) -> int:
        """Schemathesis's coverage phase: for each field, boundary values, wrong types, missing
        required fields, unexpected properties (negative) and the valid edges (positive)."""
        from schemathesis.generation import GenerationMode

        sent = 0
        cases = operation.schema.iter_coverage_cases(
            operation, generation_modes=list(GenerationMode),
            generation_config=self.schema.config.generation_for(operation=operation, phase="coverage"))
        for case in cases:
            self._send(operation.label, "coverage", case, {})
            sent += 1
        return sent

    def generated(self, operation, mode: str, max_examples: int) -> int:
        """Hypothesis draws in one generation mode (positive: schema-valid; negative: violating),
        with the request headers the server reads fuzzed alongside. No shrinking: nothing raises,
        every outcome is recorded."""
        from schemathesis.generation import GenerationMode

        strategy = operation.as_strategy(generation_mode=GenerationMode(mode))
        sent = [0]

        @hypothesis.seed(self.seed)
        @hypothesis.settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
                             suppress_health_check=list(HealthCheck), verbosity=hypothesis.Verbosity.quiet)
        @hypothesis.given(case=strategy, extra=header_strategy())
        def run(case, extra: dict[str, str]) -> None:
            self._send(operation.label, mode, case, extra)
            sent[0] += 1

        try:
            run()
        except hypothesis.errors.Unsatisfiable:
            pass  # e.g. no schema-violating value exists for an operation without inputs
        return sent[0]

    def raw(self, operation, max_examples: int) -> int:
        """Bodies the schema cannot describe: arbitrary bytes, truncated / non-object JSON,
        under the JSON content type, to routes that take a body."""
        if operation.method.upper() != "POST":
            return 0
        junk = st.one_of(
            st.binary(max_size=64),
            st.text(max_size=40).map(str.encode),
            st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                         lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                         max_leaves=6).map(lambda v: json.dumps(v).encode()),
            st.builds(lambda s, k: s[:k], st.just(json.dumps({"prompt": "hi", "messages": [], "tokens": [1]})
                                                  .encode()), st.integers(0, 40)),
            # nesting deeper than the parser's recursion limit, bare and inside a field
            st.integers(1, 200_000).map(lambda d: b"[" * d + b"]" * d),
            st.integers(1, 200_000).map(lambda d: b'{"prompt": ' + b"[" * d + b"]" * d + b', "tokens": [1]}'),
            st.sampled_from([b'{"prompt": "hi", "max_tokens": NaN}', b'{"tokens": [Infinity]}',
                             b'{"prompt": "hi", "temperature": -Infinity}', b'{"prompt": "\\ud800"}',
                             b'{"prompt": "hi"}\x00', b"\xef\xbb\xbf{}", b'{"prompt": "hi", "prompt": 1}']),
        )
        sent = [0]

        @hypothesis.seed(self.seed)
        @hypothesis.settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
                             suppress_health_check=list(HealthCheck), verbosity=hypothesis.Verbosity.quiet)
        @hypothesis.given(body=junk)
        def run(body: bytes) -> None:
            self._post_raw(operation.label, operation.path, body)
            sent[0] += 1

        run()
        return sent[0]

    def engine(self, operation, max_examples: int) -> int:
        """Bodies that pass validation and run on the model (see `engine_body_strategy`); a 200 must
        be complete: a JSON body with every choice, or a stream that ends with [DONE] and no error."""
        if operation.method.upper() != "POST" or operation.path not in ("/v1/completions", "/v1/chat/completions"):
            return 0
        sent = [0]

        @hypothesis.seed(self.seed)
        @hypothesis.settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
                             suppress_health_check=list(HealthCheck), verbosity=hypothesis.Verbosity.quiet)
        @hypothesis.given(body=engine_body_strategy(operation.path, self.vocab_size), extra=header_strategy())
        def run(body: dict, extra: dict[str, str]) -> None:
            self._post_engine(operation.label, operation.path, body, extra)
            sent[0] += 1

        run()
        return sent[0]

    def run_all(self, max_examples: int, raw_examples: Optional[int] = None, engine_examples: Optional[int] = None,
                operations: Optional[Iterable] = None) -> FuzzReport:
        """Every operation: coverage cases, positive and negative draws, raw bytes, engine bodies."""
        start = time.monotonic()
        raw_n = max_examples if raw_examples is None else raw_examples
        engine_n = max_examples if engine_examples is None else engine_examples
        for operation in operations or self.operations():
            steps: list[tuple[str, Callable[[], int]]] = [
                ("coverage", lambda: self.coverage(operation)),
                ("positive", lambda: self.generated(operation, "positive", max_examples)),
                ("negative", lambda: self.generated(operation, "negative", max_examples)),
                ("raw", lambda: self.raw(operation, raw_n)),
                ("engine", lambda: self.engine(operation, engine_n)),
            ]
            for source, step in steps:
                t0 = time.monotonic()
                step()
                self.report.source_s[source] += time.monotonic() - t0
        self.report.wall_s += time.monotonic() - start
        return self.report

    # ---- sending and recording

    def _send(self, label: str, source: str, case, extra_headers: dict[str, str]) -> None:
        kwargs = case.as_transport_kwargs(base_url=self.base_url, headers=extra_headers or None)
        body = kwargs.get("data") if kwargs.get("json") is None else json.dumps(kwargs["json"])
        if body is None and "json" in kwargs:
            body = "null"
        if isinstance(body, bytes):
            body = body.decode("utf-8", errors="backslashreplace")
        headers = {k: v for k, v in (kwargs.get("headers") or {}).items() if k in FUZZED_HEADERS
                   or k.lower() == "content-type"}
        try:
            response = case.call(base_url=self.base_url, session=self.session, headers=extra_headers or None,
                                 timeout=self.timeout_s)
            status: Any = response.status_code
            text = response.text if status >= 500 else ""
            if status < 500:
                failed = self._check(case, response)
                if failed:  # e.g. a schema-violating body accepted with a 2xx
                    status, text = f"{status}-{failed}", response.text[:500]
        except requests.Timeout:
            status, text = TIMEOUT, ""
        except requests.ConnectionError as exc:
            status, text = CONNECTION_ERROR, str(exc)
            self.session = requests.Session()
        self._record(label, source, status, body if body is not None else "", headers, text)

    @staticmethod
    def _check(case, response) -> Optional[str]:
        """Schemathesis's own verdicts: no 5xx, and a body its negative mode made invalid must be
        refused (the server claims strict parsing: a typo'd field or a "16" for 16 is a 400).
        Returns the failed checks' names, or None."""
        from schemathesis.checks import not_a_server_error
        from schemathesis.core.failures import Failure, FailureGroup
        from schemathesis.specs.openapi.checks import negative_data_rejection

        try:
            case.validate_response(response, checks=[not_a_server_error, negative_data_rejection])
        except FailureGroup as group:
            return "+".join(sorted({type(f).__name__ for f in group.exceptions}))
        except Failure as failure:
            return type(failure).__name__
        return None

    def _post_raw(self, label: str, path: str, body: bytes) -> None:
        headers = {"Content-Type": "application/json"}
        shown = body.decode("utf-8", errors="backslashreplace")
        try:
            response = self.session.post(self.base_url + path, data=body, headers=headers, timeout=self.timeout_s)
            status: Any = response.status_code
            text = response.text if status >= 500 else ""
        except requests.Timeout:
            status, text = TIMEOUT, ""
        except requests.ConnectionError as exc:
            status, text = CONNECTION_ERROR, str(exc)
            self.session = requests.Session()
        self._record(label, "raw", status, shown, headers, text)

    def _post_engine(self, label: str, path: str, body: dict, extra: dict[str, str]) -> None:
        shown = json.dumps(body)  # NaN and Infinity as the bare words Python's parser accepts
        try:
            response = self.session.post(self.base_url + path, data=shown.encode(), timeout=self.timeout_s,
                                         headers={"Content-Type": "application/json", **extra})
            status: Any = response.status_code
            text = response.text
            if status == 200:
                problem = incomplete_answer(text, body)
                if problem:
                    status, text = f"200-{problem}", text[-500:]
            if isinstance(status, int) and status < 500:
                text = ""
        except requests.Timeout:
            status, text = TIMEOUT, ""
        except requests.ConnectionError as exc:
            status, text = CONNECTION_ERROR, str(exc)
            self.session = requests.Session()
        self._record(label, "engine", status, shown, extra, text)

    def _record(self, label: str, source: str, status: Any, body: str, headers: dict[str, str], text: str) -> None:
        self.report.counts[(label, source, status)] += 1
        if self.on_sent is not None:
            self.on_sent()
        if isinstance(status, int) and status < 500:
            return
        if status == TIMEOUT:
            return  # counted; the checks after the run show whether the server let it go
        finding = Finding(label, source, status, body[:2000], headers, text[:2000])
        known = any(op == label and match(body) for op, match in self.known_issues)
        (self.report.known if known else self.report.findings).append(finding)
        log.warning("%s", finding.describe())


def incomplete_answer(text: str, body: dict) -> Optional[str]:
    """Why a 200 is not a whole answer (None when it is): a stream must end with [DONE] and carry
    no error event; a JSON answer must hold one choice per prompt x n."""
    if body.get("stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "stream_without_done"
        if any('"error"' in e and e.startswith('{"error"') for e in events):
            return "stream_error_event"
        return None
    try:
        choices = json.loads(text)["choices"]
    except (ValueError, KeyError, TypeError):
        return "not_json"
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return None if len(choices) == prompts * body.get("n", 1) else "missing_choices"


def summary_lines(report: FuzzReport) -> Iterator[str]:
    yield f"bodies sent: {report.sent} in {report.wall_s:.1f}s ({report.sent / max(report.wall_s, 1e-9):.1f}/s)"
    yield "by source: " + ", ".join(f"{k}={v} ({report.source_s[k]:.0f}s)" for k, v in sorted(report.by_source().items()))
    yield "by status: " + ", ".join(f"{k}={v}" for k, v in sorted(report.by_status().items(), key=lambda kv: str(kv[0])))
    yield (f"5xx: {report.server_errors}; findings (5xx, no answer, incomplete 200): new {len(report.findings)}, "
           f"known {len(report.known)}")
