"""One `sloserve bench` invocation: for each rate, build the workload, send it, summarize it.

Glue between the workload library, the client, the metrics and the reports; no HTTP details
and no tokenizer loading here (the tokenizer comes in as an object), so it is testable with the
fake server and a toy tokenizer.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from sloserve.bench.client import BenchClient, ClientConfig, RunResult
from sloserve.bench.metrics import SLO, slo_checker, summarize
from sloserve.bench.timeline import client_timeline, server_timeline
from sloserve.core.records import RequestRecord
from sloserve.bench.report import fmt_rate, report_markdown
from sloserve.bench.result import BenchResult, save_results
from sloserve.workload.build import WorkloadSpec, build_stream
from sloserve.workload.mix import Mix
from sloserve.workload.synth import PromptFormat, PromptSynthesizer, TokenizerLike
from sloserve.workload.traces import sharegpt_texts, shared_path
from sloserve.workload.types import WorkloadRequest

log = logging.getLogger(__name__)

WARMUP_MAX_TOKENS = 16
WARMUP_SEED_OFFSET = 7919


class BenchError(RuntimeError):
    """The server cannot be benchmarked (e.g. every warm-up request failed)."""


@dataclass
class BenchPlan:
    """What to run: a workload (rates left open), how to reach the server, what to check."""

    spec: WorkloadSpec
    client: ClientConfig
    rates: Sequence[Optional[float]] = (None,)  # None = replay / the spec's own arrivals
    slo: SLO = field(default_factory=SLO)
    prompt_format: PromptFormat = "text"
    out_dir: Optional[Path] = None
    warmup: int = 1  # requests sent one by one before the first run, not recorded
    extra_config: dict = field(default_factory=dict)  # recorded in the result file as is

    def class_slos(self) -> dict[str, SLO]:
        return class_slos(self.spec.mix)


def class_slos(mix: Optional[Mix]) -> dict[str, SLO]:
    """Each class's targets as an SLO: TTFT, TBT checked as TPOT (as vLLM's goodput), E2E."""
    if mix is None:
        return {}

    return {c.name: replace(c.qos.slo, e2e_s=c.e2e_target_s if math.isfinite(c.e2e_target_s) else None)
            for c in mix.classes}


def default_synthesizer(tokenizer: TokenizerLike, seed: int) -> PromptSynthesizer:
    """Prompts cut from ShareGPT text (the shared file), tokenized by the served model's tokenizer."""
    return PromptSynthesizer(tokenizer, sharegpt_texts(shared_path("sharegpt")), seed=seed)


def prepare(spec: WorkloadSpec, synthesizer: Optional[PromptSynthesizer], fmt: PromptFormat) -> list[WorkloadRequest]:
    """The requests of one run, each with a prompt in `fmt`."""
    reqs = build_stream(spec)
    if synthesizer is None:
        missing = sum(1 for r in reqs if not r.has_prompt)
        if missing:
            raise ValueError(f"{missing} requests have only token counts; a tokenizer is needed to synthesize prompts")
        return reqs
    return synthesizer.synthesize(reqs, fmt, max_prompt_len=spec.max_prompt_len)


def kept_apart(requests: list[WorkloadRequest], run: int,
               synthesizer: Optional[PromptSynthesizer]) -> list[WorkloadRequest]:
    """The requests of a sweep's `run`-th rate (as `prepare` gave them), their prompts led by a tag
    of that run (none for the first): every rate sends the same prompts, and a server with prefix
    caching would otherwise serve every rate after the first from the KV cache the first left.
    Prompts that share a prefix within a run still share it: they all get the same tag. Token
    prompts keep their length (the tag goes first, their last tokens go); text prompts grow by it."""
    if run == 0:
        return requests
    tag = f"[rate {run}] "
    out = []
    for r in requests:
        if r.prompt_token_ids is None:
            out.append(replace(r, prompt_text=tag + r.prompt_text))
            continue
        if synthesizer is None:
            raise ValueError("keeping a sweep's rates apart needs a tokenizer for token prompts")
        ids = (synthesizer.tokenizer.encode(tag) + list(r.prompt_token_ids))[:len(r.prompt_token_ids)]
        out.append(replace(r, prompt_token_ids=ids))
    return out


def config_dict(plan: BenchPlan, rate: Optional[float], model: Optional[str]) -> dict:
    s, c = plan.spec, plan.client
    return {
        "base_url": c.base_url, "model": model, "endpoint": c.endpoint, "backend": c.backend,
        "workload": s.name, "rate": fmt_rate(rate), "replay": rate is None and s.replay,
        "arrival_process": s.arrival_process, "cv": s.cv, "time_scale": s.time_scale, "start_s": s.start_s,
        "num_requests": s.num_requests, "duration_s": s.duration_s, "max_concurrency": c.max_concurrency,
        "seed": s.seed, "prompt_format": plan.prompt_format, "max_prompt_len": s.max_prompt_len,
        "max_output_len": s.max_output_len, "request_timeout_s": c.request_timeout_s,
        "ignore_eos": c.ignore_eos, "slo": {"ttft_s": plan.slo.ttft_s, "tpot_s": plan.slo.tpot_s,
                                            "e2e_s": plan.slo.e2e_s},
        **plan.extra_config,
    }


def run_plan(plan: BenchPlan, synthesizer: Optional[PromptSynthesizer],
             on_run_start: Optional[Callable[[Optional[float], int], None]] = None,
             on_record: Optional[Callable[[RequestRecord], None]] = None,
             write: bool = True) -> list[BenchResult]:
    """Run every rate in turn; write results.json, report.md and PNGs when `out_dir` is set."""
    results = []
    for i, rate in enumerate(plan.rates):
        spec = plan.spec if rate is None else replace(plan.spec, rate=rate, replay=False)
        requests = kept_apart(prepare(spec, synthesizer, plan.prompt_format), i, synthesizer)
        if i == 0 and plan.warmup > 0:
            # Drawn with another seed: warm-up prompts that are also measured would be prefix-cache hits.
            warm_up(plan.client, prepare(replace(spec, seed=spec.seed + WARMUP_SEED_OFFSET), synthesizer,
                                         plan.prompt_format)[:plan.warmup])
        if on_run_start is not None:
            on_run_start(rate, len(requests))
        log.info("rate %s: %d requests", fmt_rate(rate), len(requests))
        client_cfg = replace(plan.client, duration_s=plan.spec.duration_s)
        started = time.time()
        run: RunResult = asyncio.run(BenchClient(client_cfg, on_record=on_record).run(requests))
        summary = summarize(run.records, run.duration_s, plan.slo, plan.class_slos())
        label = f"{run.model or plan.client.base_url} · {spec.name} · " + (
            f"rate {fmt_rate(rate)}" if rate is not None else ("replay" if spec.replay else "burst"))
        timeline = None
        if plan.out_dir is not None:  # report.html: the server's own view of the run, else the client's
            met = slo_checker(plan.slo, plan.class_slos())
            if plan.client.backend == "openai":
                timeline = server_timeline(plan.client.base_url, auth_headers(plan.client), started, time.time(),
                                           run.records, met)
            if timeline is None:
                timeline = client_timeline(run.records, run.duration_s, met)
        results.append(BenchResult(label, summary, run.records, rate, config_dict(plan, rate, run.model),
                                   run.num_unsent, timeline))
    if write and plan.out_dir is not None:
        write_outputs(results, plan.out_dir)
    return results


def auth_headers(client: ClientConfig) -> dict:
    headers = dict(client.extra_headers)
    if client.api_key:
        headers["Authorization"] = f"Bearer {client.api_key}"
    return headers


def warm_up(client: ClientConfig, requests: Sequence[WorkloadRequest]) -> None:
    """Send a few requests and discard them: first-use costs (connection set-up, kernel
    compilation, cold caches) stay out of the measurement, and a server that cannot answer at all
    (wrong URL, model or key) fails the run with its error instead of N failed records. The first
    goes alone; the rest go at once, so what batched steps pay on first use is paid here too,
    not by the first rate measured."""
    if not requests:
        return
    reqs = [replace(r, arrival_s=0.0, output_len=min(r.output_len, WARMUP_MAX_TOKENS)) for r in requests]
    records = asyncio.run(BenchClient(replace(client, max_concurrency=1, duration_s=None)).run(reqs[:1])).records
    if len(reqs) > 1:
        records += asyncio.run(BenchClient(replace(client, max_concurrency=None, duration_s=None)).run(reqs[1:])).records
    if not any(r.success for r in records):
        first = records[0]
        raise BenchError(f"warm-up request failed ({first.error_kind}): {first.error}")
    log.info("warm-up: %d/%d requests ok", sum(r.success for r in records), len(records))


def write_timelines(results: Sequence[BenchResult], out_dir: Path) -> list[Path]:
    """Each run's fleet timeline as a page with a time slider: report.html for one run; for a
    sweep report-1.html... in run order, and report.html is the last (the highest rate)."""
    from sloserve.dashboard import write_report

    runs = [(i, r) for i, r in enumerate(results, 1) if r.timeline is not None]
    paths = []
    for i, r in runs:
        names = ["report.html"] if len(results) == 1 else [f"report-{i}.html"] + (["report.html"] if r is results[-1] else [])
        for name in names:
            paths.append(write_report(out_dir / name, r.timeline, r.label))  # type: ignore[arg-type]
    return paths


def write_outputs(results: Sequence[BenchResult], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_results(out_dir / "results.json", results)
    (out_dir / "report.md").write_text(report_markdown(results), encoding="utf-8")
    paths = [out_dir / "results.json", out_dir / "report.md"]
    paths += write_timelines(results, out_dir)
    try:
        from sloserve.bench.plots import write_plots

        paths += write_plots(results, out_dir)
    except ImportError as exc:  # matplotlib is a dependency, but a report without PNGs beats none
        log.warning("no PNGs: %s", exc)
    return paths
