"""Autoscaling policies, selected by name; a new one is one file plus one line here."""
from __future__ import annotations

from typing import Optional

from sloserve.cluster.autoscale.base import Autoscaler, ScalingDecision, ScalingOptions, ScalingSignals
from sloserve.cluster.autoscale.hybrid import HybridAutoscaler
from sloserve.cluster.autoscale.oracle import OracleAutoscaler
from sloserve.cluster.autoscale.predictive import PredictiveAutoscaler
from sloserve.cluster.autoscale.reactive import ReactiveAutoscaler
from sloserve.cluster.autoscale.static import StaticAutoscaler

AUTOSCALERS: dict[str, type[Autoscaler]] = {a.name: a for a in (
    StaticAutoscaler, ReactiveAutoscaler, PredictiveAutoscaler, HybridAutoscaler, OracleAutoscaler)}


def make_autoscaler(name: str, options: Optional[ScalingOptions] = None) -> Autoscaler:
    try:
        cls = AUTOSCALERS[name]
    except KeyError:
        raise ValueError(f"unknown autoscaler {name!r}; choose from {sorted(AUTOSCALERS)}") from None
    return cls(options or ScalingOptions())


__all__ = ["AUTOSCALERS", "Autoscaler", "ScalingDecision", "ScalingOptions", "ScalingSignals", "make_autoscaler"]
