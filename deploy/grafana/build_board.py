"""Build deploy/grafana/sloserve.json, the Grafana dashboard for sloserve's /metrics.

    python deploy/grafana/build_board.py          # rewrite sloserve.json next to this file
    python deploy/grafana/build_board.py --check  # exit 1 if sloserve.json is not what this builds

Edit the panel lists below, not the JSON. The output is deterministic (same input, same
bytes), and tests/test_deploy_board.py checks every expression against real servers'
/metrics: each metric it selects must exist, and each metric family must be on the board.

Conventions:
- every query names its metrics literally (no `{__name__=~...}`), so the test can check them;
- a single server's (and each worker's) series carry `model_name`, filtered by the
  `$model_name` variable (whose "All" is `.+`, so it never matches a series without the
  label); the multi-instance front's series have no `model_name`, which tells its
  `slo_*` counters (as clients saw them) from the workers' ones of the same name;
- the front labels per-instance series `instance="<slot>"`; Prometheus renames a scraped
  label that clashes with its own target label `instance` to `exported_instance`
  (the default `honor_labels: false`), so the fleet row groups by `exported_instance`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("sloserve.json")
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
M = 'model_name=~"$model_name"'  # the single-server filter
RATE = "1m"  # rate window: 12 scrapes at the 5 s interval of deploy/prometheus/prometheus.yml
EVENTS = "5m"  # window for rare events (retries, migrations, scaling): shown as counts per 5 min
QUANTILES = (0.5, 0.9, 0.99)


# ---- query helpers ---------------------------------------------------------------------
def sel(metric: str, labels: str = M) -> str:
    return f"{metric}{{{labels}}}" if labels else metric


def rate(metric: str, by: str = "model_name", labels: str = M, window: str = RATE) -> str:
    return f"sum by ({by}) (rate({sel(metric, labels)}[{window}]))"


def increase(metric: str, labels: str = "") -> str:
    return f"sum(increase({sel(metric, labels)}[{EVENTS}]))"


def quantiles(histogram: str, by: str = "model_name", labels: str = M) -> list[tuple[str, str]]:
    """p50 / p90 / p99 of a Prometheus histogram over the rate window."""
    legend_by = f" {{{{{by}}}}}" if by else ""
    grouping = f"le, {by}" if by else "le"
    return [(f"histogram_quantile({q}, sum by ({grouping}) (rate({sel(histogram + '_bucket', labels)}[{RATE}])))",
             f"p{round(q * 100)}{legend_by}") for q in QUANTILES]


# ---- panels ---------------------------------------------------------------------------
def panel(title: str, targets: list[tuple[str, str]], unit: str = "short", description: str = "",
          width: int = 8, kind: str = "timeseries", stack: bool = False, max_value=None) -> dict:
    """One panel: `targets` are (PromQL, legend) pairs."""
    defaults: dict = {"unit": unit}
    if kind == "timeseries":
        defaults["min"] = 0
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                              "spanNulls": False,
                              "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    if max_value is not None:
        defaults["max"] = max_value
    p = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"h": 8, "w": width, "x": 0, "y": 0},  # placed by rows()
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "targets": [{"datasource": DS, "refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "range": kind != "table", "instant": kind == "table",
                     **({"format": "table"} if kind == "table" else {})}
                    for i, (expr, legend) in enumerate(targets)],
    }
    if kind == "timeseries":
        p["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}}
    elif kind == "table":
        p["options"] = {"showHeader": True}
        p["transformations"] = [{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True},
                                                               "renameByName": {"exported_instance": "instance"}}}]
    return p


REQUESTS = [
    panel("Requests in the engine", [
        (f"sum by (model_name) ({sel('sloserve:num_requests_running')})", "running {{model_name}}"),
        (f"sum by (model_name) ({sel('sloserve:num_requests_waiting')})", "waiting {{model_name}}"),
        (f"sum by (model_name) ({sel('sloserve:num_requests_in_flight')})", "in flight {{model_name}}"),
    ], description="Running: in the batch. Waiting: queued or preempted. In flight: admitted by the HTTP "
                   "server and not yet answered."),
    panel("Finished requests by reason", [
        (rate("sloserve:request_success_total", by="finished_reason"), "{{finished_reason}}"),
    ], unit="reqps", stack=True, description="stop, length, abort (client gone) ..."),
    panel("Rejected requests by reason", [
        (rate("sloserve:requests_rejected_total", by="reason"), "{{reason}}"),
    ], unit="reqps", stack=True, description="Refused before admission: queue_full, slo_unattainable, "
                                             "unauthorized, draining ..."),
    panel("HTTP responses by route and status", [
        (rate("sloserve:http_requests_total", by="route, status"), "{{route}} {{status}}"),
    ], unit="reqps", width=16),
    panel("Streams ended: client stopped reading", [
        (rate("sloserve:client_stalled_total"), "{{model_name}}"),
    ], unit="reqps", description="--client-stall-timeout expired: the client accepted no data."),
]

LATENCY = [
    panel(title, quantiles(metric), unit="s", description=description)
    for title, metric, description in [
        ("Time to first token", "sloserve:time_to_first_token_seconds", "Arrival to first output token."),
        ("Inter-token latency", "sloserve:inter_token_latency_seconds", "Gap between consecutive output tokens."),
        ("Time per output token (per request)", "sloserve:request_time_per_output_token_seconds",
         "Each request's mean gap after its first token (TPOT)."),
        ("End-to-end latency", "sloserve:e2e_request_latency_seconds", "Arrival to last token."),
        ("Queue time", "sloserve:request_queue_time_seconds", "Arrival to first scheduled."),
    ]
]

SLO = [
    panel("SLO attainment, last 5 min", [
        (f"sum by (model_name, qos_class) (rate({sel('sloserve:slo_attained_requests_total')}[{EVENTS}]))"
         f" / sum by (model_name, qos_class) (rate({sel('sloserve:slo_requests_total')}[{EVENTS}]))",
         "{{qos_class}} {{model_name}}"),
    ], unit="percentunit", max_value=1,
        description="Share of finished (not aborted) requests that met their class's TTFT and TBT targets."),
    panel("SLO attainment since start", [
        (sel("sloserve:slo_attainment_ratio"), "{{qos_class}} {{instance}}"),
    ], unit="percentunit", max_value=1, description="The server's own lifetime ratio, per server and class."),
    panel("SLO requests per class", [
        (rate("sloserve:slo_requests_total", by="qos_class"), "finished {{qos_class}}"),
        (rate("sloserve:slo_attained_requests_total", by="qos_class"), "met SLO {{qos_class}}"),
    ], unit="reqps"),
]

TOKENS = [
    panel("Token throughput", [
        (rate("sloserve:prompt_tokens_total"), "prompt {{model_name}}"),
        (rate("sloserve:generation_tokens_total"), "generation {{model_name}}"),
    ], unit="suffix:tok/s"),
    panel("Prompt length per request", quantiles("sloserve:request_prompt_tokens"), unit="suffix: tok"),
    panel("Output length per request", quantiles("sloserve:request_generation_tokens"), unit="suffix: tok"),
]

CACHE = [
    panel("KV-cache usage", [
        (sel("sloserve:kv_cache_usage_perc"), "{{model_name}} {{instance}}"),
    ], unit="percentunit", max_value=1, description="Share of KV blocks referenced, per server."),
    panel("Prefix-cache hit rate", [
        (f"{rate('sloserve:prefix_cache_hits_total')} / {rate('sloserve:prefix_cache_queries_total')}",
         "{{model_name}}"),
    ], unit="percentunit", max_value=1, description="Prompt tokens found in the prefix cache / looked up."),
    panel("Preemptions", [
        (rate("sloserve:num_preemptions_total"), "{{model_name}}"),
    ], unit="ops", description="Running requests preempted (KV memory full), per second."),
]

ENGINE = [
    panel("Engine steps", [
        (rate("sloserve:engine_steps_total"), "{{model_name}}"),
    ], unit="ops", description="Model iterations per second."),
    panel("Batch size", [
        (f"{rate('sloserve:engine_scheduled_seqs_total')} / {rate('sloserve:engine_steps_total')}",
         "mean {{model_name}}"),
        (f"max by (model_name) ({sel('sloserve:engine_max_batch_size')})", "largest so far {{model_name}}"),
    ], description="Mean sequences per step over the rate window; the largest batch since the server started."),
    panel("Speculative decoding", [
        (f"{rate('sloserve:spec_decode_num_accepted_tokens_total')} / "
         f"{rate('sloserve:spec_decode_num_draft_tokens_total')}", "acceptance {{model_name}}"),
    ], unit="percentunit", max_value=1,
        description="Draft tokens the model accepted / drafted. No data without speculative decoding."),
]

I = "exported_instance"  # the front's slot label, as Prometheus stores it (see the module docstring)
FRONT = 'model_name=""'  # series without model_name: the front's own (slo_* exist on both)
FRONT_COUNTERS = ("retries", "failed_midstream", "resumed_midstream", "replacements", "no_instance",
                  "moved_unstarted", "moved_stalled", "pd_fallback", "split_calls")
FLEET = [
    panel("SLO attainment at the front, last 5 min", [
        (f"sum by (qos_class) (rate(sloserve:slo_attained_requests_total{{{FRONT}}}[{EVENTS}]))"
         f" / sum by (qos_class) (rate(sloserve:slo_requests_total{{{FRONT}}}[{EVENTS}]))", "{{qos_class}}"),
    ], unit="percentunit", max_value=1,
        description="Requests answered in full, timed as the clients saw them through the front (TTFT and TPOT "
                    "against their class's targets)."),
    panel("SLO requests per class at the front", [
        (rate("sloserve:slo_requests_total", by="qos_class", labels=FRONT), "finished {{qos_class}}"),
        (rate("sloserve:slo_attained_requests_total", by="qos_class", labels=FRONT), "met SLO {{qos_class}}"),
    ], unit="reqps"),
    panel("Instance health", [
        (f"max by ({I}) (sloserve:instance_healthy)", "instance {{exported_instance}}"),
    ], max_value=1, description="1: takes requests; 0: starting, unresponsive, dead or stopped."),
    panel("Instance roles", [
        (f"max by ({I}, role) (sloserve:instance_role) == 1", ""),
    ], kind="table", description="prefill, decode or mixed, per instance slot."),
    panel("Requests routed per instance", [
        (rate("sloserve:instance_routed_total", by=I, labels=""), "instance {{exported_instance}}"),
    ], unit="reqps", stack=True),
    panel("Running and waiting per instance (as polled)", [
        (f"max by ({I}) (sloserve:instance_num_requests_running)", "running {{exported_instance}}"),
        (f"max by ({I}) (sloserve:instance_num_requests_waiting)", "waiting {{exported_instance}}"),
    ]),
    panel("Proxied by the front per instance", [
        (f"max by ({I}) (sloserve:instance_requests_in_flight)", "instance {{exported_instance}}"),
    ], stack=True),
    panel("KV-cache usage per instance", [
        (f"max by ({I}) (sloserve:instance_kv_cache_usage_perc)", "instance {{exported_instance}}"),
    ], unit="percentunit", max_value=1),
    panel("Front events (per 5 min)", [
        (increase(f"sloserve:front_{name}_total"), name.replace("_", " ")) for name in FRONT_COUNTERS
    ], description="Retries on another instance, streams failed or resumed mid-way, workers replaced, requests "
                   "with no instance, requests moved off stalled workers, decode instances serving whole requests."),
    panel("Live migrations (per 5 min)", [
        (increase("sloserve:migrations_started_total"), "started"),
        (increase("sloserve:migrations_completed_total"), "completed"),
        (increase("sloserve:migrations_aborted_total"), "aborted"),
    ]),
    panel("Migration KV copied", [
        (f"sum(rate(sloserve:migration_bytes_total[{EVENTS}]))", "bytes/s"),
    ], unit="Bps", description="KV bytes copied by completed migrations."),
    panel("Migration pause", [
        (f"sum(rate(sloserve:migration_downtime_seconds_total[{EVENTS}])) / "
         f"sum(rate(sloserve:migrations_completed_total[{EVENTS}]))", "mean per migration"),
    ], unit="s", description="How long a migrated request was paused, on average, over completed migrations."),
    panel("Autoscaling: instances", [
        ("sum by (state) (sloserve:instances)", "{{state}}"),
        ("max(sloserve:autoscale_target)", "target"),
    ], stack=False, description="Slots by state; target: instances the autoscaler wants ready (0 before its first "
                                "decision). Only with --autoscale."),
    panel("Autoscaling actions (per 5 min)", [
        (increase(f"sloserve:autoscale_{key}_total"), key.replace("_", " "))
        for key in ("starts", "stops", "drains", "cancelled", "taken_back")
    ]),
    panel("P/D hand-offs (per 5 min)", [
        (increase("sloserve:pd_handoffs_started_total"), "started"),
        (increase("sloserve:pd_handoffs_completed_total"), "completed"),
        (increase("sloserve:pd_handoffs_aborted_total"), "aborted"),
        (increase("sloserve:pd_decoded_on_prefill_total"), "decoded on prefill"),
    ], description="Prefill -> decode hand-offs; decoded on prefill: streams no decode instance took. Only with --pd."),
    panel("P/D hand-off aborts and streams kept (per 5 min)", [
        (f"sum by (reason) (increase(sloserve:pd_handoff_aborts_total[{EVENTS}]))", "aborted: {{reason}}"),
        (f"sum by (reason) (increase(sloserve:pd_handoffs_kept_total[{EVENTS}]))", "kept: {{reason}}"),
    ], description="Why hand-offs were abandoned (finished: the request ended before its move, nothing lost; the "
                   "refusing worker's code; client_gone, stream_ended), and streams left to decode where they were "
                   "prefilled (finishes_within_handoff: too few tokens left to pay for the move). Only with --pd."),
    panel("P/D hand-off latency", quantiles("sloserve:pd_handoff_seconds", by="", labels=""), unit="s",
          description="First token on the prefill instance to the next on the decode instance."),
    panel("P/D hand-off KV bytes", [
        (f"sum(rate(sloserve:pd_handoff_bytes_total[{EVENTS}]))", "bytes/s"),
        (f"sum(rate(sloserve:pd_handoff_pipelined_bytes_total[{EVENTS}]))", "sent during the prefill"),
    ], unit="Bps", description="All hand-off KV bytes, and those a pipelined transfer sent while the prompt was "
                               "computed (--pd-transfer pipelined)."),
]

ROWS = [
    ("Requests", REQUESTS),
    ("Latency", LATENCY),
    ("SLO", SLO),
    ("Tokens", TOKENS),
    ("KV and prefix cache", CACHE),
    ("Engine", ENGINE),
    ("Fleet (multi-instance front: `sloserve serve --instances N`)", FLEET),
]


def rows() -> list[dict]:
    """Row headers and their panels, laid out left to right, 24 columns wide; ids in order."""
    out, y, next_id = [], 0, 1
    for title, panels in ROWS:
        out.append({"type": "row", "title": title, "collapsed": False, "id": next_id, "panels": [],
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        next_id, y, x = next_id + 1, y + 1, 0
        for p in panels:
            w, h = p["gridPos"]["w"], p["gridPos"]["h"]
            if x + w > 24:
                x, y = 0, y + h
            out.append({**p, "id": next_id, "gridPos": {"h": h, "w": w, "x": x, "y": y}})
            next_id, x = next_id + 1, x + w
        y += 8
    return out


def board() -> dict:
    return {
        "title": "sloserve",
        "uid": "sloserve",
        "description": "sloserve: requests, latency, SLO attainment, tokens, KV cache, engine and fleet "
                       "(built by deploy/grafana/build_board.py)",
        "tags": ["sloserve", "llm"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "timezone": "",
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
            {"name": "model_name", "label": "Model", "type": "query", "datasource": DS,
             "query": "label_values(sloserve:num_requests_running, model_name)",
             "definition": "label_values(sloserve:num_requests_running, model_name)",
             "includeAll": True, "allValue": ".+", "multi": True, "current": {}, "hide": 0, "refresh": 2,
             "regex": "", "sort": 1, "options": []},
        ]},
        "panels": rows(),
    }


def render() -> str:
    return json.dumps(board(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv[1:] == ["--check"]:
        if OUT.read_text() != text:
            print(f"{OUT} is stale: run python {Path(__file__).as_posix()}", file=sys.stderr)
            return 1
        return 0
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
