"""webhook.controllers.fleet: the ledger the budget counts from, the latching breaker, the rate limits."""

from __future__ import annotations

import datetime

import pytest

from webhook.controllers.fleet import Breaker, BreakerState, EvictionRateLimits, Ledger, PodIndex
from webhook.kube.remediation import ConflictError, StoredState
from webhook.policy import health
from webhook.policy.health import Fleet, NodeFacts, NodeRecord, PodFacts

from .builders import make_policy

NOW = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.UTC)
POLICY = make_policy({"health": {"mode": "enforce", "signals": {"deviceGap": {"forSeconds": 0}}}})


def gpu_node(name: str, pool: str, allocatable: int = 8, record: NodeRecord | None = None) -> NodeFacts:
    return NodeFacts(
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
    ledger.classify(NodeFacts("cpu", labels={"karpenter.sh/nodepool": "p"}), POLICY)
    assert (ledger.pool_size("p"), ledger.fleet_size()) == (2, 2)
    ledger.classify(gpu_node("b", "q"), POLICY)
    assert (ledger.pool_size("p"), ledger.pool_size("q")) == (1, 1)
    ledger.forget("a")
    assert ledger.pool_size("p") == 0


def test_a_new_leader_counts_its_predecessors_nodes_before_deciding() -> None:
    acted = NodeRecord(admitted_at=NOW, unhealthy_since=NOW)
    ledger = Ledger()
    ledger.seed(
        [gpu_node("a", "p", allocatable=7, record=acted), gpu_node("b", "p"), gpu_node("c", "p")], POLICY
    )
    assert ledger.admitted_in("p", excluding="b") == 1
    assert ledger.unhealthy_since() == [NOW]


def test_plans_take_and_give_back_budget_places() -> None:
    ledger = Ledger()
    failing = gpu_node("a", "p", allocatable=7)
    ledger.classify(failing, POLICY)
    plan = health.plan_node(failing, [], POLICY, Fleet(1, 0, False), NOW)
    ledger.update("a", plan, persisted=True, now=NOW)
    assert ledger.admitted_in("p", excluding="x") == 1
    assert ledger.entry("a") is not None and ledger.entry("a").last_step == "taint do"  # type: ignore[union-attr]
    healthy = health.plan_node(gpu_node("a", "p"), [], POLICY, Fleet(1, 0, False), NOW, NodeRecord())
    ledger.update("a", healthy, persisted=True, now=NOW)
    assert ledger.admitted_in("p", excluding="x") == 0 and ledger.entry("a") is None


def test_records_that_are_not_written_are_kept_in_memory() -> None:
    ledger = Ledger()
    failing = gpu_node("a", "p", allocatable=7)
    plan = health.plan_node(failing, [], make_policy(), Fleet(1, 0, False), NOW)
    ledger.update("a", plan, persisted=False, now=NOW)
    assert ledger.memory("a") == plan.record


def test_the_pod_index_follows_pods_between_nodes() -> None:
    index = PodIndex()
    assert index.changed("ns/a", PodFacts("ns", "a", node="n1")) == ("n1",)
    assert index.changed("ns/a", PodFacts("ns", "a", node="n2")) == ("n1", "n2")
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


def test_the_breaker_latches_in_its_configmap_until_an_operator_closes_it() -> None:
    store = MemoryConfigMap()
    breaker = Breaker(store, lambda: NOW)
    assert breaker.trip("3 of 4 nodes", persist=True)
    assert not breaker.trip("again", persist=True)
    assert store.data is not None and store.data["state"] == "open" and store.data["reason"] == "3 of 4 nodes"
    assert not breaker.observe(store.data)  # its own write, seen by the informer: still open
    assert breaker.state.open
    closed = {**store.data, "state": "closed"}  # kubectl edit: no closedAt
    assert breaker.observe(closed)
    assert not breaker.state.open and breaker.state.closed_at == NOW


def test_an_audit_breaker_opens_in_memory_only() -> None:
    store = MemoryConfigMap()
    breaker = Breaker(store, lambda: NOW)
    assert breaker.trip("3 of 4 nodes", persist=False)
    assert breaker.state.open and store.data is None
    # The informer listing no ConfigMap does not close it.
    assert not breaker.observe(None) and breaker.state.open


def test_breaker_state_round_trips_through_configmap_data() -> None:
    state = BreakerState(True, NOW, "why", NOW - datetime.timedelta(hours=1), "ops")
    assert BreakerState.from_data(state.to_data()) == state


def test_eviction_rate_limits_per_node_and_per_namespace() -> None:
    clock = [1000.0]
    limits = EvictionRateLimits(lambda: clock[0])
    policy = make_policy({"health": {"eviction": {"perNodePerMinute": 2, "perNamespacePerMinute": 3}}})
    for node in ("n1", "n1"):
        assert limits.wait(node, "ns", policy) == 0
        limits.taken(node, "ns")
        clock[0] += 1
    assert limits.wait("n1", "ns", policy) == pytest.approx(58)
    assert limits.wait("n2", "ns", policy) == 0
    limits.taken("n2", "ns")
    assert limits.wait("n3", "ns", policy) == pytest.approx(58)  # the namespace's three are spent
    clock[0] += 60
    assert limits.wait("n1", "ns", policy) == 0
