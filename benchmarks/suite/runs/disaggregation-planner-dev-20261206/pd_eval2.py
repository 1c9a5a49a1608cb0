import json, sys
exec(open('benchmarks/suite/runs/disaggregation-planner-dev-20261206/pd_eval.py').read().split('for v, cells in plan.items():')[0].replace("plan = {}\nfor line in open(sys.argv[1]):", "plan = {}\nfor line in open(sys.argv[1]).readlines() + open(sys.argv[2]).readlines():"))
cur, other = plan['cur'], plan.get('cur101', {})
both = [d for d in cur if d in other]
ORDER_PL = lambda r: ["predicted-load", "least-requests", *sorted(k for k in r if k.startswith("P:D"))]
ORDER_LR = lambda r: ["least-requests", "predicted-load", *sorted(k for k in r if k.startswith("P:D"))]
def mean2(a, b): return {k: (a[k] + b[k]) / 2 for k in a}
def min2(a, b): return {k: min(a[k], b[k]) for k in a}
for name, fn in [("cur lr-first", lambda d: rule_first(cur[d], ORDER_LR(cur[d]))),
                 ("cur pl-first", lambda d: rule_first(cur[d], ORDER_PL(cur[d]))),
                 ("101 pl-first", lambda d: rule_first(other[d], ORDER_PL(other[d]))),
                 ("mean2 pl-first", lambda d: rule_first(mean2(cur[d], other[d]), ORDER_PL(cur[d]))),
                 ("min2 pl-first", lambda d: rule_first(min2(cur[d], other[d]), ORDER_PL(cur[d]))),
                 ("mean2 lr-first", lambda d: rule_first(mean2(cur[d], other[d]), ORDER_LR(cur[d])))]:
    ok = [right(d, fn(d)) for d in both]
    print(f"{name:16} {sum(o for o,_ in ok)}/{len(ok)} worst {min(x for _,x in ok):.3f}")
