"""webhook.controllers.fleet: the ledger the budget counts from, the latching breaker, the rate limits."""

from __future__ import annotations

import dataclasses
import datetime

import pytest

from tests.harness.manifests import make_policy
from webhook.controllers.breaker import DUE_LOG_BYTES, DUE_LOG_KEY, Breaker, BreakerState
from webhook.controllers.fleet import EvictionRateLimits, Ledger, PodIndex
from webhook.kube.remediation import ConflictError, StoredState
from webhook.policy.health import ladder, observed, records

NOW = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.UTC)
POLICY = make_policy({"health": {"mode": "enforce", "signals": {"deviceGap": {"forSeconds": 0}}}})


def gpu_node(
    name: str, pool: str, allocatable: int = 8, record: records.NodeRecord | None = None
) -> observed.NodeFacts:
    return observed.NodeFacts(
        name,
        labels={"karpenter.sh/nodepool": pool},
        capacity={"nvidia.com/gpu": 8},
        allocatable={"nvidia.com/gpu": allocatable},
        record=record,
    )


def test_pools_count_accelerator_nodes_only_and_follow_relabelling() -> None:
    ledger = Ledger()
    ledger.classify(gpu_node("a", "p"), POLICY)
    ledger.classify(gpu_node("b", "p"), POLICY)
    ledger.classify(observed.NodeFacts("cpu", labels={"karpenter.sh/nodepool": "p"}), POLICY)
    assert (ledger.pool_size("p"), ledger.fleet_size()) == (2, 2)
    ledger.classify(gpu_node("b", "q"), POLICY)
    assert (ledger.pool_size("p"), ledger.pool_size("q")) == (1, 1)
    ledger.forget("a")
    assert ledger.pool_size("p") == 0


def test_a_new_leader_counts_its_predecessors_nodes_before_deciding() -> None:
    acted = records.NodeRecord(admitted_at=NOW, unhealthy_since=NOW)
    ledger = Ledger()
    ledger.seed(
        [gpu_node("a", "p", allocatable=7, record=acted), gpu_node("b", "p"), gpu_node("c", "p")], POLICY, NOW
    )
    assert ledger.admitted_in("p", excluding="b") == 1


def test_a_new_leader_counts_a_node_carrying_gpuguards_taint_without_its_record() -> None:
    tainted = (observed.Taint(observed.TAINT_KEY, "", "NoSchedule"),)
    stripped = dataclasses.replace(gpu_node("a", "p", allocatable=7), taints=tainted)
    ledger = Ledger()
    ledger.seed([stripped, gpu_node("b", "p")], POLICY, NOW)
    assert ledger.admitted_in("p", excluding="b") == 1


def test_plans_take_and_give_back_budget_places() -> None:
    ledger = Ledger()
    failing = gpu_node("a", "p", allocatable=7)
    ledger.classify(failing, POLICY)
    plan = ladder.plan_node(failing, [], POLICY, ladder.Fleet(1, 0, False), NOW)
    ledger.update("a", plan, persisted=True, now=NOW)
    assert ledger.admitted_in("p", excluding="x") == 1
    assert ledger.entry("a") is not None and ledger.entry("a").last_step == "taint do"  # type: ignore[union-attr]
    healthy = ladder.plan_node(
        gpu_node("a", "p"), [], POLICY, ladder.Fleet(1, 0, False), NOW, records.NodeRecord()
    )
    ledger.update("a", healthy, persisted=True, now=NOW)
    assert ledger.admitted_in("p", excluding="x") == 0 and ledger.entry("a") is None


def test_records_that_are_not_written_are_kept_in_memory() -> None:
    ledger = Ledger()
    failing = gpu_node("a", "p", allocatable=7)
    plan = ladder.plan_node(failing, [], make_policy(), ladder.Fleet(1, 0, False), NOW)
    ledger.update("a", plan, persisted=False, now=NOW)
    assert ledger.memory("a") == plan.record


def test_the_pod_index_follows_pods_between_nodes() -> None:
    index = PodIndex()
    assert index.changed("ns/a", observed.PodFacts("ns", "a", node="n1")) == ("n1",)
    assert index.changed("ns/a", observed.PodFacts("ns", "a", node="n2")) == ("n1", "n2")
    assert (index.keys_on("n1"), index.keys_on("n2")) == ([], ["ns/a"])
    assert index.changed("ns/a", None) == ("n2",)


class MemoryConfigMap:
    def __init__(self, data: dict[str, str] | None = None) -> None:
        self.data = data
        self.version = 1

    def read(self) -> StoredState:
        return StoredState(dict(self.data or {}), str(self.version) if self.data is not None else None)

    def write(self, data: dict[str, str], read: StoredState) -> None:
        if read.resource_version != (str(self.version) if self.data is not None else None):
            raise ConflictError("changed")
        self.data, self.version = data, self.version + 1


BREAKER = make_policy(
    {"health": {"mode": "enforce", "circuitBreaker": {"maxNodes": 2, "windowSeconds": 600}}}
)
AUDIT_BREAKER = make_policy({"health": {"circuitBreaker": {"maxNodes": 2, "windowSeconds": 600}}})


def later(seconds: float) -> datetime.datetime:
    return NOW + datetime.timedelta(seconds=seconds)


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> datetime.datetime:
        return self.now


def test_the_breaker_latches_in_its_configmap_until_an_operator_closes_it() -> None:
    store = MemoryConfigMap()
    clock = Clock()
    breaker = Breaker(store, clock)
    for name in ("a", "b", "c"):
        breaker.became_due(name, f"uid-{name}", later(-60))
    trip = breaker.evaluate(BREAKER, 10, enforced=True)
    assert trip is not None and trip.enforced
    assert trip.reason.startswith("3 of 10 accelerator nodes became due for remediation within 600 s;")
    assert breaker.evaluate(BREAKER, 10, enforced=True) is None  # open already
    assert store.data is not None and store.data["state"] == "open" and store.data["reason"] == trip.reason
    assert not breaker.observe(store.data)  # its own write, seen by the informer: still open
    assert breaker.state.open
    clock.now = later(5)
    closed = {**store.data, "state": "closed"}  # kubectl patch: no closedAt
    assert breaker.observe(closed)
    assert not breaker.state.open and breaker.state.closed_at == later(5)


def test_a_node_that_became_due_counts_though_it_was_deleted_replaced_or_recovered() -> None:
    # The review's rolling fault: one node due a minute, each replaced a minute later. The breaker's
    # own log keeps them all (the ledger forgets a deleted node), so the third opens it.
    clock = Clock()
    breaker = Breaker(MemoryConfigMap(), clock)
    trips = []
    for minute in range(3):
        clock.now = later(60 * minute)
        breaker.became_due(f"gpu-{minute}", f"uid-{minute}", clock.now)
        trips.append(breaker.evaluate(BREAKER, 10, enforced=True))
    assert trips[:2] == [None, None] and trips[2] is not None and breaker.state.open
    # A replacement of the same name is another node; the same node again is the same one.
    fresh = Breaker(MemoryConfigMap(), clock)
    for uid in ("uid-1", "uid-1", "uid-2"):
        fresh.became_due("gpu-0", uid, NOW)
    assert sorted(fresh.logged()) == [("gpu-0", "uid-1"), ("gpu-0", "uid-2")]


def test_the_log_is_pruned_by_the_window_and_by_a_close_only() -> None:
    clock = Clock()
    breaker = Breaker(MemoryConfigMap(), clock)
    breaker.became_due("old", "1", later(-601))
    breaker.became_due("recent", "2", later(-10))
    assert breaker.evaluate(BREAKER, 10, enforced=True) is None
    assert list(breaker.logged()) == [("recent", "2")]


def test_a_new_leader_counts_what_the_old_one_logged_though_the_nodes_are_gone() -> None:
    store = MemoryConfigMap()
    old = Breaker(store, lambda: NOW)
    for name in ("a", "b"):
        old.became_due(name, f"uid-{name}", later(-30))
    old.flush(AUDIT_BREAKER)
    assert store.data is None  # audit writes nothing
    old.flush(BREAKER)
    assert store.data is not None and store.data["state"] == "closed"
    assert store.data[DUE_LOG_KEY].splitlines() == [
        "2026-03-01T11:59:30.000Z a uid-a",
        "2026-03-01T11:59:30.000Z b uid-b",
    ]
    new = Breaker(store, lambda: NOW)
    assert not new.observe(store.data)
    new.became_due("c", "uid-c", NOW)
    trip = new.evaluate(BREAKER, 10, enforced=True)
    assert trip is not None and new.state.open


def test_a_new_leader_reads_back_from_the_nodes_records_what_was_not_yet_written() -> None:
    breaker = Breaker(MemoryConfigMap(), lambda: NOW)
    due = records.NodeRecord(unhealthy_since=later(-5))
    breaker.seed(
        [
            observed.NodeFacts("a", uid="uid-a", record=due),
            observed.NodeFacts("b", uid="uid-b"),
            gpu_node("c", "p"),
        ]
    )
    assert list(breaker.logged()) == [("a", "uid-a")]


def test_the_written_log_stays_far_below_the_object_limit_at_twenty_thousand_nodes() -> None:
    store = MemoryConfigMap()
    breaker = Breaker(store, lambda: NOW)
    for i in range(20_000):
        name = f"ip-10-{i // 250}-{i % 250}-7.eu-west-1.compute.internal"
        breaker.became_due(name, f"{i:08d}-0000-0000-0000-000000000000", later(-i / 100))
    breaker.flush(make_policy({"health": {"mode": "enforce", "circuitBreaker": {"maxNodes": "100%"}}}))
    assert store.data is not None
    size = sum(len(key) + len(value) for key, value in store.data.items())
    assert DUE_LOG_BYTES - 200 < size < 1024 * 1024 - 100_000
    # The newest are kept: what decides a trip.
    assert store.data[DUE_LOG_KEY].splitlines()[0].endswith("00000000-0000-0000-0000-000000000000")


def test_an_audit_trip_is_said_once_holds_nothing_and_opens_for_real_once_a_policy_enforces() -> None:
    store = MemoryConfigMap()
    breaker = Breaker(store, lambda: NOW)
    for name in ("a", "b", "c"):
        breaker.became_due(name, f"uid-{name}", later(-60))
    said = breaker.evaluate(AUDIT_BREAKER, 10, enforced=False)
    assert said is not None and not said.enforced
    assert breaker.evaluate(AUDIT_BREAKER, 10, enforced=False) is None  # said once
    assert not breaker.state.open and breaker.would_open == said.reason and store.data is None
    assert not breaker.observe(None) and not breaker.state.open
    # Actions enforced: the same demand opens it, in the ConfigMap, where `reset-breaker` reads it.
    opened = breaker.evaluate(BREAKER, 10, enforced=True)
    assert opened is not None and opened.enforced and breaker.would_open == ""
    assert store.data is not None and BreakerState.from_data(store.data).open


def test_an_audit_trip_clears_itself_once_the_window_passes() -> None:
    clock = Clock()
    breaker = Breaker(MemoryConfigMap(), clock)
    for name in ("a", "b", "c"):
        breaker.became_due(name, f"uid-{name}", NOW)
    assert breaker.evaluate(AUDIT_BREAKER, 10, enforced=False) is not None
    clock.now = later(601)
    assert breaker.evaluate(AUDIT_BREAKER, 10, enforced=False) is None and breaker.would_open == ""


def test_a_republished_configmap_closes_nothing_and_a_stale_view_does_not_undo_a_trip() -> None:
    closed_before = BreakerState(False, later(-7200), "earlier", later(-3600), "ops").to_data()
    store = MemoryConfigMap(dict(closed_before))
    breaker = Breaker(store, lambda: NOW)
    assert not breaker.observe(closed_before)
    for name in ("a", "b", "c"):
        breaker.became_due(name, f"uid-{name}", later(-60))
    assert breaker.evaluate(BREAKER, 10, enforced=True) is not None
    # A relist that listed before the trip is published after it: the same old close, no new one.
    assert not breaker.observe(closed_before) and breaker.state.open
    assert not breaker.observe(None) and breaker.state.open
    assert store.data is not None
    assert not breaker.observe(store.data) and not breaker.observe(store.data)


def test_a_close_without_a_time_of_its_own_takes_now_and_the_leader_writes_it() -> None:
    # A reset a week ago left closedAt; a later trip keeps it; `kubectl patch state=closed` now.
    clock = Clock()
    opened = BreakerState(True, later(-30), "3 of 10", later(-7 * 86400), "alice").to_data()
    store = MemoryConfigMap({**opened, DUE_LOG_KEY: "2026-03-01T11:59:00.000Z a uid-a"})
    breaker = Breaker(store, clock)
    breaker.observe(store.data)
    assert breaker.state.open
    clock.now = later(10)
    patched = {**opened, "state": "closed"}
    store.data = dict(patched)
    assert breaker.observe(patched)
    assert (breaker.state.closed_at, breaker.state.closed_by) == (later(10), "an edit of the ConfigMap")
    breaker.persist(BREAKER)
    assert BreakerState.from_data(store.data).closed_at == later(10)
    # Nodes due before the close do not reopen it, and a republish keeps the same close.
    for name in ("b", "c"):
        breaker.became_due(name, f"uid-{name}", later(-20))
    assert breaker.evaluate(BREAKER, 10, enforced=True) is None
    clock.now = later(20)
    assert not breaker.observe(patched) and breaker.state.closed_at == later(10)
    # A replica that starts after the close and before the leader wrote it takes its own now.
    standby = Breaker(MemoryConfigMap(), clock)
    standby.observe(patched)
    assert not standby.state.open and standby.state.closed_at == later(20)


def test_a_trip_does_not_write_over_a_close_that_arrived_after_its_decision() -> None:
    class ClosedMeanwhile(MemoryConfigMap):
        def read(self) -> StoredState:
            # The operator's reset lands between the decision (made on the cache) and the write.
            self.data = BreakerState(False, later(-120), "before", later(-1), "ops").to_data()
            return super().read()

    store = ClosedMeanwhile()
    breaker = Breaker(store, lambda: NOW)
    for name in ("a", "b", "c"):
        breaker.became_due(name, f"uid-{name}", later(-60))
    assert breaker.evaluate(BREAKER, 10, enforced=True) is None
    assert store.data is not None and store.data["state"] == "closed" and not breaker.state.open


def test_the_trip_reason_counts_what_tripped_it_not_what_a_close_cut_off() -> None:
    clock = Clock()
    breaker = Breaker(MemoryConfigMap(), clock)
    breaker.observe(BreakerState(False, later(-300), "earlier", later(-200), "ops").to_data())
    for i in range(5):
        breaker.became_due(f"gpu-{i}", str(i), later(-250 if i < 2 else -100))
    trip = breaker.evaluate(BREAKER, 10, enforced=True)
    assert trip is not None
    assert trip.reason.startswith("3 of 10 accelerator nodes became due for remediation within 600 s")
    assert "since the breaker was last closed" in trip.reason


def test_an_operator_can_open_it_by_hand() -> None:
    breaker = Breaker(MemoryConfigMap(), lambda: NOW)
    breaker.observe({"state": "open"})
    assert breaker.state.open and breaker.state.opened_at == NOW


def test_breaker_state_round_trips_through_configmap_data() -> None:
    state = BreakerState(True, NOW, "why", NOW - datetime.timedelta(hours=1), "ops")
    assert BreakerState.from_data(state.to_data()) == state
    # Times written by hand to the second, or without a zone, read as UTC.
    assert BreakerState.from_data({"openedAt": "2026-03-01T12:00:00"}).opened_at == NOW


def test_eviction_rate_limits_per_node_and_per_namespace() -> None:
    clock = [1000.0]
    limits = EvictionRateLimits(lambda: clock[0])
    policy = make_policy({"health": {"eviction": {"perNodePerMinute": 2, "perNamespacePerMinute": 3}}})
    for _ in range(2):
        assert limits.reserve("n1", "ns", policy) == 0
        clock[0] += 1
    assert limits.reserve("n1", "ns", policy) == pytest.approx(58)
    assert limits.reserve("n2", "ns", policy) == 0
    assert limits.reserve("n3", "ns", policy) == pytest.approx(58)  # the namespace's three are spent
    clock[0] += 60
    assert limits.reserve("n1", "ns", policy) == 0


def test_a_slot_is_taken_when_granted_and_given_back_when_the_eviction_did_not_happen() -> None:
    limits = EvictionRateLimits(lambda: 1000.0)
    policy = make_policy({"health": {"eviction": {"perNodePerMinute": 1}}})
    # Two workers asking at once: one gets the last slot, the other waits.
    assert limits.reserve("n1", "a", policy) == 0
    assert limits.reserve("n1", "b", policy) > 0
    limits.release("n1", "a")  # refused (429): given back
    assert limits.reserve("n1", "b", policy) == 0


def test_rate_limits_forget_nodes_and_namespaces_without_recent_evictions() -> None:
    clock = [1000.0]
    limits = EvictionRateLimits(lambda: clock[0])
    policy = make_policy()
    for i in range(100):
        assert limits.reserve(f"node-{i}", f"ns-{i}", policy) == 0
    clock[0] += 61
    assert limits.reserve("n", "ns", policy) == 0
    assert len(limits._times) == 2


def test_the_leader_writes_back_an_open_state_the_configmap_lost_and_nothing_else() -> None:
    store = MemoryConfigMap()
    breaker = Breaker(store, lambda: NOW)
    for name in ("a", "b", "c"):
        breaker.became_due(name, f"uid-{name}", later(-60))
    assert breaker.evaluate(BREAKER, 10, enforced=True) is not None
    assert store.data is not None
    breaker.observe(store.data)
    version = store.version
    breaker.persist(BREAKER)
    assert store.version == version  # the ConfigMap says it all
    # Deleted by hand: still open (only a close closes it), and written back so `reset-breaker` sees it.
    store.data = None
    assert not breaker.observe(None) and breaker.state.open
    breaker.persist(BREAKER)
    assert store.data is not None and BreakerState.from_data(store.data).open


def test_the_written_log_keeps_only_what_can_still_count() -> None:
    clock = Clock()
    stale = "2026-03-01T11:00:00.000Z old uid-old"
    store = MemoryConfigMap({"state": "closed", DUE_LOG_KEY: stale})
    breaker = Breaker(store, clock)
    breaker.observe(store.data)
    breaker.became_due("new", "uid-new", NOW)
    breaker.flush(BREAKER)
    assert store.data is not None and store.data[DUE_LOG_KEY] == "2026-03-01T12:00:00.000Z new uid-new"
    version = store.version
    breaker.flush(BREAKER)
    assert store.version == version  # nothing new: nothing written
