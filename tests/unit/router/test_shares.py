"""Quota shares that follow demand: the allocation rule, the share book's view of its peers, and whole
clusters of admission controllers exchanging demand under a fake clock (1 to 100 routers; joins, leaves,
deaths, a first request, a load that moves, etcd out of reach)."""

from __future__ import annotations

import math
import random

import pytest

from sluice_inference.common.errors import SluiceError
from sluice_inference.common.serving_settings import AdmissionSettings, TenantSettings
from sluice_inference.router.policy.admission import AdmissionController
from sluice_inference.router.policy.backlog import Backlog
from sluice_inference.router.policy.demand import Demand
from sluice_inference.router.policy.estimators import ServiceEstimates
from sluice_inference.router.policy.lanes import LaneKey, LaneLimits, QueuedRequest
from sluice_inference.router.policy.shares import OWN_GRACE_S, ShareBook, share_fraction

EPS = 0.1


# ------------------------------------------------------------------ the allocation rule


@pytest.mark.parametrize(
    ("mine", "total", "routers", "fraction"),
    [
        (0.0, 0.0, 1, 1.0),  # one router: everything, always
        (500.0, 500.0, 1, 1.0),
        (0.0, 0.0, 4, 0.25),  # nobody asks: the equal split
        (20.0, 40.0, 2, 0.5),  # in proportion to demand, under the limit ...
        (50.0, 200.0, 2, 0.25),  # ... and over it
        (30.0, 30.0, 20, 1.0),  # all demand here: all of it, at any router count
        (0.0, 150.0, 2, EPS / 2),  # no demand here, all elsewhere: the floor
        (0.0, 150.0, 100, EPS / 100),
        (0.001, 150.0, 2, EPS / 2),
        (200.0, 150.0, 2, 1.0),  # own demand is part of the total: never more than all of it
    ],
)
def test_the_allocation_rule(mine: float, total: float, routers: int, fraction: float) -> None:
    assert share_fraction(mine, total, routers, EPS) == pytest.approx(fraction)


@pytest.mark.parametrize("routers", [1, 2, 3, 20, 100])
def test_routers_that_agree_on_the_demand_never_hold_more_than_the_limit_plus_epsilon(routers: int) -> None:
    rng = random.Random(routers)
    for _ in range(300):
        limit = rng.choice([1.0, 60.0, 5000.0])
        demand = [rng.choice([0.0, 0.0, rng.expovariate(1 / limit)]) for _ in range(routers)]
        total = sum(demand)
        exact = sum(share_fraction(d, total, routers, 0.0) for d in demand)
        floored = sum(share_fraction(d, total, routers, EPS) for d in demand)
        assert exact == pytest.approx(1.0)  # without the floor: exactly the limit
        assert 1.0 - 1e-9 <= floored <= 1.0 + EPS + 1e-9


# ------------------------------------------------------------------ the share book


def demand(**tenants: float) -> Demand:
    return Demand(tenants, sum(tenants.values()))


def test_routers_joining_leaving_and_dying_change_the_count_and_shares_follow() -> None:
    book = ShareBook(follow_demand=True, floor=EPS, max_routers=100)
    assert book.shares(["t"]).of("t") == 1.0  # alone
    book.set_peers({"b": demand(t=150.0)})
    assert book.shares(["t"]).of("t") == pytest.approx(EPS / 2)  # b has it all: the floor
    book.set_peers({"b": demand(t=150.0), "c": demand()})  # c joins, without demand
    assert book.routers == 3 and book.shares(["t"]).of("t") == pytest.approx(EPS / 3)
    book.set_peers({"c": demand()})  # b left (revoked) or died (its lease expired): its share returns
    assert book.shares(["t"]).of("t") == pytest.approx(0.5)  # nobody asks: equal


def test_stale_view_falls_back_to_the_equal_split_over_the_routers_last_known() -> None:
    book = ShareBook(follow_demand=True, floor=EPS, max_routers=100)
    book.set_peers({"b": demand(t=150.0), "c": demand()})
    book.set_peers(None)
    shares = book.shares(["t"])
    assert not shares.follow_demand and shares.of("t") == pytest.approx(1 / 3) and shares.cluster == 1 / 3
    book.set_peers({"b": demand(t=150.0), "c": demand()})
    assert book.shares(["t"]).of("t") == pytest.approx(EPS / 3)


def test_equal_mode_ignores_demand() -> None:
    book = ShareBook(follow_demand=False, floor=EPS, max_routers=100)
    book.set_peers({"b": demand(t=150.0)})
    book.publish(demand(t=1.0))
    book.promote()
    assert book.shares(["t"]).of("t") == 0.5


def test_own_demand_counts_when_lower_at_once_and_when_higher_once_peers_have_read_it() -> None:
    book = ShareBook(follow_demand=True, floor=0.0, max_routers=100)
    book.set_peers({"b": demand(t=90.0)})
    book.publish(demand(t=90.0))
    assert book.shares(["t"]).of("t") == 0.0  # peers may not have read it yet
    book.promote()
    assert book.shares(["t"]).of("t") == pytest.approx(0.5)
    book.publish(demand(t=10.0))  # it fell: counted at once, its share shrinks before b's grows
    assert book.shares(["t"]).of("t") == pytest.approx(0.1)


def test_the_global_share_follows_total_demand() -> None:
    book = ShareBook(follow_demand=True, floor=0.0, max_routers=100)
    book.set_peers({"b": Demand({"x": 30.0}, 300.0)})
    book.publish(Demand({"y": 100.0}, 100.0))
    book.promote()
    assert book.shares([]).cluster == pytest.approx(0.25)  # 100 of the 400 asked


def test_incremental_peer_sums_match_a_fresh_count() -> None:
    rng = random.Random(7)
    book = ShareBook(follow_demand=True, floor=0.0, max_routers=100)
    peers = {f"r{k}": demand() for k in range(20)}
    for _ in range(2000):
        router = rng.choice(list(peers))
        peers[router] = Demand({f"t{rng.randrange(5)}": rng.uniform(0, 100) for _ in range(3)}, 0.0)
        book.set_peers(dict(peers))
    fresh = ShareBook(follow_demand=True, floor=0.0, max_routers=100)
    fresh.set_peers(dict(peers))
    tenants = [f"t{k}" for k in range(5)]
    book.publish(demand(t1=40.0))
    fresh.publish(demand(t1=40.0))
    book.promote()
    fresh.promote()
    for name in tenants:
        assert book.shares(tenants).of(name) == pytest.approx(fresh.shares(tenants).of(name))


@pytest.mark.parametrize("fakes", [0, 3, 50, 10_000])
def test_records_nobody_vouches_for_cannot_push_a_share_below_the_floor_over_max_routers(fakes: int) -> None:
    """Whatever `routers/` holds — any number of records, any demand in them — this router keeps at least
    ε / max_routers of every limit, and the equal split at least 1 / max_routers."""
    max_routers = 4
    book = ShareBook(follow_demand=True, floor=EPS, max_routers=max_routers)
    peers = {"real": demand(t=30.0)} | {f"fake{k}": Demand({"t": 1e9}, 1e9) for k in range(fakes)}
    book.set_peers(peers)
    book.publish(demand(t=5.0))
    book.promote()
    shares = book.shares(["t"])
    assert shares.of("t") >= EPS / max_routers - 1e-12
    assert shares.cluster >= EPS / max_routers - 1e-12
    assert book.routers == min(fakes + 2, max_routers)
    book.set_peers(None)  # etcd out of reach: the equal split over the routers last known, capped too
    assert book.shares(["t"]).of("t") >= 1 / max_routers


def test_under_max_routers_the_count_is_exact() -> None:
    book = ShareBook(follow_demand=True, floor=EPS, max_routers=3)
    book.set_peers({"b": demand(t=150.0)})
    assert book.routers == 2 and book.shares(["t"]).of("t") == pytest.approx(EPS / 2)


# ------------------------------------------------------------------ clusters of admission controllers


EMPTY = Backlog(ServiceEstimates(), rows_ahead=0, workers_full=False, batch=1, workers=1)
"""An empty queue and idle workers: only quotas decide."""


LIMITS = LaneLimits(max_batch_size=8, max_wait_s=0.002)
PUBLISH_S = 0.25


class Cluster:
    """N routers' admission controllers; every publish interval (PUBLISH_S, stretched with many routers)
    each publishes its demand and counts it in full OWN_GRACE_S later, as the shell does, and the others
    read it at once (etcd's watch delivers within milliseconds)."""

    def __init__(self, routers: int, tenants: dict[str, TenantSettings], **admission: object) -> None:
        settings = AdmissionSettings(share_floor=EPS, demand_publish_s=PUBLISH_S, **admission)  # type: ignore[arg-type]
        self.routers = [AdmissionController(settings, tenants, 0.0) for _ in range(routers)]
        self.published = [Demand()] * routers
        self.next_publish = PUBLISH_S
        self.count_at = math.inf
        self.connected = True
        self._share_peers(0.0)

    def _share_peers(self, now: float) -> None:
        for me, router in enumerate(self.routers):
            peers = {f"r{k}": d for k, d in enumerate(self.published) if k != me}
            router.set_peers(peers if self.connected else None, now)

    def attempt(self, router: int, tenant: str, now: float) -> bool:
        """One request of `tenant` on `router` at `now` (ends at once: in flight never binds here)."""
        self._publish_until(now)
        request = QueuedRequest(0, LaneKey("m", "1"), 1, now, now + 10.0, tenant=tenant, priority=1)
        try:
            self.routers[router].admit(request, LIMITS, now, EMPTY)
        except SluiceError:
            return False
        self.routers[router].release(request)
        return True

    def _publish_until(self, now: float) -> None:
        while min(self.next_publish, self.count_at) <= now:
            if self.count_at < self.next_publish:
                for router in self.routers:
                    router.count_published(self.count_at)
                self.count_at = math.inf
                continue
            at = self.next_publish
            for k, router in enumerate(self.routers):
                fresh = router.publish_demand(at)
                if fresh is not None and self.connected:
                    self.published[k] = fresh
            self._share_peers(at)
            self.count_at = at + OWN_GRACE_S
            self.next_publish += self.routers[0].publish_interval_s()  # stretched with many routers

    def rate_shares(self, tenant: str) -> float:
        """The sum of every router's share of the tenant's rate."""
        return sum(r.limiter.rate_share(tenant) for r in self.routers)


def offer(cluster: Cluster, placement: list[int], rate: float, start: float, seconds: float) -> list[float]:
    """`rate` attempts/s of tenant t spread over `placement` in turn; the accepted rate per 0.5 s window."""
    windows = [0] * round(seconds / 0.5)
    for k in range(round(rate * seconds)):
        now = start + k / rate
        if cluster.attempt(placement[k % len(placement)], "t", now):
            windows[min(len(windows) - 1, int((now - start) / 0.5))] += 1
    return [count / 0.5 for count in windows]


TENANT = {"t": TenantSettings(rate=60, burst=10, max_inflight=20)}


@pytest.mark.parametrize("routers", [1, 2, 3, 20, 100])
def test_a_tenant_sticking_to_one_router_gets_its_whole_rate_at_any_router_count(routers: int) -> None:
    cluster = Cluster(routers, TENANT)
    accepted = offer(cluster, [routers - 1], 150.0, 0.0, 6.0)
    settled = sum(accepted[4:]) / len(accepted[4:])  # from 2 s on
    assert settled == pytest.approx(60, rel=0.05), accepted
    assert cluster.rate_shares("t") <= 60 * (1 + EPS) + 1e-6


def test_a_tenant_spread_evenly_gets_its_rate() -> None:
    cluster = Cluster(3, TENANT)
    accepted = offer(cluster, [0, 1, 2], 150.0, 0.0, 6.0)
    assert sum(accepted[4:]) / len(accepted[4:]) == pytest.approx(60, rel=0.05), accepted


def test_shares_follow_a_load_that_moves_to_another_router_within_two_seconds() -> None:
    cluster = Cluster(2, TENANT)
    offer(cluster, [0], 150.0, 0.0, 4.0)
    after = offer(cluster, [1], 150.0, 4.0, 4.0)
    recovered = next(k for k, rate in enumerate(after) if rate >= 0.85 * 60 and min(after[k:]) >= 0.85 * 60)
    assert (recovered + 1) * 0.5 <= 2.0, after  # the end of the first window that is back at the limit
    assert sum(after[4:]) / len(after[4:]) == pytest.approx(60, rel=0.05)


def test_the_sum_of_shares_stays_within_the_bound_while_load_moves_around() -> None:
    cluster = Cluster(20, TENANT)
    rng = random.Random(3)
    now = 0.0
    for _ in range(30):
        placement = rng.sample(range(20), rng.choice([1, 2, 5, 20]))
        rate = rng.choice([10.0, 60.0, 150.0, 400.0])
        for k in range(round(rate * 0.5)):
            cluster.attempt(placement[k % len(placement)], "t", now + k / rate)
            assert cluster.rate_shares("t") <= 60 * (1 + EPS) + 1e-6
        now += 0.5


def test_a_router_admits_a_tenants_first_request_at_once() -> None:
    cluster = Cluster(2, TENANT)
    offer(cluster, [0], 150.0, 0.0, 3.0)  # router 0 holds (nearly) the whole share, router 1 the floor
    assert cluster.routers[1].limiter.rate_share("t") == pytest.approx(60 * EPS / 2)
    assert cluster.attempt(1, "t", 3.0)


def test_in_flight_caps_follow_demand_and_never_drop_to_zero() -> None:
    cluster = Cluster(2, TENANT)
    offer(cluster, [0], 150.0, 0.0, 3.0)
    assert cluster.routers[0].limiter.inflight_cap("t") == 20
    assert cluster.routers[1].limiter.inflight_cap("t") == 1


def test_without_etcd_routers_fall_back_to_the_equal_split() -> None:
    cluster = Cluster(2, TENANT)
    offer(cluster, [0], 150.0, 0.0, 3.0)
    cluster.connected = False
    cluster._share_peers(3.0)
    assert [r.limiter.rate_share("t") for r in cluster.routers] == [30.0, 30.0]
    assert [r.limiter.inflight_cap("t") for r in cluster.routers] == [10, 10]
    accepted = offer(cluster, [0], 150.0, 3.0, 3.0)
    assert sum(accepted[2:]) / len(accepted[2:]) == pytest.approx(30, rel=0.05)


def test_the_global_limit_follows_total_demand() -> None:
    tenants = {"a": TenantSettings(rate=1000, burst=10), "b": TenantSettings(rate=1000, burst=10)}
    cluster = Cluster(2, tenants, global_rate=100.0, global_burst=10)
    now, accepted = 0.0, 0
    for k in range(1200):  # 200 req/s for 6 s, a on router 0 and b on router 1, 3:1
        now = k / 200
        tenant, router = ("a", 0) if k % 4 else ("b", 1)
        accepted += cluster.attempt(router, tenant, now) and now >= 2.0
    assert accepted / 4.0 == pytest.approx(100, rel=0.05)
    shares = [r.limiter.shares.cluster for r in cluster.routers]
    assert shares[0] == pytest.approx(0.75, abs=0.05) and shares[1] == pytest.approx(0.25, abs=0.05)
