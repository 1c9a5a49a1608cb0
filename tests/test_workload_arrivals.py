"""Synthetic arrival processes: rate, burstiness (CV) and reproducibility from a seed."""
from __future__ import annotations

import math
import statistics

import pytest

from sloserve.workload.arrivals import ArrivalProcess, make_process, weibull_shape_for_cv


def _gaps(process: ArrivalProcess, n: int = 40_000, seed: int = 1) -> list[float]:
    times = process.arrival_times(seed)
    ts = [next(times) for _ in range(n)]
    return [b - a for a, b in zip([0.0] + ts, ts)]


@pytest.mark.parametrize("kind, cv", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 3.0), ("weibull", 0.5),
                                      ("weibull", 2.0)])
def test_rate_and_cv(kind, cv):
    gaps = _gaps(make_process(kind, 4.0, cv))
    assert 1 / statistics.fmean(gaps) == pytest.approx(4.0, rel=0.05 if cv <= 1 else 0.1)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.1)


def test_seed_reproduces_and_differs():
    p = ArrivalProcess("gamma", 10.0, 2.0)
    assert _gaps(p, 100, seed=7) == _gaps(p, 100, seed=7)
    assert _gaps(p, 100, seed=7) != _gaps(p, 100, seed=8)
    assert _gaps(p, 100, seed="7:arrivals") == _gaps(p, 100, seed="7:arrivals")


def test_weibull_shape_inverts_cv():
    for cv in (0.3, 1.0, 2.5, 6.0):
        k = weibull_shape_for_cv(cv)
        got = math.sqrt(math.gamma(1 + 2 / k) / math.gamma(1 + 1 / k) ** 2 - 1)
        assert got == pytest.approx(cv, rel=1e-6)
    assert weibull_shape_for_cv(1.0) == pytest.approx(1.0, rel=1e-6)


def test_infinite_rate_and_validation():
    times = ArrivalProcess("poisson", math.inf).arrival_times(0)
    assert [next(times) for _ in range(5)] == [0.0] * 5
    for bad in (dict(kind="uniform"), dict(rate=0), dict(rate=-1), dict(cv=0), dict(shape=-1.0)):
        with pytest.raises(ValueError):
            ArrivalProcess(**bad)
