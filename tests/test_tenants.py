"""What an API key may ask for, per-tenant limits, cache salts and per-tenant request ids.

Everything here is pure Python driven by a fake clock; the server's wiring is tested where it
is wired (test_server*.py)."""
from __future__ import annotations

import hashlib
import hmac

import pytest

from sloserve.server.errors import APIError
from sloserve.server.qos import (ANONYMOUS, INT32_MIN, CacheSalter, InvalidPriority, QoSNotPermitted, QoSRegistry,
                                 UnknownQoSClass, anonymous_tenant, cache_salt, cache_secret, parse_qos_config)
from sloserve.server.tenants import (TenantLimiter, TenantLimits, client_request_id, scope_request_id,
                                     tenant_scope)
from sloserve.core.types import INT32_MAX

CONFIG = {
    "default_class": "standard",
    "classes": {
        "interactive": {"ttft_ms": 500, "priority": 0},
        "standard": {"ttft_s": 2, "priority": 5},
        "batch": {"ttft_s": 60, "priority": 9},
    },
    "api_keys": {
        "sk-alice": {"tenant": "alice", "classes": ["interactive"]},
        "sk-alice-2": {"tenant": "alice", "max_concurrent_requests": 3},
        "sk-bob": "bob",
        "sk-ops": {"tenant": "ops", "classes": "*", "min_priority": -10},
        "sk-batch": {"tenant": "carol", "default_class": "batch"},
    },
    "limits": {"max_concurrent_requests": 8, "max_tokens_per_minute": 6000},
    "tenants": {"bob": {"max_tokens_per_minute": 60}},
}


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def reg() -> QoSRegistry:
    return parse_qos_config(CONFIG)


# ---- classes and priorities a key may use ------------------------------------------------
def test_a_key_gets_its_listed_classes_and_may_always_downgrade(reg):
    alice, bob, carol, ops = (reg.authenticate(k) for k in ("sk-alice", "sk-bob", "sk-batch", "sk-ops"))
    assert reg.authorize(None, alice, None)[0].name == "standard"
    assert reg.authorize("interactive", alice, None)[0].name == "interactive"  # listed
    assert reg.allowed_classes(alice) == ["interactive", "standard"]  # a list is exact (+ its default)
    # no list: its default and anything no more urgent; never a higher class
    assert reg.allowed_classes(bob) == ["batch", "standard"]
    with pytest.raises(QoSNotPermitted) as err:
        reg.authorize("interactive", bob, None)
    assert err.value.param == "qos_class" and "interactive" in err.value.message
    assert reg.allowed_classes(carol) == ["batch"]
    with pytest.raises(QoSNotPermitted):
        reg.resolve("standard", carol)  # the older call checks the class too
    assert reg.allowed_classes(ops) == ["batch", "default", "interactive", "standard"]
    with pytest.raises(UnknownQoSClass):
        reg.authorize("platinum", ops, None)
    # errors the server can let propagate: 400 / 403 in OpenAI's schema, naming the parameter
    with pytest.raises(UnknownQoSClass) as unknown:
        reg.authorize("platinum", ops, None)
    assert isinstance(unknown.value, KeyError) and unknown.value.status == 400
    assert unknown.value.param == "qos_class" and "'standard'" in str(unknown.value)
    with pytest.raises(QoSNotPermitted) as denied:
        reg.authorize("interactive", bob, None)
    assert denied.value.body()["error"]["type"] == "permission_error" and denied.value.status == 403


def test_priority_may_only_lower_urgency_unless_a_floor_is_configured(reg):
    bob, ops = reg.authenticate("sk-bob"), reg.authenticate("sk-ops")
    assert reg.authorize(None, bob, 5) == (reg.classes["standard"], 5)
    assert reg.authorize(None, bob, INT32_MAX)[1] == INT32_MAX  # less urgent: always fine
    with pytest.raises(QoSNotPermitted) as err:
        reg.authorize(None, bob, 4)  # more urgent than its class
    assert err.value.param == "priority"
    assert reg.authorize("batch", bob, 9)[1] == 9
    with pytest.raises(QoSNotPermitted):
        reg.authorize("batch", bob, 5)  # batch's floor is batch's priority, not the default's
    assert reg.authorize("batch", ops, -10)[1] == -10  # min_priority replaces the class floor
    with pytest.raises(QoSNotPermitted):
        reg.authorize("batch", ops, -11)


@pytest.mark.parametrize("bad", [INT32_MAX + 1, INT32_MIN - 1, 2**200, True, 1.5, "3"])
def test_priority_is_an_int32_for_everybody(reg, bad):
    with pytest.raises(InvalidPriority) as err:
        reg.authorize(None, reg.authenticate("sk-ops"), bad)
    assert err.value.status == 400 and err.value.param == "priority"
    with pytest.raises(InvalidPriority):
        QoSRegistry().authorize(None, ANONYMOUS, bad)


def test_without_keys_callers_may_use_any_class_and_priority_unless_configured():
    open_reg = parse_qos_config({"classes": CONFIG["classes"]})
    anon = open_reg.authenticate(None)
    assert not open_reg.auth_required and anon.tenant == ""
    assert open_reg.authorize("interactive", anon, INT32_MIN) == (open_reg.classes["interactive"], INT32_MIN)
    closed = parse_qos_config({"classes": CONFIG["classes"], "default_class": "batch",
                               "anonymous": {"classes": ["standard"], "min_priority": 5, "tenant": "public"}})
    anon = closed.authenticate(None)
    assert anon.tenant == "public" and closed.allowed_classes(anon) == ["batch", "standard"]
    with pytest.raises(QoSNotPermitted):
        closed.authorize("interactive", anon, None)
    with pytest.raises(QoSNotPermitted):
        closed.authorize("standard", anon, 4)
    # with keys configured, the anonymous entry never applies: no key is no access
    assert parse_qos_config({**CONFIG, "anonymous": {"classes": "*"}}).authenticate(None) is None


def test_command_line_keys_get_the_default_class_and_no_upgrade(reg):
    merged = reg.with_keys(["cli-key"])
    p = merged.authenticate("cli-key")
    assert p.tenant == anonymous_tenant("cli-key") and len(anonymous_tenant("cli-key")) == len("key-") + 16
    assert merged.allowed_classes(p) == ["batch", "standard"]
    assert merged.limits_for(p.tenant) == reg.default_limits and merged.cache_isolation == reg.cache_isolation


@pytest.mark.parametrize("raw, fragment", [
    ({"api_keys": {"k": {"tenant": "t", "classes": ["gold"]}}}, "unknown class"),
    ({"api_keys": {"k": {"tenant": "t", "classes": "interactive"}}}, "classes must be"),
    ({"api_keys": {"k": {"tenant": "t", "min_priority": 2**31}}}, "min_priority"),
    ({"api_keys": {"k": {"tenant": "t", "max_concurrent_requests": 0}}}, "max_concurrent_requests"),
    ({"api_keys": {"k": {"tenant": "t", "max_tokens_per_minute": 5}}, "tenants": {"t": {"max_tokens_per_minute": 6}}},
     "contradicts"),
    ({"tenants": {"t": {"max_requests": 1}}}, "unknown key"),
    ({"limits": {"max_concurrent_requests": True}}, "positive integer"),
    ({"anonymous": {"role": "x"}}, "unknown key"),
    ({"cache_isolation": "none"}, "cache_isolation"),
    ({"classes": {"a": {"priority": 2**40}}}, "priority"),
])
def test_config_errors_name_the_entry(raw, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_qos_config(raw)


def test_limits_per_tenant_fill_from_the_defaults(reg):
    assert reg.limits_for("alice") == TenantLimits(3, 6000)  # from a key entry of alice's
    assert reg.limits_for("bob") == TenantLimits(8, 60)
    assert reg.limits_for("nobody") == TenantLimits(8, 6000)
    assert QoSRegistry().limits_for("x").unlimited


# ---- the limiter -------------------------------------------------------------------------
def limiter(**limits) -> tuple[TenantLimiter, FakeClock]:
    clock = FakeClock()
    return TenantLimiter(lambda tenant: TenantLimits(**limits), clock), clock


def test_concurrency_limit_counts_engine_requests_and_frees_on_release():
    lim, _ = limiter(max_concurrent_requests=3)
    lim.try_acquire("a", ["a1", "a2"], 10)
    with pytest.raises(APIError) as err:
        lim.try_acquire("a", ["a3", "a4"], 10)  # all or nothing
    assert err.value.status == 429 and err.value.code == "tenant_concurrency_limit"
    assert err.value.headers["Retry-After"] == "1"
    assert lim.in_flight("a") == 2
    lim.try_acquire("b", ["b1", "b2", "b3"], 10)  # another tenant is not affected
    lim.release("a", "a1")
    lim.release("a", "a1")  # twice is harmless
    lim.try_acquire("a", ["a3", "a4"], 10)
    assert lim.in_flight("a") == 3
    with pytest.raises(APIError, match="smaller n"):
        lim.try_acquire("c", ["c1", "c2", "c3", "c4"], 1)  # can never fit


def test_token_bucket_charges_prompt_and_output_and_says_when_to_retry():
    lim, clock = limiter(max_tokens_per_minute=600)  # 10 tokens per second, a minute's burst
    lim.try_acquire("a", ["r1"], 500)
    lim.record("a", 90)  # generated tokens: 10 left
    assert lim.tokens_available("a") == pytest.approx(10)
    with pytest.raises(APIError) as err:
        lim.try_acquire("a", ["r2"], 50)  # needs 40 more: 4 s
    assert err.value.code == "tenant_token_limit" and err.value.headers["Retry-After"] == "4"
    assert lim.in_flight("a") == 1  # the refused request took no slot
    clock.t += 4.0
    lim.try_acquire("a", ["r2"], 50)
    lim.record("a", 300)  # generated past the bucket: debt of 300
    clock.t += 10.0
    assert lim.tokens_available("a") == pytest.approx(-200)
    with pytest.raises(APIError) as err:
        lim.try_acquire("a", ["r3"], 1)
    assert err.value.headers["Retry-After"] == "21"  # (1 + 200) / 10, rounded up
    lim.try_acquire("b", ["b1"], 600)  # every tenant has its own bucket
    clock.t += 100.0
    assert lim.tokens_available("a") == 600  # refills to one minute's worth, no more


def test_a_prompt_larger_than_the_bucket_waits_for_a_full_bucket_then_runs_into_debt():
    lim, clock = limiter(max_tokens_per_minute=60)
    lim.try_acquire("a", ["big"], 1000)
    assert lim.tokens_available("a") == pytest.approx(-940)
    with pytest.raises(APIError):
        lim.try_acquire("a", ["small"], 1)
    clock.t += 1000.0  # 940 s to repay, then the next one
    lim.try_acquire("a", ["small"], 1)


def test_idle_tenants_are_forgotten_and_unlimited_tenants_never_tracked():
    lim, clock = limiter(max_concurrent_requests=2, max_tokens_per_minute=60)
    lim.try_acquire("a", ["r"], 30)
    lim.release("a", "r")
    assert lim.num_tracked == 1  # its bucket is not full yet: kept
    clock.t += 60.0
    lim.try_acquire("b", ["x"], 1)
    lim.release("b", "x")
    lim.release("a", "r")
    assert lim.num_tracked == 1  # a is back to its initial state and dropped; b is still refilling
    free, _ = limiter()
    free.try_acquire("a", ["r"], 10**9)
    free.record("a", 10**9)
    assert free.num_tracked == 0 and free.tokens_available("a") is None


def test_limiter_reads_the_registry_limits(reg):
    clock = FakeClock()
    lim = TenantLimiter(reg.limits_for, clock)
    lim.try_acquire("bob", ["b1"], 60)
    with pytest.raises(APIError):
        lim.try_acquire("bob", ["b2"], 1)
    lim.try_acquire("alice", ["a1", "a2", "a3"], 1)
    with pytest.raises(APIError):
        lim.try_acquire("alice", ["a4"], 1)


# ---- cache salts ----------------------------------------------------------------------------
def test_cache_salt_is_an_hmac_of_the_namespace_and_never_the_key():
    secret = b"s3cret"
    assert cache_salt(secret, "tenant\0alice") == hmac.new(secret, b"tenant\0alice", hashlib.sha256).hexdigest()
    assert cache_salt(secret, None) == ""
    assert cache_salt(b"other", "tenant\0alice") != cache_salt(secret, "tenant\0alice")


@pytest.mark.parametrize("mode, same_tenant_shares, tenants_share", [
    ("tenant", True, False), ("key", False, False), ("shared", True, True)])
def test_cache_isolation_modes(mode, same_tenant_shares, tenants_share):
    reg = parse_qos_config({**CONFIG, "cache_isolation": mode})
    salter = CacheSalter(b"k")
    a1, a2, b = (salter.salt(reg.authenticate(k)) for k in ("sk-alice", "sk-alice-2", "sk-bob"))
    assert (a1 == a2) is same_tenant_shares and (a1 == b) is tenants_share
    for key in ("sk-alice", "sk-alice-2", "sk-bob"):
        ns = reg.authenticate(key).cache_namespace
        assert ns is None or key not in ns
    assert reg.with_cache_isolation("shared").authenticate("sk-alice").cache_namespace is None
    if mode == "shared":
        assert a1 == ""  # no salt: the keys of before, and everybody's prefixes shared


def test_cache_secret_comes_from_the_flag_then_the_environment_else_is_random():
    assert cache_secret("flag", {"SLOSERVE_CACHE_SECRET": "env"}) == b"flag"
    assert cache_secret(None, {"SLOSERVE_CACHE_SECRET": "env"}) == b"env"
    one, two = cache_secret(None, {}), cache_secret(None, {})
    assert len(one) == 32 and one != two


# ---- request ids ----------------------------------------------------------------------------
def test_request_ids_are_scoped_per_tenant_and_map_back():
    a, b = scope_request_id("alice", "job-1"), scope_request_id("bob", "job-1")
    assert a != b and a.endswith(":job-1") and len(tenant_scope("alice")) == 16
    assert client_request_id(a) == client_request_id(b) == "job-1"
    assert client_request_id(f"{a}-3") == "job-1-3"  # one of n choices
    nested = scope_request_id("alice", f"{tenant_scope('bob')}:x")  # a client cannot pose as another scope
    assert nested != scope_request_id("bob", "x") and client_request_id(nested) == f"{tenant_scope('bob')}:x"
    assert client_request_id("cmpl-123") == "cmpl-123" and client_request_id("a:b") == "a:b"
    assert "alice" not in a
