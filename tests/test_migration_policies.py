"""Migration policies and the fleet controller on constructed instance views: each policy moves
what it should, where it should, weighing the copy against the gain; the controller lets through
only what is safe (one migration per instance at a time, cooldowns, accepting targets)."""
from __future__ import annotations

import math
from typing import Sequence

import pytest

from sloserve.cluster.controller import FleetController
from sloserve.cluster.migration import (MIGRATION_POLICIES, BalancePolicy, DefragPolicy, DrainPolicy, InstanceView,
                                        MigrationOptions, MigrationPolicy, MovableRequest, Move, MoveCosts,
                                        NoMigration, PriorityPolicy, make_migration_policy)
from sloserve.cluster.routers import make_router
from sloserve.cluster.routers.predicted_load import instance_load
from sloserve.sched.state import InstanceState

BS = 16
KV_PER_TOKEN = 512 * 1024  # Llama-2-7B in bf16
COSTS = MoveCosts.uniform(KV_PER_TOKEN, 50e9)  # InfiniBand NDR: 1000 tokens copy in ~10 ms


def st(running=0, waiting=0, prefill=0, used=0, total=1000, decode=0, waiting_blocks=0,
       slack=math.inf) -> InstanceState:
    return InstanceState(num_running=running, num_waiting=waiting, queued_prefill_tokens=prefill, kv_blocks_used=used,
                         kv_blocks_free=total - used, kv_blocks_total=total, predicted_remaining_decode_tokens=decode,
                         prefix_cache_hit_rate=0.0, min_ttft_slack_s=slack, block_size=BS,
                         kv_blocks_waiting=waiting_blocks)


def mr(rid: str, tokens: int = 500, remaining: int = 200, priority: int = 0, ttft: float = math.inf,
       tbt_target: float = math.inf, tbt: float = 0.0) -> MovableRequest:
    return MovableRequest(rid, tokens, 50, remaining, priority, ttft, tbt_target, tbt)


def view(i: int, state: InstanceState, running: Sequence[MovableRequest] = (), waiting: Sequence[MovableRequest] = (),
         accepting: bool = True, draining: bool = False) -> InstanceView:
    return InstanceView(i, state, list(running), list(waiting), accepting, draining)


def pairs(moves: list[Move]) -> list[tuple[str, int, int]]:
    return [(m.request_id, m.source, m.target) for m in moves]


# ---- registry and costs -------------------------------------------------------------------------

def test_registry_and_combination_by_name():
    assert set(MIGRATION_POLICIES) == {"none", "balance", "defrag", "priority", "drain"}
    assert isinstance(make_migration_policy("none"), NoMigration)
    assert not make_migration_policy("none").moves_anything
    assert make_migration_policy("balance").name == "balance"
    combined = make_migration_policy("balance, priority,drain")
    assert combined.names == ["drain", "priority", "balance"]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown migration policy"):
        make_migration_policy("balance,teleport")


def test_move_costs_price_bytes_over_the_link():
    costs = MoveCosts(KV_PER_TOKEN, lambda a, b: 50e9 if {a, b} == {0, 1} else 12.5e9)
    assert costs.copy_time(1000, 0, 1) == pytest.approx(1000 * KV_PER_TOKEN / 50e9)
    assert costs.copy_time(1000, 0, 2) == pytest.approx(4 * costs.copy_time(1000, 0, 1))
    move = costs.move(mr("a", tokens=1000), 0, 2, "test")
    assert move.kv_bytes == 1000 * KV_PER_TOKEN and move.est_copy_s == pytest.approx(costs.copy_time(1000, 0, 2))


# ---- balance ---------------------------------------------------------------------------------------

def test_balance_moves_from_the_most_to_the_least_loaded_past_the_threshold():
    running = [mr("a0", remaining=2000), mr("a1", remaining=1500)]
    views = [view(0, st(running=2, prefill=3000, used=300, decode=3500), running),
             view(1, st(running=1, prefill=0, used=50, decode=100), [mr("b0", remaining=100)]),
             view(2, st(running=1, prefill=1500, used=100, decode=400), [mr("c0", remaining=400)])]
    policy = BalancePolicy()
    loads = [instance_load(v.state).total for v in views]
    assert loads[0] > loads[2] > loads[1]
    moves = policy.plan(0.0, views, COSTS)
    assert pairs(moves) == [("a0", 0, 1)]  # the request that closes the gap most, to the least loaded
    assert moves[0].reason == "balance" and moves[0].kv_bytes == 500 * KV_PER_TOKEN
    # the same fleet with the gap under the threshold: nothing moves
    assert BalancePolicy(min_gap=loads[0] - loads[1] + 1).plan(0.0, views, COSTS) == []
    assert BalancePolicy(rel_gap=1.0).plan(0.0, views, COSTS) == []  # the gap is never all of the source's load


def test_balance_prefers_cheap_moves_and_never_flips_the_imbalance():
    # two requests with the same predicted work; one has 10x the KV to copy
    src = view(0, st(running=2, prefill=4000, used=400, decode=2400),
               [mr("big", tokens=5000, remaining=1200), mr("small", tokens=500, remaining=1200)])
    dst = view(1, st())
    slow_link = MoveCosts.uniform(KV_PER_TOKEN, 2e9)  # 25 GbE-class: the big copy takes over a second
    policy = BalancePolicy()
    loads = policy.loads([src, dst])
    scored = {c.request.request_id: c for c in policy.candidates(src, dst, loads, slow_link)}
    assert scored["big"].gain == pytest.approx(scored["small"].gain)
    assert scored["big"].copy_s > 5 * scored["small"].copy_s
    assert pairs(policy.plan(0.0, [src, dst], slow_link)) == [("small", 0, 1)]
    # a copy longer than max_copy_s is not considered at all
    assert "big" not in {c.request.request_id for c in
                         BalancePolicy(options=MigrationOptions(max_copy_s=1.0)).candidates(src, dst, loads, slow_link)}
    # a request whose move would leave the target more loaded than the source was gains nothing
    lopsided = view(0, st(running=1, used=100, total=5000, decode=20000), [mr("huge", remaining=20000)])
    busy = view(1, st(prefill=2000, total=5000))
    assert BalancePolicy(min_gap=0, rel_gap=0).plan(0.0, [lopsided, busy], COSTS) == []
    # nor does carrying an instance's only request to an idle one: the load just changes address
    assert BalancePolicy(min_gap=0, rel_gap=0).plan(0.0, [lopsided, view(1, st(total=5000))], COSTS) == []
    # and a move that saves less than min_gain is not worth its pause
    trickle = view(0, st(running=1, prefill=6000, used=100, decode=400), [mr("short-tail", remaining=400)])
    assert BalancePolicy().plan(0.0, [trickle, view(1, st())], COSTS) == []  # gains 100 tokens
    assert pairs(BalancePolicy(min_gain=50).plan(0.0, [trickle, view(1, st())], COSTS)) == [("short-tail", 0, 1)]


def test_balance_counts_kv_the_pool_cannot_hold():
    """A full pool whose queue waits for blocks is loaded by what it cannot hold (84 blocks here),
    and the move that relieves most of that per second of copy wins."""
    full = view(0, st(running=3, waiting=2, prefill=1200, used=990, waiting_blocks=75, decode=300),
                [mr("long", tokens=4000, remaining=100), mr("mid", tokens=1500, remaining=100),
                 mr("short", tokens=200, remaining=100)])
    empty = view(1, st(used=100))
    load = instance_load(full.state)
    assert load.overflow > 0
    moves = BalancePolicy().plan(0.0, [full, empty], COSTS)
    # "mid" (100 blocks) covers the shortfall; "long" covers no more and copies 2.7x longer; "short" frees 19
    # blocks, which leaves the pool short all the same (a preemption still due): it gains next to nothing
    assert pairs(moves) == [("mid", 0, 1)]
    eager = BalancePolicy(min_gain=0)
    scored = {c.request.request_id: c for c in eager.candidates(full, empty, eager.loads([full, empty]), COSTS)}
    assert scored["mid"].gain == pytest.approx(scored["long"].gain)
    assert scored["mid"].gain > 20 * scored["short"].gain


def test_balance_needs_room_on_the_target_and_skips_requests_about_to_end():
    src = view(0, st(running=2, prefill=6000, used=500, decode=500),
               [mr("ending", remaining=3, tbt=0.05), mr("fat", tokens=8000, remaining=400)])
    tight = view(1, st(used=600))  # 400 blocks free: 8000 tokens need 501
    assert BalancePolicy().plan(0.0, [src, tight], COSTS) == []


# ---- defrag ----------------------------------------------------------------------------------------

def test_defrag_makes_room_for_a_request_no_instance_can_admit():
    head = mr("long-prompt", tokens=300 * BS)  # needs 300 blocks; nobody has more than 150 free
    a = view(0, st(running=3, waiting=1, used=900, waiting_blocks=300),
             [mr("a1", tokens=100 * BS), mr("a2", tokens=100 * BS), mr("a3", tokens=20 * BS)], [head])
    b = view(1, st(used=850))
    c = view(2, st(used=850))
    moves = DefragPolicy().plan(0.0, [a, b, c], COSTS)
    # shortfall 200 blocks: no single request covers it, so the two largest go, one per target
    assert pairs(moves) == [("a1", 0, 1), ("a2", 0, 2)]
    assert all(m.reason == "defrag" for m in moves)
    # one request big enough alone: the smallest such moves (the cheapest copy)
    a_big = view(0, a.state, [mr("huge", tokens=400 * BS), mr("enough", tokens=210 * BS), mr("a3", tokens=20 * BS)],
                 [head])
    roomy_b = view(1, st(used=720))  # 280 free: still not enough for the 300-block prompt
    assert pairs(DefragPolicy().plan(0.0, [a_big, roomy_b, view(2, st(used=840))], COSTS)) == [("enough", 0, 1)]


def test_defrag_stays_still_when_someone_can_admit_or_the_shortfall_cannot_be_covered():
    head = mr("long-prompt", tokens=300 * BS)
    a = view(0, st(running=2, waiting=1, used=900), [mr("a1", tokens=100 * BS), mr("a2", tokens=100 * BS)], [head])
    assert DefragPolicy().plan(0.0, [a, view(1, st(used=600))], COSTS) == []  # instance 1 can take it
    # targets too full to take the movers: partial room helps no one, so nothing moves
    assert DefragPolicy().plan(0.0, [a, view(1, st(used=880)), view(2, st(used=880))], COSTS) == []


# ---- priority --------------------------------------------------------------------------------------

def test_priority_moves_a_low_class_off_where_a_high_class_would_miss_its_ttft():
    urgent = mr("vip", tokens=120 * BS, priority=0, ttft=1.0)
    running = [mr("vip-running", tokens=50 * BS, priority=0), mr("bulk-small", tokens=30 * BS, priority=2),
               mr("bulk-large", tokens=150 * BS, priority=2), mr("mid", tokens=200 * BS, priority=1)]
    a = view(0, st(running=4, waiting=1, used=950, waiting_blocks=120, slack=0.3), running, [urgent])
    b = view(1, st(used=300))
    moves = PriorityPolicy().plan(0.0, [a, b], COSTS)
    # 120 blocks needed, 50 free: the lowest class pays, and its one request that covers 70 blocks moves
    assert pairs(moves) == [("bulk-large", 0, 1)]
    assert moves[0].reason == "priority"
    # plenty of slack left: the high class will make it without help
    relaxed = view(0, st(running=4, waiting=1, used=950, waiting_blocks=120, slack=0.9), running, [urgent])
    assert PriorityPolicy().plan(0.0, [relaxed, b], COSTS) == []
    # nobody of a lower class to move: nothing moves
    only_vips = view(0, a.state, [mr("vip-running", priority=0)], [urgent])
    assert PriorityPolicy().plan(0.0, [only_vips, b], COSTS) == []


def test_priority_moves_a_low_class_off_where_a_high_class_misses_its_tbt():
    running = [mr("vip", priority=0, tbt_target=0.05, tbt=0.08), mr("bulk-a", tokens=900, priority=3),
               mr("bulk-b", tokens=300, priority=3), mr("mid", tokens=100, priority=1)]
    a = view(0, st(running=4, used=400), running)
    moves = PriorityPolicy().plan(0.0, [a, view(1, st(used=100)), view(2, st(used=50))], COSTS)
    assert pairs(moves) == [("bulk-b", 0, 2)]  # lowest class, cheapest copy, roomiest target
    on_time = view(0, a.state, [mr("vip", priority=0, tbt_target=0.05, tbt=0.04)] + running[1:])
    assert PriorityPolicy().plan(0.0, [on_time, view(1, st())], COSTS) == []


# ---- drain -----------------------------------------------------------------------------------------

def test_drain_empties_draining_instances_onto_accepting_ones():
    running = [mr(f"d{i}", tokens=100 * BS, remaining=100 * (i + 1)) for i in range(4)]
    draining = view(0, st(running=4, used=400), running, accepting=False, draining=True)
    b = view(1, st(used=700))  # 300 free
    c = view(2, st(used=500))  # 500 free
    closed = view(3, st(used=0), accepting=False)  # unhealthy: never a target
    moves = DrainPolicy().plan(0.0, [draining, b, c, closed], COSTS)
    assert sorted(m.request_id for m in moves) == ["d0", "d1", "d2", "d3"]
    assert all(m.source == 0 and m.target in (1, 2) and m.reason == "drain" for m in moves)
    assert moves[0].request_id == "d3"  # the most work left goes first, to the roomiest
    assert moves[0].target == 2
    # room for only some of them: those move now, the rest on a later tick
    crowded = DrainPolicy().plan(0.0, [draining, view(1, st(used=850))], COSTS)
    assert [m.request_id for m in crowded] == ["d3"]
    # a request that would finish before its copy does stays to finish
    nearly_done = view(0, st(running=1, used=100), [mr("last", tokens=20000, remaining=2, tbt=0.02)],
                       accepting=False, draining=True)
    slow = MoveCosts.uniform(KV_PER_TOKEN, 3e9)
    assert DrainPolicy().plan(0.0, [nearly_done, view(1, st(total=5000))], slow) == []


def test_combined_policy_drains_first_and_moves_each_request_once():
    running = [mr("x", remaining=2000), mr("y", remaining=1500)]
    draining = view(0, st(running=2, prefill=5000, used=300, decode=3500), running, accepting=False, draining=True)
    idle = view(1, st())
    other = view(2, st(prefill=3000, used=200))
    combined = make_migration_policy("balance,drain")
    moves = combined.plan(0.0, [draining, idle, other], COSTS)
    assert sorted(m.request_id for m in moves) == ["x", "y"]
    assert all(m.reason == "drain" for m in moves)  # balance skips draining sources; drain owns them
    busy = view(0, st(running=2, prefill=5000, used=300, decode=3500), running)
    both = make_migration_policy("balance,defrag,priority").plan(0.0, [busy, idle, other], COSTS)
    assert len({m.request_id for m in both}) == len(both) >= 1


# ---- the controller --------------------------------------------------------------------------------

class FixedPlan(MigrationPolicy):
    """Proposes the moves it was given, among the requests still visible in the views."""

    name = "fixed"

    def __init__(self, moves: list[Move]):
        self.moves = moves

    def plan(self, now, views, costs):
        visible = {r.request_id for v in views for r in v.running}
        return [m for m in self.moves if m.request_id in visible]


def fleet_views(accepting=(True, True, True)) -> list[InstanceView]:
    return [view(i, st(running=3), [mr(f"i{i}r{j}") for j in range(3)], accepting=accepting[i]) for i in range(3)]


def test_controller_limits_concurrent_migrations_per_instance():
    moves = [Move("i0r0", 0, 1, "fixed"), Move("i0r1", 0, 2, "fixed"),  # two out of instance 0
             Move("i2r0", 2, 1, "fixed"), Move("i2r1", 2, 0, "fixed")]  # a second one into 1
    ctl = FleetController(make_router("round-robin"), FixedPlan(moves))
    chosen = ctl.plan_migrations(0.0, fleet_views(), COSTS)
    assert pairs(chosen) == [("i0r0", 0, 1), ("i2r1", 2, 0)]
    for m in chosen:
        ctl.started(m)
    # while those run, instance 0 sends nothing more and instance 1 receives nothing more
    assert ctl.plan_migrations(0.1, fleet_views(), COSTS) == []
    ctl.finished(chosen[0], True, 0.2)
    assert pairs(ctl.plan_migrations(0.2, fleet_views(), COSTS)) == [("i0r1", 0, 2)]  # 0 is free to send again
    wider = FleetController(make_router("round-robin"), FixedPlan(moves), max_concurrent_per_instance=2)
    assert len(wider.plan_migrations(0.0, fleet_views(), COSTS)) == 4


def test_controller_cooldown_in_flight_and_non_accepting_targets():
    move = Move("i0r0", 0, 1, "fixed", kv_bytes=1000)
    ctl = FleetController(make_router("round-robin"), FixedPlan([move]), min_interval_s=1.0)
    assert ctl.plan_migrations(0.0, fleet_views(accepting=(True, False, True)), COSTS) == []  # 1 does not accept
    assert ctl.plan_migrations(0.0, fleet_views(), COSTS) == [move]
    ctl.started(move)
    with pytest.raises(ValueError, match="already migrating"):
        ctl.started(move)
    assert ctl.plan_migrations(0.05, fleet_views(), COSTS) == []  # in flight
    ctl.finished(move, False, 0.1)
    assert ctl.plan_migrations(0.5, fleet_views(), COSTS) == []  # cooling down
    assert ctl.plan_migrations(1.2, fleet_views(), COSTS) == [move]  # cooled down
    ctl.started(move)
    ctl.finished(move, True, 1.3, bytes_sent=1500, downtime_s=0.02)
    assert ctl.counters == {"started": 2, "completed": 1, "aborted": 1, "bytes": 1500, "downtime_s": 0.02}
    with pytest.raises(ValueError, match="not migrating"):
        ctl.finished(move, True, 1.4)


def test_controller_hides_blocked_requests_from_the_policy_and_routes_through_its_router():
    """A request that cannot move is invisible to the policy, which then picks its next best."""
    views = [view(0, st(running=2, prefill=6000, used=300, decode=6000),
                  [mr("best", remaining=4000), mr("second", remaining=2000)]), view(1, st())]
    ctl = FleetController(make_router("least-requests"), BalancePolicy(), min_interval_s=5.0)
    first = ctl.plan_migrations(0.0, views, COSTS)
    assert pairs(first) == [("best", 0, 1)]
    ctl.started(first[0])
    ctl.finished(first[0], False, 0.1)  # aborted: it stays at 0, and may not be retried at once
    assert pairs(ctl.plan_migrations(0.2, views, COSTS)) == [("second", 0, 1)]
    assert ctl.route(None, [st(running=3), st(running=1)]) == 1  # type: ignore[arg-type]
    assert FleetController(make_router("round-robin")).plan_migrations(0.0, views, COSTS) == []


def test_the_precopy_rule_stops_under_a_block_or_at_the_round_limit():
    from sloserve.cluster.migration.precopy import PrecopyRule
    rule = PrecopyRule(max_rounds=3)
    assert rule.another_round(1, 17, 16)  # more than a block computed since: copy again
    assert not rule.another_round(1, 16, 16)  # a block or less: suspend and copy the rest
    assert rule.another_round(2, 500, 16) and not rule.another_round(3, 500, 16)  # bounded rounds
