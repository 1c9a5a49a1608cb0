"""Demand forecasters (cluster/forecast/) on a synthetic week-and-a-half with a daily cycle, a
trend and noise: every seasonal model recovers the cycle an hour ahead (where the last value is
far off), every band covers about what it claims, gaps neither crash nor read as zero; and the
`sloserve forecast` command on the shared ServeGen series."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sloserve.cli import main
from sloserve.cluster.forecast import FORECASTERS, fill_gaps, make_forecaster
from sloserve.cluster.forecast.evaluate import evaluate
from sloserve.workload.series import Series, binned, servegen_series
from sloserve.workload.types import WorkloadRequest

STEP = 600.0
DAY = 144
NOISE = 0.03  # lognormal sigma: the best any model can do is a MAPE of about 0.8 x this


def synthetic(days: int = 9, seed: int = 0) -> Series:
    rng = np.random.default_rng(seed)
    t = np.arange(days * DAY)
    cycle = 1 + 0.6 * np.sin(2 * np.pi * (t % DAY) / DAY)
    trend = 1 + 0.02 * t / DAY
    return Series("synthetic", 100 * trend * cycle * np.exp(rng.normal(0, NOISE, len(t))), STEP)


@pytest.fixture(scope="module")
def scores():
    train, test = synthetic().split(DAY)
    return {name: evaluate(make_forecaster(name, STEP), train, test, horizon=6) for name in FORECASTERS}


def test_seasonal_models_recover_the_daily_cycle(scores):
    naive = scores["naive"].mape
    assert naive > 0.08  # an hour ahead the cycle has moved: the last value is a poor guess
    for name in ("seasonal-naive", "holt-winters", "gbm"):
        assert scores[name].mape < 0.05, (name, scores[name].mape)
        assert scores[name].mape < naive / 2, name


def test_bands_cover_what_they_claim(scores):
    for name, s in scores.items():
        assert s.level == 0.9 and 0.8 <= s.coverage <= 0.99, (name, s.coverage)
        assert all(lo <= m <= hi for lo, m, hi in zip(s.lo, s.mean, s.hi)), name
        assert s.origins == DAY - 6 + 1


def test_forecast_shape_and_peak():
    series = synthetic(days=5)
    f = make_forecaster("seasonal-naive", STEP).train(series, horizon=3)
    out = f.forecast(series.values, 3)
    assert out.horizon == 3 and out.step_s == STEP and out.peak() == max(out.hi)
    with pytest.raises(RuntimeError, match="horizon of at least 4"):
        f.forecast(series.values, 4)


def test_gaps_are_carried_forward_not_zero():
    v = np.array([math.nan, 5.0, math.nan, math.nan, 8.0])
    assert fill_gaps(v).tolist() == [5.0, 5.0, 5.0, 5.0, 8.0]
    series = synthetic(days=4)
    holes = series.values.copy()
    holes[200:210] = math.nan
    gappy = Series("gappy", holes, STEP)
    f = make_forecaster("holt-winters", STEP).train(gappy, horizon=1)
    assert all(np.isfinite(f.forecast(holes[:205], 1).mean))


def test_bad_names_and_short_histories_fail_clearly():
    with pytest.raises(ValueError, match="unknown forecaster 'prophet'"):
        make_forecaster("prophet", STEP)
    with pytest.raises(ValueError, match="too few"):
        make_forecaster("naive", STEP).train(Series("x", np.ones(2), STEP), horizon=1)
    with pytest.raises(ValueError, match="gbm needs at least"):
        make_forecaster("gbm", STEP).train(Series("x", np.ones(30), STEP), horizon=1)


def test_servegen_series_marks_gaps_and_their_edges():
    s = servegen_series("m-mid")
    assert len(s) == 14 * DAY and s.step_s == STEP
    known = s.values[np.isfinite(s.values)]
    assert np.isnan(s.values).sum() > 84 and known.min() > 100  # the partial windows beside gaps are gone too


def test_binned_trace_rates():
    reqs = [WorkloadRequest(float(i) * 10, prompt_len=100, output_len=10) for i in range(12)]
    s = binned(reqs, 60.0, "prompt-tokens")
    assert s.values.tolist() == [600 / 60, 600 / 60] and s.unit == "prompt tok/s"


def test_forecast_command_scores_and_draws(tmp_path, capsys):
    out = tmp_path / "fc"
    assert main(["forecast", "--series", "servegen:m-small", "--models", "naive,seasonal-naive",
                 "--holdout", "86400", "--out", str(out)]) == 0
    payload = json.loads((out / "forecast.json").read_text())
    assert [s["name"] for s in payload["scores"]] == ["naive", "seasonal-naive"]
    assert payload["holdout_steps"] == DAY and all(0 < s["mape"] < 1 for s in payload["scores"])
    assert (out / "forecast.png").stat().st_size > 10_000
    assert "MAPE" in capsys.readouterr().out
    assert main(["forecast", "--models", "nope"]) == 2
    assert main(["forecast", "--series", "servegen:m-small", "--holdout", "30"]) == 2
