"""The node health reconcile against seams: a real informer over a listed Node, writes recorded.

What the end-to-end tests cannot see from outside: which patches are sent, at which resourceVersion,
in which order, and that audit mode sends none.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from webhook.controllers.fleet import Breaker, DeviceReports, Ledger, PodIndex
from webhook.controllers.nodehealth import CONFLICT_RECHECK_SECONDS, NodeHealth
from webhook.kube.events import EventRecorder
from webhook.kube.informer import Change, Informer, ListPage
from webhook.kube.remediation import ConflictError, NotFoundError, StoredState
from webhook.metrics import Registry
from webhook.policy import health
from webhook.policy.health import NodeFacts, NodeRecord, PodFacts
from webhook.policy.model import Policy

from .builders import make_policy
from .test_health import GPU, raw_node

NOW = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.UTC)
ENFORCE = make_policy({"health": {"mode": "enforce", "signals": {"deviceGap": {"forSeconds": 0}}}})


class Listed:
    """A ListWatch whose one list returns the given objects and whose watch stays silent."""

    def __init__(self, *objects: dict[str, Any]) -> None:
        self.objects = list(objects)

    def list_page(self, continue_token: str | None) -> ListPage:
        return ListPage(self.objects, "1", None)

    @contextlib.contextmanager
    def watch(self, resource_version: str, timeout_seconds: int) -> Iterator[Iterator[dict[str, Any]]]:
        yield iter(())


class RecordedWrites:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.version = 7

    def patch(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._answer("node", patch)

    def patch_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._answer("status", patch)

    def _answer(self, kind: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((kind, patch))
        self.version += 1
        return {"metadata": {"resourceVersion": str(self.version)}}


class NoStore:
    def read(self) -> StoredState:
        return StoredState({}, None)

    def write(self, data: dict[str, str], read: StoredState) -> None:
        self.written = data


def controller(
    policy: Policy, *nodes: dict[str, Any], ledger: Ledger | None = None, breaker: Breaker | None = None
) -> tuple[NodeHealth, RecordedWrites, list[dict[str, Any]], Breaker]:
    stop = threading.Event()
    node_informer: Informer[NodeFacts] = Informer(
        "nodes", Listed(*nodes), lambda raw: (f.name, f) if (f := health.node_facts(raw)) else None, stop=stop
    )
    pod_informer: Informer[PodFacts] = Informer("pods", Listed(), lambda raw: None, stop=stop)
    for informer in (node_informer, pod_informer):
        assert informer.sync()
    sent: list[dict[str, Any]] = []
    events = EventRecorder(lambda namespace, body: sent.append(body), stop=stop)
    writes = RecordedWrites()
    breaker = breaker or Breaker(NoStore(), lambda: NOW)
    ledger = ledger or Ledger()
    for facts in node_informer.snapshot().values():
        ledger.classify(facts, policy)
    loop = NodeHealth(
        nodes=node_informer,
        pods=pod_informer,
        index=PodIndex(),
        reports=DeviceReports(),
        ledger=ledger,
        breaker=breaker,
        policy=lambda: policy,
        writes=writes,
        events=events,
        registry=_registry(),
        clock=lambda: NOW,
        on_drain=lambda node: None,
        stop=stop,
    )
    return loop, writes, sent, breaker


def _registry() -> Registry:
    from webhook.controllers import series

    registry = Registry()
    series.register(
        registry,
        node_health=list,
        breaker_open=lambda: False,
        held_nodes=lambda: 0,
        queue_depths=list,
        leader=lambda: True,
    )
    return registry


def flushed(loop: NodeHealth, sent: list[dict[str, Any]]) -> list[str]:
    loop.events.stop.set()
    loop.events.start()
    loop.events.thread.join(timeout=5)
    return [body["reason"] for body in sent]


def test_enforce_writes_the_condition_then_taint_and_record_at_the_versions_it_read() -> None:
    loop, writes, sent, _ = controller(ENFORCE, raw_node("gpu-1", allocatable=7))
    loop.reconcile("gpu-1")
    (kind, status), (node_kind, node) = writes.calls
    assert kind == "status" and status["metadata"]["resourceVersion"] == "7"
    (condition,) = status["status"]["conditions"]
    assert (condition["type"], condition["status"]) == (health.CONDITION_TYPE, "False")
    assert "lastTransitionTime" in condition
    # The node patch goes at the version the status patch answered: nothing in between is overwritten.
    assert node_kind == "node" and node["metadata"]["resourceVersion"] == "8"
    assert node["spec"]["taints"] == [{"key": health.TAINT_KEY, "effect": "NoSchedule"}]
    assert NodeRecord.from_json(node["metadata"]["annotations"][health.RECORD_ANNOTATION]).admitted_at == NOW
    assert flushed(loop, sent) == ["DeviceUnhealthy", "NodeTainted"]


def test_others_taints_are_kept_exactly_in_the_rewritten_list() -> None:
    theirs = {
        "key": "example.com/maintenance",
        "effect": "NoExecute",
        "timeAdded": "2026-03-01T11:00:00Z",
    }
    loop, writes, _, _ = controller(ENFORCE, raw_node("gpu-1", allocatable=7, taints=[theirs]))
    loop.reconcile("gpu-1")
    node = writes.calls[-1][1]
    assert node["spec"]["taints"][0] == theirs


def test_audit_mode_sends_no_write_at_all() -> None:
    audit = make_policy({"health": {"signals": {"deviceGap": {"forSeconds": 0}}}})
    loop, writes, sent, _ = controller(audit, raw_node("gpu-1", allocatable=7))
    for _ in range(3):
        loop.reconcile("gpu-1")
    assert writes.calls == []
    # Said once, not on every reconcile.
    assert flushed(loop, sent) == ["WouldMarkDeviceUnhealthy", "WouldTaintNode"]


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
    earlier = NodeRecord(signals={}, unhealthy_since=NOW, admitted_at=NOW)
    ledger, breaker = Ledger(), Breaker(NoStore(), lambda: NOW)
    seeded = [health.node_facts(raw_node("gpu-0", allocatable=7, record=earlier))]
    ledger.seed(seeded, policy, NOW)  # type: ignore[arg-type]
    breaker.seed(seeded)  # type: ignore[arg-type]
    loop, writes, sent, _ = controller(
        policy, raw_node("gpu-1", allocatable=7), ledger=ledger, breaker=breaker
    )
    loop.reconcile("gpu-1")
    assert breaker.state.open
    # The condition says what is wrong; no taint: the breaker opened on this very node.
    assert [kind for kind, _ in writes.calls] == ["status", "node"]
    assert "taints" not in writes.calls[-1][1].get("spec", {})
    # Said in a form node remediators do not act on: the breaker holds them too.
    (condition,) = writes.calls[0][1]["status"]["conditions"]
    assert (condition["status"], condition["reason"]) == ("Unknown", "Held")
    assert flushed(loop, sent) == ["CircuitBreakerOpened", "DeviceUnhealthy", "RemediationHeld"]


def test_a_write_that_conflicts_is_decided_again_without_an_event() -> None:
    loop, writes, sent, _ = controller(ENFORCE, raw_node("gpu-1", allocatable=7))

    def conflict(name: str, patch: dict[str, Any]) -> dict[str, Any]:
        raise ConflictError("the node changed")

    writes.patch_status = conflict  # type: ignore[method-assign]
    assert loop.reconcile("gpu-1").requeue_after == CONFLICT_RECHECK_SECONDS
    assert flushed(loop, sent) == []


def test_a_node_deleted_before_the_write_is_let_go_without_an_event() -> None:
    loop, writes, sent, _ = controller(ENFORCE, raw_node("gpu-1", allocatable=7))

    def deleted(name: str, patch: dict[str, Any]) -> dict[str, Any]:
        raise NotFoundError('nodes "gpu-1" not found')

    writes.patch_status = deleted  # type: ignore[method-assign]
    # No retry: the Node's deletion arrives as a watch event, which forgets it.
    assert loop.reconcile("gpu-1").requeue_after is None
    assert flushed(loop, sent) == []


def test_a_node_left_alone_keeps_its_signals_timed_in_memory() -> None:
    policy = make_policy({"health": {"mode": "enforce", "signals": {"deviceGap": {"forSeconds": 60}}}})
    excluded = raw_node("gpu-1", allocatable=7, labels={health.EXCLUDE_LABEL: "true"})
    clock = [NOW]
    loop, writes, sent, _ = controller(policy, excluded)
    loop.clock = lambda: clock[0]
    loop.reconcile("gpu-1")
    clock[0] = NOW + datetime.timedelta(seconds=61)
    loop.reconcile("gpu-1")
    assert writes.calls == []
    assert flushed(loop, sent) == ["RemediationHeld", "RemediationHeld"]


def test_nodes_replaced_after_they_became_due_still_count_for_the_breaker() -> None:
    # The review's rolling fault: each node due is drained and replaced (deleted) before the next.
    # The ledger forgets a deleted node (its budget place is free); the breaker's log does not.
    policy = breaking_at(2)
    breaker = Breaker(NoStore(), lambda: NOW)
    ledger = Ledger()
    for i in range(3):
        name = f"gpu-{i}"
        loop, writes, sent, _ = controller(
            policy, raw_node(name, allocatable=7), ledger=ledger, breaker=breaker
        )
        loop.reconcile(name)
        facts = loop.nodes.get(name)
        loop.node_changed(Change(name, facts, None))
        assert ledger.entry(name) is None
    assert breaker.state.open
    assert "CircuitBreakerOpened" in flushed(loop, sent)
    assert "taints" not in writes.calls[-1][1].get("spec", {})


def test_a_node_left_alone_does_not_count_for_the_breaker() -> None:
    policy = make_policy({"health": {"mode": "enforce", "signals": {"deviceGap": {"forSeconds": 0}}}})
    excluded = raw_node("gpu-1", allocatable=7, labels={health.EXCLUDE_LABEL: "true"})
    loop, _, _, breaker = controller(policy, excluded)
    loop.reconcile("gpu-1")
    assert breaker.logged() == {}


def test_an_unreadable_record_is_logged_once_while_it_lasts_and_again_when_it_breaks_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken = raw_node("gpu-1", record="{not json")
    loop, _, _, _ = controller(ENFORCE, broken)
    with caplog.at_level(logging.WARNING, logger="gpuguard.nodehealth"):
        loop.reconcile("gpu-1")
        loop.reconcile("gpu-1")
        assert len(caplog.records) == 1
        # Deleted: nothing of it is kept.
        loop.node_changed(Change("gpu-1", loop.nodes.get("gpu-1"), None))
        assert loop._reported_errors == set()


def test_a_node_someone_else_remediates_gets_no_write_and_an_event_says_why() -> None:
    disrupted = {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}
    loop, writes, sent, _ = controller(ENFORCE, raw_node("gpu-1", allocatable=7, taints=[disrupted]))
    loop.reconcile("gpu-1")
    assert writes.calls == []
    assert flushed(loop, sent) == ["RemediationHeld", "RemediationHeld"]


def test_a_node_that_does_not_answer_gets_no_write_and_is_never_due() -> None:
    unreachable = raw_node(
        "gpu-1",
        allocatable=0,
        conditions=[{"type": "Ready", "status": "Unknown"}],
        taints=[{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}],
    )
    loop, writes, _, _ = controller(ENFORCE, unreachable)
    loop.reconcile("gpu-1")
    assert writes.calls == []
    assert loop.breaker.logged() == {}


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
    ledger = Ledger()
    earlier = NodeRecord(signals={}, unhealthy_since=NOW, admitted_at=NOW)
    ledger.seed([health.node_facts(raw_node("gpu-0", allocatable=7, record=earlier))], policy, NOW)  # type: ignore[list-item]
    loop, writes, _, _ = controller(policy, raw_node("gpu-1", allocatable=7), ledger=ledger)
    loop.reconcile("gpu-1")
    (condition,) = writes.calls[0][1]["status"]["conditions"]
    assert (condition["status"], condition["reason"]) == ("Unknown", "Held")
    assert "budget" in condition["message"]


def test_gpuguards_marks_without_a_record_are_kept_as_its_own_and_reported() -> None:
    draining = {"type": health.CONDITION_TYPE, "status": "False", "reason": "Draining", "message": "m"}
    marked = raw_node(
        "gpu-1",
        allocatable=0,
        conditions=[draining],
        taints=[{"key": health.TAINT_KEY, "effect": "NoSchedule"}],
    )
    marked["spec"]["unschedulable"] = True
    marked["metadata"]["annotations"] = {health.RECORD_ANNOTATION: "[" * 1000 + "]" * 1000}
    loop, writes, sent, _ = controller(ENFORCE, marked)
    loop.reconcile("gpu-1")
    written = NodeRecord.from_json(writes.calls[-1][1]["metadata"]["annotations"][health.RECORD_ANNOTATION])
    assert written.admitted_at == NOW and written.cordoned
    entry = loop.ledger.entry("gpu-1")
    assert entry is not None and entry.record is not None and entry.record.admitted_at == NOW
    assert "RemediationRecordLost" in flushed(loop, sent)


def test_recorded_times_in_the_future_are_taken_as_now_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    future = NodeRecord(signals={f"deviceGap/{GPU}": datetime.datetime(2099, 1, 1, tzinfo=datetime.UTC)})
    loop, writes, _, _ = controller(ENFORCE, raw_node("gpu-1", allocatable=7, record=future))
    with caplog.at_level(logging.WARNING, logger="gpuguard.nodehealth"):
        loop.reconcile("gpu-1")
    assert "later than now" in caplog.text
    written = NodeRecord.from_json(writes.calls[-1][1]["metadata"]["annotations"][health.RECORD_ANNOTATION])
    assert written.signals == {f"deviceGap/{GPU}": NOW}


def test_a_signal_not_yet_due_is_timed_in_memory_and_writes_nothing() -> None:
    # A kubelet or device-plugin restart clears before it is due: it must cause no write at all, and a
    # failure that stays is acted on when its wait, timed from the first sighting, is over.
    waiting = make_policy({"health": {"mode": "enforce", "signals": {"deviceGap": {"forSeconds": 60}}}})
    loop, writes, _, _ = controller(waiting, raw_node("gpu-1", allocatable=7))
    loop.reconcile("gpu-1")
    assert writes.calls == []
    loop.clock = lambda: NOW + datetime.timedelta(seconds=59)
    loop.reconcile("gpu-1")
    assert writes.calls == []
    loop.clock = lambda: NOW + datetime.timedelta(seconds=60)
    loop.reconcile("gpu-1")
    assert [kind for kind, _ in writes.calls] == ["status", "node"]
    record = NodeRecord.from_json(writes.calls[1][1]["metadata"]["annotations"][health.RECORD_ANNOTATION])
    assert record.signals[f"deviceGap/{GPU}"] == NOW
