"""The pod device-health watcher against seams: real informers over listed Nodes and Pods, evictions
and Events recorded. Which pods it may evict (the node controller's scope), the fleet brake on
pod-level evictions, and what it does with each answer of the Eviction API (evicted, refused, gone)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tests.harness.manifests import make_policy
from tests.harness.wired import NOW, RecordedEvictions, Wired
from tests.unit.policy.test_health import raw_node, raw_pod
from webhook.controllers import series
from webhook.policy.health import ladder, records, signals
from webhook.policy.model import Policy

UNHEALTHY = [("GPU-1", "Unhealthy")]


def enforcing(**section: Any) -> Policy:
    return make_policy({"health": {"mode": "enforce", **section}})


def test_pods_of_nodes_outside_the_node_selector_are_not_evicted_nor_spoken_of() -> None:
    # The review's reproducer: a pilot on one pool, evictions enforced, a pod elsewhere reports a
    # failed device.
    pilot = enforcing(nodeSelector={"matchLabels": {"gpuguard-pilot": "true"}})
    outside = Wired(pilot, [raw_node("gpu-9")], [raw_pod(node_name="gpu-9", devices=UNHEALTHY)])
    result = outside.pod_health.reconcile("ml/trainer")
    assert outside.evictions.sent == [] and outside.reasons() == []
    assert result.requeue_after == ladder.HELD_RECHECK_SECONDS  # it may be relabelled into the pilot
    inside = Wired(
        pilot,
        [raw_node("gpu-9", labels={"gpuguard-pilot": "true"})],
        [raw_pod(node_name="gpu-9", devices=UNHEALTHY)],
    )
    inside.pod_health.reconcile("ml/trainer")
    assert inside.evictions.sent == [("ml", "trainer")]


def test_pods_of_a_node_the_cache_does_not_know_are_held() -> None:
    unknown = Wired(enforcing(), [], [raw_pod(node_name="gpu-new", devices=UNHEALTHY)])
    assert unknown.pod_health.reconcile("ml/trainer").requeue_after == ladder.HELD_RECHECK_SECONDS
    assert unknown.evictions.sent == [] and unknown.reasons() == ["EvictionHeld"]
    assert unknown.breaker.logged() == {}


def test_pods_of_an_excluded_or_paused_node_are_held_and_do_not_count_for_the_breaker() -> None:
    excluded = raw_node("gpu-1", labels={signals.EXCLUDE_LABEL: "true"})
    for policy, node in ((enforcing(), excluded), (enforcing(paused=True), raw_node("gpu-1"))):
        watcher = Wired(policy, [node], [raw_pod(devices=UNHEALTHY)])
        watcher.pod_health.reconcile("ml/trainer")
        assert watcher.evictions.sent == [] and watcher.reasons() == ["EvictionHeld"]
        assert watcher.breaker.logged() == {}


def test_pod_level_evictions_count_their_nodes_for_the_breaker_once_per_node() -> None:
    nodes = [raw_node(f"gpu-{i}") for i in range(3)]
    pods = [
        raw_pod("a", node_name="gpu-0", devices=UNHEALTHY),
        raw_pod("b", node_name="gpu-0", devices=UNHEALTHY),
        raw_pod("c", node_name="gpu-1", devices=UNHEALTHY),
        raw_pod("d", node_name="gpu-2", devices=UNHEALTHY),
    ]
    watcher = Wired(enforcing(circuitBreaker={"maxNodes": 2}), nodes, pods)
    for key in ("ml/a", "ml/b", "ml/c"):
        watcher.pod_health.reconcile(key)
    assert watcher.evictions.sent == [("ml", "a"), ("ml", "b"), ("ml", "c")]
    assert not watcher.breaker.state.open  # two nodes, however many pods
    # A third node's pod goes bad: a fleet-wide signal, the breaker opens and the pod is held.
    assert watcher.pod_health.reconcile("ml/d").requeue_after == ladder.HELD_RECHECK_SECONDS
    assert watcher.breaker.state.open and ("ml", "d") not in watcher.evictions.sent
    assert watcher.reasons()[-2:] == ["CircuitBreakerOpened", "EvictionHeld"]


def test_evictions_said_in_audit_open_the_breaker_only_as_would_and_hold_nothing() -> None:
    nodes = [raw_node(f"gpu-{i}") for i in range(2)]
    pods = [
        raw_pod("a", node_name="gpu-0", devices=UNHEALTHY),
        raw_pod("b", node_name="gpu-1", devices=UNHEALTHY),
    ]
    watcher = Wired(make_policy({"health": {"circuitBreaker": {"maxNodes": 1}}}), nodes, pods)
    for key in ("ml/a", "ml/b"):
        watcher.pod_health.reconcile(key)
    assert not watcher.breaker.state.open and watcher.breaker.would_open
    assert watcher.reasons() == ["WouldEvictPod", "WouldOpenCircuitBreaker", "WouldEvictPod"]


def test_a_refused_eviction_gives_its_rate_limit_slot_back() -> None:
    policy = enforcing(eviction={"perNodePerMinute": 1})
    pods = [raw_pod("a", devices=UNHEALTHY), raw_pod("b", devices=UNHEALTHY)]
    watcher = Wired(policy, [raw_node("gpu-1")], pods, evictions=RecordedEvictions("blocked"))
    watcher.pod_health.reconcile("ml/a")
    watcher.evictions.result = "evicted"
    watcher.pod_health.reconcile("ml/b")
    assert watcher.evictions.sent == [("ml", "a"), ("ml", "b")]
    # That one happened: the node's minute is spent.
    assert watcher.limits.reserve("gpu-1", "other", policy) > 0


def test_a_drain_recorded_without_its_cordon_evicts_nothing() -> None:
    # An earlier version recorded a drain only said in audit mode; enforcing the drain later must
    # cordon first (the node controller does), not evict every accelerator pod at once.
    said = records.NodeRecord(unhealthy_since=NOW, admitted_at=NOW, draining_since=NOW)
    done = dataclasses.replace(said, cordoned=True)
    evicted = []
    for record in (said, done):
        watcher = Wired(enforcing(), [raw_node("gpu-1", record=record)], [raw_pod()])
        watcher.pod_health.reconcile("ml/trainer")
        evicted.append(watcher.evictions.sent)
    assert evicted == [[], [("ml", "trainer")]]


def test_a_refused_eviction_is_retried_with_backoff_and_said_stuck_once_after_the_timeout() -> None:
    policy = enforcing(eviction={"retrySeconds": 10, "maxRetrySeconds": 40, "timeoutSeconds": 60})
    watcher = Wired(
        policy, [raw_node("gpu-1")], [raw_pod(devices=UNHEALTHY)], evictions=RecordedEvictions("blocked")
    )
    waits = []
    for seconds in (0, 30, 60, 120):
        watcher.at(seconds)
        waits.append(watcher.pod_health.reconcile("ml/trainer").requeue_after)
    # Doubling from retrySeconds, capped at maxRetrySeconds; every retry is an eviction, never a delete.
    assert waits == [10, 20, 40, 40]
    assert watcher.evictions.sent == [("ml", "trainer")] * 4
    # Each refusal is counted; the recorder sends the same Event once, and stuck is said once.
    assert watcher.registry.value(series.REMEDIATIONS, "evict", "blocked") == 3
    assert watcher.registry.value(series.REMEDIATIONS, "evict", "stuck") == 1
    assert watcher.reasons() == ["EvictionBlocked", "EvictionStuck"]


def test_an_eviction_that_goes_through_is_said_once_and_counted_done() -> None:
    watcher = Wired(enforcing(), [raw_node("gpu-1")], [raw_pod(devices=UNHEALTHY)])
    assert watcher.pod_health.reconcile("ml/trainer").requeue_after is None
    assert watcher.evictions.sent == [("ml", "trainer")]
    assert watcher.reasons() == ["PodEvicted"]
    assert watcher.registry.value(series.REMEDIATIONS, "evict", "done") == 1


def test_a_pod_gone_before_its_eviction_is_let_go_without_an_event() -> None:
    watcher = Wired(
        enforcing(), [raw_node("gpu-1")], [raw_pod(devices=UNHEALTHY)], evictions=RecordedEvictions("gone")
    )
    # No retry: the Pod's deletion arrives as a watch event.
    assert watcher.pod_health.reconcile("ml/trainer").requeue_after is None
    assert watcher.reasons() == []
    assert watcher.registry.value(series.REMEDIATIONS, "evict", "done") == 0
