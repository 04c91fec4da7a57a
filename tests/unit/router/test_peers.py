"""What the peers' view makes of `routers/` snapshots: the records it parses (once per value), its own
record left out, malformed records counted as no demand, and the core's shares following. The etcd side
(watch, publish, outage) is tested with a real etcd in tests/integration/test_quota_shares.py."""

from __future__ import annotations

import json

import pytest

from sluice_inference.common.clock import FakeClock
from sluice_inference.common.etcd_watch import MAX_VALUE_BYTES, decode_json_value
from sluice_inference.common.serving_settings import AdmissionSettings, RouterSettings, TenantSettings
from sluice_inference.common.trust_settings import EtcdSettings
from sluice_inference.router.driver import Driver
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.peers import PeerView, merge_overrides, router_record
from sluice_inference.router.policy.core import RouterCore
from sluice_inference.router.policy.demand import Demand
from sluice_inference.router.worker_link import WorkerLinks

TENANTS = {"t": TenantSettings(rate=60, burst=10, max_inflight=10)}


def peer_view() -> tuple[PeerView, Driver]:
    clock = FakeClock(0.0)
    core = RouterCore(0.0, settings=RouterSettings(), admission=AdmissionSettings(), tenants=TENANTS)
    driver = Driver(clock, core, WorkerLinks(), RouterMetrics())
    view = PeerView(
        EtcdSettings(), TENANTS, require_api_key=False, driver=driver, metrics=RouterMetrics(), clock=clock
    )
    view.router_id = "me"  # what start() sets (it also opens the etcd watches)
    return view, driver


def test_a_record_carries_the_address_and_bounded_demand() -> None:
    assert json.loads(router_record("h:1", None)) == {"addr": "h:1"}
    record = json.loads(router_record("h:1", Demand({"t": 123.456}, 130.0)))
    assert record == {"addr": "h:1", "demand": {"tenants": {"t": 123.0}, "total": 130.0}}


def test_peers_demand_moves_this_routers_share_and_its_own_record_is_not_a_peer() -> None:
    view, driver = peer_view()
    limiter = driver.core.admission.limiter
    me = router_record("h:0", None)
    busy = router_record("h:1", Demand({"t": 150.0}, 150.0))
    view.apply_routers({"me": me, "busy": busy, "idle": router_record("h:2", None)})
    assert view.routers == 3
    assert limiter.rate_share("t") == pytest.approx(60 * 0.1 / 3)  # all demand elsewhere: the floor
    view.apply_routers({"me": me, "idle": router_record("h:2", None)})  # busy's lease expired
    assert view.routers == 2 and limiter.rate_share("t") == pytest.approx(30)  # nobody asks: equal


def test_a_record_is_parsed_once_per_value_and_a_malformed_one_counts_as_no_demand() -> None:
    view, _ = peer_view()
    busy = router_record("h:1", Demand({"t": 150.0}, 150.0))
    view.apply_routers({"busy": busy, "bad": b"{not json"})
    parsed = view.peers["busy"]
    view.apply_routers({"busy": busy, "bad": b"{not json", "new": router_record("h:3", None)})
    assert view.peers["busy"] is parsed  # the same value is not parsed again
    assert view.peers["bad"] == Demand()
    assert view.routers == 4


def test_while_stale_the_view_is_kept_but_not_applied() -> None:
    view, driver = peer_view()
    limiter = driver.core.admission.limiter
    busy = router_record("h:1", Demand({"t": 150.0}, 150.0))
    view.apply_routers({"busy": busy})
    view.stale = True  # what the publish loop does when the registration lost etcd
    driver.set_peers(None)
    assert limiter.rate_share("t") == pytest.approx(30)  # the equal split over the 2 routers last known
    view.apply_routers({"busy": busy, "idle": router_record("h:2", None)})
    assert limiter.rate_share("t") == pytest.approx(30)  # not applied while stale ...
    driver.set_peers(view.peers)  # ... but kept, for when etcd answers again
    assert limiter.rate_share("t") == pytest.approx(60 * 0.1 / 3)


def test_records_that_would_exhaust_the_parser_or_overflow_a_float_count_as_no_demand() -> None:
    view, _ = peer_view()
    busy = router_record("h:1", Demand({"t": 150.0}, 150.0))
    huge = b'{"addr": "h:2", "demand": {"tenants": {"t": 1' + b"0" * 400 + b'}, "total": 5}}'
    view.apply_routers({"busy": busy, "deep": b"[" * 100_000, "huge": huge})
    assert view.routers == 4
    assert view.peers["deep"] == Demand()
    assert view.peers["huge"] == Demand({}, 5.0)  # the absurd rate is dropped, the sane total kept
    assert view.peers["busy"] == Demand({"t": 150.0}, 150.0)


def test_a_tenant_override_that_would_exhaust_the_parser_is_ignored_and_the_rest_apply() -> None:
    configured = {"t": TenantSettings(rate=60, burst=10, max_inflight=10)}
    previous = merge_overrides(configured, {"t": b'{"rate": 5}'})
    merged = merge_overrides(configured, {"t": b'{"rate": 5}', "zzz": b"[" * 100_000}, previous)
    assert merged["t"].rate == 5 and "zzz" not in merged
    kept = merge_overrides(configured, {"t": b'{"rate": ' + b"[" * 100_000}, previous)
    assert kept["t"].rate == 5  # an unreadable override keeps what was in force, never half-applied


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"[" * 100_000, "nested too deeply"),
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b" " * (MAX_VALUE_BYTES + 1), "limit"),
    ],
)
def test_the_etcd_value_reader_turns_every_bad_value_into_a_value_error(raw: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        decode_json_value(raw, what="a value")


def test_an_override_cannot_grant_admin_but_its_revocation_applies() -> None:
    old, new = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    configured = {"t": TenantSettings(api_keys=[old, new], rate=60)}
    merged = merge_overrides(configured, {"t": json.dumps({"admin": True, "api_keys": [new]}).encode()})
    assert merged["t"].admin is False and merged["t"].api_keys == [new]


def test_an_override_cannot_create_a_tenant_or_add_a_key() -> None:
    key = "sha256:" + "3" * 64
    configured = {"t": TenantSettings(rate=60)}
    overrides = {
        "mallory": json.dumps({"api_keys": [key], "admin": True}).encode(),
        "anonymous": b"{}",  # would open key-less access
        "t": json.dumps({"api_keys": [key], "rate": 1e9}).encode(),
    }
    merged = merge_overrides(configured, overrides)
    assert set(merged) == {"t"}
    assert merged["t"].api_keys == [] and merged["t"].rate == 60
