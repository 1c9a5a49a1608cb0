"""Three ServeGen services on one fleet for a day, at flow level (`sloserve simulate --fidelity fluid`).

The services are ServeGen's m-large, m-mid and m-small demand series over the same day, scaled so
their mean together is `--rate`, each served by its own pool of the same model (request shapes
from `--workload`, priced by one response curve the discrete simulator measures). Compared:
- per-service autoscaling, each pool on its own (no budget);
- per-service autoscaling under a shared budget (`--budget`, default: the pooled fleet's peak);
- one pooled fleet on the three demands summed (one model serving all three: the lower bound
  on instances a shared pool reaches by statistical multiplexing);
- static: each service at the instances its own peak needs, all day.
Writes benchmarks/results/services-day-<time>/{services_day.json,services_day.md,services_day.png}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SERVICES = ("m-large", "m-mid", "m-small")


def simulate(out: Path, demand: list[str], common: list[str], extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "sloserve.cli", "simulate", "--fidelity", "fluid", "--no-progress",
           "--out", str(out), *[a for d in demand for a in ("--demand", d)], *common, *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\n{done.stderr}")
    name = "services.json" if (out / "services.json").is_file() else "fluid.json"
    return json.loads((out / name).read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--day", type=int, default=12, help="the ServeGen day (0-13)")
    p.add_argument("--rate", type=float, default=6.0, help="the three services' mean together, req/s")
    p.add_argument("--budget", type=int, default=None, help="instances all pools share (default: the pooled peak)")
    p.add_argument("--autoscale", default="reactive")
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--hardware", default="a10-24g")
    p.add_argument("--workload", default="azure-conv")
    p.add_argument("--slo", default="ttft=2000,tpot=200")
    p.add_argument("--capacity", default="1.0", help="req/s one instance sustains (else measured)")
    p.add_argument("--max-instances", type=int, default=16)
    args = p.parse_args()

    common = ["--start", str(args.day * 86400), "--duration", "86400", "--rate", str(args.rate),
              "--workload", args.workload, "--model", args.model, "--hardware", args.hardware, "--slo", args.slo,
              "--capacity", args.capacity, "--cold-start", "120", "--instances", f"1:{args.max_instances}"]
    named = [f"{s}=servegen:{s}" for s in SERVICES]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"services-day-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SLOSERVE_CACHE_DIR", str(out / "cache"))
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        pooled = simulate(t / "pooled", ["servegen:" + "+".join(SERVICES)], common, ["--autoscale", args.autoscale])
        peak = max(row[1] + row[2] + row[3] for row in pooled["scaling"]["timeline"])
        budget = args.budget or peak
        free = simulate(t / "free", named, common, ["--autoscale", args.autoscale])
        shared = simulate(t / "shared", named, common, ["--autoscale", args.autoscale, "--budget", str(budget)])
        free_peaks = {n: max(r + s + d for _, r, s, d, *_ in tl) for n, tl in free["timelines"].items()}
        static = {}
        for name in SERVICES:  # each alone at its own mean (its share of --rate) and its own peak's instances
            need = free_peaks[name]
            mean = free["services"][name]["requests"] / free["duration_s"]
            own = [a if a != str(args.rate) else f"{mean:.6g}" for a in common]
            own[own.index("--instances") + 1] = f"{need}:{need}"
            static[name] = simulate(t / f"static-{name}", [f"servegen:{name}"], own, ["--autoscale", "static"])
    rows = [("per-service " + args.autoscale, free["attainment"], free["instance_hours"], free["services"]),
            (f"per-service {args.autoscale}, budget {budget}", shared["attainment"], shared["instance_hours"],
             shared["services"]),
            (f"one pooled fleet ({args.autoscale})", pooled["attainment"], pooled["instance_hours"], None)]
    static_hours = sum(r["instance_hours"] for r in static.values())
    static_att = sum(r["attainment"] * r["requests"] for r in static.values()) / \
        sum(r["requests"] for r in static.values())
    rows.append(("static at each service's peak", static_att, static_hours,
                 {n: {"attainment": r["attainment"], "instance_hours": r["instance_hours"]} for n, r in static.items()}))
    header = ("| fleet | SLO attainment, all | instance-hours | " +
              " | ".join(f"{s}: attainment / instance-hours" for s in SERVICES) + " |")
    lines = [f"Three ServeGen services, day {args.day}, mean {args.rate:g} req/s together; {args.model} on "
             f"{args.hardware}, {args.workload} request shapes, SLO {args.slo}, 120 s cold starts "
             f"(pooled peak {peak} instances; budget {budget}).", "", header,
             "|" + "---|" * (3 + len(SERVICES))]
    for label, attainment, hours, per in rows:
        cells = [f"{100 * per[s]['attainment']:.2f}% / {per[s]['instance_hours']:.1f}" if per else "-"
                 for s in SERVICES]
        lines.append(f"| {label} | {100 * attainment:.3f}% | {hours:.1f} | " + " | ".join(cells) + " |")
    report = "\n".join(lines) + "\n"
    (out / "services_day.md").write_text(report)
    (out / "services_day.json").write_text(json.dumps({"args": vars(args), "budget": budget, "pooled_peak": peak,
                                                       "free": free, "shared": shared, "pooled": pooled,
                                                       "static": static}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for ax, run, title in ((axes[0], free, "per-service, no budget"), (axes[1], shared, f"budget {budget}")):
        for name, tl in run["timelines"].items():
            ax.step([row[0] / 3600 for row in tl], [row[1] + row[2] + row[3] for row in tl], where="post",
                    label=name)
        total = {}
        for tl in run["timelines"].values():
            for row in tl:
                total[row[0]] = total.get(row[0], 0) + row[1] + row[2] + row[3]
        ax.step([k / 3600 for k in sorted(total)], [total[k] for k in sorted(total)], where="post", color="black",
                label="all")
        ax.set_title(title)
        ax.set_ylabel("instances held")
        ax.legend(loc="upper left", fontsize=8)
    axes[1].set_xlabel("hour of the day")
    fig.tight_layout()
    fig.savefig(out / "services_day.png", dpi=110)
    print(report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
