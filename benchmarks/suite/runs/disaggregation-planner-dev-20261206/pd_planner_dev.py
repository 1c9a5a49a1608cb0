"""Dev only: the planner's per-layout goodput@99 on each disaggregation dev cell, under planning measures."""
import json, sys, time
from pathlib import Path
from sloserve.evaluation.suite import cells, Measure
from sloserve.evaluation.fleet import Setting
from sloserve.evaluation.metrics import PolicyRuns, probe_for, start_rate
from sloserve.evaluation.decisions.disaggregation import COLOCATED, splits

VARIANTS = {
    "cur": (100, Measure(sustain_s=10.0, sustain_ttfts=3.0, iters=2, sample=80, max_requests=5000, loads=())),
    "long": (100, Measure(sustain_s=20.0, sustain_ttfts=6.0, iters=3, sample=120, max_requests=8000, loads=())),
    "long101": (101, Measure(sustain_s=20.0, sustain_ttfts=6.0, iters=3, sample=120, max_requests=8000, loads=())),
    "cur101": (101, Measure(sustain_s=10.0, sustain_ttfts=3.0, iters=2, sample=80, max_requests=5000, loads=())),
}
out = Path(sys.argv[1]); which = sys.argv[2].split(",")
done = {json.loads(l)["key"] for l in out.read_text().splitlines()} if out.exists() else set()
for cell in cells("disaggregation", "dev"):
    setting = Setting.of(cell.params)
    for v in which:
        key = cell.description + "|" + v
        if key in done:
            continue
        seed, m = VARIANTS[v]
        t = time.time()
        probe = probe_for(setting, seed, m)
        start = start_rate(setting, COLOCATED[0], probe)
        rps = {p.name: PolicyRuns(setting, p, probe).goodput(0.99, start, m.iters).rps
               for p in (*COLOCATED, *splits(setting.instances))}
        with out.open("a") as f:
            f.write(json.dumps({"key": key, "settings": cell.params, "variant": v, "rps": rps, "s": time.time() - t}) + "\n")
        print(v, cell.label if hasattr(cell, "label") else key, round(time.time() - t, 1), flush=True)
