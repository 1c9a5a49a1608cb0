"""deploy/: the Grafana board and the Prometheus config, held to what sloserve really exports.

Every PromQL expression on the board (panel targets, and the metric in the `$model_name`
variable's `label_values(...)`) is parsed with promql-parser, and the metric names of its
vector and matrix selectors are read off the AST (walked here: promql-parser 0.4, the
declared minimum, has no `walk`; the node types used are the same through 0.12). What servers
export is read from their /metrics with prometheus_client's parser, as sample names (`_total`,
`_bucket`, `_sum`, `_count` included):
- a multi-instance front, in-process over stand-in workers (tests/multi_helpers.py), with
  autoscaling and prefill/decode roles both on so their families are exported (the CLI takes
  the two together too: `--pd P:D --autoscale POLICY --pd-capacity ...`, as the test below runs);
- a real `sloserve serve` (slow: it loads the embedded model), after one answered request and
  one refused one, so its labelled families (by finish reason, rejection reason, route and
  status, QoS class) have samples rather than only HELP/TYPE lines.

Checked: every metric the board selects is exported; every family exported is selected by the
board; label matchers and `by (...)` labels exist on what they select. Not shown on purpose:
the `<name>_created` gauges prometheus_client adds beside its own counters and histograms
(series creation timestamps, not quantities).

Then the board as it runs (slow): a real Prometheus (the Debian package, which `make install`
installs) scrapes a real server and a real front (P/D and autoscaling on) with the shipped job,
and every board query must answer with data through its HTTP API once traffic has flowed.
promtool checks the shipped config; a missing promtool or prometheus is a failure, not a skip.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import promql_parser as promql  # the dev extra
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BOARD = ROOT / "deploy" / "grafana" / "sloserve.json"
BUILDER = ROOT / "deploy" / "grafana" / "build_board.py"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
TARGET_LABELS = {"job", "instance"}  # what Prometheus adds to every scraped series
LABEL_VALUES = re.compile(r"^label_values\((?P<metric>.+),\s*(?P<label>\w+)\)$")
KEY = "sk-board"  # the real servers' API key


# ---- the board --------------------------------------------------------------------------
def load_board() -> dict:
    return json.loads(BOARD.read_text())


def all_panels(board: dict) -> list[dict]:
    out = []
    for p in board["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row keeps its panels inside
    return out


def board_expressions(board: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every query the board runs."""
    exprs = [(f"panel {p['title']!r} {t['refId']}", t["expr"])
             for p in all_panels(board) for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            m = LABEL_VALUES.match(var["query"])
            assert m, f"variable {var['name']}: expected label_values(metric, label), got {var['query']!r}"
            exprs.append((f"variable {var['name']}", m["metric"]))
    return exprs


def nodes(node):
    """`node` and everything under it, depth first (promql-parser's node types, as of 0.4)."""
    yield node
    if isinstance(node, promql.AggregateExpr):
        children = [node.param, node.expr]
    elif isinstance(node, promql.BinaryExpr):
        children = [node.lhs, node.rhs]
    elif isinstance(node, promql.Call):
        children = list(node.args)
    elif isinstance(node, (promql.ParenExpr, promql.UnaryExpr, promql.SubqueryExpr)):
        children = [node.expr]
    elif isinstance(node, promql.MatrixSelector):
        children = [node.vector_selector]
    elif isinstance(node, (promql.VectorSelector, promql.NumberLiteral, promql.StringLiteral)):
        children = []
    else:
        raise TypeError(f"unexpected PromQL node {type(node).__name__}: {node}")
    for child in children:
        if child is not None:
            yield from nodes(child)


def selectors(node) -> list:
    """Every vector selector under `node` (a matrix selector's vector selector included)."""
    return [n for n in nodes(node) if isinstance(n, promql.VectorSelector)]


def metric_name(vs) -> str:
    if vs.name:
        return vs.name
    named = [m.value for m in vs.matchers.matchers if m.name == "__name__" and m.op == promql.MatchOp.Equal]
    assert named, f"selector {vs} names no metric (the board must name each metric literally)"
    return named[0]


def selected(expr: str) -> set[str]:
    return {metric_name(vs) for vs in selectors(promql.parse(expr))}


# ---- what servers export ------------------------------------------------------------------
def exposition(text: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """({family: its sample names}, {sample name: label names as Prometheus stores them}).

    Families named `X_created` beside a counter or histogram family `X` are dropped (see the
    module docstring). A label `instance` in the scraped data is stored as `exported_instance`
    (it clashes with the target label; honor_labels is false by default)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, set[str]] = {}
    types: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = {s.name for s in family.samples}
        types[family.name] = family.type
        for s in family.samples:
            names = {"exported_instance" if k == "instance" else k for k in s.labels}
            labels.setdefault(s.name, set()).update(names | TARGET_LABELS)
    for name in list(families):
        base = name.removesuffix("_created")
        if base != name and types.get(base) in ("counter", "histogram"):
            for sample in families.pop(name):
                labels.pop(sample, None)
    return families, labels


def scrape_front() -> str:
    """/metrics of an in-process front (1 prefill + 1 decode stand-in worker, reactive
    autoscaling that never acts in this test's lifetime) after one routed request."""
    from multi_helpers import FakeWorker, serving_front
    from fleet_helpers import front_config

    async def main() -> str:
        cfg = front_config(router="round-robin", poll_interval_s=0.1, pd=(1, 1), autoscale="reactive",
                           pd_capacity=(10.0, 10.0), pd_min=(1, 1), scaling_interval_s=3600.0)
        workers = lambda slot: FakeWorker(tokens=2, delay=0.01)  # noqa: E731
        async with serving_front(workers, cfg, run_loops=True) as (_, _, port):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                r = await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 2})
                assert r.status_code == 200, r.text
                metrics = await client.get("/metrics")
                assert metrics.status_code == 200, metrics.text
                return metrics.text

    return asyncio.run(main())


@pytest.fixture(scope="module")
def front_metrics():
    return exposition(scrape_front())


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    """A real `sloserve serve` (the embedded model) taking key KEY, shared by this module's tests."""
    from server_helpers import ServerProcess

    server = ServerProcess(["--api-key", KEY, "--log-level", "warning"],
                           tmp_path_factory.mktemp("board") / "server.log", exact=False)
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def server_metrics(real_server):
    """/metrics of a real `sloserve serve` after (at least) an answered request and a refused one."""
    server = real_server
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    ok = httpx.post(server.v1 + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                    timeout=120)
    assert ok.status_code == 200, ok.text
    refused = httpx.post(server.v1 + "/completions", json=body, timeout=30)  # no key: rejected, unauthorized
    assert refused.status_code == 401, refused.text
    metrics = httpx.get(server.base_url + "/metrics", timeout=10)
    assert metrics.status_code == 200, metrics.text
    return exposition(metrics.text)


# ---- tests: the files themselves ------------------------------------------------------------
def test_board_is_what_its_builder_writes_and_the_builder_needs_no_sloserve():
    spec = importlib.util.spec_from_file_location("build_board", BUILDER)
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    assert builder.render() == builder.render() == BOARD.read_text(), \
        "deploy/grafana/sloserve.json is stale: run python deploy/grafana/build_board.py"
    probe = ("import runpy, sys; runpy.run_path(sys.argv[1]); "
             "assert not [m for m in sys.modules if m.split('.')[0] == 'sloserve'], 'imports sloserve'")
    subprocess.run([sys.executable, "-c", probe, str(BUILDER)], check=True, cwd=ROOT, timeout=60)


def test_board_is_a_grafana_dashboard_on_a_templated_prometheus_datasource():
    board = load_board()
    assert board["schemaVersion"] == 39 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query" and LABEL_VALUES.match(model["query"])["label"] == "model_name"
    assert model["datasource"]["uid"] == "${DS_PROMETHEUS}"
    panels = all_panels(board)
    assert len({p["id"] for p in panels}) == len(panels)
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert [r.split(" ")[0] for r in rows] == ["Requests", "Latency", "SLO", "Tokens", "KV", "Engine", "Fleet"]
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for source in [p["datasource"], *(t["datasource"] for t in p["targets"])]:
            assert source == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


def test_every_board_expression_parses_and_names_sloserve_metrics():
    exprs = board_expressions(load_board())
    assert len(exprs) > 40
    for where, expr in exprs:
        names = selected(expr)  # raises on anything promql-parser rejects
        assert names and all(n.startswith("sloserve:") for n in names), (where, expr, names)


def test_prometheus_config_scrapes_localhost_8000_every_5s():
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "sloserve"]
    assert job["metrics_path"] == "/metrics" and job["scrape_interval"] == "5s"
    assert job["static_configs"] == [{"targets": ["localhost:8000"]}]


def test_promtool_accepts_the_prometheus_config():
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: `make install` installs it (Debian package prometheus)"
    out = subprocess.run([promtool, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


# ---- tests: the board against real /metrics --------------------------------------------------
def uncovered(families: dict[str, set[str]]) -> list[str]:
    on_board = set().union(*(selected(expr) for _, expr in board_expressions(load_board())))
    return sorted(f for f, samples in families.items() if not samples & on_board)


def test_the_board_shows_every_family_the_front_exports(front_metrics):
    families, _ = front_metrics
    for needed in ("sloserve:instances", "sloserve:autoscale_target", "sloserve:pd_handoff_seconds",
                   "sloserve:migrations_started", "sloserve:instance_role"):  # autoscaling and P/D were on
        assert needed in families, needed
    assert all(families.values()), [f for f, s in families.items() if not s]  # every family has samples
    assert uncovered(families) == []


@pytest.mark.slow
def test_the_board_shows_every_family_a_server_exports(server_metrics):
    families, _ = server_metrics
    assert len(families) >= 28
    empty = [f for f, s in families.items() if not s]
    assert empty == [], f"families with no sample after a request and a refusal: {empty}"
    assert uncovered(families) == []


@pytest.mark.slow
def test_every_metric_and_label_the_board_selects_is_exported(server_metrics, front_metrics):
    labels: dict[str, set[str]] = {}
    for exported in (server_metrics[1], front_metrics[1]):
        for name, names in exported.items():
            labels.setdefault(name, set()).update(names)
    problems = []
    for where, expr in board_expressions(load_board()):
        ast = promql.parse(expr)
        for vs in selectors(ast):
            name = metric_name(vs)
            if name not in labels:
                problems.append(f"{where}: {name} is not exported")
                continue
            # label="" selects series without the label: fine on any metric
            matched = {m.name for m in vs.matchers.matchers
                       if not (m.op == promql.MatchOp.Equal and m.value == "")} - {"__name__"}
            if not matched <= labels[name]:
                problems.append(f"{where}: {name} has no label {sorted(matched - labels[name])}")
        for node in nodes(ast):
            if isinstance(node, promql.AggregateExpr) and node.modifier is not None \
                    and node.modifier.type == promql.AggModifierType.By:
                under = set().union(*(labels.get(metric_name(vs), set()) for vs in selectors(node.expr)))
                missing = set(node.modifier.labels) - under
                if missing:
                    problems.append(f"{where}: grouping by {sorted(missing)}, which nothing under it has")
    assert problems == [], "\n".join(problems)


# ---- tests: the board's queries on a real Prometheus ------------------------------------------
SCRAPE_S = 1  # scrape interval of the test's Prometheus: the board's 1m and 5m windows hold many scrapes
GRAFANA_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")  # $v, ${v}, ${v:fmt}, [[v]]
# Counters the traffic below must move, as (panel title, refId): their query must be > 0, so data that
# is there but is zero everywhere (say, a series that exists but is never scraped as it grows) fails.
MOVED = [("Finished requests by reason", "A"), ("Rejected requests by reason", "A"),
         ("Token throughput", "B"), ("Requests routed per instance", "A"),
         ("SLO requests per class at the front", "A"), ("P/D hand-offs (per 5 min)", "A")]


def prometheus_config(targets: list[str]) -> dict:
    """deploy/prometheus/prometheus.yml, its `sloserve` job (name, path, labels: what the board's
    queries rely on) pointed at `targets` and scraping every SCRAPE_S seconds."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(scrape_interval=f"{SCRAPE_S}s", evaluation_interval=f"{SCRAPE_S}s")
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "sloserve"]
    job.update(scrape_interval=f"{SCRAPE_S}s", static_configs=[{"targets": targets}])
    return config


def promql_regex(value: str) -> str:
    """`value` as Grafana puts a selected variable value into a `=~"..."` matcher: its regex
    metacharacters escaped, and the backslashes doubled for the PromQL string."""
    return "".join("\\\\" + c if c in "\\^$.|?*+()[]{}" else c for c in value)


# Grafana's built-in interval variables as they would be on a Prometheus data source scraped every
# SCRAPE_S (the board writes its windows literally today; these keep a later $__rate_interval working):
# $__interval is the panel's step, $__rate_interval max($__interval + scrape interval, 4 x scrape interval).
GRAFANA_BUILTINS = {"__interval": f"{SCRAPE_S}s", "__rate_interval": f"{4 * SCRAPE_S}s"}


def grafana_substitute(expr: str, variables: dict[str, str]) -> str:
    """`expr` with its template variables (`variables`, then Grafana's built-in intervals) replaced
    as Grafana would; an unknown one fails."""
    values = {**GRAFANA_BUILTINS, **variables}

    def one(m: re.Match) -> str:
        name = m[1] or m[2] or m[3]
        assert name in values, f"board query uses ${name}, which this test does not fill in: {expr}"
        return values[name]

    return GRAFANA_VARIABLE.sub(one, expr)


class Prometheus:
    """A real `prometheus` on 127.0.0.1 (a free port), its TSDB and config under `workdir`."""

    def __init__(self, targets: list[str], workdir: Path) -> None:
        from server_helpers import free_port, wait_for

        binary = shutil.which("prometheus")
        assert binary, "prometheus not found: `make install` installs it (Debian package prometheus)"
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(prometheus_config(targets)))
        check = subprocess.run([shutil.which("promtool") or "promtool", "check", "config", str(config)],
                               capture_output=True, text=True, timeout=60, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        self.base_url = f"http://127.0.0.1:{free_port()}"
        self.http = httpx.Client(base_url=self.base_url, timeout=10)
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.base_url.removeprefix('http://')}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir)
        try:
            wait_for(self._ready, 30, interval=0.2, what="Prometheus ready")
        except BaseException:
            self.kill()
            raise

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited with {self.proc.returncode}:\n{self.log()}"
        try:
            return self.http.get("/-/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def api(self, path: str, **params) -> dict | list:
        r = self.http.get("/api/v1/" + path, params=params)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list:
        """The instant query's result now (a vector's samples; a scalar as one)."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        from server_helpers import stop_process

        stop_process(self.proc)
        self.http.close()
        self._log.close()


def send_traffic(base_url: str, streams: int) -> str:
    """`streams` completions and chats each, through the official client, streamed and not;
    then one request refused for its key. Returns the served model's name."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    (model,) = [m.id for m in client.models.list().data]
    for i in range(streams):
        prompt = f"Count to {i + 3}:"
        text = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
        assert text
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        messages = [{"role": "user", "content": f"Name {i + 2} colours."}]
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
        assert chat.choices[0].message.content
        chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    stranger = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        stranger.completions.create(model=model, prompt="Hello", max_tokens=2)
    return model


@pytest.mark.slow
def test_every_board_query_has_data_in_a_real_prometheus(real_server, tmp_path):
    """The board as a user sees it: a real Prometheus (deploy/prometheus/prometheus.yml's job,
    scraping every second) scrapes a real `sloserve serve` and a real front over a prefill and a
    decode worker (`--pd 1:1`) with reactive autoscaling that never acts in this test's lifetime,
    so that the P/D and autoscaling families exist too. Traffic goes through both in two rounds
    with a scrape between them (so counters created by the first round grow in the second). Then
    every board query, with `$model_name` as "All" and as the one model the variable's own query
    finds, answers status success and a non-empty result through Prometheus' HTTP API."""
    from server_helpers import ServerProcess, wait_for

    front = ServerProcess(["--pd", "1:1", "--autoscale", "reactive", "--pd-capacity", "10:10",
                           "--scaling-interval", "3600", "--kv-cache-gib", "0.1", "--api-key", KEY,
                           "--log-level", "warning"], tmp_path / "front.log", startup_timeout=300, exact=False)
    servers = {"server": real_server, "front": front}
    prometheus = None
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        wait_for(lambda: [d["status"] for d in httpx.get(front.v1 + "/instances", headers=auth, timeout=10)
                          .json()["data"]] == ["healthy"] * 2, 240, interval=0.5, what="both workers healthy")
        prometheus = Prometheus([s.base_url.removeprefix("http://") for s in servers.values()], tmp_path)

        def scraped_since(t: float) -> bool:
            """Both targets up, each last scraped after wall-clock time t."""
            up = {s["metric"]["instance"]: float(s["value"][1]) for s in prometheus.query("up")}
            last = [float(s["value"][1]) for s in prometheus.query("timestamp(up)")]
            return len(up) == 2 and all(up.values()) and len(last) == 2 and min(last) > t

        wait_for(lambda: scraped_since(0), 30, interval=0.2, what="both targets scraped")
        models = set()
        for _ in range(2):
            models |= {send_traffic(s.base_url, streams=1) for s in servers.values()}
            done = time.time()
            wait_for(lambda done=done: scraped_since(done), 30, interval=0.2,
                     what="a scrape of both after the traffic")
        (model,) = models

        board = load_board()
        (variable,) = [v for v in board["templating"]["list"] if v["name"] == "model_name"]
        found = LABEL_VALUES.match(variable["query"])
        assert prometheus.api(f"label/{found['label']}/values", **{"match[]": found["metric"]}) == [model]
        choices = {"All": {"model_name": variable["allValue"]}, "one": {"model_name": promql_regex(model)}}
        queries = [(f"{where} (model {choice})", grafana_substitute(expr, values))
                   for where, expr in board_expressions(board) for choice, values in choices.items()]

        def empty() -> list[str]:
            return [f"{where}: {expr}" for where, expr in queries if not prometheus.query(expr)]

        deadline = time.monotonic() + 15  # every series has two scrapes in every window by now: bounded slack
        while (missing := empty()) and time.monotonic() < deadline:
            time.sleep(SCRAPE_S)
        assert missing == [], "board queries without data:\n" + "\n".join(missing)

        by_title = {p["title"]: p for p in all_panels(board)}
        for title, ref in MOVED:
            (target,) = [t for t in by_title[title]["targets"] if t["refId"] == ref]
            values = [float(s["value"][1]) for s in prometheus.query(grafana_substitute(target["expr"],
                                                                                         choices["All"]))]
            assert values and max(values) > 0, (title, ref, values)
    except BaseException:
        if prometheus is not None:
            print(prometheus.log()[-4000:])
        raise
    finally:
        if prometheus is not None:
            prometheus.kill()
        front.kill()
