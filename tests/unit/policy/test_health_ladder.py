"""webhook.policy.health, the record and the ladder: who gpuguard leaves alone, what it records and how
long it waits, what a remediator it hands a node to may act on, and what survives a lost record.

Each test is one of the controllers review's reproducers (remediation-review.md), turned around to
assert the behaviour that was missing.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from typing import Any

import pytest

from tests.harness.manifests import make_policy
from tests.unit.policy.test_health import (
    ENFORCE,
    FREE,
    GPU,
    NOW,
    applied,
    device_plugin,
    enforcing,
    later,
    node,
    pod,
    raw_node,
    seen,
)
from webhook.policy.health import ladder, observed, records
from webhook.policy.model import PolicyError, default_policy

GAP = f"deviceGap/{GPU}"
MISSING = f"deviceMissing/{GPU}"
TAINTED = {"key": observed.TAINT_KEY, "effect": "NoSchedule"}


def actions(plan: ladder.NodePlan) -> list[tuple[str, str]]:
    return [(step.action, step.effect) for step in plan.steps]


def writes(facts: observed.NodeFacts, plan: ladder.NodePlan) -> bool:
    """Whether the controller would write anything to the node for this plan."""
    if plan.hands_off:
        return False
    wanted = (plan.condition, plan.tainted, plan.unschedulable, plan.record)
    return wanted != (facts.condition, facts.tainted, facts.unschedulable, facts.record)


# --- nodes someone else handles: no write at all -----------------------------------------------------


def test_the_node_lifecycle_controllers_taints_are_others_by_default() -> None:
    taints = default_policy().health.othersRemediatingTaints
    assert {"node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"} <= set(taints)


@pytest.mark.parametrize(
    "unanswering",
    [
        pytest.param(
            {
                "taints": [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}],
                "conditions": [{"type": "Ready", "status": "Unknown"}],
            },
            id="unreachable",
        ),
        pytest.param({"conditions": [{"type": "Ready", "status": "False"}]}, id="not-ready"),
    ],
)
def test_a_node_that_does_not_answer_is_left_to_the_node_lifecycle_controller(
    unanswering: dict[str, Any],
) -> None:
    facts = dataclasses.replace(
        node(**unanswering), conditions={"Ready": unanswering["conditions"][0]["status"]}
    )
    plugin = device_plugin(ready=False, started=later(-3600))
    plan = ladder.plan_node(facts, [plugin], ENFORCE, FREE, NOW)
    plan = ladder.plan_node(applied(facts, plan), [plugin], ENFORCE, FREE, later(301), plan.record)
    assert "node lifecycle controller" in plan.hands_off
    assert {effect for _, effect in actions(plan)} <= {"hold"}
    assert (plan.condition, plan.tainted, plan.unschedulable) == (None, False, False)
    # Never due: neither the budget nor the breaker counts it.
    assert not plan.became_due and not plan.budget_slot()
    assert plan.record is None or plan.record.unhealthy_since is None
    assert plan.requeue_after is None

    # Back: the plugin's clock starts again from now, not from when the node stopped answering.
    back = ladder.plan_node(node(), [plugin], ENFORCE, FREE, later(302), plan.record)
    assert not back.hands_off and back.assessment.state == "suspect"


def test_a_node_someone_else_cordoned_is_held_and_never_due() -> None:
    facts = node(allocatable=7, unschedulable=True)
    plan = ladder.plan_node(facts, [device_plugin()], ENFORCE, FREE, NOW, seen(300, GAP))
    assert "cordoned by someone else" in plan.held and not plan.tainted
    assert not plan.became_due and plan.record is not None and plan.record.unhealthy_since is None
    given_back = dataclasses.replace(applied(facts, plan), unschedulable=False)
    plan = ladder.plan_node(given_back, [device_plugin()], ENFORCE, FREE, later(10))
    assert plan.became_due and plan.tainted


def test_a_node_someone_else_remediates_gets_no_write_at_all() -> None:
    facts = node(allocatable=7, taints=[{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}])
    plan = ladder.plan_node(facts, [device_plugin()], ENFORCE, FREE, NOW, seen(300, GAP))
    assert "karpenter.sh/disrupted" in plan.hands_off
    assert not writes(facts, plan) and plan.condition is None
    # Said: every step held, which the controller reports as RemediationHeld.
    assert actions(plan) and {effect for _, effect in actions(plan)} == {"hold"}
    assert not plan.became_due


# --- waits are as long as they say -------------------------------------------------------------------


def test_record_times_keep_their_fraction_of_a_second() -> None:
    first = NOW + datetime.timedelta(seconds=0.92)
    record = records.NodeRecord(signals={GAP: first}, unhealthy_since=first, remediations=(first,))
    back = records.NodeRecord.from_json(record.to_json())
    assert back.signals[GAP] == first and back.unhealthy_since == first and back.remediations == (first,)
    # Whole seconds are written as before, and records written before are read.
    assert json.loads(records.NodeRecord(clear_since=NOW).to_json())["clearSince"] == "2026-03-01T12:00:00Z"
    old = records.NodeRecord.from_json('{"signals":{"deviceGap/nvidia.com/gpu":"2026-03-01T12:00:00Z"}}')
    assert old.signals == {GAP: NOW}


def test_a_signal_never_acts_before_its_wait() -> None:
    policy = enforcing(signals={"deviceGap": {"forSeconds": 3}})
    first = NOW + datetime.timedelta(seconds=0.92)
    facts = node(allocatable=7)
    plan = ladder.plan_node(facts, [device_plugin()], policy, FREE, first)
    stored = observed.node_facts(raw_node(allocatable=7, record=plan.record))
    assert stored is not None
    early = ladder.plan_node(stored, [device_plugin()], policy, FREE, first + datetime.timedelta(seconds=2.5))
    assert early.steps == () and early.requeue_after == pytest.approx(0.5)
    on_time = ladder.plan_node(stored, [device_plugin()], policy, FREE, first + datetime.timedelta(seconds=3))
    assert ("condition", "do") in actions(on_time)


def test_times_in_the_future_are_clamped_to_now() -> None:
    future = datetime.datetime(2099, 1, 1, tzinfo=datetime.UTC)
    record = records.NodeRecord(signals={GAP: future}, clear_since=future)
    plan = ladder.plan_node(node(allocatable=7), [device_plugin()], ENFORCE, FREE, NOW, record)
    assert plan.record is not None and plan.record.signals[GAP] == NOW
    assert plan.clamped == ("clear_since", f"signals[{GAP}]")
    assert plan.requeue_after == 300
    assert (
        ladder.plan_node(node(allocatable=7), [device_plugin()], ENFORCE, FREE, NOW, seen(10, GAP)).clamped
        == ()
    )


# --- the hand-off obeys the brakes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fleet", "why"),
    [
        pytest.param(ladder.Fleet(10, 0, True), "circuit breaker open", id="breaker"),
        pytest.param(ladder.Fleet(10, 5, False), "budget", id="budget"),
    ],
)
def test_a_held_node_gets_a_condition_remediators_do_not_act_on(fleet: ladder.Fleet, why: str) -> None:
    facts = node(allocatable=0)
    plan = ladder.plan_node(facts, [device_plugin(started=later(-3600))], ENFORCE, fleet, NOW, seen(400, GAP))
    assert plan.condition is not None
    assert (plan.condition.status, plan.condition.reason) == ("Unknown", "Held")
    assert why in plan.condition.message and not plan.tainted

    # Once a place is free gpuguard acts, and only then says False.
    plan = ladder.plan_node(
        applied(facts, plan), [device_plugin(started=later(-3600))], ENFORCE, FREE, later(1)
    )
    assert plan.condition is not None and plan.condition.status == "False" and plan.tainted


def test_the_condition_alone_takes_a_budget_place() -> None:
    only_condition = enforcing(actions={"taint": {"mode": "off"}, "drain": {"mode": "off"}})
    plan = ladder.plan_node(node(allocatable=7), [device_plugin()], only_condition, FREE, NOW, seen(300, GAP))
    assert plan.budget_slot() and plan.condition is not None and plan.condition.status == "False"
    full = ladder.plan_node(
        node(allocatable=7),
        [device_plugin()],
        only_condition,
        ladder.Fleet(10, 2, False),
        NOW,
        seen(300, GAP),
    )
    assert full.condition is not None and full.condition.status == "Unknown"


# --- a drain said is not a drain done ----------------------------------------------------------------


def test_a_drain_said_in_audit_is_not_recorded_and_enforcing_it_later_cordons_first() -> None:
    step1 = enforcing(actions={"drain": {"mode": "audit", "threshold": 100}})
    plug, job = device_plugin(started=later(-3600)), pod()
    facts = node(allocatable=0, record=seen(400, GAP))
    plan = ladder.plan_node(facts, [plug, job], step1, FREE, NOW)
    assert ("drain", "would") in actions(plan)
    assert plan.record is not None and plan.record.draining_since is None and not plan.record.cordoned
    assert plan.condition is not None and plan.condition.reason == "DevicesUnhealthy"

    step2 = enforcing(actions={"drain": {"mode": "enforce", "threshold": 100}})
    plan = ladder.plan_node(applied(facts, plan), [plug, job], step2, FREE, later(60))
    assert ("drain", "do") in actions(plan) and plan.unschedulable
    assert plan.record is not None and plan.record.cordoned and plan.record.draining_since == later(60)


def test_a_drain_an_earlier_version_recorded_without_doing_it_is_not_taken_for_done() -> None:
    said = seen(400, GAP, admitted_at=later(-300), unhealthy_since=later(-300), draining_since=later(-300))
    facts = node(allocatable=0, taints=[TAINTED], record=said)
    plan = ladder.plan_node(facts, [device_plugin(started=later(-3600)), pod()], ENFORCE, FREE, NOW)
    assert ("drain", "do") in actions(plan) and plan.unschedulable
    assert plan.record is not None and plan.record.cordoned and plan.record.draining_since == NOW


def test_a_node_is_drained_when_only_pods_gpuguard_never_evicts_are_left() -> None:
    policy = make_policy(
        {"health": {"mode": "enforce"}, "namespaces": [{"names": ["infra"], "health": "off"}]}
    )
    plug, left = device_plugin(ready=False), pod(namespace="infra")
    facts = node(record=seen(400, "devicePlugin"))
    drained = ladder.plan_node(facts, [plug, left], policy, FREE, NOW)
    assert ("drain", "do") in actions(drained)
    plan = ladder.plan_node(applied(facts, drained), [plug, left], policy, FREE, later(1))
    assert plan.condition is not None and plan.condition.reason == "Drained"
    # A pod the drain evicts is waited for.
    waiting = ladder.plan_node(applied(facts, drained), [plug, pod()], policy, FREE, later(1))
    assert waiting.condition is not None and waiting.condition.reason == "Draining"


# --- a GPU that disappears is not a recovery ---------------------------------------------------------


def xid79_then_plugin_restart(policy: Any = ENFORCE) -> tuple[observed.NodeFacts, ladder.NodePlan]:
    """A device marked unhealthy (8/7), the plugin restarted and no longer enumerating it (7/7)."""
    plug = device_plugin(started=later(-3600))
    facts = node(allocatable=7, record=seen(400, GAP))
    facts = applied(facts, ladder.plan_node(facts, [plug], policy, FREE, NOW))
    restarted = device_plugin(started=later(60))
    facts = dataclasses.replace(facts, capacity={GPU: 7}, allocatable={GPU: 7})
    facts = applied(facts, ladder.plan_node(facts, [restarted], policy, FREE, later(700)))
    return facts, ladder.plan_node(facts, [restarted], policy, FREE, later(1400))


def test_a_gpu_gone_from_capacity_keeps_the_node_marked() -> None:
    _, plan = xid79_then_plugin_restart()
    assert ("recover", "do") not in actions(plan)
    assert plan.tainted and plan.condition is not None and plan.condition.status == "False"
    assert plan.assessment.state == "unhealthy"
    assert [s.key for s in plan.assessment.signals] == [MISSING]
    assert "1 of 8 expected devices missing" in plan.assessment.signals[0].message
    assert plan.record is not None and plan.record.expected == {GPU: 8}


def test_a_gpu_a_plugin_restart_stopped_enumerating_is_due_when_its_gap_would_have_been() -> None:
    # The same failure seen another way: its wait does not start again at the plugin restart.
    plug = device_plugin(started=later(-3600))
    facts = node(allocatable=7, record=seen(100, GAP))
    facts = applied(facts, ladder.plan_node(facts, [plug], ENFORCE, FREE, NOW))
    wait = ENFORCE.health.signals.deviceGap.forSeconds
    restarted = dataclasses.replace(facts, capacity={GPU: 7}, allocatable={GPU: 7})
    plan = ladder.plan_node(restarted, [device_plugin(started=later(1))], ENFORCE, FREE, later(wait - 100))
    (missing,) = plan.assessment.signals
    assert (missing.key, missing.since) == (MISSING, later(-100))
    assert ("taint", "do") in actions(plan)


def test_expected_devices_reset_with_a_new_node_a_new_layout_or_an_acknowledgement() -> None:
    facts, _ = xid79_then_plugin_restart()
    mig = "nvidia.com/mig-3g.40gb"
    relaid = dataclasses.replace(facts, capacity={GPU: 0, mig: 2}, allocatable={GPU: 0, mig: 2})
    plan = ladder.plan_node(relaid, [device_plugin(started=later(-3600))], ENFORCE, FREE, later(1500))
    assert not any(s.kind == "deviceMissing" for s in plan.assessment.signals)
    assert plan.record is not None and plan.record.expected == {mig: 2}

    replaced = dataclasses.replace(facts, uid="uid-new")
    plan = ladder.plan_node(replaced, [device_plugin(started=later(-3600))], ENFORCE, FREE, later(1500))
    assert not plan.assessment.signals

    acknowledged = dataclasses.replace(facts, acknowledged_at=later(1450))
    plan = ladder.plan_node(acknowledged, [device_plugin(started=later(-3600))], ENFORCE, FREE, later(1500))
    assert not plan.assessment.signals
    assert plan.record is not None and plan.record.expected == {GPU: 7}


def test_a_kubelet_restart_reading_no_capacity_keeps_the_expected_counts() -> None:
    facts, _ = xid79_then_plugin_restart()
    restarting = dataclasses.replace(facts, capacity={GPU: 0}, allocatable={GPU: 0})
    plan = ladder.plan_node(restarting, [device_plugin(started=later(-3600))], ENFORCE, FREE, later(1500))
    assert plan.record is not None and plan.record.expected == {GPU: 8}


def test_the_policy_baseline_flags_a_node_gpuguard_never_saw_whole() -> None:
    policy = enforcing(
        expectedDevices=[
            {"selector": {"matchLabels": {"node.kubernetes.io/instance-type": "p4d"}}, "resources": {GPU: 8}}
        ]
    )
    short = node(capacity=7, allocatable=7, labels={"node.kubernetes.io/instance-type": "p4d"})
    plan = ladder.plan_node(short, [device_plugin()], policy, FREE, NOW)
    assert [s.key for s in plan.assessment.signals] == [MISSING]
    other_class = node(capacity=7, allocatable=7, labels={"node.kubernetes.io/instance-type": "g5"})
    assert not ladder.plan_node(other_class, [device_plugin()], policy, FREE, NOW).assessment.signals


def test_a_healthy_node_gpuguard_never_acted_on_gets_no_record() -> None:
    facts = node()
    plan = ladder.plan_node(facts, [device_plugin()], ENFORCE, FREE, NOW)
    assert plan.record is None and not writes(facts, plan)


# --- repeated failures escalate ----------------------------------------------------------------------


def episode(facts: observed.NodeFacts, start: float) -> tuple[observed.NodeFacts, ladder.NodePlan]:
    """A device gap that acts and clears: the node after the recovery that follows."""
    plug = device_plugin(started=later(-3600))
    failed = dataclasses.replace(facts, allocatable={GPU: 7})
    failed = applied(failed, ladder.plan_node(failed, [plug], ENFORCE, FREE, later(start)))
    failed = applied(failed, ladder.plan_node(failed, [plug], ENFORCE, FREE, later(start + 300)))
    assert failed.tainted
    clear = dataclasses.replace(failed, allocatable={GPU: 8})
    clear = applied(clear, ladder.plan_node(clear, [plug], ENFORCE, FREE, later(start + 400)))
    plan = ladder.plan_node(clear, [plug], ENFORCE, FREE, later(start + 1000))
    return applied(clear, plan), plan


def test_a_node_remediated_again_within_the_window_keeps_its_marks_until_acknowledged() -> None:
    facts, first = episode(node(), 0)
    assert actions(first) == [("recover", "do")] and not first.tainted
    assert first.record is not None and first.record.remediations == (later(300),)

    facts, second = episode(facts, 86400)
    assert second.tainted and second.escalated
    assert second.condition is not None
    assert (second.condition.status, second.condition.reason) == ("False", "RepeatedFailures")
    assert "gpuguard nodes ack gpu-1" in second.condition.message
    again = ladder.plan_node(facts, [device_plugin(started=later(-3600))], ENFORCE, FREE, later(90000))
    assert again.tainted and again.steps == ()

    acknowledged = dataclasses.replace(facts, acknowledged_at=later(90000))
    plan = ladder.plan_node(acknowledged, [device_plugin(started=later(-3600))], ENFORCE, FREE, later(90001))
    assert actions(plan) == [("recover", "do")] and not plan.tainted and plan.condition is None
    assert plan.record is None or plan.record.remediations == ()


def test_remediations_outside_the_window_do_not_escalate() -> None:
    facts, _ = episode(node(), 0)
    _, plan = episode(facts, 8 * 86400)
    assert not plan.escalated and not plan.tainted


# --- ownership survives a lost record ----------------------------------------------------------------


def test_a_stripped_record_keeps_the_budget_place_and_the_cordon() -> None:
    plug = device_plugin(started=later(-3600))
    a = node(name="gpu-a", allocatable=0, record=seen(400, GAP))
    a = applied(
        a, ladder.plan_node(a, [plug, pod(node_name="gpu-a")], ENFORCE, ladder.Fleet(5, 0, False), NOW)
    )
    assert a.tainted and a.unschedulable
    a = dataclasses.replace(a, record=None)
    plan = ladder.plan_node(a, [plug], ENFORCE, ladder.Fleet(5, 0, False), later(10))
    assert plan.budget_slot() and not plan.held
    assert "annotation gpuguard.io/remediation is missing" in plan.record_lost
    assert "cordon" in plan.record_lost
    assert not plan.became_due

    # Recovered, gpuguard undoes its cordon as well.
    a = applied(dataclasses.replace(a, allocatable={GPU: 8}), plan)
    healthy = ladder.plan_node(a, [plug], ENFORCE, FREE, later(20))
    done = ladder.plan_node(applied(a, healthy), [plug], ENFORCE, FREE, later(700))
    assert actions(done) == [("recover", "do")] and not done.unschedulable and not done.tainted


@pytest.mark.parametrize(
    "annotation",
    [
        pytest.param("[" * 1000 + "]" * 1000, id="deep"),
        pytest.param('{"signals":{}, "pad":"' + "x" * 20000 + '"}', id="oversize"),
        pytest.param('{"expected":{"nvidia.com/gpu":"8"}}', id="count-as-string"),
        pytest.param('{"remediations":{"a":1}}', id="history-not-a-list"),
        pytest.param('{"lastAction":["taint"]}', id="action-not-a-string"),
        pytest.param("{", id="not-json"),
    ],
)
def test_an_unreadable_record_is_an_error_on_that_node_only(annotation: str) -> None:
    raw = raw_node(
        allocatable=0, taints=[TAINTED], conditions=[{"type": observed.CONDITION_TYPE, "status": "False"}]
    )
    raw["metadata"]["annotations"] = {records.RECORD_ANNOTATION: annotation}
    facts = observed.node_facts(raw)
    assert facts is not None and facts.record is None and facts.record_error
    plan = ladder.plan_node(facts, [device_plugin(started=later(-3600))], ENFORCE, FREE, NOW)
    assert plan.budget_slot() and facts.record_error in plan.record_lost


def test_the_acknowledgement_annotation_is_read() -> None:
    raw = raw_node()
    raw["metadata"]["annotations"] = {records.ACK_ANNOTATION: "2026-03-01T12:00:00Z"}
    facts = observed.node_facts(raw)
    assert facts is not None and facts.acknowledged_at == NOW


@pytest.mark.parametrize(
    ("health_section", "field"),
    [
        pytest.param(
            {"expectedDevices": [{"selector": {}, "resources": {GPU: 0}}]},
            "health.expectedDevices[0].resources",
            id="no-devices-expected",
        ),
        pytest.param(
            {"expectedDevices": [{"selector": {}, "resources": {}}]},
            "health.expectedDevices[0].resources",
            id="empty",
        ),
        pytest.param(
            {"recovery": {"escalation": {"remediations": 101}}},
            "health.recovery.escalation.remediations",
            id="too-long-a-history",
        ),
        pytest.param(
            {"recovery": {"escalation": {"windowSeconds": 0}}},
            "health.recovery.escalation.windowSeconds",
            id="no-window",
        ),
    ],
)
def test_the_new_health_keys_are_validated(health_section: dict[str, Any], field: str) -> None:
    with pytest.raises(PolicyError, match=re.escape(field)):
        make_policy({"health": health_section})
