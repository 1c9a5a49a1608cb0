"""Which prefilled streams a P/D fleet hands off (FleetController.handoff_pays), and how an
abandoned hand-off is named in /metrics (front/handoff.outcome_label): pure functions, no fleet."""
from __future__ import annotations

import pytest

from sloserve.cluster.controller import FleetController
from sloserve.front.handoff import Ewma, outcome_label
from sloserve.front.relay import MigrationOutcome


@pytest.mark.parametrize("remaining, token_s, handoff_s, pays", [
    (None, 0.03, 0.1, True),  # no max_tokens: it may decode for ever, so it moves
    (3, 0.03, 0.1, False),  # 90 ms left to decode against a 100 ms pause: it stays
    (4, 0.03, 0.1, True),  # 120 ms left: the decode instance pays for the pause
    (10, 0.01, 0.1, False),  # a pause exactly as long as what is left: moving only delays it
    (200, 0.07, 0.45, True),
])
def test_a_stream_moves_only_when_what_it_has_left_outlasts_the_hand_off(remaining, token_s, handoff_s, pays):
    assert FleetController.handoff_pays(remaining, token_s, handoff_s) is pays


def test_an_abort_is_named_by_the_refusing_workers_code_else_by_the_fronts_reason():
    refused = MigrationOutcome(False, "409 finished: request r finished here", code="finished")
    assert outcome_label(refused) == "finished"
    assert outcome_label(MigrationOutcome(False, "client gone")) == "client_gone"
    assert outcome_label(MigrationOutcome(False, "source unreachable: ConnectError")) == "source_unreachable"
    assert outcome_label(MigrationOutcome(False, "")) == "unknown"


def test_the_measured_times_start_from_a_prior_and_follow_what_is_seen():
    e = Ewma(0.1, weight=0.5)
    e.observe(0.3)
    assert e.value == pytest.approx(0.2)
    for _ in range(30):
        e.observe(0.45)
    assert e.value == pytest.approx(0.45, rel=1e-6)
