"""`sloserve evaluate --tune POLICY`: search a policy's declared thresholds on dev cells only.

The thresholds are the ones a decision declares for the policy (`Decision.thresholds`: constructor
arguments and their ranges). Each trial runs the candidate with the trial's values in every dev
cell and seed, and scores the geometric mean of its goodput at 99% over the best baseline's (the
baselines are measured once). The first trial is the policy's current defaults, so the answer
says what tuning bought on dev. It is printed to be committed as the new defaults; claims about
it come from the test split afterwards. Any test cell among the cells given is refused.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from sloserve.cluster.migration import MIGRATION_POLICIES, parse_migration
from sloserve.evaluation.decisions import DECISIONS, Decision, Threshold, make_decision, measure_of
from sloserve.evaluation.fleet import Setting
from sloserve.evaluation.metrics import PolicyRuns, probe_for, start_rate
from sloserve.evaluation.suite import REPO_ROOT, Cell, split_of

RATIO_FLOOR = 1e-3  # a candidate meeting the SLO at no rate scores this ratio, not log(0)


@dataclass(frozen=True)
class TuneResult:
    policy: str
    decision: str
    cells: int
    seeds: int
    trials: int
    values: dict[str, dict[str, Any]]  # policy part -> constructor argument -> the best value found
    score: float  # geometric mean of goodput@99 over the best baseline's, with `values`
    default_score: float  # the same with the current defaults

    def text(self) -> str:
        lines = [f"tuned {self.policy} ({self.decision}) on {self.cells} dev cell(s) x {self.seeds} seeds, "
                 f"{self.trials} trials: goodput@99 {self.score:.3f}x the best baseline (current defaults "
                 f"{self.default_score:.3f}x)", "frozen values to commit as the defaults:"]
        for part, values in self.values.items():
            cls = MIGRATION_POLICIES[part]
            args = ", ".join(f"{k}={_round(v)!r}" for k, v in values.items())
            lines.append(f"  {cls.__name__}({args})  # {_where(cls)}")
        return "\n".join(lines)


def _where(cls: type) -> str:
    path = Path(inspect.getsourcefile(cls) or "?").resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def _round(v: Any) -> Any:
    return v if isinstance(v, int) else float(f"{v:.4g}")


def declared(policy: str) -> tuple[Decision, dict[str, dict[str, Threshold]]]:
    """The decision whose candidates run `policy` and the thresholds it declares for its parts;
    ValueError (one line) when no decision declares any."""
    parts = parse_migration(policy) if all(p.strip() in MIGRATION_POLICIES for p in policy.split(",")) else []
    for name, cls in DECISIONS.items():
        space = {p: cls.thresholds[p] for p in parts if cls.thresholds.get(p)}
        if parts and space:
            return make_decision(name), space
    tunable = sorted({p for cls in DECISIONS.values() for p in cls.thresholds})
    raise ValueError(f"{policy} declares no thresholds to tune (policies that do: {', '.join(tunable)})")


def defaults_of(part: str, names: Sequence[str]) -> dict[str, Any]:
    """The current defaults of `part`'s constructor arguments `names`."""
    sig = inspect.signature(MIGRATION_POLICIES[part].__init__)
    return {n: sig.parameters[n].default for n in names}


def tune(policy: str, cells: Sequence[Cell], trials: int = 20, seeds: int = 2, quick: bool = False, seed: int = 0,
         on_trial: Optional[Callable[[int, float], None]] = None) -> TuneResult:
    """Search `policy`'s declared thresholds on `cells` (dev only) for `trials` trials, each cell
    measured as its grid says (`quick`: as its quick grid says)."""
    test = [c for c in cells if split_of(c) == "test"]
    if test:
        raise ValueError(f"refusing to tune on {len(test)} test cell(s): thresholds are tuned on dev cells only")
    if trials < 1 or seeds < 1:
        raise ValueError("--trials and --seeds must be >= 1")
    decision, space = declared(policy)
    decision = make_decision(decision.name, measure_of(decision.name, quick))
    mine = [c for c in cells if c.decision == decision.name]
    if not mine:
        raise ValueError(f"no dev cells of the {decision.name} decision to tune {policy} on")
    try:
        import optuna
    except ImportError:
        raise ValueError("tuning needs optuna: pip install 'sloserve[place]'") from None
    spec = ",".join(parse_migration(policy))
    measure = decision.measure
    # what every trial is held against: per (cell, seed), the probe, the start rate and the best baseline
    fixed = []
    for cell in mine:
        setting, lineup = Setting.of(cell.params), decision.policies(cell)
        candidate = next((p for p in lineup.candidates if p.migration == spec), None)
        if candidate is None:
            raise ValueError(f"{policy} is not a candidate of {decision.name} "
                             f"(its candidates: {', '.join(p.name for p in lineup.candidates)})")
        for s in range(seeds):
            probe = probe_for(setting, s, measure)
            start = start_rate(setting, lineup.baselines[0], probe)
            best = max(PolicyRuns(setting, b, probe).goodput(0.99, start, measure.iters).rps for b in lineup.baselines)
            fixed.append((setting, candidate, probe, start, best))

    def score(values: dict[str, dict[str, Any]]) -> float:
        logs = []
        for setting, candidate, probe, start, best in fixed:
            got = PolicyRuns(setting, candidate, probe, values).goodput(0.99, start, measure.iters).rps
            ratio = got / best if best > 0 else (1.0 if got == 0 else 1 / RATIO_FLOOR)
            logs.append(math.log(max(RATIO_FLOOR, ratio)))
        return math.exp(sum(logs) / len(logs))

    def suggest(trial) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for part, args in space.items():
            for arg, t in args.items():
                key = f"{part}.{arg}"
                out.setdefault(part, {})[arg] = (trial.suggest_int(key, int(t.low), int(t.high), log=t.log)
                                                 if t.integer else trial.suggest_float(key, t.low, t.high, log=t.log))
        return out

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    current = {part: defaults_of(part, list(args)) for part, args in space.items()}
    study.enqueue_trial({f"{p}.{a}": v for p, vals in current.items() for a, v in vals.items()})

    def objective(trial) -> float:
        value = score(suggest(trial))
        if on_trial is not None:
            on_trial(trial.number, value)
        return value

    study.optimize(objective, n_trials=trials)
    best = study.best_trial
    values: dict[str, dict[str, Any]] = {}
    for key, v in best.params.items():
        part, arg = key.split(".", 1)
        values.setdefault(part, {})[arg] = v
    return TuneResult(policy, decision.name, len(mine), seeds, trials, values, float(best.value),
                      float(study.trials[0].value))
