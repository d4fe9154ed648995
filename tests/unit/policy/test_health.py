"""webhook.policy.health: node and pod facts in, verdicts and plans out, on a fake clock."""

from __future__ import annotations

import dataclasses
import datetime
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness.manifests import make_policy
from webhook.policy.health import ladder, observed, podverdicts, records, signals
from webhook.policy.model import Policy, PolicyError, parse_policy

JSON = dict[str, Any]
NOW = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.UTC)
GPU = "nvidia.com/gpu"
FREE = ladder.Fleet(pool_nodes=10, pool_admitted=0, breaker_open=False)


def later(seconds: float) -> datetime.datetime:
    return NOW + datetime.timedelta(seconds=seconds)


def enforcing(**health_overrides: Any) -> Policy:
    return make_policy({"health": {"mode": "enforce", **health_overrides}})


AUDIT = make_policy()
ENFORCE = enforcing()


# --- builders: raw objects as the API server sends them ----------------------------------------------


def raw_node(
    name: str = "gpu-1",
    *,
    capacity: int | None = 8,
    allocatable: int | None = 8,
    labels: Mapping[str, str] | None = None,
    conditions: Sequence[JSON] = (),
    taints: Sequence[JSON] = (),
    unschedulable: bool = False,
    record: records.NodeRecord | str | None = None,
) -> JSON:
    status: JSON = {"capacity": {"cpu": "32", "memory": "256Gi"}, "allocatable": {"cpu": "31"}}
    if capacity is not None:
        status["capacity"][GPU] = str(capacity)
    if allocatable is not None:
        status["allocatable"][GPU] = str(allocatable)
    status["conditions"] = [{"type": "Ready", "status": "True"}, *conditions]
    metadata: JSON = {
        "name": name,
        "uid": f"uid-{name}",
        "resourceVersion": "7",
        "labels": dict(labels or {}),
    }
    if record is not None:
        text = record if isinstance(record, str) else record.to_json()
        metadata["annotations"] = {records.RECORD_ANNOTATION: text}
    spec: JSON = {"taints": list(taints)}
    if unschedulable:
        spec["unschedulable"] = True
    return {"apiVersion": "v1", "kind": "Node", "metadata": metadata, "spec": spec, "status": status}


def node(**kwargs: Any) -> observed.NodeFacts:
    facts = observed.node_facts(raw_node(**kwargs))
    assert facts is not None
    return facts


def raw_pod(
    name: str = "trainer",
    *,
    namespace: str = "ml",
    node_name: str = "gpu-1",
    gpus: int = 1,
    phase: str = "Running",
    devices: Sequence[tuple[str, str]] = (),
    owner: str | None = "Job",
    labels: Mapping[str, str] | None = None,
    ready: bool = True,
    started: datetime.datetime | None = None,
    exit_codes: Sequence[int] = (),
    waiting: str | None = None,
    deleting: bool = False,
    disrupted: bool = False,
    claims: Sequence[str] = (),
) -> JSON:
    resources: JSON = {"limits": {GPU: str(gpus)}} if gpus else {"requests": {"cpu": "100m"}}
    container: JSON = {"name": "main", "image": "trainer:1", "resources": resources}
    if claims:
        container["resources"]["claims"] = [{"name": claim} for claim in claims]
    spec: JSON = {"nodeName": node_name, "containers": [container]}
    if claims:
        spec["resourceClaims"] = [{"name": claim, "resourceClaimName": claim} for claim in claims]
    state: JSON = {"running": {"startedAt": records.format_time(started or later(-3600))}}
    if waiting is not None:
        state = {"waiting": {"reason": waiting}}
    status: JSON = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]
        + (
            [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
            if disrupted
            else []
        ),
        "containerStatuses": [
            {
                "name": "main",
                "state": state,
                "lastState": {
                    "terminated": {"exitCode": exit_codes[0], "finishedAt": records.format_time(later(-60))}
                }
                if exit_codes
                else {},
                "allocatedResourcesStatus": [
                    {"name": resource, "resources": [{"resourceID": device, "health": state_}]}
                    for resource, device, state_ in (_device(d) for d in devices)
                ],
            }
        ],
    }
    metadata: JSON = {
        "name": name,
        "namespace": namespace,
        "uid": f"uid-{name}",
        "labels": dict(labels or {}),
    }
    if owner is not None:
        metadata["ownerReferences"] = [{"kind": owner, "name": "owner", "controller": True, "uid": "o"}]
    if deleting:
        metadata["deletionTimestamp"] = records.format_time(NOW)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec, "status": status}


def _device(spec: tuple[str, str]) -> tuple[str, str, str]:
    device, state = spec
    resource, _, device_id = device.rpartition(" ")
    return resource or GPU, device_id, state


def pod(**kwargs: Any) -> observed.PodFacts:
    facts = observed.pod_facts(raw_pod(**kwargs))
    assert facts is not None
    return facts


def raw_device_plugin(
    *, ready: bool = True, started: datetime.datetime | None = None, phase: str = "Running"
) -> JSON:
    return raw_pod(
        name="nvidia-device-plugin-x",
        namespace="gpu-operator",
        gpus=0,
        owner="DaemonSet",
        labels={"app": "nvidia-device-plugin-daemonset"},
        ready=ready,
        started=started,
        phase=phase,
    )


def device_plugin(*, ready: bool = True, started: datetime.datetime | None = None) -> observed.PodFacts:
    facts = observed.pod_facts(raw_device_plugin(ready=ready, started=started))
    assert facts is not None
    return facts


def applied(facts: observed.NodeFacts, plan: ladder.NodePlan) -> observed.NodeFacts:
    """The node after the caller wrote what the plan wants."""
    taints = tuple(t for t in facts.taints if t.key != observed.TAINT_KEY)
    if plan.tainted:
        taints += (observed.Taint(observed.TAINT_KEY, "", "NoSchedule"),)
    return dataclasses.replace(
        facts, condition=plan.condition, taints=taints, unschedulable=plan.unschedulable, record=plan.record
    )


def seen(seconds_ago: float, *keys: str, **extra: Any) -> records.NodeRecord:
    """A record in which gpuguard first saw `keys` that long ago."""
    return records.NodeRecord(signals={key: later(-seconds_ago) for key in keys}, **extra)


def actions(plan: ladder.NodePlan) -> list[tuple[str, str]]:
    return [(step.action, step.effect) for step in plan.steps]


# --- converters --------------------------------------------------------------------------------------


def test_node_facts_keep_extended_resources_and_separate_gpuguards_condition() -> None:
    raw = raw_node(
        conditions=[
            {"type": observed.CONDITION_TYPE, "status": "False", "reason": "DevicesUnhealthy", "message": "m"}
        ],
        taints=[{"key": observed.TAINT_KEY, "effect": "NoSchedule"}],
    )
    facts = observed.node_facts(raw)
    assert facts is not None
    assert facts.capacity == {GPU: 8} and facts.allocatable == {GPU: 8}
    assert facts.conditions == {"Ready": "True"}
    assert facts.condition == observed.OwnCondition("False", "DevicesUnhealthy", "m")
    assert facts.tainted and facts.resource_version == "7"


def test_a_record_edited_by_hand_is_reported_and_treated_as_none() -> None:
    facts = node(record="{not json")
    assert facts.record is None
    assert records.RECORD_ANNOTATION in facts.record_error


def test_record_round_trips_through_its_annotation() -> None:
    record = records.NodeRecord(
        signals={f"deviceGap/{GPU}": later(-30)},
        unhealthy_since=later(-10),
        admitted_at=later(-5),
        cordoned=True,
        draining_since=later(-5),
        last_action="drain",
        last_action_at=later(-5),
    )
    assert records.NodeRecord.from_json(record.to_json()) == record


def test_pods_that_no_verdict_reads_are_not_kept() -> None:
    assert observed.pod_facts(raw_pod(gpus=0, owner="ReplicaSet")) is None
    assert observed.pod_facts(raw_pod(gpus=0, owner="DaemonSet")) is not None
    assert pod(gpus=0, owner=None, claims=["gpu"]).requests == ("claim:gpu",)


def test_pod_facts_read_device_health_exits_and_crash_loops() -> None:
    facts = pod(devices=[("GPU-1", "Unhealthy"), ("GPU-2", "Healthy")], exit_codes=[74])
    assert [(d.device, d.health) for d in facts.devices] == [("GPU-1", "Unhealthy")]
    assert [t.exit_code for t in facts.terminations] == [74]
    assert pod(waiting="CrashLoopBackOff").crash_looping


# --- signals -----------------------------------------------------------------------------------------


def test_a_device_gap_is_a_signal_that_acts_only_once_it_persisted() -> None:
    fresh = signals.assess(node(allocatable=7), [device_plugin()], AUDIT, NOW)
    assert fresh.state == "suspect"
    (signal,) = fresh.signals
    assert (signal.kind, signal.devices, signal.since) == ("deviceGap", 1, NOW)

    record = seen(300, f"deviceGap/{GPU}")
    persisted = signals.assess(node(allocatable=7), [device_plugin()], AUDIT, NOW, record)
    assert persisted.state == "unhealthy"
    assert persisted.failed_share == pytest.approx(1 / 8)


@pytest.mark.parametrize(
    "plugin",
    [
        pytest.param(device_plugin(ready=False), id="plugin-not-ready"),
        pytest.param(device_plugin(started=later(-20)), id="plugin-just-restarted"),
    ],
)
def test_allocatable_zero_while_the_plugin_restarts_is_not_a_gap(plugin: observed.PodFacts) -> None:
    record = seen(3600, f"deviceGap/{GPU}")
    assessment = signals.assess(node(allocatable=0), [plugin], ENFORCE, NOW, record)
    assert [s.kind for s in assessment.signals if s.kind == "deviceGap"] == []
    assert [s.kind for s in assessment.suppressed] == ["deviceGap"]


def test_without_a_plugin_pod_to_ask_an_all_device_gap_waits_longer() -> None:
    (signal,) = signals.assess(node(allocatable=0), [], ENFORCE, NOW).signals
    assert signal.for_seconds == ENFORCE.health.signals.devicePlugin.capacityVanishedForSeconds


def test_a_kubelet_restart_reads_capacity_zero_and_waits_for_the_plugin() -> None:
    restarted = node(capacity=0, allocatable=0)
    assessment = signals.assess(restarted, [device_plugin()], ENFORCE, NOW)
    assert [s.kind for s in assessment.signals] == ["capacityVanished"]
    assert assessment.state == "suspect"
    gone = signals.assess(restarted, [device_plugin()], ENFORCE, later(601), assessment_record(assessment))
    assert gone.state == "unhealthy" and gone.failed_share == 1.0


def assessment_record(assessment: signals.Assessment) -> records.NodeRecord:
    return records.NodeRecord(signals={s.key: s.since for s in assessment.signals})


def test_a_plugin_not_ready_too_long_is_a_whole_node_signal() -> None:
    record = seen(301, "devicePlugin")
    assessment = signals.assess(node(), [device_plugin(ready=False)], ENFORCE, NOW, record)
    assert assessment.state == "unhealthy" and assessment.failed_share == 1.0


def test_node_conditions_are_timed_from_gpuguards_own_first_sight() -> None:
    condition = {
        "type": "AcceleratedHardwareReady",
        "status": "False",
        "lastTransitionTime": "2020-01-01T00:00:00Z",
    }
    facts = node(conditions=[condition])
    first = signals.assess(facts, [device_plugin()], ENFORCE, NOW)
    assert first.state == "suspect"  # the old lastTransitionTime does not make it due
    (signal,) = first.signals
    assert signal.since == NOW and signal.for_seconds == 600


def test_devices_reported_unhealthy_by_pods_count_for_the_node() -> None:
    pods = [pod(devices=[("GPU-3", "Unhealthy")]), pod(name="other", devices=[("GPU-3", "Unhealthy")])]
    (signal,) = signals.assess(node(), [*pods, device_plugin()], ENFORCE, NOW).signals
    assert (signal.kind, signal.devices) == ("podDevice", 1)


def test_correlated_device_failure_exits_confirm_a_gap_at_once() -> None:
    pods = [pod(exit_codes=[74]), pod(name="b", waiting="CrashLoopBackOff")]
    assessment = signals.assess(node(allocatable=7), [*pods, device_plugin()], ENFORCE, NOW)
    assert assessment.correlated_failures == 2
    assert assessment.state == "unhealthy"
    (signal,) = assessment.signals
    assert "2 device-failure exits" in signal.confirmed_by


def test_failure_exits_on_a_node_without_a_gap_are_no_signal() -> None:
    pods = [pod(exit_codes=[74]), pod(name="b", exit_codes=[75])]
    assert signals.assess(node(), [*pods, device_plugin()], ENFORCE, NOW).state == "healthy"


def test_nodes_without_accelerators_or_outside_the_selector_are_never_assessed() -> None:
    assert not signals.assess(node(capacity=None, allocatable=None), [], ENFORCE, NOW).in_scope
    selective = enforcing(nodeSelector={"matchLabels": {"team": "ml"}})
    assert not signals.assess(node(allocatable=0), [], selective, NOW).in_scope


# --- plans: the ladder -------------------------------------------------------------------------------

GAP = f"deviceGap/{GPU}"


def test_audit_mode_says_what_it_would_do_and_wants_nothing_changed() -> None:
    facts = node(allocatable=7)
    plan = ladder.plan_node(facts, [device_plugin()], AUDIT, FREE, NOW, seen(300, GAP))
    assert actions(plan) == [("condition", "would"), ("taint", "would")]
    assert (plan.condition, plan.tainted, plan.unschedulable) == (None, False, False)
    assert plan.budget_slot()  # the budget counts what enforce would do


def test_enforce_marks_the_node_and_taints_it() -> None:
    plan = ladder.plan_node(node(allocatable=7), [device_plugin()], ENFORCE, FREE, NOW, seen(300, GAP))
    assert actions(plan) == [("condition", "do"), ("taint", "do")]
    assert plan.condition is not None and plan.condition.status == "False"
    assert "1 of 8 devices unhealthy" in plan.condition.message
    assert plan.tainted and not plan.unschedulable
    assert plan.record is not None and plan.record.admitted_at == NOW


def test_a_gap_that_has_not_persisted_only_records_when_it_was_first_seen() -> None:
    plan = ladder.plan_node(node(allocatable=7), [device_plugin()], ENFORCE, FREE, NOW)
    assert plan.steps == ()
    assert plan.record is not None and plan.record.signals == {GAP: NOW}
    assert plan.requeue_after == 300


def test_all_devices_failed_cordons_and_drains() -> None:
    record = seen(400, "devicePlugin")
    plan = ladder.plan_node(node(), [device_plugin(ready=False), pod()], ENFORCE, FREE, NOW, record)
    assert actions(plan) == [("condition", "do"), ("taint", "do"), ("drain", "do")]
    assert plan.unschedulable
    assert plan.record is not None and plan.record.cordoned and plan.record.draining_since == NOW
    assert plan.condition is not None and plan.condition.reason == "Draining"


def test_a_node_already_cordoned_by_someone_else_is_held() -> None:
    plan = ladder.plan_node(
        node(allocatable=7, unschedulable=True), [device_plugin()], ENFORCE, FREE, NOW, seen(300, GAP)
    )
    assert actions(plan) == [("condition", "do"), ("taint", "hold")]
    assert "cordoned by someone else" in plan.held
    assert not plan.tainted


def test_a_node_someone_else_remediates_is_held() -> None:
    facts = node(allocatable=7, taints=[{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}])
    plan = ladder.plan_node(facts, [device_plugin()], ENFORCE, FREE, NOW, seen(300, GAP))
    assert "karpenter.sh/disrupted" in plan.held and not plan.tainted


def test_the_budget_holds_nodes_beyond_it_to_conditions_only() -> None:
    full = ladder.Fleet(pool_nodes=4, pool_admitted=1, breaker_open=False)
    plan = ladder.plan_node(
        node(allocatable=7),
        [device_plugin()],
        enforcing(budget={"maxUnhealthy": "25%"}),
        full,
        NOW,
        seen(300, GAP),
    )
    assert actions(plan) == [("condition", "do"), ("taint", "hold")]
    assert "allows 1" in plan.held
    assert not plan.budget_slot()


def test_an_open_breaker_holds_new_nodes_and_new_drains_but_not_undoing() -> None:
    tripped = ladder.Fleet(pool_nodes=10, pool_admitted=0, breaker_open=True)
    new = ladder.plan_node(node(allocatable=7), [device_plugin()], ENFORCE, tripped, NOW, seen(300, GAP))
    assert ("taint", "hold") in actions(new) and new.held == "circuit breaker open"

    admitted = seen(300, "devicePlugin", admitted_at=later(-10), unhealthy_since=later(-10))
    tainted = node(taints=[{"key": observed.TAINT_KEY, "effect": "NoSchedule"}])
    no_drain = ladder.plan_node(tainted, [device_plugin(ready=False)], ENFORCE, tripped, NOW, admitted)
    assert ("drain", "hold") in actions(no_drain) and not no_drain.unschedulable

    recovering = dataclasses.replace(admitted, signals={}, clear_since=later(-601))
    undo = ladder.plan_node(tainted, [device_plugin()], ENFORCE, tripped, NOW, recovering)
    assert actions(undo) == [("recover", "do")] and not undo.tainted


@pytest.mark.parametrize(
    ("policy", "labels"),
    [
        pytest.param(ENFORCE, {signals.EXCLUDE_LABEL: "true"}, id="excluded"),
        pytest.param(enforcing(paused=True), {}, id="paused"),
    ],
)
def test_excluded_and_paused_nodes_are_left_alone(policy: Policy, labels: dict[str, str]) -> None:
    facts = node(allocatable=0, labels=labels)
    plan = ladder.plan_node(facts, [device_plugin(ready=False)], policy, FREE, NOW, seen(400, "devicePlugin"))
    assert plan.hands_off
    assert {effect for _, effect in actions(plan)} == {"hold"}
    assert (plan.condition, plan.tainted, plan.unschedulable) == (None, False, False)


def test_recovery_waits_then_undoes_exactly_gpuguards_marks() -> None:
    marks = node(
        conditions=[
            {"type": observed.CONDITION_TYPE, "status": "False", "reason": "Draining", "message": "m"}
        ],
        taints=[{"key": observed.TAINT_KEY, "effect": "NoSchedule"}, {"key": "team", "effect": "NoSchedule"}],
        unschedulable=True,
    )
    record = records.NodeRecord(
        admitted_at=later(-900), cordoned=True, draining_since=later(-900), clear_since=later(-60)
    )
    waiting = ladder.plan_node(marks, [device_plugin()], ENFORCE, FREE, NOW, record)
    assert waiting.steps == () and waiting.requeue_after == pytest.approx(540)

    done = ladder.plan_node(marks, [device_plugin()], ENFORCE, FREE, later(540), record)
    assert actions(done) == [("recover", "do")]
    assert (done.condition, done.tainted, done.unschedulable, done.record) == (None, False, False, None)
    assert [t.key for t in applied(marks, done).taints] == ["team"]


def test_a_recovery_that_may_only_be_said_is_not_said_again_in_a_loop() -> None:
    marks = node(taints=[{"key": observed.TAINT_KEY, "effect": "NoSchedule"}])
    record = records.NodeRecord(admitted_at=later(-900), clear_since=later(-900))
    audited = enforcing(actions={"taint": {"mode": "audit"}})
    plan = ladder.plan_node(marks, [device_plugin()], audited, FREE, NOW, record)
    assert actions(plan) == [("recover", "would")] and plan.tainted
    assert plan.requeue_after is None


def test_recovery_never_uncordons_what_an_operator_cordoned() -> None:
    marks = node(taints=[{"key": observed.TAINT_KEY, "effect": "NoSchedule"}], unschedulable=True)
    record = records.NodeRecord(admitted_at=later(-900), cordoned=False, clear_since=later(-900))
    plan = ladder.plan_node(marks, [device_plugin()], ENFORCE, FREE, NOW, record)
    assert not plan.tainted and plan.unschedulable


def test_an_operator_uncordoning_a_drained_node_cancels_gpuguards_remediation() -> None:
    tainted = node(taints=[{"key": observed.TAINT_KEY, "effect": "NoSchedule"}], unschedulable=False)
    record = seen(
        900,
        "devicePlugin",
        admitted_at=later(-600),
        cordoned=True,
        draining_since=later(-600),
        unhealthy_since=later(-600),
    )
    plan = ladder.plan_node(tainted, [device_plugin(ready=False)], ENFORCE, FREE, NOW, record)
    assert ("cancel", "do") in actions(plan)
    assert not plan.tainted and not plan.unschedulable
    assert plan.record is not None and plan.record.cancelled_at == NOW and plan.record.draining_since is None
    again = ladder.plan_node(applied(tainted, plan), [device_plugin(ready=False)], ENFORCE, FREE, later(1))
    assert not again.tainted and not again.unschedulable


def test_off_does_nothing_at_all() -> None:
    off = enforcing(
        actions={"condition": {"mode": "off"}, "taint": {"mode": "off"}, "drain": {"mode": "off"}}
    )
    plan = ladder.plan_node(
        node(allocatable=0), [device_plugin(ready=False)], off, FREE, NOW, seen(400, "devicePlugin")
    )
    assert plan.steps == () and not plan.budget_slot()


def test_drained_once_no_accelerator_pod_is_left() -> None:
    record = seen(
        400,
        "devicePlugin",
        admitted_at=later(-60),
        cordoned=True,
        draining_since=later(-60),
        unhealthy_since=later(-60),
    )
    facts = node(taints=[{"key": observed.TAINT_KEY, "effect": "NoSchedule"}], unschedulable=True)
    terminating = ladder.plan_node(
        facts, [device_plugin(ready=False), pod(deleting=True)], ENFORCE, FREE, NOW, record
    )
    assert terminating.condition is not None and terminating.condition.reason == "Draining"
    gone = ladder.plan_node(facts, [device_plugin(ready=False)], ENFORCE, FREE, NOW, record)
    assert gone.condition is not None and gone.condition.reason == "Drained"


@functools.cache
def with_modes(condition: str, taint: str, drain: str) -> Policy:
    return enforcing(
        actions={"condition": {"mode": condition}, "taint": {"mode": taint}, "drain": {"mode": drain}}
    )


@settings(max_examples=200, deadline=None)
@given(
    allocatable=st.integers(0, 8),
    plugin_ready=st.booleans(),
    age=st.sampled_from([0, 100, 400, 700]),
    modes=st.tuples(*[st.sampled_from(["enforce", "audit", "warn", "off"])] * 3),
    unschedulable=st.booleans(),
    admitted=st.integers(0, 3),
)
def test_a_plan_written_out_is_a_fixed_point(
    allocatable: int,
    plugin_ready: bool,
    age: int,
    modes: tuple[str, str, str],
    unschedulable: bool,
    admitted: int,
) -> None:
    """Whatever the node, writing what the plan wants and planning again at the same moment asks for no
    further write: reconciles converge, and a requeue never repeats an action."""
    policy = with_modes(*modes)
    fleet = ladder.Fleet(pool_nodes=4, pool_admitted=admitted, breaker_open=False)
    facts = node(allocatable=allocatable, unschedulable=unschedulable)
    plugins = [device_plugin(ready=plugin_ready)]
    record = seen(age, GAP, "devicePlugin", "capacityVanished")
    first = ladder.plan_node(facts, plugins, policy, fleet, NOW, record)
    written = applied(facts, first)
    second = ladder.plan_node(written, plugins, policy, fleet, NOW)
    assert [s for s in second.steps if s.effect == "do"] == []
    assert (second.condition, second.tainted, second.unschedulable) == (
        written.condition,
        written.tainted,
        written.unschedulable,
    )
    if "enforce" not in modes:
        assert (written.condition, written.tainted, written.unschedulable) == (None, False, unschedulable)


# --- pods --------------------------------------------------------------------------------------------


def test_a_pod_on_an_unhealthy_device_is_evicted_and_its_neighbour_is_not() -> None:
    broken = pod(devices=[("GPU-1", "Unhealthy")])
    verdict = podverdicts.pod_verdict(broken, ENFORCE, NOW)
    assert verdict.evict and verdict.reason == "DeviceUnhealthy" and "GPU-1" in verdict.message
    assert not podverdicts.pod_verdict(
        pod(name="neighbour", devices=[("GPU-2", "Healthy")]), ENFORCE, NOW
    ).evict


def test_a_claim_device_counts_for_the_pod_that_holds_the_claim() -> None:
    claimed = pod(
        gpus=0, claims=["gpu"], devices=[("claim:gpu/req-0 gpu.nvidia.com/pool/gpu-0", "Unhealthy")]
    )
    assert podverdicts.pod_verdict(claimed, ENFORCE, NOW).evict


@pytest.mark.parametrize(
    "facts",
    [
        pytest.param(pod(devices=[("GPU-1", "Unhealthy")], phase="Failed"), id="terminal"),
        pytest.param(pod(devices=[("GPU-1", "Unhealthy")], deleting=True), id="already-deleting"),
        # Between an eviction's DisruptionTarget condition and its deletion: evicting again would only
        # delete the pod a second time (and count a second eviction).
        pytest.param(pod(devices=[("GPU-1", "Unhealthy")], disrupted=True), id="already-disrupted"),
        pytest.param(pod(devices=[("GPU-1", "Unhealthy")], owner="DaemonSet"), id="daemonset"),
        pytest.param(pod(devices=[("example.com/fpga F-1", "Unhealthy")]), id="resource-not-held"),
    ],
)
def test_pods_that_are_not_evicted(facts: observed.PodFacts) -> None:
    assert not podverdicts.pod_verdict(facts, ENFORCE, NOW).evict


def test_a_drained_node_evicts_its_accelerator_pods() -> None:
    assert podverdicts.pod_verdict(pod(), ENFORCE, NOW, draining=True).reason == "NodeDrain"
    assert not podverdicts.pod_verdict(pod(gpus=0, owner="DaemonSet"), ENFORCE, NOW, draining=True).evict


def test_refused_evictions_back_off_to_the_maximum() -> None:
    delays = [podverdicts.eviction_retry_seconds(ENFORCE, attempt) for attempt in range(1, 7)]
    assert delays == [5, 10, 20, 40, 60, 60]


# --- fleet: budget and breaker -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "pool", "expected"),
    [("20%", 3, 1), ("20%", 10, 2), ("25%", 4, 1), ("0%", 10, 0), (2, 100, 2), ("100%", 7, 7)],
)
def test_the_budget_rounds_a_share_up(value: int | str, pool: int, expected: int) -> None:
    assert ladder.budget(enforcing(budget={"maxUnhealthy": value}), pool) == expected


def test_the_breaker_trips_on_more_nodes_due_within_its_window_than_allowed() -> None:
    policy = enforcing(circuitBreaker={"maxNodes": 2, "windowSeconds": 600})
    recent = [later(-10), later(-20), later(-30)]
    assert ladder.breaker_trips(recent, 4, policy, NOW)
    assert not ladder.breaker_trips(recent[:2], 4, policy, NOW)
    assert not ladder.breaker_trips([*recent[:2], later(-601)], 4, policy, NOW)
    # Nodes that were due before an operator closed the breaker do not trip it again.
    assert not ladder.breaker_trips(recent, 4, policy, NOW, closed_at=later(-15))


# --- the health: section of the policy ---------------------------------------------------------------


def test_the_default_health_policy_is_audit_everywhere() -> None:
    policy = make_policy()
    assert {policy.health_mode(action) for action in ("condition", "taint", "evict", "drain")} == {"audit"}
    assert policy.health_mode("evict", "kube-system") == "off"  # infrastructure pods are never evicted


def test_health_modes_resolve_from_namespace_to_action_to_section() -> None:
    policy = make_policy(
        {
            "mode": "audit",
            "health": {"mode": "warn", "actions": {"taint": {"mode": "enforce"}}},
            "namespaces": [
                {"names": ["ml"], "mode": "enforce", "health": "enforce"},
                {"names": ["web"], "mode": "enforce"},
            ],
        }
    )
    assert policy.health_mode("taint") == "enforce"
    assert policy.health_mode("condition") == "warn"
    assert policy.health_mode("evict", "ml") == "enforce"
    # A namespace's admission mode never turns evictions on.
    assert policy.health_mode("evict", "web") == "warn"


@pytest.mark.parametrize("switch", [{"enabled": False}, {"health": {"enabled": False, "mode": "enforce"}}])
def test_either_kill_switch_turns_every_action_off(switch: dict[str, Any]) -> None:
    policy = make_policy({"health": {"mode": "enforce"}, **switch} if "enabled" in switch else switch)
    assert {policy.health_mode(action, "ml") for action in ("condition", "taint", "evict", "drain")} == {
        "off"
    }


@pytest.mark.parametrize(
    ("health_section", "field"),
    [
        pytest.param(
            {"budget": {"maxUnhealthy": "120%"}}, "health.budget.maxUnhealthy", id="percent-too-big"
        ),
        pytest.param({"circuitBreaker": {"maxNodes": -1}}, "health.circuitBreaker.maxNodes", id="negative"),
        pytest.param(
            {"actions": {"drain": {"threshold": 0}}}, "health.actions.drain.threshold", id="threshold"
        ),
        pytest.param({"actions": {"reboot": {}}}, "health.actions.reboot", id="unknown-action"),
        pytest.param(
            {"eviction": {"retrySeconds": 30, "maxRetrySeconds": 10}}, "health.eviction", id="retry-order"
        ),
        pytest.param(
            {"signals": {"nodeConditions": [{"type": "A", "status": "False", "forSeconds": 1}] * 2}},
            "health.signals",
            id="duplicate-condition",
        ),
        pytest.param({"mode": "loud"}, "health.mode", id="mode"),
        pytest.param(
            {"signals": {"podDeviceHealth": {"unknownForSeconds": -1}}},
            "health.signals.podDeviceHealth.unknownForSeconds",
            id="negative-unknown-wait",
        ),
    ],
)
def test_an_invalid_health_section_is_refused_naming_the_field(health_section: JSON, field: str) -> None:
    with pytest.raises(PolicyError, match=field.replace(".", r"\.")):
        make_policy({"health": health_section})


def test_unquoted_yaml_booleans_mean_what_the_user_wrote() -> None:
    policy = parse_policy(
        "health:\n  mode: off\n  signals:\n    nodeConditions:\n    - {type: X, status: False, forSeconds: 5}\n"
    )
    assert policy.health.mode == "off"
    assert policy.health.signals.nodeConditions[0].status == "False"
