"""The node health reconcile against seams: a real informer over a listed Node, writes recorded.

What the end-to-end tests cannot see from outside: which patches are sent, at which resourceVersion,
in which order, and that audit mode sends none.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import pytest

from tests.harness.manifests import make_policy
from tests.harness.wired import NOW, Wired
from tests.unit.policy.test_health import GPU, raw_node
from webhook.controllers.nodehealth import CONFLICT_RECHECK_SECONDS
from webhook.kube.informer import Change
from webhook.kube.remediation import ConflictError, NotFoundError
from webhook.policy.health import observed, records, signals
from webhook.policy.model import Policy

ENFORCE = make_policy({"health": {"mode": "enforce", "signals": {"deviceGap": {"forSeconds": 0}}}})


def test_enforce_writes_the_condition_then_taint_and_record_at_the_versions_it_read() -> None:
    wired = Wired(ENFORCE, [raw_node("gpu-1", allocatable=7)])
    wired.node_health.reconcile("gpu-1")
    (kind, status), (node_kind, node) = wired.writes.calls
    assert kind == "status" and status["metadata"]["resourceVersion"] == "7"
    (condition,) = status["status"]["conditions"]
    assert (condition["type"], condition["status"]) == (observed.CONDITION_TYPE, "False")
    assert "lastTransitionTime" in condition
    # The node patch goes at the version the status patch answered: nothing in between is overwritten.
    assert node_kind == "node" and node["metadata"]["resourceVersion"] == "8"
    assert node["spec"]["taints"] == [{"key": observed.TAINT_KEY, "effect": "NoSchedule"}]
    assert (
        records.NodeRecord.from_json(node["metadata"]["annotations"][records.RECORD_ANNOTATION]).admitted_at
        == NOW
    )
    assert wired.reasons() == ["DeviceUnhealthy", "NodeTainted"]


def test_others_taints_are_kept_exactly_in_the_rewritten_list() -> None:
    theirs = {
        "key": "example.com/maintenance",
        "effect": "NoExecute",
        "timeAdded": "2026-03-01T11:00:00Z",
    }
    wired = Wired(ENFORCE, [raw_node("gpu-1", allocatable=7, taints=[theirs])])
    wired.node_health.reconcile("gpu-1")
    node = wired.writes.calls[-1][1]
    assert node["spec"]["taints"][0] == theirs


def test_audit_mode_sends_no_write_at_all() -> None:
    audit = make_policy({"health": {"signals": {"deviceGap": {"forSeconds": 0}}}})
    wired = Wired(audit, [raw_node("gpu-1", allocatable=7)])
    for _ in range(3):
        wired.node_health.reconcile("gpu-1")
    assert wired.writes.calls == []
    # Said once, not on every reconcile.
    assert wired.reasons() == ["WouldMarkDeviceUnhealthy", "WouldTaintNode"]


def breaking_at(max_nodes: int) -> Policy:
    return make_policy(
        {
            "health": {
                "mode": "enforce",
                "signals": {"deviceGap": {"forSeconds": 0}},
                "circuitBreaker": {"maxNodes": max_nodes},
            }
        }
    )


def test_the_node_that_trips_the_breaker_is_not_acted_on() -> None:
    policy = breaking_at(1)
    earlier = records.NodeRecord(signals={}, unhealthy_since=NOW, admitted_at=NOW)
    wired = Wired(policy, [raw_node("gpu-1", allocatable=7)])
    seeded = observed.node_facts(raw_node("gpu-0", allocatable=7, record=earlier))
    assert seeded is not None
    wired.seed([seeded], policy, NOW)
    wired.node_health.reconcile("gpu-1")
    assert wired.breaker.state.open
    # The condition says what is wrong; no taint: the breaker opened on this very node.
    assert [kind for kind, _ in wired.writes.calls] == ["status", "node"]
    assert "taints" not in wired.writes.calls[-1][1].get("spec", {})
    # Said in a form node remediators do not act on: the breaker holds them too.
    (condition,) = wired.writes.calls[0][1]["status"]["conditions"]
    assert (condition["status"], condition["reason"]) == ("Unknown", "Held")
    assert wired.reasons() == ["CircuitBreakerOpened", "DeviceUnhealthy", "RemediationHeld"]


def test_a_write_that_conflicts_is_decided_again_without_an_event() -> None:
    wired = Wired(ENFORCE, [raw_node("gpu-1", allocatable=7)])

    def conflict(name: str, patch: dict[str, Any]) -> dict[str, Any]:
        raise ConflictError("the node changed")

    wired.writes.patch_status = conflict  # type: ignore[method-assign]
    assert wired.node_health.reconcile("gpu-1").requeue_after == CONFLICT_RECHECK_SECONDS
    assert wired.reasons() == []


def test_a_node_deleted_before_the_write_is_let_go_without_an_event() -> None:
    wired = Wired(ENFORCE, [raw_node("gpu-1", allocatable=7)])

    def deleted(name: str, patch: dict[str, Any]) -> dict[str, Any]:
        raise NotFoundError('nodes "gpu-1" not found')

    wired.writes.patch_status = deleted  # type: ignore[method-assign]
    # No retry: the Node's deletion arrives as a watch event, which forgets it.
    assert wired.node_health.reconcile("gpu-1").requeue_after is None
    assert wired.reasons() == []


def test_a_node_left_alone_keeps_its_signals_timed_in_memory() -> None:
    policy = make_policy({"health": {"mode": "enforce", "signals": {"deviceGap": {"forSeconds": 60}}}})
    excluded = raw_node("gpu-1", allocatable=7, labels={signals.EXCLUDE_LABEL: "true"})
    wired = Wired(policy, [excluded])
    wired.node_health.reconcile("gpu-1")
    wired.at(61)
    wired.node_health.reconcile("gpu-1")
    assert wired.writes.calls == []
    assert wired.reasons() == ["RemediationHeld", "RemediationHeld"]


def test_nodes_replaced_after_they_became_due_still_count_for_the_breaker() -> None:
    # The review's rolling fault: each node due is drained and replaced (deleted) before the next.
    # The ledger forgets a deleted node (its budget place is free); the breaker's log does not.
    wired = Wired(breaking_at(2), [])
    for i in range(3):
        name = f"gpu-{i}"
        wired.list_nodes(raw_node(name, allocatable=7))
        wired.node_health.reconcile(name)
        wired.list_nodes()
        assert wired.ledger.entry(name) is None
    assert wired.breaker.state.open
    assert "CircuitBreakerOpened" in wired.reasons()
    assert "taints" not in wired.writes.calls[-1][1].get("spec", {})


def test_a_node_left_alone_does_not_count_for_the_breaker() -> None:
    policy = make_policy({"health": {"mode": "enforce", "signals": {"deviceGap": {"forSeconds": 0}}}})
    excluded = raw_node("gpu-1", allocatable=7, labels={signals.EXCLUDE_LABEL: "true"})
    wired = Wired(policy, [excluded])
    wired.node_health.reconcile("gpu-1")
    assert wired.breaker.logged() == {}


def test_an_unreadable_record_is_logged_once_while_it_lasts_and_again_when_it_breaks_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken = raw_node("gpu-1", record="{not json")
    wired = Wired(ENFORCE, [broken])
    with caplog.at_level(logging.WARNING, logger="gpuguard.nodehealth"):
        wired.node_health.reconcile("gpu-1")
        wired.node_health.reconcile("gpu-1")
        assert len(caplog.records) == 1
        # Deleted: nothing of it is kept.
        wired.node_health.node_changed(Change("gpu-1", wired.node_health.nodes.get("gpu-1"), None))
        assert wired.node_health._reported_errors == set()


def test_a_node_someone_else_remediates_gets_no_write_and_an_event_says_why() -> None:
    disrupted = {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}
    wired = Wired(ENFORCE, [raw_node("gpu-1", allocatable=7, taints=[disrupted])])
    wired.node_health.reconcile("gpu-1")
    assert wired.writes.calls == []
    assert wired.reasons() == ["RemediationHeld", "RemediationHeld"]


def test_a_node_that_does_not_answer_gets_no_write_and_is_never_due() -> None:
    unreachable = raw_node(
        "gpu-1",
        allocatable=0,
        conditions=[{"type": "Ready", "status": "Unknown"}],
        taints=[{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}],
    )
    wired = Wired(ENFORCE, [unreachable])
    wired.node_health.reconcile("gpu-1")
    assert wired.writes.calls == []
    assert wired.breaker.logged() == {}


def test_a_held_node_is_handed_off_as_unknown_until_gpuguard_acts() -> None:
    policy = make_policy(
        {
            "health": {
                "mode": "enforce",
                "signals": {"deviceGap": {"forSeconds": 0}},
                "budget": {"maxUnhealthy": 1},
                "circuitBreaker": {"maxNodes": 10},
            }
        }
    )
    earlier = records.NodeRecord(signals={}, unhealthy_since=NOW, admitted_at=NOW)
    wired = Wired(policy, [raw_node("gpu-1", allocatable=7)])
    wired.ledger.seed([observed.node_facts(raw_node("gpu-0", allocatable=7, record=earlier))], policy, NOW)  # type: ignore[list-item]
    wired.node_health.reconcile("gpu-1")
    (condition,) = wired.writes.calls[0][1]["status"]["conditions"]
    assert (condition["status"], condition["reason"]) == ("Unknown", "Held")
    assert "budget" in condition["message"]


def test_gpuguards_marks_without_a_record_are_kept_as_its_own_and_reported() -> None:
    draining = {"type": observed.CONDITION_TYPE, "status": "False", "reason": "Draining", "message": "m"}
    marked = raw_node(
        "gpu-1",
        allocatable=0,
        conditions=[draining],
        taints=[{"key": observed.TAINT_KEY, "effect": "NoSchedule"}],
    )
    marked["spec"]["unschedulable"] = True
    marked["metadata"]["annotations"] = {records.RECORD_ANNOTATION: "[" * 1000 + "]" * 1000}
    wired = Wired(ENFORCE, [marked])
    wired.node_health.reconcile("gpu-1")
    written = records.NodeRecord.from_json(
        wired.writes.calls[-1][1]["metadata"]["annotations"][records.RECORD_ANNOTATION]
    )
    assert written.admitted_at == NOW and written.cordoned
    entry = wired.ledger.entry("gpu-1")
    assert entry is not None and entry.record is not None and entry.record.admitted_at == NOW
    assert "RemediationRecordLost" in wired.reasons()


def test_a_record_rebuilt_from_gpuguards_marks_is_no_new_onset_for_the_breaker() -> None:
    # The node became due long ago (its onset has left the breaker's window); stripping its record
    # must not make it count again as a node that just became due.
    tainted = raw_node("gpu-1", allocatable=7, taints=[{"key": observed.TAINT_KEY, "effect": "NoSchedule"}])
    wired = Wired(ENFORCE, [tainted])
    wired.node_health.reconcile("gpu-1")
    assert "RemediationRecordLost" in wired.reasons()
    assert wired.breaker.logged() == {}
    fresh = Wired(ENFORCE, [raw_node("gpu-1", allocatable=7)])
    fresh.node_health.reconcile("gpu-1")
    assert list(fresh.breaker.logged().values()) == [NOW]


def test_recorded_times_in_the_future_are_taken_as_now_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    future = records.NodeRecord(
        signals={f"deviceGap/{GPU}": datetime.datetime(2099, 1, 1, tzinfo=datetime.UTC)}
    )
    wired = Wired(ENFORCE, [raw_node("gpu-1", allocatable=7, record=future)])
    with caplog.at_level(logging.WARNING, logger="gpuguard.nodehealth"):
        wired.node_health.reconcile("gpu-1")
    assert "later than now" in caplog.text
    written = records.NodeRecord.from_json(
        wired.writes.calls[-1][1]["metadata"]["annotations"][records.RECORD_ANNOTATION]
    )
    assert written.signals == {f"deviceGap/{GPU}": NOW}


def test_a_signal_not_yet_due_is_timed_in_memory_and_writes_nothing() -> None:
    # A kubelet or device-plugin restart clears before it is due: it must cause no write at all, and a
    # failure that stays is acted on when its wait, timed from the first sighting, is over.
    waiting = make_policy({"health": {"mode": "enforce", "signals": {"deviceGap": {"forSeconds": 60}}}})
    wired = Wired(waiting, [raw_node("gpu-1", allocatable=7)])
    wired.node_health.reconcile("gpu-1")
    assert wired.writes.calls == []
    wired.at(59)
    wired.node_health.reconcile("gpu-1")
    assert wired.writes.calls == []
    wired.at(60)
    wired.node_health.reconcile("gpu-1")
    assert [kind for kind, _ in wired.writes.calls] == ["status", "node"]
    record = records.NodeRecord.from_json(
        wired.writes.calls[1][1]["metadata"]["annotations"][records.RECORD_ANNOTATION]
    )
    assert record.signals[f"deviceGap/{GPU}"] == NOW
