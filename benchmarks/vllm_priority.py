#!/usr/bin/env python3
"""How much of the SLO scheduler's win survives inside an unmodified vLLM: two QoS classes share
vLLM-CPU workers behind sloserve's front, which sends each call its TTFT deadline as vLLM's
`priority` (`--vllm-priority deadline`) or nothing (`none`: vLLM serves in arrival order, its
default). The same workers' model, the same requests, the same rate; a fresh front and fresh vLLM
workers for every run; the two settings interleaved, `--rounds` times each.

    .venv/bin/python benchmarks/vllm_priority.py --model benchmarks/results/smollm2-135m-hf --rate 6

Per run it records each class's SLO attainment and goodput (sloserve's bench client against the
front); the table gives each setting's mean and the spread over rounds, and the ratio of
interactive goodput, deadline over none. Needs `make vllm`; the model is a Hugging Face directory
(`benchmarks/peers/setup_vllm_cpu.sh` writes the embedded model's)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from statistics import fmean

import httpx
import yaml
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("none", "deadline")
# Interactive calls due within a second of arriving, batch ones within half a minute: the mix the
# held-out QoS cells hold (a third interactive)
CLASSES = {"default_class": "batch", "classes": {
    "interactive": {"ttft_ms": 1000, "tbt_ms": 200, "share": 0.3},
    "batch": {"ttft_ms": 30000, "tbt_ms": 1000, "share": 0.7}}}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def one_run(args, setting: str, classes: Path, qos: Path, out: Path, port: int) -> dict:
    """A fresh front and workers, one load, their per-class results."""
    front = subprocess.Popen(
        [sys.executable, "-m", "sloserve.cli", "serve", "--engine", "vllm", "--model", args.model,
         "--served-model-name", "m", "--instances", str(args.instances), "--vllm-priority", setting,
         "--qos-config", str(qos), "--dtype", args.dtype, "--kv-cache-gib", "1", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        stdout=open(out / f"front-{setting}.log", "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json().get("healthy_instances") \
                        == args.instances:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if front.poll() is not None:
                raise RuntimeError(f"the front exited: see {out}/front-{setting}.log")
            time.sleep(1)
        else:
            raise TimeoutError("the vLLM workers did not become healthy in 600 s")
        run_dir = out / f"bench-{setting}"
        subprocess.run([sys.executable, "-m", "sloserve.cli", "bench", "--base-url", f"http://127.0.0.1:{port}",
                        "--model", "m", "--workload", args.workload, "--rate", str(args.rate), "--num-requests",
                        str(args.num_requests), "--classes", str(classes), "--max-output-len", "256",
                        "--seed", str(args.seed), "--out", str(run_dir), "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL)
        summary = json.loads((run_dir / "results.json").read_text())["runs"][0]["summary"]
        return {name: {"attainment": g["slo_attainment"], "goodput": g["goodput"], "completed": g["completed"]}
                for name, g in summary["per_class"].items()}
    finally:
        front.terminate()
        try:
            front.wait(timeout=60)
        except subprocess.TimeoutExpired:
            front.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory vLLM reads")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("--rate", type=float, required=True, help="req/s: near the workers' capacity, where order matters")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "vllm_priority")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp())
    classes, qos = folder / "classes.yaml", folder / "qos.yaml"  # the bench's mix; the front's classes (no shares)
    classes.write_text(yaml.safe_dump(CLASSES))
    qos.write_text(yaml.safe_dump({**CLASSES, "classes": {name: {k: v for k, v in c.items() if k != "share"}
                                                          for name, c in CLASSES["classes"].items()}}))
    console = Console(stderr=True)
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    port = 8300 + os.getpid() % 500
    for round_ in range(args.rounds):
        order = SETTINGS if round_ % 2 == 0 else tuple(reversed(SETTINGS))  # interleaved, alternating first
        for setting in order:
            console.print(f"round {round_ + 1}/{args.rounds}: --vllm-priority {setting} ...")
            runs[setting].append(one_run(args, setting, classes, qos, args.out, port))
            console.print(f"  {json.dumps(runs[setting][-1])}")
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_model(),
              "cores": len(os.sched_getaffinity(0)), "model": args.model, "dtype": args.dtype,
              "instances": args.instances, "workload": args.workload, "rate": args.rate,
              "num_requests": args.num_requests, "classes": CLASSES, "runs": runs,
              "command": " ".join(sys.argv)}
    (args.out / "vllm_priority.json").write_text(json.dumps(record, indent=1))
    table = Table(title=f"two classes over {args.instances} vLLM-CPU worker(s), {args.dtype}, {args.workload} at "
                        f"{args.rate:g} req/s ({record['cpu']})")
    for col in ("vLLM priority", "class", "SLO attainment (mean, min-max)", "goodput req/s (mean, min-max)"):
        table.add_column(col)
    for setting in SETTINGS:
        for name in sorted(runs[setting][0]):
            att = [r[name]["attainment"] for r in runs[setting]]
            good = [r[name]["goodput"] for r in runs[setting]]
            table.add_row(setting, name, f"{fmean(att):.3f} ({min(att):.3f}-{max(att):.3f})",
                          f"{fmean(good):.2f} ({min(good):.2f}-{max(good):.2f})")
    Console().print(table)
    ratio = fmean(r["interactive"]["goodput"] for r in runs["deadline"]) / max(
        1e-9, fmean(r["interactive"]["goodput"] for r in runs["none"]))
    Console().print(f"interactive goodput, deadline / none: {ratio:.2f}x; written {args.out / 'vllm_priority.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
