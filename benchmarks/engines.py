"""sloserve against llama.cpp's own C++ server on the same GGUF file: one system at a time on the same
cores, interleaved repeats, closed-loop load at fixed concurrency, and the greedy outputs compared.

Both read the very same weights (the GGUF); on Q4_0/Q4_1 files both multiply the file's 4-bit codes
by 8-bit activations (llama.cpp's Q4 x Q8 dot products, sloserve's W4A8 kernels), so the pair is
matched in precision; on other types the table says what each engine computes in. Load comes from
`sloserve bench` (the same client for both: synthetic prompts of `--input-len` tokens of the
model's own tokenizer, `--output-len` tokens with EOS ignored, temperature 0), `--requests` per
concurrency level, all sent at once and capped at the concurrency.

    benchmarks/peers/setup_llama_server.sh          # once: builds .peers/llama-server
    .venv/bin/python benchmarks/engines.py --model benchmarks/results/models/qwen2.5-0.5b/qwen2.5-0.5b-q4_0.gguf

Writes benchmarks/results/engines-<time>/results.json and report.md (one row per system and
concurrency: the median over repeats with the min-max spread, and sloserve's ratio to llama-server).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv" / "bin"
# What each engine computes a GGUF type in (the precision column of every row).
PRECISION = {
    "Q4_0": ("4-bit codes x int8 activations (Q4_0 x Q8_0)", "4-bit codes x int8 activations (W4A8)"),
    "Q4_1": ("4-bit codes x int8 activations (Q4_1 x Q8_1)", "4-bit codes x int8 activations (W4A8)"),
    "Q8_0": ("8-bit codes x int8 activations (Q8_0 x Q8_0)", "dequantized at load (bf16 or float32, --dtype)"),
    "F16": ("f16 weights", "bf16 or float32 (--dtype)"),
    "BF16": ("bf16 weights", "bf16 or float32 (--dtype)"),
    "F32": ("float32", "float32 (--dtype float32)"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gguf_type(path: Path) -> str:
    from sloserve.engine.gguf_file import read_gguf

    kinds = {}
    for t in read_gguf(path).tensors:
        if len(t.shape) == 2:
            kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    return max(kinds, key=kinds.get)


def start(system: str, model: Path, port: int, threads: int, slots: int, context: int, log: Path):
    if system == "sloserve":
        cmd = [str(VENV / "sloserve"), "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--num-threads", str(threads), "--max-num-seqs", str(slots), "--log-level", "warning"]
    else:
        cmd = [str(ROOT / ".peers" / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(slots), "-c", str(context * slots), "-t", str(threads), "-tb", str(threads)]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{system} exited: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{system} did not come up: see {log}")


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench(url: str, system: str, concurrency: int, requests: int, args, seed: int, out: Path) -> dict:
    cmd = [str(VENV / "sloserve"), "bench", "--base-url", url, "--workload", "synthetic", "--input-len",
           str(args.input_len), "--output-len", str(args.output_len), "--rate", "inf", "--max-concurrency",
           str(concurrency), "--num-requests", str(requests), "--seed", str(seed), "--no-progress", "--out", str(out)]
    if system == "llama-server":
        cmd += ["--backend", "llamacpp"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((out / "results.json").read_text())["runs"][0]["summary"]["overall"]
    lat = summary["latency"]
    return {"output_tok_s": summary["output_throughput"], "tpot_p50_ms": lat["tpot"]["percentiles"]["p50"] * 1e3,
            "ttft_p50_ms": lat["ttft"]["percentiles"]["p50"] * 1e3, "failed": summary["failed"]}


def greedy_text(url: str, system: str, n: int = 48) -> str:
    body = {"prompt": "The history of the printing press begins", "max_tokens": n, "temperature": 0,
            "ignore_eos": True}
    if system == "llama-server":
        body["n_predict"] = n
    return httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a GGUF file both systems serve")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: 4 x concurrency, >= 8)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not (ROOT / ".peers" / "llama-server").exists():
        print("engines.py: error: run benchmarks/peers/setup_llama_server.sh first", file=sys.stderr)
        return 2
    levels = [int(c) for c in args.concurrency.split(",")]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "benchmarks" / "results" / f"engines-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    kind = gguf_type(args.model)
    llama_prec, sloserve_prec = PRECISION.get(kind, (kind, kind))
    precision = {"llama-server": llama_prec, "sloserve": sloserve_prec}
    runs: list[dict] = []
    texts: dict[str, str] = {}
    context = args.input_len + args.output_len + 64
    for rep in range(args.repeats):
        order = ("sloserve", "llama-server") if rep % 2 == 0 else ("llama-server", "sloserve")
        for system in order:  # one at a time, alternating which goes first
            port = free_port()
            proc = start(system, args.model, port, args.threads, max(levels), context, out / f"{system}-{rep}.log")
            url = f"http://127.0.0.1:{port}"
            try:
                texts.setdefault(system, greedy_text(url, system))
                for li, c in enumerate(levels):
                    n = args.requests or max(8, 4 * c)
                    # One seed per (repeat, level), the same for both systems: a level drawn with
                    # the previous level's seed re-sends its prompts, which a prefix cache serves.
                    seed = rep * len(levels) + li
                    row = bench(url, system, c, n, args, seed, out / f"{system}-c{c}-r{rep}")
                    runs.append({"system": system, "repeat": rep, "concurrency": c, "requests": n, **row})
                    print(f"repeat {rep} {system:12s} c={c:3d}: {row['output_tok_s']:7.1f} tok/s, "
                          f"TPOT p50 {row['tpot_p50_ms']:6.1f} ms, TTFT p50 {row['ttft_p50_ms']:7.1f} ms", flush=True)
            finally:
                stop(proc)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    meta = {"model": str(args.model), "gguf_type": kind, "precision": precision, "threads": args.threads, "cpu": cpu,
            "input_len": args.input_len, "output_len": args.output_len, "date": stamp, "greedy_text": texts}
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    lines = [f"# sloserve vs llama-server on {args.model.name} ({kind})", "",
             f"{cpu}, {args.threads} threads each, one system at a time, {args.repeats} interleaved repeats; "
             f"prompts {args.input_len} tokens, outputs {args.output_len} (EOS ignored). Median (min-max).", "",
             "| system | precision | concurrency | output tok/s | TPOT p50 ms | TTFT p50 ms | sloserve / llama tok/s |",
             "|---|---|---:|---|---|---|---:|"]

    def agg(system: str, c: int, key: str) -> tuple[float, float, float]:
        vals = [r[key] for r in runs if r["system"] == system and r["concurrency"] == c]
        return statistics.median(vals), min(vals), max(vals)

    for c in levels:
        for system in ("sloserve", "llama-server"):
            tok, tpot, ttft = (agg(system, c, k) for k in ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms"))
            ratio = agg("sloserve", c, "output_tok_s")[0] / agg("llama-server", c, "output_tok_s")[0]
            lines.append(f"| {system} | {precision[system]} | {c} | {tok[0]:.1f} ({tok[1]:.1f}-{tok[2]:.1f}) | "
                         f"{tpot[0]:.1f} ({tpot[1]:.1f}-{tpot[2]:.1f}) | {ttft[0]:.0f} ({ttft[1]:.0f}-{ttft[2]:.0f}) | "
                         f"{ratio:.2f}x |" if system == "sloserve" else
                         f"| {system} | {precision[system]} | {c} | {tok[0]:.1f} ({tok[1]:.1f}-{tok[2]:.1f}) | "
                         f"{tpot[0]:.1f} ({tpot[1]:.1f}-{tpot[2]:.1f}) | {ttft[0]:.0f} ({ttft[1]:.0f}-{ttft[2]:.0f}) | |")
    a, b = texts.get("sloserve", ""), texts.get("llama-server", "")
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lines += ["", f"Greedy output, 48 tokens of one prompt: the first {same} characters agree "
                  f"({len(a)} and {len(b)} characters).", ""]
    (out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
