"""The settings of the held-out evaluation, each one a `Cell`, and the split each cell belongs to.

A cell is one decision (routing, migration, ...) in one setting (trace, hardware, model, tensor
parallelism, instances, SLO tightness, link). Load is not a setting: every cell is measured at
each of `Measure.loads` x its own capacity, and its verdict (on goodput) is one rate. Its split, `dev` or `test`, is a function of its canonical description alone
(`split_of`): no list of cells is ever stored, so adding settings to a grid never moves a cell
that existed before, and a cell keeps its split for as long as its description is unchanged.

Grids live in `benchmarks/suite/<decision>.yaml`:

    defaults:   # what a setting is when no axis names it. A cell's description leaves out the settings
                # at their default, so a new axis declared with a default equal to what every cell ran
                # before moves no old cell. Frozen: changing a default changes what old cells mean.
      instances: 4
    axes:       # name -> values; the grid is their product
      trace: [azure-conv, azure-code]
      slo: [1.0, 0.5]
    exclude:    # optional: a cell matching every key of one rule is left out (a value or a list of values)
      - {trace: azure-code, slo: 0.5}
    measure:    # how each cell is measured (not part of any description: see `Measure`)
      sustain_s: 60
    quick:      # axes overrides (of an axis or a default) for a tiny grid (tests, smoke runs), and
                # `measure:` overrides. A quick grid never holds a cell that is one of the full grid's
                # test cells (it is withheld): smoke runs and tests never measure what claims rest on.
      trace: [azure-conv]
      measure: {sustain_s: 10}
"""
from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
SUITE_DIR = REPO_ROOT / "benchmarks" / "suite"
SPLITS = ("dev", "test")
TEST_PERCENT = 40  # share of cells in `test` (the rest are `dev`)

Value = Any  # a setting's value: str, int, float or bool (what YAML scalars are)


@dataclass(frozen=True)
class Cell:
    """One decision in one setting. `settings`: the described (key, value) pairs, sorted by key;
    `defaults`: the settings the cell runs with but does not describe (they are at the grid's
    declared default). Identity, equality and the split come from `decision` and `settings` only."""

    decision: str
    settings: tuple[tuple[str, Value], ...]
    defaults: tuple[tuple[str, Value], ...] = field(default=(), compare=False)

    @classmethod
    def make(cls, decision: str, values: Mapping[str, Value], defaults: Optional[Mapping[str, Value]] = None) -> "Cell":
        """A cell from its full settings: those equal to `defaults` move out of its description."""
        defaults = dict(defaults or {})
        for key, value in values.items():
            _check_scalar(key, value)
        described = {k: v for k, v in values.items() if not (k in defaults and _same(defaults[k], v))}
        implicit = {**defaults, **{k: v for k, v in values.items() if k not in described}}
        return cls(decision, tuple(sorted(described.items())), tuple(sorted(implicit.items())))

    @property
    def params(self) -> dict[str, Value]:
        """Every setting the cell runs with: its defaults overlaid with its described settings."""
        return {**dict(self.defaults), **dict(self.settings)}

    @property
    def description(self) -> str:
        """The canonical text the split is drawn from: JSON with sorted keys, no spaces."""
        return description(self)

    @property
    def split(self) -> str:
        return split_of(self)

    @property
    def label(self) -> str:
        """A short human form: `trace=azure-conv slo=0.5` (settings at their default left out)."""
        return " ".join(f"{k}={v}" for k, v in self.settings) or "(defaults)"

    def as_dict(self) -> dict:
        return {"decision": self.decision, "settings": dict(self.settings), "defaults": dict(self.defaults),
                "description": self.description, "split": self.split}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Cell":
        return cls(d["decision"], tuple(sorted(d["settings"].items())), tuple(sorted(d.get("defaults", {}).items())))


def description(cell: Cell) -> str:
    return json.dumps({"decision": cell.decision, "settings": dict(cell.settings)}, sort_keys=True,
                      separators=(",", ":"))


def split_of(cell: Cell) -> str:
    """`test` for about 40% of cells, `dev` for the rest, by the SHA-256 of the cell's description:
    fixed forever for a given description."""
    digest = hashlib.sha256(description(cell).encode("utf-8")).hexdigest()
    return "test" if int(digest[:8], 16) % 100 < TEST_PERCENT else "dev"


class MeasureSpec:
    """What every decision's measure type shares (a frozen dataclass of settings with `validate()`):
    parsed from a grid's `measure:` mapping over a base (lists become tuples), and written back."""

    @classmethod
    def parse(cls, raw: Optional[Mapping[str, Any]], base: Any = None) -> Any:
        base = base if base is not None else cls()
        if raw is None:
            return base
        if not isinstance(raw, Mapping):
            raise ValueError(f"measure: must be a mapping, got {raw!r}")
        known = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"unknown measure setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        out = replace(base, **{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
        out.validate()
        return out

    def validate(self) -> None:
        """Raise ValueError (one line) on settings that cannot be measured."""

    def as_dict(self) -> dict:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class Measure(MeasureSpec):
    """How a decision's cells are measured: not part of any cell's description (a quicker or more
    careful measurement of a cell is still that cell). Each rate of a goodput search is held for
    `sustain_s` seconds of the trace's arrivals, and at least `sustain_ttfts` times the cell's TTFT
    target (a backlog must have time to cost a TTFT miss; planning.sustained: never fewer than `sample`
    requests, never more than `max_requests`; a rate that cannot be held is not credited), the
    search bisects `iters` times after bracketing, and every policy is also run at `loads` x the
    cell's capacity."""

    sustain_s: float = 60.0
    sustain_ttfts: float = 0.0
    iters: int = 5
    sample: int = 200
    max_requests: int = 20000
    loads: tuple[float, ...] = (0.8, 1.0, 1.1)

    def validate(self) -> None:
        if self.sustain_ttfts < 0:
            raise ValueError(f"measure: sustain_ttfts must be >= 0, got {self.sustain_ttfts}")
        if not self.sustain_s > 0:
            raise ValueError(f"measure: sustain_s must be > 0 (rates are held, never squeezed), got {self.sustain_s}")
        if self.iters < 1 or self.sample < 10 or self.max_requests < self.sample:
            raise ValueError("measure: iters >= 1, sample >= 10 and max_requests >= sample")
        if not self.loads or not all(x > 0 for x in self.loads):
            raise ValueError(f"measure: loads must be positive fractions of capacity, got {self.loads}")

    def sustain_for(self, ttft_s: Optional[float]) -> float:
        """Seconds each rate is held in a cell whose TTFT target is `ttft_s`."""
        return max(self.sustain_s, self.sustain_ttfts * ttft_s) if ttft_s else self.sustain_s


@dataclass(frozen=True)
class Grid:
    """A decision's grid as its YAML file gives it (with the quick overrides applied, if asked)."""

    decision: str
    axes: dict[str, list[Value]]
    defaults: dict[str, Value]
    exclude: tuple[dict[str, list[Value]], ...]
    measure: dict[str, Any]  # the grid's measure: as written (quick overrides applied); see measure_as
    quick: bool = False
    withheld: frozenset[str] = frozenset()  # descriptions never among `cells` (a quick grid: the full grid's test cells)

    def measure_as(self, kind: Any) -> Any:
        """The grid's measure read by `kind` (a MeasureSpec: the decision's measure_type), validated."""
        return kind.parse(self.measure)

    @property
    def cells(self) -> list[Cell]:
        """Every cell of the product of the axes not excluded, in grid order."""
        names = list(self.axes)
        out = []
        for combo in itertools.product(*(self.axes[n] for n in names)):
            values = dict(zip(names, combo))
            if any(_matches(rule, {**self.defaults, **values}) for rule in self.exclude):
                continue
            cell = Cell.make(self.decision, values, self.defaults)
            if cell.description not in self.withheld:
                out.append(cell)
        return list(dict.fromkeys(out))  # an axis value equal to its default twice over is one cell


def load_grid(decision: str, quick: bool = False, root: Optional[Path] = None) -> Grid:
    """The grid of `decision` from `<root>/<decision>.yaml` (root: benchmarks/suite). Its `measure:`
    stays a mapping: each decision reads it with its own type (`Grid.measure_as`)."""
    path = (root or SUITE_DIR) / f"{decision}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no grid for decision {decision!r}: {path} not found")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: a grid is a mapping (axes:, defaults:, exclude:, measure:, quick:)")
    unknown = sorted(set(raw) - {"axes", "defaults", "exclude", "measure", "quick"})
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}")
    axes = _axes(raw.get("axes"), path)
    defaults = dict(raw.get("defaults") or {})
    for key, value in defaults.items():
        _check_scalar(key, value)
    measure = _mapping(raw.get("measure"), path, "measure")
    withheld: frozenset[str] = frozenset()
    if quick:  # a smoke run never measures a cell the full grid holds out for claims
        withheld = frozenset(c.description for c in load_grid(decision, False, root).cells if c.split == "test")
        overrides = dict(raw.get("quick") or {})
        measure = {**measure, **_mapping(overrides.pop("measure", None), path, "quick: measure")}
        stray = sorted(set(overrides) - set(axes) - set(defaults))
        if stray:
            raise ValueError(f"{path}: quick: overrides settings the grid does not have: {', '.join(stray)}")
        axes = {**axes, **_axes(overrides, path)}
    rules = []
    for rule in raw.get("exclude") or []:
        if not isinstance(rule, Mapping) or not rule:
            raise ValueError(f"{path}: each exclude rule is a non-empty mapping, got {rule!r}")
        stray = sorted(set(rule) - set(axes) - set(defaults))
        if stray:
            raise ValueError(f"{path}: exclude names unknown setting(s) {', '.join(stray)}")
        rules.append({k: list(v) if isinstance(v, list) else [v] for k, v in rule.items()})
    return Grid(decision, axes, defaults, tuple(rules), measure, quick, withheld)


def cells(decision: str, split: Optional[str] = None, quick: bool = False, root: Optional[Path] = None) -> list[Cell]:
    """The cells of `decision`'s grid in `split` ("dev", "test"; None or "both": all of them)."""
    if split not in (None, "both", *SPLITS):
        raise ValueError(f"split must be dev, test or both, got {split!r}")
    every = load_grid(decision, quick, root).cells
    return every if split in (None, "both") else [c for c in every if split_of(c) == split]


def _mapping(raw: Any, path: Path, what: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: {what}: must be a mapping, got {raw!r}")
    return dict(raw)


def _axes(raw: Any, path: Path) -> dict[str, list[Value]]:
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError(f"{path}: axes: must map each setting to a list of values")
    out = {}
    for name, values in raw.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"{path}: axis {name!r} needs a non-empty list of values, got {values!r}")
        for v in values:
            _check_scalar(name, v)
        out[str(name)] = list(dict.fromkeys(values))
    return out


def _matches(rule: Mapping[str, list[Value]], values: Mapping[str, Value]) -> bool:
    return all(any(_same(values.get(k), v) for v in allowed) for k, allowed in rule.items())


def _same(a: Value, b: Value) -> bool:
    """Equal as settings: 1 and 1.0 are one value, True and 1 are not."""
    return type(a) is type(b) and a == b or (
        isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
        and not isinstance(b, bool) and a == b)


def _check_scalar(key: str, value: Value) -> None:
    if not isinstance(value, (str, int, float, bool)):
        raise ValueError(f"setting {key!r} must be a string, number or boolean, got {value!r}")
