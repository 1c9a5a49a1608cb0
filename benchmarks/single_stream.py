#!/usr/bin/env python3
"""Single-stream latency: one request at a time against `sloserve serve` (one or more dtype /
quantization configurations) and against llama.cpp's server (llama-cpp-python) on the same GGUF.

What it measures, per system: TTFT (request sent -> first token chunk) and TPOT ((last token
chunk - first token chunk) / (token chunks - 1)) of `--repeats` streaming completions (default 5),
each sent alone after one uncounted warm-up request, plus the output rate (completion tokens /
end-to-end time). This is the latency of a single user on an idle server: no batching, all cores
on one sequence. The "vs llama.cpp" column is sloserve's TPOT p50 / llama.cpp's (< 1 = sloserve
faster per token).

How, so that the systems are comparable:
* one server at a time, bound to 127.0.0.1, all usable cores (`--num-threads` for sloserve,
  `--n_threads` / `--n_threads_batch` for llama.cpp), the same GGUF file (`--model`, default the
  embedded SmolLM2-135M-Instruct);
* the official `openai` client, completions API, streaming, temperature 0 (greedy),
  `max_tokens=--max-tokens` with EOS ignored. sloserve honours `ignore_eos`; llama-cpp-python's
  server silently drops it, so llama.cpp is sent `min_tokens=max_tokens` instead (EOS masked
  until then, by a Python logits processor) and `repeat_penalty=1.0` (its default 1.1 would make
  it decode something other than plain greedy). Every request records its token count, so a
  system that stopped early shows up in the JSON and the table;
* the prompt: a ShareGPT first turn of about `--prompt-tokens` tokens (the served model's
  tokenizer), read with the repo's ShareGPT loader; each request gets a short distinct prefix
  ("[request N]") so neither server can reuse the previous request's KV cache (both would:
  sloserve's prefix cache, llama-cpp-python's prefix match) and TTFT includes a real prefill.
  `--same-prompt` sends byte-identical prompts instead.

Output: a table; benchmarks/results/single_stream-STAMP.json (every request's raw numbers, CPU
model, core count, versions, server command lines) with single_stream-STAMP.png (TPOT p50 per
system) beside it; server logs in single_stream-STAMP.logs/.

llama.cpp lives in .venv-llamacpp: run benchmarks/peers/setup_llama_cpp.sh once (a source build,
10-20 min on 2 cores). `--peer none` runs sloserve only.

    python benchmarks/single_stream.py --configs float32,bfloat16 --repeats 5 --max-tokens 256
    python benchmarks/single_stream.py --configs float32,bfloat16+int8,bfloat16+int4 --peer llamacpp
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import machine_info, usable_cores  # noqa: E402  (the benchmarks' shared helpers)

from sloserve.bench.local_server import SLOSERVE_SERVE, LocalServer  # noqa: E402
from sloserve.bench.precision import SYNTAX as PRECISION_SYNTAX  # noqa: E402
from sloserve.bench.precision import Precision, parse_precision_list  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LLAMACPP_PYTHON = REPO / ".venv-llamacpp" / "bin" / "python"
LLAMACPP_SETUP = "benchmarks/peers/setup_llama_cpp.sh"
SERVED_NAME = "smollm2-135m"
# Used when the ShareGPT file is not there: ~100 tokens of ordinary English prose.
FALLBACK_PROMPT = (
    "I am planning a two-week trip through northern Italy in late September with my partner. We like "
    "small towns, good food and easy hikes more than museums, and we would rather not drive in big cities. "
    "We will arrive in Milan and leave from Venice. Could you suggest a day-by-day itinerary that uses "
    "trains where possible, says which towns are worth a night and which only a day trip, and adds a few "
    "tips on what to eat in each region?"
)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="default,float32,bfloat16",
                   help=f"comma-separated sloserve configs, each {PRECISION_SYNTAX}: default = no precision flags "
                        "(the server's auto choices), D = `--dtype D --quantization none`, D+Q = `--dtype D "
                        "--quantization Q`, /only = `--quantized-only` (default: %(default)s)")
    p.add_argument("--peer", choices=["llamacpp", "none"], default="llamacpp",
                   help="llama.cpp's server after the sloserve configs, or none (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed requests per system, after one warm-up (default: 5)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens generated per request, EOS ignored (default: 256)")
    p.add_argument("--prompt-tokens", type=int, default=100,
                   help="ShareGPT prompt length to pick, in model tokens, +-10%% (default: 100)")
    p.add_argument("--same-prompt", action="store_true",
                   help="send byte-identical prompts (then both servers reuse cached KV and TTFT is mostly not prefill)")
    p.add_argument("--threads", type=int, default=None, help="threads for every server (default: usable cores)")
    p.add_argument("--model", type=Path, default=None, help="GGUF file served by all systems (default: the embedded model)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra option for every `sloserve serve` (repeatable, e.g. --server-arg=--no-native-kernels)")
    p.add_argument("--llamacpp-python", type=Path, default=LLAMACPP_PYTHON,
                   help=f"python of the llama-cpp-python venv (default: .venv-llamacpp, made by {LLAMACPP_SETUP})")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default: benchmarks/results/single_stream-STAMP.json; the PNG goes beside it)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.max_tokens < 2:
        p.error("--repeats must be >= 1 and --max-tokens >= 2 (TPOT needs two tokens)")
    try:
        args.config_list = parse_precision_list(args.configs)
    except ValueError as exc:
        p.error(f"--configs: {exc}")
    return args


# ---------------------------------------------------------------------- systems


@dataclass
class System:
    name: str  # "sloserve float32", "llama.cpp"
    kind: str  # "sloserve" | "llamacpp"
    launcher: list[str]
    server_args: list[str]
    extra_body: dict[str, Any]
    health_path: str = "/health"

    def command(self) -> str:
        return " ".join([*self.launcher, "--host", "127.0.0.1", "--port", "PORT", *self.server_args])


class PolledServer(LocalServer):
    """`LocalServer` for a server without `GET /health` (llama-cpp-python's): ready once
    `health_path` answers 200."""

    def __init__(self, *a: Any, health_path: str = "/health", **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.health_path = health_path

    def wait_ready(self, timeout: float = 300.0) -> None:
        if self.health_path == "/health":
            return super().wait_ready(timeout)
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}; see {self._log.name}")
            try:
                if httpx.get(self.base_url + self.health_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise SystemExit(f"server not ready after {timeout}s; see {self._log.name}")


def sloserve_system(precision: Precision, args: argparse.Namespace, threads: int, gguf: str) -> System:
    server_args = ["--model", gguf, *precision.serve_args, "--num-threads", str(threads),
                   "--served-model-name", SERVED_NAME]
    name = f"sloserve {precision.label}"
    return System(name, "sloserve", list(SLOSERVE_SERVE), server_args + list(args.server_arg),
                  extra_body={"ignore_eos": True})


def llamacpp_system(args: argparse.Namespace, threads: int, gguf: str) -> System:
    server_args = ["--model", gguf, "--model_alias", SERVED_NAME, "--n_threads", str(threads),
                   "--n_threads_batch", str(threads), "--n_ctx", "2048"]
    # ignore_eos is accepted but dropped by llama-cpp-python (not a field of its request model);
    # min_tokens is its way to keep generating past EOS. repeat_penalty=1.0: plain greedy, as sloserve.
    return System("llama.cpp", "llamacpp", [str(args.llamacpp_python), "-m", "llama_cpp.server"], server_args,
                  extra_body={"ignore_eos": True, "min_tokens": args.max_tokens, "repeat_penalty": 1.0},
                  health_path="/v1/models")


# ---------------------------------------------------------------------- prompt


def pick_prompt(target: int) -> dict[str, Any]:
    """The first ShareGPT first turn (file order) of target +-10% model tokens; a fixed text without the file."""
    from sloserve.bench.tokenizer import load_bench_tokenizer
    from sloserve.workload.traces import iter_sharegpt, shared_path

    tok = load_bench_tokenizer(None)
    lo, hi = int(target * 0.9), int(target * 1.1) + 1
    try:
        path = shared_path("sharegpt")
        for d in iter_sharegpt(path):
            cl100k = int(d.get("prompt_tokens_cl100k", 0))
            if not (0.6 * target <= cl100k <= 1.4 * target):  # cheap pre-filter before tokenizing
                continue
            n = len(tok.encode(d["prompt"]))
            if lo <= n <= hi:
                return {"source": f"{path.name} id {d.get('id', '?')}", "text": d["prompt"], "model_tokens": n}
    except FileNotFoundError:
        pass
    return {"source": "fixed text in single_stream.py (ShareGPT file not found or no prompt of that length)",
            "text": FALLBACK_PROMPT, "model_tokens": len(tok.encode(FALLBACK_PROMPT))}


def request_prompt(base: str, index: int, same: bool) -> str:
    return base if same else f"[request {index}] {base}"


# ---------------------------------------------------------------------- measuring


@dataclass
class RequestResult:
    index: int  # 0 = the warm-up
    ttft_s: float = float("nan")
    tpot_s: float = float("nan")
    e2e_s: float = float("nan")
    token_chunks: int = 0
    completion_tokens: Optional[int] = None  # from usage, where the server sends it in the stream
    prompt_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    output_chars: int = 0
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each token chunk, from the send

    @property
    def tokens(self) -> int:
        """Output tokens: usage's count where there is one, else one per token chunk."""
        return self.completion_tokens if self.completion_tokens is not None else self.token_chunks


def one_request(client: Any, prompt: str, index: int, system: System, args: argparse.Namespace) -> RequestResult:
    r = RequestResult(index)
    t0 = time.perf_counter()
    stream = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=args.max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body=system.extra_body)
    for chunk in stream:
        now = time.perf_counter() - t0
        if chunk.usage is not None:
            r.completion_tokens, r.prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
        for choice in chunk.choices:
            # A token chunk: one with text, or an empty one mid-stream (sloserve sends a chunk per
            # token even when its text is held back or is a skipped special token). Not counted:
            # llama-cpp-python's closing chunk, which has no text and only the finish_reason.
            if choice.text or choice.finish_reason is None:
                r.chunk_times_s.append(now)
                r.output_chars += len(choice.text or "")
            if choice.finish_reason:
                r.finish_reason = choice.finish_reason
    r.e2e_s = time.perf_counter() - t0
    r.token_chunks = len(r.chunk_times_s)
    if r.chunk_times_s:
        r.ttft_s = r.chunk_times_s[0]
    if r.token_chunks >= 2:
        r.tpot_s = (r.chunk_times_s[-1] - r.chunk_times_s[0]) / (r.token_chunks - 1)
    return r


def summarize(requests: list[RequestResult], max_tokens: int) -> dict[str, Any]:
    timed = [r for r in requests if r.index > 0]
    ttft = [r.ttft_s for r in timed if r.ttft_s == r.ttft_s]
    tpot = [r.tpot_s for r in timed if r.tpot_s == r.tpot_s]
    rate = [r.tokens / r.e2e_s for r in timed if r.e2e_s > 0]
    tokens = [r.tokens for r in timed]
    return {
        "requests": len(timed),
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "tpot_p50_s": statistics.median(tpot) if tpot else None,
        "tpot_min_s": min(tpot) if tpot else None,
        "tpot_max_s": max(tpot) if tpot else None,
        "output_tok_s_p50": statistics.median(rate) if rate else None,
        "tokens_per_request": tokens,
        "all_exactly_max_tokens": all(t == max_tokens for t in tokens),
        "chunks_match_tokens": all(r.completion_tokens is None or r.completion_tokens == r.token_chunks for r in timed),
    }


def run_system(system: System, args: argparse.Namespace, base_prompt: str, logs: Path,
               console: Console) -> dict[str, Any]:
    from openai import OpenAI

    record: dict[str, Any] = {"name": system.name, "kind": system.kind, "command": system.command(),
                              "extra_body": system.extra_body, "ok": False}
    log = logs / (system.name.replace(" ", "_").replace("+", "_") + ".log")
    record["log"] = str(log.relative_to(REPO)) if log.is_relative_to(REPO) else str(log)
    server = PolledServer(system.server_args, log, launcher=system.launcher, health_path=system.health_path)
    requests: list[RequestResult] = []
    try:
        with console.status(f"[bold]{system.name}[/]: starting the server"):
            t = time.perf_counter()
            server.wait_ready(timeout=600)
            record["startup_s"] = time.perf_counter() - t
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                        timeout=args.request_timeout)
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.fields[last]}"), console=console)
        with progress:
            task = progress.add_task(f"{system.name} (1 warm-up + {args.repeats})", total=args.repeats + 1, last="")
            for i in range(args.repeats + 1):
                r = one_request(client, request_prompt(base_prompt, i, args.same_prompt), i, system, args)
                requests.append(r)
                progress.update(task, advance=1, last=f"TTFT {1e3 * r.ttft_s:.1f} ms, TPOT {1e3 * r.tpot_s:.2f} ms, "
                                                     f"{r.tokens} tok" + (" (warm-up)" if i == 0 else ""))
        record["ok"] = True
    except SystemExit as exc:  # LocalServer: the server died or never got ready
        record["error"] = f"{exc}; last log line: {last_line(log)}"
    except Exception as exc:  # noqa: BLE001  (a failed system is one line; the others still run)
        record["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        record["server_exit_code"] = server.stop()
    if not record["ok"]:
        console.print(f"[red]{system.name}: failed[/]: {record['error']}")
    record["requests"] = [asdict(r) for r in requests]
    record["summary"] = summarize(requests, args.max_tokens) if record["ok"] else None
    return record


def last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"


# ---------------------------------------------------------------------- report


def versions(args: argparse.Namespace) -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("sloserve", "torch", "openai"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if args.peer == "llamacpp" and args.llamacpp_python.is_file():
        try:
            out["llama-cpp-python"] = subprocess.run(
                [str(args.llamacpp_python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                capture_output=True, text=True, check=True, timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out["llama-cpp-python"] = "unknown"
    return out


def ratio_to_peer(record: dict[str, Any], peer: Optional[dict[str, Any]]) -> Optional[float]:
    """This system's TPOT p50 / llama.cpp's (< 1 = faster per token than llama.cpp)."""
    if not record["ok"] or peer is None or not peer["ok"]:
        return None
    a, b = record["summary"]["tpot_p50_s"], peer["summary"]["tpot_p50_s"]
    return a / b if a is not None and b else None


def ms(x: Optional[float], digits: int = 1) -> str:
    return "—" if x is None else f"{1e3 * x:.{digits}f}"


def print_table(console: Console, report: dict[str, Any]) -> None:
    t = Table(title=f"single stream: {report['workload']['max_tokens']} tokens, {report['workload']['repeats']} "
                    f"requests each, {report['machine']['cpu']} x{report['machine']['usable_cores']}")
    t.add_column("system", no_wrap=True)
    for col in ("TTFT p50 ms", "TPOT p50 ms", "TPOT min ms", "tok/s e2e", "tokens", "vs llama.cpp"):
        t.add_column(col, justify="right")
    for rec in report["systems"]:
        if not rec["ok"]:
            t.add_row(rec["name"], "[red]failed[/]", "", "", "", "", "")
            continue
        s = rec["summary"]
        toks = sorted(set(s["tokens_per_request"]))
        tok_text = ",".join(map(str, toks)) + ("" if s["all_exactly_max_tokens"] else " [yellow](!)[/]")
        ratio = rec.get("tpot_vs_llamacpp")
        t.add_row(rec["name"], ms(s["ttft_p50_s"]), ms(s["tpot_p50_s"], 2), ms(s["tpot_min_s"], 2),
                  "—" if s["output_tok_s_p50"] is None else f"{s['output_tok_s_p50']:.1f}", tok_text,
                  "—" if ratio is None else f"{ratio:.2f}x")
    console.print(t)
    console.print("tok/s e2e: output tokens / end-to-end time (p50); tokens: per request; "
                  "vs llama.cpp: TPOT p50 / llama.cpp's (< 1 = faster)")
    if any(r["ok"] and not r["summary"]["all_exactly_max_tokens"] for r in report["systems"]):
        console.print("[yellow](!)[/] some requests did not produce exactly --max-tokens tokens; see the JSON")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["systems"] if r["ok"] and r["summary"]["tpot_p50_s"] is not None]
    if not ok:
        return
    names = [r["name"] for r in ok]
    p50 = [1e3 * r["summary"]["tpot_p50_s"] for r in ok]
    lo = [p - 1e3 * r["summary"]["tpot_min_s"] for p, r in zip(p50, ok)]
    hi = [1e3 * r["summary"]["tpot_max_s"] - p for p, r in zip(p50, ok)]
    colors = ["tab:orange" if r["kind"] == "llamacpp" else "tab:blue" for r in ok]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(ok) + 2), 4), layout="constrained")
    bars = ax.bar(names, p50, color=colors, yerr=[lo, hi], capsize=4)
    ax.bar_label(bars, labels=[f"{v:.2f}" for v in p50], padding=3)
    ax.set_ylabel("TPOT p50 (ms/token), whiskers min-max")
    m = report["machine"]
    ax.set_title(f"single stream, {report['workload']['max_tokens']} tokens, greedy, EOS ignored\n"
                 f"{m['cpu']}, {m['usable_cores']} cores", fontsize="medium")
    ax.tick_params(axis="x", labelrotation=20)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    console = Console()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or RESULTS / f"single_stream-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.with_suffix(".logs")
    logs.mkdir(exist_ok=True)

    from sloserve.engine.weights import embedded_model_path

    gguf = str((args.model or Path(embedded_model_path())).resolve())
    threads = args.threads or usable_cores()
    systems = [sloserve_system(c, args, threads, gguf) for c in args.config_list]
    if args.peer == "llamacpp":
        if args.llamacpp_python.is_file():
            systems.append(llamacpp_system(args, threads, gguf))
        else:
            console.print(f"[yellow]llama.cpp peer skipped[/]: {args.llamacpp_python} not found; run {LLAMACPP_SETUP} "
                          f"(or pass --peer none)")

    prompt = pick_prompt(args.prompt_tokens)
    console.print(f"prompt: {prompt['model_tokens']} model tokens from {prompt['source']}; model {gguf}; "
                  f"{threads} threads")
    records = [run_system(s, args, prompt["text"], logs, console) for s in systems]
    peer = next((r for r in records if r["kind"] == "llamacpp"), None)
    for rec in records:
        rec["tpot_vs_llamacpp"] = ratio_to_peer(rec, peer)

    report = {
        "benchmark": "single_stream", "started_utc": stamp,
        "machine": machine_info(), "versions": versions(args),
        "workload": {"repeats": args.repeats, "warmup_requests": 1, "max_tokens": args.max_tokens, "temperature": 0,
                     "ignore_eos": True, "same_prompt": args.same_prompt, "prompt": prompt, "model": gguf,
                     "threads": threads, "client": "openai completions, stream=True"},
        "definitions": {
            "ttft_s": "request sent -> first token chunk (a chunk with text, or an empty one before the finish)",
            "tpot_s": "(last token chunk - first token chunk) / (token chunks - 1)",
            "output_tok_s_p50": "median over requests of output tokens / end-to-end time",
            "tokens": "usage.completion_tokens where the server streams usage (sloserve), else token chunks",
            "tpot_vs_llamacpp": "this system's TPOT p50 / llama.cpp's (< 1 = faster)",
        },
        "args": {k: str(v) for k, v in vars(args).items()},
        "systems": records,
    }
    out.write_text(json.dumps(report, indent=1))
    png = out.with_suffix(".png")
    plot(report, png)
    print_table(console, report)
    console.print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}"
                  + (f" and {png.name}" if png.exists() else "") + f"; server logs in {logs.name}/")
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
