import gzip, json, statistics as st, sys
d = json.load(gzip.open('benchmarks/suite/runs/disaggregation-dev-20261206/results.json.gz'))
meas = {}
for c in d['cells']:
    m = c['metrics']
    g = {k: [x['goodput99']['rps'] for x in v] for k, v in m.items() if not k.startswith('planner')}
    meas[c['description']] = (c['settings'], g)
plan = {}
for line in open(sys.argv[1]):
    r = json.loads(line); desc, v = r['key'].rsplit('|', 1)
    plan.setdefault(v, {})[desc] = r['rps']

def right(desc, pick):
    """The suite's verdict of `pick` against the best layout of the cell (verdict.judge_one)."""
    import math
    s, g = meas[desc]
    means = {k: st.mean(v) for k, v in g.items()}
    best = max(means, key=means.get)
    ratios = []
    for mine, theirs in zip(g[pick], g[best]):
        ratios.append(mine / theirs if theirs > 0 else (math.inf if mine > 0 else 1.0))
    if any(r == 0 for r in ratios): ratio = 0.0
    elif any(math.isinf(r) for r in ratios): ratio = math.inf
    else: ratio = math.exp(st.fmean(math.log(r) for r in ratios))
    finite = [r for r in ratios if 0 < r < math.inf]
    noise = 0.03 if len(finite) < 2 else max(0.03, math.exp((max(map(math.log, finite)) - min(map(math.log, finite))) / 2) - 1)
    return ratio >= 1 / (1 + noise), ratio

def rule_first(rps, order, margin=0.0):
    best, brps = None, -1
    for p in order:
        if p not in rps: continue
        if brps < 0 or rps[p] > brps * (1 + margin):
            best, brps = p, rps[p]
    return best

for v, cells in plan.items():
    for name, fn in [
        ("current (lr first, strict >)", lambda r: rule_first(r, ["least-requests", "predicted-load", *sorted(k for k in r if k.startswith("P:D"))])),
        ("pl first", lambda r: rule_first(r, ["predicted-load", "least-requests", *sorted(k for k in r if k.startswith("P:D"))])),
        ("pl first, split needs +10%", lambda r: (lambda col: (lambda sp: sp if sp and r[sp] > r[col] * 1.10 else col)(max((k for k in r if k.startswith("P:D")), key=r.get, default=None)))(rule_first(r, ["predicted-load", "least-requests"]))),
    ]:
        ok = [right(desc, fn(rps)) for desc, rps in cells.items()]
        print(v, name, sum(o for o, _ in ok), "/", len(ok), " worst", round(min(x for _, x in ok), 3))
print("---- misses of pl-first")
for desc, rps in plan['cur'].items():
    pick = rule_first(rps, ["predicted-load", "least-requests", *sorted(k for k in rps if k.startswith("P:D"))])
    ok, ratio = right(desc, pick)
    if not ok:
        s, g = meas[desc]
        means = {k: round(st.mean(v), 2) for k, v in g.items()}
        print(s, "pick", pick, round(ratio, 3))
        print("   planner", {k: round(v, 2) for k, v in rps.items()})
        print("   measured", means)
