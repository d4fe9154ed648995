"""webhook.policy.health on DRA nodes: devices in ResourceSlices (their taints, their count per pool
generation) and the conditions drivers write on claims, feeding the same ladder as extended resources."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from tests.harness.manifests import make_policy
from tests.unit.policy.test_health import FREE, NOW, actions, applied, enforcing, later, node, pod
from webhook.cli import nodes
from webhook.controllers.breaker import BreakerState
from webhook.controllers.status import Row
from webhook.policy.health import fences, ladder, observed, podverdicts, records, signals

JSON = dict[str, Any]
DRIVER = "gpu.example.com"
ENFORCE = enforcing(signals={"deviceTaints": {"keys": [], "forSeconds": 60}})
XID = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
GPU_3 = f"{DRIVER}/gpu-1/gpu-3"


def raw_slice(
    name: str = "gpu-1-gpu.example.com-a",
    *,
    node_name: str | None = "gpu-1",
    driver: str = DRIVER,
    pool: str = "gpu-1",
    generation: int = 1,
    slice_count: int = 1,
    devices: int = 8,
    taints: Mapping[int, Sequence[JSON]] | None = None,
    first: int = 0,
) -> JSON:
    spec: JSON = {
        "driver": driver,
        "pool": {"name": pool, "generation": generation, "resourceSliceCount": slice_count},
        "devices": [
            {"name": f"gpu-{i}", **({"taints": list(taints[i])} if taints and i in taints else {})}
            for i in range(first, first + devices)
        ],
    }
    if node_name is not None:
        spec["nodeName"] = node_name
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": spec,
    }


def sliced(**kwargs: Any) -> observed.SliceFacts:
    facts = observed.slice_facts(raw_slice(**kwargs))
    assert facts is not None
    return facts


def raw_claim(
    name: str = "trainer-gpu", *, device: str = "gpu-3", pod: str = "trainer", conditions: Sequence[JSON] = ()
) -> JSON:
    status: JSON = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": "gpu-1", "device": device}]}
        },
        "reservedFor": [{"resource": "pods", "name": pod, "uid": f"uid-{pod}"}],
    }
    if conditions:
        status["devices"] = [
            {"driver": DRIVER, "pool": "gpu-1", "device": device, "conditions": list(conditions)}
        ]
    return {"metadata": {"name": name, "namespace": "ml", "uid": "c1"}, "status": status}


def claimed(**kwargs: Any) -> observed.ClaimFacts:
    facts = observed.claim_facts(raw_claim(**kwargs))
    assert facts is not None
    return facts


def dra_node(
    *slices: observed.SliceFacts, claims: Sequence[observed.ClaimFacts] = (), **kwargs: Any
) -> observed.NodeFacts:
    """A node with no extended resource and no accelerator label: only its slices say it has GPUs."""
    bare = node(capacity=None, allocatable=None, **kwargs)
    return observed.with_devices(bare, observed.node_devices(slices or [sliced()], claims))


def tainted(*indexes: int, taint: JSON = XID) -> dict[int, list[JSON]]:
    return {i: [taint] for i in indexes}


# --- facts -------------------------------------------------------------------------------------------


def test_a_slice_of_no_single_node_is_not_kept() -> None:
    assert observed.slice_facts(raw_slice(node_name=None)) is None
    facts = sliced(taints=tainted(2))
    assert [d.id for d in facts.devices][:3] == [f"{DRIVER}/gpu-1/gpu-{i}" for i in range(3)]
    assert facts.devices[2].taints == (observed.Taint("gpu.nvidia.com/xid", "79", "NoSchedule"),)
    assert facts.devices[2].slice == "gpu-1-gpu.example.com-a"


def test_unallocated_claims_are_not_kept_and_conditions_are_read_per_device() -> None:
    assert observed.claim_facts({"metadata": {"name": "c", "namespace": "ml"}, "status": {}}) is None
    claim = claimed(conditions=[{"type": "Ready", "status": "False", "reason": "XID79"}])
    assert claim.pods == ("trainer",)
    assert claim.conditions == {
        f"{DRIVER}/gpu-1/gpu-3": (observed.DeviceCondition("Ready", "False", "XID79"),)
    }


def test_only_the_newest_generation_of_a_pool_is_published() -> None:
    old = sliced(name="old", generation=1, devices=8)
    new = sliced(name="new", generation=2, devices=7)
    devices = observed.node_devices([old, new])
    assert devices.counts() == {DRIVER: 7} and devices.updating == frozenset()


def test_a_generation_not_yet_published_in_full_leaves_the_count_unknown() -> None:
    old = sliced(name="old", generation=1, devices=8)
    half = sliced(name="new-a", generation=2, slice_count=2, devices=4)
    devices = observed.node_devices([old, half])
    assert devices.counts() == {} and devices.updating == {DRIVER}
    other_half = sliced(name="new-b", generation=2, slice_count=2, devices=4, first=4)
    assert observed.node_devices([old, half, other_half]).counts() == {DRIVER: 8}


# --- driver taints -----------------------------------------------------------------------------------


def test_a_driver_taint_fails_its_device_after_for_seconds() -> None:
    facts = dra_node(sliced(taints=tainted(3)))
    assert signals.in_health_scope(facts, ENFORCE)
    first = ladder.plan_node(facts, [], ENFORCE, FREE, NOW)
    assert first.assessment.state == "suspect" and first.steps == ()
    (signal,) = first.assessment.signals
    assert signal.key == f"deviceTaint/{DRIVER}" and signal.devices == 1
    assert f"{DRIVER}/gpu-1/gpu-3 (gpu.nvidia.com/xid=79:NoSchedule, ResourceSlice" in signal.message
    due = ladder.plan_node(applied(facts, first), [], ENFORCE, FREE, later(60))
    assert actions(due) == [("condition", "do"), ("taint", "do")]
    assert due.assessment.devices == {DRIVER: (7, 8)}
    assert due.assessment.failed_share == 1 / 8
    # The device is fenced alone: the node takes no taint.
    assert not due.tainted
    assert due.fences == {GPU_3: fences.DeviceFence(DRIVER, "gpu-1", "gpu-3", "NoSchedule")}
    assert due.steps[1].note.startswith(f"DeviceTaintRule {observed.TAINT_KEY}:NoSchedule on {GPU_3}: ")


def test_none_effect_unknown_effects_and_gpuguards_own_key_fail_nothing() -> None:
    informational = [
        {"key": "gpu.nvidia.com/xid", "value": "13", "effect": "None"},
        {"key": "gpu.nvidia.com/unmonitored", "effect": "None"},
        {"key": "example.com/future", "effect": "NoExecuteWithPodDisruptionBudget"},
        {"key": observed.TAINT_KEY, "effect": "NoExecute"},
    ]
    facts = dra_node(sliced(taints={0: informational}))
    assessment = signals.assess(facts, [], ENFORCE, later(3600))
    assert assessment.signals == () and assessment.state == "healthy"
    assert assessment.devices == {DRIVER: (8, 8)}


def test_the_policy_may_name_the_taint_keys_that_fail_a_device() -> None:
    policy = enforcing(signals={"deviceTaints": {"keys": ["gpu.nvidia.com/gpu-lost"], "forSeconds": 0}})
    xid = dra_node(sliced(taints=tainted(1)))
    assert signals.assess(xid, [], policy, NOW).signals == ()
    lost = dra_node(
        sliced(taints=tainted(1, taint={"key": "gpu.nvidia.com/gpu-lost", "effect": "NoExecute"}))
    )
    assert [s.kind for s in signals.assess(lost, [], policy, NOW).signals] == ["deviceTaint"]


def test_every_device_tainted_reaches_the_drain_threshold() -> None:
    facts = dra_node(sliced(taints=tainted(*range(8))))
    policy = enforcing(signals={"deviceTaints": {"keys": [], "forSeconds": 0}})
    plan = ladder.plan_node(facts, [], policy, FREE, NOW)
    assert plan.assessment.failed_share == 1.0
    assert ("drain", "do") in actions(plan) and plan.unschedulable


def test_devices_of_drivers_that_are_no_accelerators_are_not_watched() -> None:
    nic = dra_node(sliced(driver="rdma.example.com", taints=tainted(0)))
    assert not signals.in_health_scope(nic, ENFORCE)
    plan = ladder.plan_node(nic, [], ENFORCE, FREE, later(3600))
    assert plan.assessment.signals == () and plan.record is None


# --- devices that left their pool --------------------------------------------------------------------


def test_a_device_that_left_its_pool_is_missing_and_goes_on_from_its_taint() -> None:
    """The driver taints a lost GPU, then publishes a new pool generation without it (as a device
    plugin's 8/7 becomes 7/7): the same failure, timed from the taint's first sighting."""
    eight = dra_node(sliced(generation=1, devices=8, taints=tainted(3)))
    first = ladder.plan_node(eight, [], ENFORCE, FREE, NOW)
    assert first.record is not None and first.record.expected == {DRIVER: 8}
    republished = observed.node_devices([sliced(generation=2, devices=7)])
    seven = observed.with_devices(applied(eight, first), republished)
    plan = ladder.plan_node(seven, [], ENFORCE, FREE, later(300), first.record)
    (signal,) = plan.assessment.signals
    assert signal.kind == "deviceMissing" and signal.devices == 1 and signal.since == NOW
    assert signal.message == f"{DRIVER}: 1 of 8 expected devices missing (7 in its ResourceSlices)"
    assert actions(plan) == [("condition", "do"), ("taint", "do")]


def test_a_pool_being_republished_or_gone_keeps_the_expected_count_and_says_nothing() -> None:
    record = records.NodeRecord(unhealthy_since=later(-60), admitted_at=later(-60), expected={DRIVER: 8})
    half = dra_node(sliced(name="a", generation=2, slice_count=2, devices=4))
    plan = ladder.plan_node(half, [], ENFORCE, FREE, NOW, record)
    assert plan.assessment.signals == ()
    assert signals.missing_devices(half, record, ENFORCE) == {}
    assert plan.record is not None and plan.record.expected == {DRIVER: 8}
    gone = observed.with_devices(node(capacity=None, allocatable=None), observed.NO_DRA_DEVICES)
    assert signals.missing_devices(gone, record, ENFORCE) == {}


def test_expected_devices_may_name_a_driver() -> None:
    policy = enforcing(
        expectedDevices=[{"selector": {"matchLabels": {"pool": "h100"}}, "resources": {DRIVER: 8}}]
    )
    facts = dra_node(sliced(devices=6), labels={"pool": "h100"})
    assert signals.missing_devices(facts, records.NodeRecord(), policy) == {DRIVER: (6, 8)}


# --- claims ------------------------------------------------------------------------------------------


def test_claim_device_conditions_are_read_and_acted_on_only_when_the_policy_names_them() -> None:
    claim = claimed(conditions=[{"type": "Healthy", "status": "False", "reason": "XID79", "message": "lost"}])
    facts = dra_node(sliced(), claims=[claim])
    (device,) = [d for d in facts.dra.devices if d.conditions]
    assert device.name == "gpu-3"
    assert signals.assess(facts, [], ENFORCE, later(3600)).signals == ()
    policy = enforcing(
        signals={"claimDeviceConditions": [{"type": "Healthy", "status": "False", "forSeconds": 0}]}
    )
    (signal,) = signals.assess(facts, [], policy, NOW).signals
    assert signal.key == f"deviceCondition/Healthy/{DRIVER}" and signal.devices == 1
    assert f"{DRIVER}/gpu-1/gpu-3 (XID79: lost)" in signal.message


def test_a_claim_device_reported_unhealthy_counts_for_its_drivers_share() -> None:
    device_id = f"{DRIVER}/gpu-1/gpu-3"
    holder = pod(gpus=0, claims=["gpu"], devices=[(f"claim:gpu/gpu {device_id}", "Unhealthy")])
    facts = dra_node(sliced(devices=2))
    plan = ladder.plan_node(facts, [holder], ENFORCE, FREE, NOW)
    (signal,) = plan.assessment.signals
    assert signal.key == "podDevice/claim:gpu/gpu" and signal.resource == DRIVER
    due = signals.assess(applied(facts, plan), [holder], ENFORCE, later(300), plan.record)
    assert due.failed_share == 0.5
    verdict = podverdicts.pod_verdict(holder, ENFORCE, NOW)
    assert verdict.evict and verdict.reason == "DeviceUnhealthy"


# --- fencing one device ------------------------------------------------------------------------------


def fenced(plan: ladder.NodePlan) -> dict[str, str]:
    """What the node's DRA devices carry once the caller wrote the plan's DeviceTaintRules."""
    return {key: fence.effect for key, fence in plan.fences.items()}


def test_audit_fences_with_a_none_rule_and_writes_nothing_else() -> None:
    policy = make_policy({"health": {"signals": {"deviceTaints": {"keys": [], "forSeconds": 0}}}})
    assert policy.health_mode("taint") == "audit"
    plan = ladder.plan_node(dra_node(sliced(taints=tainted(3))), [], policy, FREE, NOW)
    assert fenced(plan) == {GPU_3: "None"}
    assert ("taint", "would") in actions(plan) and not plan.tainted


def test_evictions_by_the_device_taint_controller_make_the_rule_no_execute() -> None:
    policy = enforcing(signals={"deviceTaints": {"keys": [], "forSeconds": 0}}, dra={"evict": "deviceTaint"})
    plan = ladder.plan_node(dra_node(sliced(taints=tainted(3))), [], policy, FREE, NOW)
    assert fenced(plan) == {GPU_3: "NoExecute"}
    audit_evictions = enforcing(
        signals={"deviceTaints": {"keys": [], "forSeconds": 0}},
        dra={"evict": "deviceTaint"},
        actions={"evict": {"mode": "audit"}},
    )
    assert fenced(ladder.plan_node(dra_node(sliced(taints=tainted(3))), [], audit_evictions, FREE, NOW)) == {
        GPU_3: "NoSchedule"
    }


# --- who evicts the pods of a fenced device: health.dra.evict ------------------------------------------

TAINTS_NOW = {"deviceTaints": {"keys": [], "forSeconds": 0}}
BUDGETED = observed.DeviceUser("ml", budgeted=True)
UNBUDGETED = observed.DeviceUser("ml", budgeted=False)


def test_by_default_a_pod_a_disruption_budget_selects_is_left_to_the_eviction_api() -> None:
    policy = enforcing(signals=TAINTS_NOW)
    assert policy.health.dra.evict == "auto"
    assert fences.eviction_path(policy, BUDGETED) == "evictionAPI"
    assert fences.eviction_path(policy, UNBUDGETED) == "deviceTaint"
    assert fences.fence_effect(policy, [UNBUDGETED]) == "NoExecute"
    # One pod with a budget on the device keeps its rule NoSchedule: NoExecute would delete it too.
    assert fences.fence_effect(policy, [UNBUDGETED, BUDGETED]) == "NoSchedule"
    # No pod known to use it: one not seen yet may have a budget.
    assert fences.fence_effect(policy) == "NoSchedule"


def test_the_choice_is_the_policys_outright_and_per_namespace() -> None:
    policy = enforcing(
        signals=TAINTS_NOW,
        dra={"evict": "evictionAPI"},
    )
    assert fences.fence_effect(policy, [UNBUDGETED]) == "NoSchedule"
    per_namespace = make_policy(
        {
            "health": {"mode": "enforce", "signals": TAINTS_NOW, "dra": {"evict": "evictionAPI"}},
            "namespaces": [
                {"names": ["batch"], "draEvict": "deviceTaint"},
                {"selector": {"matchLabels": {"team": "serving"}}, "draEvict": "auto"},
            ],
        }
    )
    batch = observed.DeviceUser("batch", budgeted=True)
    assert fences.eviction_path(per_namespace, batch) == "deviceTaint"  # even with a budget
    assert fences.fence_effect(per_namespace, [batch]) == "NoExecute"
    assert fences.eviction_path(per_namespace, UNBUDGETED) == "evictionAPI"
    serving = observed.DeviceUser("web", budgeted=False, namespace_labels={"team": "serving"})
    assert fences.eviction_path(per_namespace, serving) == "deviceTaint"
    assert fences.eviction_path(per_namespace, dataclasses.replace(serving, budgeted=True)) == "evictionAPI"
    # The device-taint-eviction controller deletes: never where that namespace's evictions are not enforced.
    audited = make_policy(
        {
            "health": {"mode": "enforce", "signals": TAINTS_NOW, "dra": {"evict": "deviceTaint"}},
            "namespaces": [{"names": ["ml"], "health": "audit"}],
        }
    )
    assert fences.fence_effect(audited, [UNBUDGETED]) == "NoSchedule"
    assert fences.fence_effect(audited, [observed.DeviceUser("other", budgeted=False)]) == "NoExecute"
    with pytest.raises(ValueError, match="draEvict"):
        make_policy({"namespaces": [{"names": ["ml"], "draEvict": "delete"}]})


def test_each_failed_device_gets_the_effect_its_own_pods_call_for() -> None:
    users = {GPU_3: (BUDGETED,), f"{DRIVER}/gpu-1/gpu-4": (UNBUDGETED,)}
    facts = dra_node(sliced(taints=tainted(3, 4)))
    facts = observed.with_devices(facts, dataclasses.replace(facts.dra, users=users))
    plan = ladder.plan_node(facts, [], enforcing(signals=TAINTS_NOW), FREE, NOW)
    assert fenced(plan) == {GPU_3: "NoSchedule", f"{DRIVER}/gpu-1/gpu-4": "NoExecute"}
    (step,) = [step for step in plan.steps if step.action == "taint"]
    assert step.note.startswith(
        f"DeviceTaintRule {observed.TAINT_KEY}:NoSchedule on {GPU_3}; "
        f"{observed.TAINT_KEY}:NoExecute on {DRIVER}/gpu-1/gpu-4: "
    )


def test_a_disruption_budget_selects_by_labels_and_expressions_and_a_null_selector_selects_nothing() -> None:
    def budget(selector: JSON | None) -> observed.BudgetFacts | None:
        spec = {"maxUnavailable": 0} | ({"selector": selector} if selector is not None else {})
        return observed.budget_facts({"metadata": {"namespace": "ml", "name": "b"}, "spec": spec})

    assert budget(None) is None
    everything = budget({})
    assert everything is not None and everything.selects({}) and everything.key == "ml/b"
    chosen = budget(
        {
            "matchLabels": {"app": "trainer"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["gold", "silver"]},
                {"key": "canary", "operator": "DoesNotExist"},
            ],
        }
    )
    assert chosen is not None
    assert chosen.selects({"app": "trainer", "tier": "gold"})
    assert not chosen.selects({"app": "trainer", "tier": "bronze"})
    assert not chosen.selects({"app": "trainer", "tier": "gold", "canary": "yes"})
    assert not chosen.selects({"tier": "gold"})


def test_a_node_held_by_the_budget_gets_a_none_rule() -> None:
    policy = enforcing(signals={"deviceTaints": {"keys": [], "forSeconds": 0}}, budget={"maxUnhealthy": 1})
    full = ladder.Fleet(pool_nodes=10, pool_admitted=1, breaker_open=False)
    plan = ladder.plan_node(dra_node(sliced(taints=tainted(3))), [], policy, full, NOW)
    assert plan.held and fenced(plan) == {GPU_3: "None"}


def test_the_rule_goes_once_the_device_is_no_longer_failed() -> None:
    policy = enforcing(signals={"deviceTaints": {"keys": [], "forSeconds": 0}})
    facts = dra_node(sliced(taints=tainted(3)))
    plan = ladder.plan_node(facts, [], policy, FREE, NOW)
    rules = observed.NodeDevices(facts.dra.devices, fenced=fenced(plan))
    again = ladder.plan_node(observed.with_devices(applied(facts, plan), rules), [], policy, FREE, later(1))
    assert fenced(again) == fenced(plan) and actions(again) == []  # written already: no step again
    cleared = observed.NodeDevices(observed.node_devices([sliced(generation=2)]).devices, fenced=fenced(plan))
    recovering = ladder.plan_node(
        observed.with_devices(applied(facts, plan), cleared), [], policy, FREE, later(2), plan.record
    )
    assert recovering.assessment.state == "recovering" and recovering.fences == {}


def test_a_failure_no_rule_can_fence_taints_the_node() -> None:
    """A device that left its pool cannot be selected by a rule: the node is tainted, and the device
    still published and failed is fenced beside it."""
    record = records.NodeRecord(expected={DRIVER: 8})
    facts = dra_node(sliced(devices=7, taints=tainted(3)))
    plan = ladder.plan_node(facts, [], ENFORCE, FREE, later(300), replace_signals(record, 300))
    assert {s.kind for s in plan.assessment.due(later(300))} == {"deviceMissing", "deviceTaint"}
    assert plan.tainted and fenced(plan) == {GPU_3: "NoSchedule"}


def replace_signals(record: records.NodeRecord, seconds_ago: float) -> records.NodeRecord:
    return dataclasses.replace(
        record,
        signals={
            f"deviceMissing/{DRIVER}": later(-seconds_ago),
            f"deviceTaint/{DRIVER}": later(-seconds_ago),
        },
    )


def test_a_claim_device_reported_unhealthy_is_fenced() -> None:
    holder = pod(gpus=0, claims=["gpu"], devices=[(f"claim:gpu/gpu {GPU_3}", "Unhealthy")])
    policy = enforcing(signals={"deviceGap": {"forSeconds": 0}})
    plan = ladder.plan_node(dra_node(sliced()), [holder], policy, FREE, NOW)
    assert fenced(plan) == {GPU_3: "NoSchedule"} and not plan.tainted


def test_gpuguard_nodes_shows_dra_devices_beside_extended_resources_and_explains_them() -> None:
    informational = {"key": "gpu.nvidia.com/unmonitored", "effect": "None"}
    claim = claimed(device="gpu-5", conditions=[{"type": "Ready", "status": "True", "reason": "Prepared"}])
    facts = dra_node(sliced(taints={3: [XID], 4: [informational]}), claims=[claim])
    plan = ladder.plan_node(
        facts, [], ENFORCE, FREE, later(60), records.NodeRecord(signals={f"deviceTaint/{DRIVER}": NOW})
    )
    closed = BreakerState(False, None, "", None, "")
    table = nodes.health_table([Row(facts, plan)], closed, later(60))
    assert f"{DRIVER}=7/8" in table
    explained = nodes.explain(Row(facts, plan), ENFORCE, closed, later(60))
    assert (
        f"  {GPU_3}: taint gpu.nvidia.com/xid=79:NoSchedule (ResourceSlice gpu-1-gpu.example.com-a); "
        in explained
    )
    assert f"DeviceTaintRule {fences.rule_name(GPU_3)}: none, wanted NoSchedule" in explained
    assert f"  {DRIVER}/gpu-1/gpu-4: taint gpu.nvidia.com/unmonitored:None (ResourceSlice" in explained
    assert f"  {DRIVER}/gpu-1/gpu-5: claim condition Ready=True Prepared" in explained


def test_without_device_taint_rules_served_the_node_is_tainted_instead() -> None:
    facts = dra_node(sliced(taints=tainted(3)))
    unfenced = observed.with_devices(facts, dataclasses.replace(facts.dra, fencing=False))
    plan = ladder.plan_node(
        unfenced, [], enforcing(signals={"deviceTaints": {"keys": [], "forSeconds": 0}}), FREE, NOW
    )
    assert plan.tainted and plan.fences == {}
