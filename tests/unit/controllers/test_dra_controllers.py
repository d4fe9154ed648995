"""The node health controller on DRA nodes, wired as the manager wires it: ResourceSlices and claims
from their informers joined to the Node, in whichever order they arrive."""

from __future__ import annotations

from typing import Any

from tests.harness.manifests import make_policy
from tests.harness.wired import Wired
from tests.unit.policy.test_health import raw_node, raw_pod
from tests.unit.policy.test_health_dra import DRIVER, raw_claim, raw_slice, tainted
from webhook.policy.health import fences, observed

ENFORCE = make_policy(
    {
        "health": {
            "mode": "enforce",
            "signals": {
                "deviceTaints": {"keys": [], "forSeconds": 0},
                "claimDeviceConditions": [{"type": "Healthy", "status": "False", "forSeconds": 0}],
            },
        }
    }
)


def dra_node(name: str = "gpu-1") -> dict[str, object]:
    """A Node with no extended resource and no accelerator label: only its slices say it has GPUs."""
    return raw_node(name, capacity=None, allocatable=None, labels={"karpenter.sh/nodepool": "h100"})


def test_a_driver_taint_in_a_slice_marks_its_node_which_counts_in_its_pool() -> None:
    wired = Wired(ENFORCE, [dra_node()], slices=[raw_slice(taints=tainted(3))])
    assert wired.ledger.pool_size("h100") == 1
    wired.node_health.reconcile("gpu-1")
    (kind, status), (node_kind, _) = wired.writes.calls
    (condition,) = status["status"]["conditions"]
    assert (kind, node_kind, condition["status"]) == ("status", "node", "False")
    assert f"{DRIVER}: 1 of 8 devices tainted by their driver: {DRIVER}/gpu-1/gpu-3" in condition["message"]


def test_a_slice_that_arrives_after_its_node_brings_the_node_into_its_pool_and_back_to_the_queue() -> None:
    wired = Wired(ENFORCE, [dra_node()])
    assert wired.ledger.pool_size("h100") == 0
    queue = wired.node_health.controller.queue
    assert queue.get(timeout=0) == "gpu-1"  # the node's first sighting
    queue.done("gpu-1")
    assert queue.get(timeout=0) is None
    wired.list_slices(raw_slice(taints=tainted(3)))
    assert wired.ledger.pool_size("h100") == 1
    assert queue.get(timeout=0) == "gpu-1"
    wired.list_slices()
    assert wired.ledger.pool_size("h100") == 0


def test_a_claim_condition_reaches_the_node_publishing_its_device() -> None:
    condition = {"type": "Healthy", "status": "False", "reason": "XID79"}
    wired = Wired(ENFORCE, [dra_node()], slices=[raw_slice()], claims=[raw_claim(conditions=[condition])])
    wired.node_health.reconcile("gpu-1")
    (_, status), _ = wired.writes.calls
    assert f"{DRIVER}/gpu-1/gpu-3 (XID79)" in status["status"]["conditions"][0]["message"]
    assert status["status"]["conditions"][0]["type"] == observed.CONDITION_TYPE


GPU_3 = f"{DRIVER}/gpu-1/gpu-3"


def own_rule(effect: str, *, device: str = GPU_3, version: str = "5") -> dict[str, Any]:
    driver, pool, name = device.split("/")
    rule = fences.rule_object(fences.DeviceFence(driver, pool, name, "None"), "gpu-1", "uid-gpu-1")
    rule["spec"]["taint"]["effect"] = effect
    rule["metadata"]["resourceVersion"] = version
    return rule


def test_a_failed_device_gets_its_own_rule_owned_by_its_node_and_the_node_no_taint() -> None:
    wired = Wired(ENFORCE, [dra_node()], slices=[raw_slice(taints=tainted(3))])
    wired.node_health.reconcile("gpu-1")
    ((verb, body),) = wired.rules.calls
    assert verb == "create" and body["metadata"]["name"] == fences.rule_name(GPU_3)
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "gpu-1", "uid": "uid-gpu-1"}
    ]
    assert body["spec"] == {
        "deviceSelector": {"driver": DRIVER, "pool": "gpu-1", "device": "gpu-3"},
        "taint": {"key": observed.TAINT_KEY, "effect": "NoSchedule"},
    }
    (_, node_patch) = wired.writes.calls[-1]
    assert "taints" not in node_patch.get("spec", {})
    assert "NodeTainted" in wired.reasons()
    (note,) = [event["note"] for event in wired.sent if event["reason"] == "NodeTainted"]
    assert note.startswith(f"DeviceTaintRule {observed.TAINT_KEY}:NoSchedule on {GPU_3}: ")


def test_a_dry_run_rule_gets_its_effect_at_the_version_read_and_goes_once_the_device_recovers() -> None:
    wired = Wired(ENFORCE, [dra_node()], slices=[raw_slice(taints=tainted(3))], rules=[own_rule("None")])
    wired.node_health.reconcile("gpu-1")
    assert wired.rules.calls == [("patch", (fences.rule_name(GPU_3), "5", "NoSchedule"))]
    wired.list_slices(raw_slice(generation=2))
    wired.rules.calls.clear()
    wired.node_health.reconcile("gpu-1")
    assert wired.rules.calls == [("delete", (fences.rule_name(GPU_3), "5"))]


def test_rules_gpuguard_did_not_create_are_never_read() -> None:
    theirs = own_rule("NoExecute")
    del theirs["metadata"]["labels"]
    renamed = own_rule("NoExecute")
    renamed["metadata"]["name"] = "admin-gpu-3"
    assert fences.own_rule(theirs) is None and fences.own_rule(renamed) is None
    wired = Wired(ENFORCE, [dra_node()], slices=[raw_slice()], rules=[theirs, renamed])
    wired.node_health.reconcile("gpu-1")
    assert wired.rules.calls == []


def test_the_pods_of_a_fenced_device_are_evicted_through_the_eviction_api_and_their_neighbours_not() -> None:
    trainer = raw_pod("trainer", gpus=0, claims=["gpu"])
    neighbour = raw_pod("neighbour", gpus=0, claims=["gpu"])
    claims = [raw_claim("trainer-gpu"), raw_claim("neighbour-gpu", device="gpu-4", pod="neighbour")]
    wired = Wired(
        ENFORCE,
        [dra_node()],
        [trainer, neighbour],
        slices=[raw_slice(taints=tainted(3))],
        claims=claims,
        rules=[own_rule("NoSchedule")],
    )
    for key in ("ml/trainer", "ml/neighbour"):
        wired.pod_health.reconcile(key)
    assert wired.evictions.sent == [("ml", "trainer")]


def test_pods_of_a_no_execute_fence_are_left_to_the_device_taint_eviction_controller() -> None:
    policy = make_policy(
        {
            "health": {
                "mode": "enforce",
                "dra": {"evict": "deviceTaint"},
                "signals": {"deviceTaints": {"keys": [], "forSeconds": 0}},
            }
        }
    )
    wired = Wired(
        policy,
        [dra_node()],
        [raw_pod("trainer", gpus=0, claims=["gpu"])],
        slices=[raw_slice(taints=tainted(3))],
        claims=[raw_claim("trainer-gpu")],
        rules=[own_rule("NoExecute")],
    )
    wired.pod_health.reconcile("ml/trainer")
    wired.node_health.reconcile("gpu-1")
    assert wired.evictions.sent == [] and wired.rules.calls == []


def budget(name: str = "trainer", labels: dict[str, str] | None = None) -> dict[str, Any]:
    selector = {"matchLabels": labels or {"app": "trainer"}}
    return {"metadata": {"name": name, "namespace": "ml"}, "spec": {"minAvailable": 1, "selector": selector}}


def test_by_default_the_device_of_a_pod_with_a_budget_is_fenced_no_schedule_and_one_without_no_execute() -> (
    None
):
    trainer = raw_pod("trainer", gpus=0, claims=["gpu"], labels={"app": "trainer"})
    loner = raw_pod("loner", gpus=0, claims=["gpu"], labels={"app": "loner"})
    claims = [raw_claim("trainer-gpu"), raw_claim("loner-gpu", device="gpu-4", pod="loner")]
    wired = Wired(
        ENFORCE,
        [dra_node()],
        [trainer, loner],
        slices=[raw_slice(taints=tainted(3, 4))],
        claims=claims,
        budgets=[budget()],
    )
    wired.node_health.reconcile("gpu-1")
    created = {body["metadata"]["name"]: body["spec"]["taint"]["effect"] for _, body in wired.rules.calls}
    gpu_4 = f"{DRIVER}/gpu-1/gpu-4"
    assert created == {fences.rule_name(GPU_3): "NoSchedule", fences.rule_name(gpu_4): "NoExecute"}


def test_a_budget_that_comes_makes_the_rule_no_schedule() -> None:
    trainer = raw_pod("trainer", gpus=0, claims=["gpu"], labels={"app": "trainer"})
    wired = Wired(
        ENFORCE,
        [dra_node()],
        [trainer],
        slices=[raw_slice(taints=tainted(3))],
        claims=[raw_claim("trainer-gpu")],
        rules=[own_rule("NoExecute")],
    )
    wired.node_health.reconcile("gpu-1")
    wired.pod_health.reconcile("ml/trainer")
    assert wired.rules.calls == [] and wired.evictions.sent == []  # the device-taint-eviction controller's

    queue = wired.node_health.controller.queue
    while (key := queue.get(timeout=0)) is not None:
        queue.done(key)
    wired.list_budgets(budget())
    assert queue.get(timeout=0) == "gpu-1"  # the fenced node is looked at again
    wired.node_health.reconcile("gpu-1")
    assert wired.rules.calls == [("patch", (fences.rule_name(GPU_3), "5", "NoSchedule"))]


def test_a_pod_not_in_the_cache_yet_is_taken_to_have_a_budget() -> None:
    wired = Wired(
        ENFORCE,
        [dra_node()],
        slices=[raw_slice(taints=tainted(3))],
        claims=[raw_claim("trainer-gpu")],
    )
    wired.node_health.reconcile("gpu-1")
    ((_, body),) = wired.rules.calls
    assert body["spec"]["taint"]["effect"] == "NoSchedule"
