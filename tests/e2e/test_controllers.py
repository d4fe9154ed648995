"""The node health controller and the pod device-health watcher on the real API server, with the real
kube-controller-manager (Job, disruption, taint-eviction and pod GC controllers) and the test playing
the kubelet (see tests/harness/controllers.py). Each test gets its own nodes, its own policy (on its own
nodes only) and a fresh controllers process."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO_ROOT
from tests.harness.admission import (
    WebhookProcess,
    default_priority_classes,
    gpu_job,
    install_priority_classes,
    register,
    unregister,
    wait_until_called,
)
from tests.harness.controllers import (
    DRA_DRIVER,
    GPU,
    KCM_CONTROLLERS,
    LEASE_SECONDS,
    NAMESPACE,
    ControllersProcess,
    Kubelet,
    Start,
    eventually,
    fast_policy,
    install_rbac,
    own_condition,
    reasons,
    record,
    service_account_kubeconfig,
    start_fixture,
    taints,
)
from tests.harness.controlplane import ControlPlane, without_proxies
from tests.harness.install import CRD_FILE, find, install_crds, render
from webhook.policy.health import fences, observed, signals

TAINT = f"{observed.TAINT_KEY}:NoSchedule"
STATE_CONFIGMAP = "gpuguard-remediation"


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A control plane of its own (the suite's has no controller manager, and its Jobs must stay
    podless), with the controllers' RBAC from deploy/."""
    plane = ControlPlane.start(control_plane.bin_dir, tmp_path_factory.mktemp("controllers-plane"))
    try:
        plane.start_controller_manager(controllers=KCM_CONTROLLERS)
        install_rbac(plane)
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def kubeconfig(cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return service_account_kubeconfig(cluster, tmp_path_factory.mktemp("controllers-sa") / "sa.kubeconfig")


@pytest.fixture
def test_id(request: pytest.FixtureRequest) -> str:
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:30].rstrip("-")
    return f"{stem}-{secrets.token_hex(2)}"


@pytest.fixture
def kubelet(cluster: ControlPlane, test_id: str) -> Iterator[Kubelet]:
    playing = Kubelet(cluster, test_id)
    try:
        yield playing
    finally:
        playing.cleanup()


@pytest.fixture
def ns(cluster: ControlPlane, test_id: str) -> Iterator[str]:
    cluster.kubectl("create", "namespace", test_id)
    yield test_id
    cluster.kubectl("delete", "namespace", test_id, "--wait=false", check=False)


def forget_the_breaker(cluster: ControlPlane) -> None:
    """The breaker's state is fleet-wide: each test starts with none."""
    cluster.kubectl("delete", "configmap", STATE_CONFIGMAP, "-n", NAMESPACE, "--ignore-not-found")


start = start_fixture(forget_the_breaker)


# --- nodes ---------------------------------------------------------------------------------------------


def test_a_persisting_device_gap_gets_the_condition_the_event_and_the_taint_and_is_undone_once_it_clears(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str
) -> None:
    controllers = start(fast_policy(test_id))
    name = kubelet.node(f"{test_id}-a")
    kubelet.devices(name, capacity=8, allocatable=7)

    eventually(lambda: TAINT in taints(cluster, name), what="the taint", processes=[controllers])
    condition = own_condition(cluster, name)
    assert condition is not None
    assert (condition["status"], condition["reason"]) == ("False", "DevicesUnhealthy")
    assert "nvidia.com/gpu: 1 of 8 devices unhealthy" in condition["message"]
    node_record = record(cluster, name)
    assert node_record is not None and f"deviceGap/{GPU}" in node_record["signals"]
    eventually(
        lambda: {"DeviceUnhealthy", "NodeTainted"} <= set(reasons(cluster, kind="Node", name=name)),
        what="the Events",
    )
    assert controllers.metric("gpuguard_remediations_total", action="taint", outcome="done") == 1

    kubelet.devices(name, capacity=8, allocatable=8)
    eventually(lambda: TAINT not in taints(cluster, name), what="the taint removed", processes=[controllers])
    assert own_condition(cluster, name) is None
    assert record(cluster, name) is None
    eventually(lambda: "NodeRecovered" in reasons(cluster, kind="Node", name=name), what="NodeRecovered")


def control_node_tainted(
    cluster: ControlPlane, kubelet: Kubelet, controllers: ControllersProcess, test_id: str
) -> None:
    """A node that fails for real, changed last. One worker takes nodes in order and requeues each at its
    due time, so once this one is tainted, any node changed before it with a signal due no later would
    have been acted on before it."""
    control = kubelet.node(f"{test_id}-control")
    kubelet.devices(control, capacity=8, allocatable=6)
    eventually(
        lambda: TAINT in taints(cluster, control), what="the control node tainted", processes=[controllers]
    )


def assert_unmarked(cluster: ControlPlane, name: str) -> None:
    assert TAINT not in taints(cluster, name), name
    assert own_condition(cluster, name) is None, name


def test_the_plugin_restart_and_kubelet_restart_patterns_get_no_action(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str
) -> None:
    # Long plugin and capacity waits: only a device gap could act within this test, and it must not.
    policy = fast_policy(
        test_id, signals={"devicePlugin": {"notReadyForSeconds": 600, "capacityVanishedForSeconds": 600}}
    )
    controllers = start(policy)
    # The plugin pod restarts: the kubelet marks every device unhealthy until it registers again.
    restarting = kubelet.node(f"{test_id}-plugin")
    kubelet.device_plugin(restarting, ready=False, started_seconds_ago=5)
    kubelet.devices(restarting, capacity=8, allocatable=0)
    # The kubelet restarts: capacity reads 0 until the plugin registers.
    rebooted = kubelet.node(f"{test_id}-kubelet")
    kubelet.devices(rebooted, capacity=0, allocatable=0)
    control_node_tainted(cluster, kubelet, controllers, test_id)
    for name in (restarting, rebooted):
        assert_unmarked(cluster, name)
        assert not any(
            key.startswith("deviceGap") for key in (record(cluster, name) or {}).get("signals", {})
        )
    assert "deviceGap" not in reasons(cluster, kind="Node", name=restarting)

    # The plugin is back: every device healthy, nothing left of the suspicion.
    kubelet.device_plugin(restarting, ready=True, started_seconds_ago=5)
    kubelet.devices(restarting, capacity=8, allocatable=8)
    kubelet.devices(rebooted, capacity=8, allocatable=8)
    eventually(
        lambda: record(cluster, restarting) is None and record(cluster, rebooted) is None,
        what="the suspicions dropped",
        processes=[controllers],
    )


def test_counts_the_api_server_writes_as_1k_and_nodes_without_device_plugin_capacity_get_no_action(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str
) -> None:
    # Every signal that could misfire is due before the control node's gap.
    policy = fast_policy(test_id, signals={"deviceGap": {"forSeconds": 6}})
    controllers = start(policy)
    thousand = kubelet.node(f"{test_id}-1k", capacity=1000, labels={"nvidia.com/gpu.present": "true"})
    stored = cluster.kubectl_json("get", "node", thousand)["status"]
    # The premise: the API server stores a count of 1000 in its canonical form.
    assert (stored["capacity"][GPU], stored["allocatable"][GPU]) == ("1k", "1k")
    # A DRA (or passthrough) node: accelerator labels, no device-plugin resource to vanish.
    dra = kubelet.node(f"{test_id}-dra", capacity=None, labels={"nvidia.com/gpu.present": "true"})
    control_node_tainted(cluster, kubelet, controllers, test_id)
    for name in (thousand, dra):
        assert_unmarked(cluster, name)
        assert record(cluster, name) is None, name
    # 1000 devices, 16 of them failed: counted as such, not as a node with no capacity.
    kubelet.devices(thousand, capacity=1000, allocatable=984)
    eventually(
        lambda: TAINT in taints(cluster, thousand), what="the 1k node tainted", processes=[controllers]
    )
    condition = own_condition(cluster, thousand)
    assert condition is not None and "nvidia.com/gpu: 16 of 1000 devices unhealthy" in condition["message"]


# --- pods ----------------------------------------------------------------------------------------------


def disruption_target(pod: dict[str, Any]) -> dict[str, Any] | None:
    conditions = pod["status"].get("conditions") or []
    return next((c for c in conditions if c["type"] == "DisruptionTarget"), None)


def test_a_pod_on_an_unhealthy_device_is_evicted_and_its_neighbour_on_a_healthy_one_is_not(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str, ns: str
) -> None:
    controllers = start(fast_policy(test_id))
    name = kubelet.node(f"{test_id}-a")
    for pod, device in (("trainer", "GPU-1"), ("neighbour", "GPU-2")):
        kubelet.gpu_pod(pod, ns, name)
        kubelet.running(ns, pod, devices={device: "Healthy"})

    kubelet.device_health(ns, "trainer", {"GPU-1": "Unhealthy"})

    def evicted() -> bool:
        pod = cluster.kubectl_json("get", "pod", "trainer", "-n", ns)
        return pod["metadata"].get("deletionTimestamp") is not None

    eventually(evicted, what="the trainer evicted", processes=[controllers])
    trainer = cluster.kubectl_json("get", "pod", "trainer", "-n", ns)
    target = disruption_target(trainer)
    assert target is not None and target["reason"] == "EvictionByEvictionAPI"
    neighbour = cluster.kubectl_json("get", "pod", "neighbour", "-n", ns)
    assert neighbour["metadata"].get("deletionTimestamp") is None and disruption_target(neighbour) is None
    eventually(
        lambda: "PodEvicted" in reasons(cluster, kind="Pod", name="trainer", namespace=ns), what="PodEvicted"
    )
    assert controllers.metric("gpuguard_remediations_total", action="evict", outcome="done") == 1
    kubelet.finish_deletion(ns, "trainer")


def test_a_dra_device_unknown_from_the_start_is_never_evicted_and_one_that_reported_before_is(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str, ns: str
) -> None:
    """The kubelet reports every DRA device Unknown until its driver streams health for it."""
    controllers = start(fast_policy(test_id))
    name = kubelet.node(f"{test_id}-a", capacity=None, labels={"nvidia.com/gpu.present": "true"})
    # Unknown first, and for longer than the control pod below.
    kubelet.claim_pod("silent", ns, name)
    kubelet.device_health(ns, "silent", {"gpu-0": "Unknown"}, resource="claim:gpu")
    kubelet.claim_pod("streamed", ns, name)
    # The controllers were synced before these writes, so their watch delivers the Healthy status too.
    kubelet.device_health(ns, "streamed", {"gpu-1": "Healthy"}, resource="claim:gpu")
    kubelet.device_health(ns, "streamed", {"gpu-1": "Unknown"}, resource="claim:gpu")

    def evicted(pod: str) -> bool:
        deleted = cluster.kubectl_json("get", "pod", pod, "-n", ns)["metadata"].get("deletionTimestamp")
        return deleted is not None

    eventually(lambda: evicted("streamed"), what="the pod whose device went Unknown", processes=[controllers])
    silent = cluster.kubectl_json("get", "pod", "silent", "-n", ns)
    assert not evicted("silent") and disruption_target(silent) is None

    def node_message() -> str:
        condition = own_condition(cluster, name)
        return condition["message"] if condition is not None else ""

    eventually(
        lambda: "(gpu-1)" in node_message(), what="the node's podDeviceUnknown", processes=[controllers]
    )
    assert "claim:gpu: 1 devices reported Unknown by pods (gpu-1)" in node_message()
    kubelet.finish_deletion(ns, "streamed")


def test_a_disruption_budget_holds_the_eviction_and_the_controller_reports_it_stuck(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str, ns: str
) -> None:
    controllers = start(fast_policy(test_id))
    name = kubelet.node(f"{test_id}-a")
    for pod, device in (("serve-0", "GPU-1"), ("serve-1", "GPU-2")):
        kubelet.gpu_pod(pod, ns, name, labels={"app": "serve"})
        kubelet.running(ns, pod, devices={device: "Healthy"})
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "serve", "namespace": ns},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "serve"}}},
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(budget))

    def allowed() -> int | None:
        status = cluster.kubectl_json("get", "pdb", "serve", "-n", ns).get("status") or {}
        return status.get("disruptionsAllowed") if status.get("currentHealthy") == 2 else None

    eventually(lambda: allowed() == 0, what="the disruption controller counting the budget")

    kubelet.device_health(ns, "serve-0", {"GPU-1": "Unhealthy"})
    eventually(
        lambda: "EvictionStuck" in reasons(cluster, kind="Pod", name="serve-0", namespace=ns),
        what="the eviction reported stuck",
        processes=[controllers],
    )
    assert "EvictionBlocked" in reasons(cluster, kind="Pod", name="serve-0", namespace=ns)
    pod = cluster.kubectl_json("get", "pod", "serve-0", "-n", ns)
    assert pod["metadata"].get("deletionTimestamp") is None  # stuck is reported, never forced
    assert controllers.metric("gpuguard_remediations_total", action="evict", outcome="stuck") == 1
    assert controllers.metric("gpuguard_remediations_total", action="evict", outcome="blocked") >= 1

    # The budget makes room: the next retry goes through.
    cluster.kubectl("patch", "pdb", "serve", "-n", ns, "--type=merge", "-p", '{"spec": {"minAvailable": 1}}')
    eventually(
        lambda: disruption_target(cluster.kubectl_json("get", "pod", "serve-0", "-n", ns)) is not None,
        what="the eviction once the budget allows it",
        processes=[controllers],
    )
    assert (
        cluster.kubectl_json("get", "pod", "serve-1", "-n", ns)["metadata"].get("deletionTimestamp") is None
    )
    kubelet.finish_deletion(ns, "serve-0")


# --- DRA ---------------------------------------------------------------------------------------------

XID_79 = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}


def device_rules(cluster: ControlPlane) -> dict[str, dict[str, Any]]:
    """Every DeviceTaintRule in the cluster, by name."""
    listed = json.loads(cluster.kubectl("get", "devicetaintrules", "-o", "json").stdout)["items"]
    return {rule["metadata"]["name"]: rule for rule in listed}


def test_a_driver_taint_in_a_resource_slice_fences_that_device_alone_until_republished_without(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str
) -> None:
    """A DRA node has no extended resource: its ResourceSlice is the only thing that says it has GPUs,
    and a driver taint on one of them (NVIDIA's driver on XID 79) the only sign of the failure. The
    device gets gpuguard's DeviceTaintRule, the node keeps no taint; an admin's rule is left alone."""
    theirs = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": f"{test_id}-admin"},
        "spec": {
            "deviceSelector": {"driver": DRA_DRIVER, "pool": f"{test_id}-a", "device": "gpu-3"},
            "taint": {"key": "example.com/maintenance", "effect": "None"},
        },
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(theirs))
    admin_version = device_rules(cluster)[f"{test_id}-admin"]["metadata"]["resourceVersion"]
    controllers = start(fast_policy(test_id, signals={"deviceTaints": {"keys": [], "forSeconds": 2}}))
    name = kubelet.node(f"{test_id}-a", capacity=None, plugin=False)
    kubelet.resource_slice(name, taints={3: [XID_79]})
    device = f"{DRA_DRIVER}/{name}/gpu-3"
    rule_name = fences.rule_name(device)

    eventually(
        lambda: rule_name in device_rules(cluster), what="the DeviceTaintRule", processes=[controllers]
    )
    rule = device_rules(cluster)[rule_name]
    assert rule["spec"]["deviceSelector"] == {"driver": DRA_DRIVER, "pool": name, "device": "gpu-3"}
    assert (rule["spec"]["taint"]["key"], rule["spec"]["taint"]["effect"]) == (
        observed.TAINT_KEY,
        "NoSchedule",
    )
    assert rule["metadata"]["ownerReferences"][0]["name"] == name
    condition = own_condition(cluster, name)
    assert condition is not None and condition["status"] == "False"
    assert f"{DRA_DRIVER}: 1 of 8 devices tainted by their driver: {device}" in condition["message"]
    assert TAINT not in taints(cluster, name)
    node_record = record(cluster, name)
    assert node_record is not None and node_record["expected"] == {DRA_DRIVER: 8}

    kubelet.resource_slice(name, generation=2)
    eventually(
        lambda: rule_name not in device_rules(cluster), what="the rule deleted", processes=[controllers]
    )
    eventually(lambda: own_condition(cluster, name) is None, what="recovery", processes=[controllers])
    assert device_rules(cluster)[f"{test_id}-admin"]["metadata"]["resourceVersion"] == admin_version
    cluster.kubectl("delete", "devicetaintrule", f"{test_id}-admin")


def test_audit_mode_fences_a_failed_dra_device_with_a_none_rule_only(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str
) -> None:
    """The API's own dry run: a None rule, whose status says what NoExecute would evict; nothing else."""
    policy = fast_policy(test_id, mode="audit", signals={"deviceTaints": {"keys": [], "forSeconds": 0}})
    controllers = start(policy)
    name = kubelet.node(f"{test_id}-a", capacity=None, plugin=False)
    kubelet.resource_slice(name, taints={3: [XID_79]})
    rule_name = fences.rule_name(f"{DRA_DRIVER}/{name}/gpu-3")
    eventually(lambda: rule_name in device_rules(cluster), what="the None rule", processes=[controllers])
    assert device_rules(cluster)[rule_name]["spec"]["taint"]["effect"] == "None"
    eventually(
        lambda: "WouldTaintNode" in reasons(cluster, kind="Node", name=name),
        what="the Event",
        processes=[controllers],
    )
    assert own_condition(cluster, name) is None and TAINT not in taints(cluster, name)
    kubelet.resource_slice(name, generation=2)
    eventually(
        lambda: rule_name not in device_rules(cluster), what="the rule deleted", processes=[controllers]
    )


def running_on_device(kubelet: Kubelet, ns: str, node: str, pod: str, device: str) -> None:
    kubelet.claim_pod(pod, ns, node)
    kubelet.allocated_claim(ns, pod, node, device)
    kubelet.running(ns, pod)


@pytest.mark.parametrize(
    ("evict", "reason", "effect"),
    [
        ("evictionAPI", "EvictionByEvictionAPI", "NoSchedule"),
        ("deviceTaint", "DeletionByDeviceTaintManager", "NoExecute"),
    ],
)
def test_the_pod_on_a_fenced_dra_device_is_removed_and_its_neighbour_on_the_same_node_keeps_running(
    cluster: ControlPlane,
    kubelet: Kubelet,
    start: Start,
    test_id: str,
    ns: str,
    evict: str,
    reason: str,
    effect: str,
) -> None:
    """evictionAPI: gpuguard evicts the pod (PDBs respected). deviceTaint: the rule is NoExecute and the
    real device-taint-eviction controller removes the pod. Either way, DisruptionTarget first, and only
    the pod on the failed device."""
    policy = fast_policy(
        test_id, signals={"deviceTaints": {"keys": [], "forSeconds": 1}}, dra={"evict": evict}
    )
    controllers = start(policy)
    name = kubelet.node(f"{test_id}-a", capacity=None, plugin=False)
    kubelet.resource_slice(name)
    running_on_device(kubelet, ns, name, "trainer", "gpu-3")
    running_on_device(kubelet, ns, name, "neighbour", "gpu-4")

    kubelet.resource_slice(name, taints={3: [XID_79]})
    rule_name = fences.rule_name(f"{DRA_DRIVER}/{name}/gpu-3")

    def removed(pod: str) -> bool:
        return (
            cluster.kubectl_json("get", "pod", pod, "-n", ns)["metadata"].get("deletionTimestamp") is not None
        )

    eventually(lambda: removed("trainer"), what="the pod on the failed device", processes=[controllers])
    assert device_rules(cluster)[rule_name]["spec"]["taint"]["effect"] == effect
    target = disruption_target(cluster.kubectl_json("get", "pod", "trainer", "-n", ns))
    assert target is not None and target["reason"] == reason
    assert not removed("neighbour")
    assert disruption_target(cluster.kubectl_json("get", "pod", "neighbour", "-n", ns)) is None
    kubelet.finish_deletion(ns, "trainer")


def test_by_default_a_pod_with_a_disruption_budget_is_left_to_the_eviction_api_and_one_without_to_no_execute(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str, ns: str
) -> None:
    """health.dra.evict auto: the device of a pod a PDB selects is fenced NoSchedule and the pod
    evicted through the Eviction API, which its budget (0 disruptions allowed) refuses, and gpuguard
    says so; the device of a pod no PDB selects is fenced NoExecute and the real device-taint-eviction
    controller removes that pod."""
    controllers = start(fast_policy(test_id, signals={"deviceTaints": {"keys": [], "forSeconds": 1}}))
    name = kubelet.node(f"{test_id}-a", capacity=None, plugin=False)
    kubelet.resource_slice(name)
    running_on_device(kubelet, ns, name, "trainer", "gpu-3")
    running_on_device(kubelet, ns, name, "loner", "gpu-4")
    cluster.kubectl("label", "pod", "trainer", "-n", ns, "app=trainer")
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "trainer", "namespace": ns},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "trainer"}}},
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(budget))

    def allowed() -> int | None:
        status = cluster.kubectl_json("get", "pdb", "trainer", "-n", ns).get("status") or {}
        return status.get("disruptionsAllowed") if status.get("currentHealthy") == 1 else None

    eventually(lambda: allowed() == 0, what="the disruption controller counting the budget")

    kubelet.resource_slice(name, taints={3: [XID_79], 4: [XID_79]})
    budgeted, loner = (fences.rule_name(f"{DRA_DRIVER}/{name}/gpu-{i}") for i in (3, 4))

    def pod(pod: str) -> dict[str, Any]:
        got: dict[str, Any] = cluster.kubectl_json("get", "pod", pod, "-n", ns)
        return got

    eventually(
        lambda: pod("loner")["metadata"].get("deletionTimestamp") is not None,
        what="the pod without a budget removed",
        processes=[controllers],
    )
    target = disruption_target(pod("loner"))
    assert target is not None and target["reason"] == "DeletionByDeviceTaintManager"
    eventually(
        lambda: "EvictionBlocked" in reasons(cluster, kind="Pod", name="trainer", namespace=ns),
        what="the refused eviction said",
        processes=[controllers],
    )
    rules = device_rules(cluster)
    assert rules[budgeted]["spec"]["taint"]["effect"] == "NoSchedule"
    assert rules[loner]["spec"]["taint"]["effect"] == "NoExecute"
    assert pod("trainer")["metadata"].get("deletionTimestamp") is None  # refused, never deleted
    assert controllers.metric("gpuguard_remediations_total", action="evict", outcome="blocked") >= 1
    kubelet.finish_deletion(ns, "loner")


def test_a_node_whose_devices_all_failed_is_cordoned_and_drained_and_given_back_on_recovery(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str, ns: str
) -> None:
    controllers = start(fast_policy(test_id))
    name = kubelet.node(f"{test_id}-a")
    for pod in ("a", "b"):
        kubelet.gpu_pod(pod, ns, name)
        kubelet.running(ns, pod)
    # The device plugin is gone for good: the whole node's devices are unusable.
    kubelet.device_plugin(name, ready=False)

    def unschedulable() -> bool:
        return bool(cluster.kubectl_json("get", "node", name)["spec"].get("unschedulable"))

    eventually(unschedulable, what="the node cordoned", processes=[controllers])
    for pod in ("a", "b"):
        eventually(
            lambda pod=pod: disruption_target(cluster.kubectl_json("get", "pod", pod, "-n", ns)) is not None,  # type: ignore[misc]
            what=f"pod {pod} evicted",
            processes=[controllers],
        )
    condition = own_condition(cluster, name)
    assert condition is not None and condition["reason"] == "Draining"
    node_record = record(cluster, name)
    assert node_record is not None and node_record["cordoned"] is True
    for pod in ("a", "b"):
        kubelet.finish_deletion(ns, pod)
    eventually(
        lambda: (own_condition(cluster, name) or {}).get("reason") == "Drained",
        what="the condition saying Drained: the hand-off to a node remediator",
        processes=[controllers],
    )

    kubelet.device_plugin(name, ready=True, started_seconds_ago=5)
    eventually(lambda: not unschedulable(), what="uncordoned on recovery", processes=[controllers])
    assert TAINT not in taints(cluster, name) and own_condition(cluster, name) is None


# --- the whole chain: webhook, controllers, Job controller -----------------------------------------------


@pytest.fixture
def webhook(cluster: ControlPlane, tmp_path: Path, ns: str) -> Iterator[WebhookProcess]:
    """gpuguard's webhook on this cluster, for this test's namespace only (by label)."""
    (tmp_path / "webhook").mkdir()
    process = WebhookProcess(tmp_path / "webhook")
    process.start()
    label = "gpuguard-e2e/controllers-chain"
    cluster.kubectl("label", "namespace", ns, f"{label}=true")
    install_priority_classes(cluster, default_priority_classes())
    register(cluster, process, name="chain", namespace_selector={"matchLabels": {label: "true"}})
    try:
        wait_until_called(cluster, namespace=ns)
        yield process
    finally:
        unregister(cluster, "chain")
        process.stop()


def job_pods(cluster: ControlPlane, ns: str, job: str) -> list[dict[str, Any]]:
    listed = cluster.kubectl_json("get", "pods", "-n", ns, "-l", f"job-name={job}")
    pods: list[dict[str, Any]] = listed["items"]
    return pods


def running_job_pod(
    cluster: ControlPlane, kubelet: Kubelet, ns: str, job: str, node: str, device: str
) -> str:
    """Waits for the Job controller's pod, binds it to `node` and runs it on `device`."""
    eventually(lambda: len(job_pods(cluster, ns, job)) == 1, what=f"the pod of Job {job}")
    (pod,) = job_pods(cluster, ns, job)
    name: str = pod["metadata"]["name"]
    kubelet.bind(ns, name, node)
    kubelet.running(ns, name, devices={device: "Healthy"})
    return name


def job_status(cluster: ControlPlane, ns: str, job: str) -> dict[str, Any]:
    status: dict[str, Any] = cluster.kubectl_json("get", "job", job, "-n", ns).get("status") or {}
    return status


def test_a_failed_device_costs_a_job_nothing_through_webhook_controllers_and_the_job_controller(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str, ns: str, webhook: WebhookProcess
) -> None:
    controllers = start(fast_policy(test_id))
    name = kubelet.node(f"{test_id}-a")
    for job in ("evicted", "plain"):
        cluster.kubectl("create", "-f", "-", input=json.dumps(gpu_job(job, ns)))
        spec = cluster.kubectl_json("get", "job", job, "-n", ns)["spec"]
        # gpuguard's webhook injected the rule that makes a disruption free.
        rules = spec["podFailurePolicy"]["rules"]
        assert {
            "action": "Ignore",
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
        } in rules
    evicted = running_job_pod(cluster, kubelet, ns, "evicted", name, "GPU-1")
    plain = running_job_pod(cluster, kubelet, ns, "plain", name, "GPU-2")

    # The device under the first Job's pod fails; the kubelet reports it on the pod and the node.
    kubelet.device_health(ns, evicted, {"GPU-1": "Unhealthy"})
    kubelet.devices(name, capacity=8, allocatable=7)
    eventually(
        lambda: disruption_target(cluster.kubectl_json("get", "pod", evicted, "-n", ns)) is not None,
        what="the Job's pod evicted",
        processes=[controllers],
    )
    # The kubelet kills the container and reports the pod Failed, then finishes the deletion.
    kubelet.terminate(ns, evicted, exit_code=137)
    kubelet.finish_deletion(ns, evicted)

    # The same failure without gpuguard: the second Job's pod dies on its device, no eviction.
    kubelet.terminate(ns, plain, exit_code=137)
    kubelet.finish_deletion(ns, plain)

    def replaced(job: str, old: str) -> bool:
        return any(pod["metadata"]["name"] != old for pod in job_pods(cluster, ns, job))

    eventually(lambda: replaced("evicted", evicted), what="the real Job controller's replacement pod")
    eventually(lambda: job_status(cluster, ns, "plain").get("failed") == 1, what="the plain failure counted")
    assert job_status(cluster, ns, "evicted").get("failed", 0) == 0
    # Retried too (after the Job controller's failure backoff), but it cost one of backoffLimit's retries.
    eventually(lambda: replaced("plain", plain), what="the counted failure retried")
    assert job_status(cluster, ns, "evicted").get("failed", 0) == 0


# --- safety: budget, breaker, exclusion, audit ---------------------------------------------------------


def breaker_state(cluster: ControlPlane) -> str | None:
    found = cluster.kubectl(
        "get", "configmap", STATE_CONFIGMAP, "-n", NAMESPACE, "--ignore-not-found", "-o", "json"
    ).stdout
    state: str | None = json.loads(found)["data"].get("state") if found.strip() else None
    return state


def gpuguard_cli(cluster: ControlPlane, command: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The gpuguard command line as an operator runs it (the admin's kubeconfig)."""
    env = {k: v for k, v in without_proxies().items() if k not in ("KUBERNETES_SERVICE_HOST", "KUBECONFIG")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run(
        [sys.executable, "-m", "webhook", command, f"--kubeconfig={cluster.kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO_ROOT,
    )


def test_more_failing_nodes_than_the_budget_only_the_budget_is_acted_on_and_the_breaker_latches(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str
) -> None:
    # Four nodes in one pool, one of them may be remediated at a time, and more than two nodes going
    # bad within the window means something fleet-wide: the breaker opens.
    policy = fast_policy(test_id, budget={"maxUnhealthy": "25%"}, circuitBreaker={"maxNodes": 2})
    controllers = start(policy)
    nodes = [kubelet.node(f"{test_id}-{i}", pool=test_id) for i in range(4)]
    failing = nodes[:3]
    for name in failing:
        kubelet.devices(name, capacity=8, allocatable=6)

    def tainted() -> list[str]:
        return [name for name in nodes if TAINT in taints(cluster, name)]

    eventually(lambda: breaker_state(cluster) == "open", what="the breaker open", processes=[controllers])
    eventually(
        lambda: all(own_condition(cluster, name) is not None for name in failing),
        what="every failing node marked",
        processes=[controllers],
    )
    (acted,) = tainted()  # the budget: one node, and the breaker stopped the rest
    held = [name for name in failing if name != acted]
    # Only the node gpuguard acts on is handed off as False: node remediators leave the held ones be.
    statuses = {name: (own_condition(cluster, name) or {}).get("status") for name in failing}
    assert statuses == {acted: "False", **dict.fromkeys(held, "Unknown")}
    assert controllers.metric("gpuguard_circuit_breaker_open") == 1
    assert controllers.metric("gpuguard_remediation_held_nodes") == 2
    assert any("CircuitBreakerOpened" in reasons(cluster, kind="Node", name=name) for name in failing), (
        "an Event says why"
    )
    for name in held:
        eventually(
            lambda name=name: "RemediationHeld" in reasons(cluster, kind="Node", name=name),  # type: ignore[misc]
            what="held Events",
        )
    table = gpuguard_cli(cluster, "nodes")
    assert table.returncode == 0, table.stderr
    assert "circuit breaker: OPEN" in table.stdout
    assert {line.split()[0]: line.split()[4] for line in table.stdout.splitlines()[1:5]} == {
        **{name: "unhealthy,held" for name in held},
        acted: "unhealthy",
        nodes[3]: "healthy",
    }

    # The acted-on node recovers and frees its place in the budget: the breaker still holds the others.
    before = controllers.metric("gpuguard_remediations_total", action="taint", outcome="held")
    kubelet.devices(acted, capacity=8, allocatable=8)
    eventually(lambda: tainted() == [], what="the first node given back", processes=[controllers])
    eventually(
        lambda: (
            controllers.metric("gpuguard_remediations_total", action="taint", outcome="held") >= before + 2
        ),
        what="the held nodes decided on again",
        processes=[controllers],
    )
    assert tainted() == []

    # The breaker survives a restart: its state is in the cluster, not in the process.
    controllers.stop()
    controllers = start(policy, "a-again")
    eventually(
        lambda: controllers.metric("gpuguard_remediations_total", action="taint", outcome="held") >= 2,
        what="the restarted leader holding the nodes again",
        processes=[controllers],
    )
    assert controllers.metric("gpuguard_circuit_breaker_open") == 1 and tainted() == []

    # An operator closes the breaker: the budget's one place goes to one held node, and the breaker
    # does not open again for the nodes that were already due.
    reset = gpuguard_cli(cluster, "nodes", "reset-breaker")
    assert reset.returncode == 0 and "closed" in reset.stdout, reset.stderr
    eventually(lambda: len(tainted()) == 1, what="one held node acted on", processes=[controllers])
    assert tainted()[0] in held
    assert breaker_state(cluster) == "closed"
    assert controllers.metric("gpuguard_circuit_breaker_open") == 0


def breaker_data(cluster: ControlPlane) -> dict[str, str]:
    found = cluster.kubectl(
        "get", "configmap", STATE_CONFIGMAP, "-n", NAMESPACE, "--ignore-not-found", "-o", "json"
    ).stdout
    data: dict[str, str] = json.loads(found).get("data") or {} if found.strip() else {}
    return data


def due_nodes(cluster: ControlPlane) -> list[str]:
    return [line.split()[1] for line in breaker_data(cluster).get("dueNodes", "").splitlines()]


def test_nodes_replaced_after_they_became_due_open_the_breaker_across_a_failover_and_a_kubectl_close_sticks(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str
) -> None:
    # A rolling fault: each failing node is drained and replaced (deleted) before the next fails. The
    # breaker's log in its ConfigMap keeps them, so a new leader opens it at the third.
    policy = fast_policy(test_id, circuitBreaker={"maxNodes": 2})
    controllers = start(policy, "a")
    nodes = [kubelet.node(f"{test_id}-{i}", pool=test_id) for i in range(4)]
    for name in nodes[:2]:
        kubelet.devices(name, capacity=8, allocatable=6)
        eventually(lambda name=name: TAINT in taints(cluster, name), what="acted on", processes=[controllers])  # type: ignore[misc]
        eventually(lambda name=name: name in due_nodes(cluster), what="logged", processes=[controllers])  # type: ignore[misc]
        cluster.kubectl("delete", "node", name)
    assert breaker_data(cluster)["state"] == "closed"

    controllers.stop()
    controllers = start(policy, "b")
    third = nodes[2]
    kubelet.devices(third, capacity=8, allocatable=6)
    eventually(lambda: breaker_state(cluster) == "open", what="the breaker open", processes=[controllers])
    assert "3 of " in breaker_data(cluster)["reason"]
    eventually(
        lambda: "RemediationHeld" in reasons(cluster, kind="Node", name=third),
        what="the third node held",
        processes=[controllers],
    )
    assert TAINT not in taints(cluster, third)

    # The documented kubectl close: the leader gives it a time after the opening and writes it back,
    # and the nodes that were due before it do not open the breaker again.
    cluster.kubectl(
        "patch",
        "configmap",
        STATE_CONFIGMAP,
        "-n",
        NAMESPACE,
        "--type=merge",
        "-p",
        '{"data":{"state":"closed"}}',
    )
    eventually(
        lambda: breaker_data(cluster).get("closedAt", "") > breaker_data(cluster)["openedAt"],
        what="the close time written back",
        processes=[controllers],
    )
    assert breaker_data(cluster)["closedBy"] == "an edit of the ConfigMap"
    eventually(
        lambda: TAINT in taints(cluster, third), what="the held node acted on", processes=[controllers]
    )
    assert breaker_state(cluster) == "closed"
    assert controllers.metric("gpuguard_circuit_breaker_open") == 0
    assert "CircuitBreakerClosed" in reasons(
        cluster, kind="ConfigMap", name=STATE_CONFIGMAP, namespace=NAMESPACE
    )


def test_an_excluded_node_gets_events_and_no_writes(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str
) -> None:
    controllers = start(fast_policy(test_id))
    excluded = kubelet.node(f"{test_id}-excluded", labels={signals.EXCLUDE_LABEL: "true"})
    kubelet.devices(excluded, capacity=8, allocatable=0)
    kubelet.device_plugin(excluded, ready=False)
    version = cluster.kubectl_json("get", "node", excluded)["metadata"]["resourceVersion"]

    eventually(
        lambda: "RemediationHeld" in reasons(cluster, kind="Node", name=excluded),
        what="the Event saying it is held",
        processes=[controllers],
    )
    assert cluster.kubectl_json("get", "node", excluded)["metadata"]["resourceVersion"] == version


def test_nodes_someone_else_handles_get_events_and_no_writes(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str
) -> None:
    controllers = start(fast_policy(test_id))
    disrupted = kubelet.node(f"{test_id}-disrupted")
    cluster.kubectl("taint", "node", disrupted, "karpenter.sh/disrupted:NoSchedule")
    # What the node lifecycle controller writes once a kubelet stops posting its status.
    unreachable = kubelet.node(f"{test_id}-unreachable")
    kubelet.node_condition(unreachable, "Ready", "Unknown")
    cluster.kubectl("taint", "node", unreachable, "node.kubernetes.io/unreachable:NoSchedule")
    versions = {}
    for name in (disrupted, unreachable):
        kubelet.devices(name, capacity=8, allocatable=0)
        kubelet.device_plugin(name, ready=False)
        versions[name] = cluster.kubectl_json("get", "node", name)["metadata"]["resourceVersion"]

    eventually(
        lambda: "RemediationHeld" in reasons(cluster, kind="Node", name=disrupted),
        what="the Event saying why it is held",
        processes=[controllers],
    )
    # Its signals' clocks start again until it answers: suspect, never due.
    eventually(
        lambda: controllers.metric("gpuguard_node_device_health", node=unreachable, state="suspect") == 1,
        what="the unreachable node assessed",
        processes=[controllers],
    )
    now = {
        name: cluster.kubectl_json("get", "node", name)["metadata"]["resourceVersion"] for name in versions
    }
    assert now == versions
    assert breaker_state(cluster) != "open"


def test_a_node_remediated_twice_keeps_its_marks_until_an_operator_acknowledges_it(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str
) -> None:
    controllers = start(
        fast_policy(test_id, recovery={"escalation": {"remediations": 2, "windowSeconds": 600}})
    )
    name = kubelet.node(f"{test_id}-a")
    for episode in (1, 2):
        kubelet.devices(name, capacity=8, allocatable=7)
        eventually(
            lambda: TAINT in taints(cluster, name), what=f"failure {episode} tainted", processes=[controllers]
        )
        kubelet.devices(name, capacity=8, allocatable=8)
        if episode == 1:
            eventually(
                lambda: TAINT not in taints(cluster, name), what="recovered once", processes=[controllers]
            )
    eventually(
        lambda: (own_condition(cluster, name) or {}).get("reason") == "RepeatedFailures",
        what="the condition saying the node failed again",
        processes=[controllers],
    )
    assert TAINT in taints(cluster, name)

    ack = gpuguard_cli(cluster, "nodes", "ack", name)
    assert ack.returncode == 0 and "acknowledged" in ack.stdout, ack.stderr
    eventually(
        lambda: TAINT not in taints(cluster, name),
        what="recovered once acknowledged",
        processes=[controllers],
    )
    assert own_condition(cluster, name) is None
    missing = gpuguard_cli(cluster, "nodes", "ack", f"{test_id}-absent")
    assert missing.returncode == 1 and "not found" in missing.stderr


def test_audit_mode_records_what_it_would_do_and_writes_nothing_until_enforced(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str, ns: str
) -> None:
    audit = fast_policy(test_id, mode="audit")
    controllers = start(audit)
    name = kubelet.node(f"{test_id}-a")
    kubelet.gpu_pod("trainer", ns, name)
    kubelet.running(ns, "trainer", devices={"GPU-1": "Unhealthy"})
    kubelet.device_plugin(name, ready=False)
    node_version = cluster.kubectl_json("get", "node", name)["metadata"]["resourceVersion"]
    pod_version = cluster.kubectl_json("get", "pod", "trainer", "-n", ns)["metadata"]["resourceVersion"]

    wanted = {"WouldMarkDeviceUnhealthy", "WouldTaintNode", "WouldDrainNode"}
    eventually(
        lambda: wanted <= set(reasons(cluster, kind="Node", name=name)),
        what="the Would... Events on the node",
        processes=[controllers],
    )
    eventually(
        lambda: "WouldEvictPod" in reasons(cluster, kind="Pod", name="trainer", namespace=ns),
        what="WouldEvictPod",
    )
    assert cluster.kubectl_json("get", "node", name)["metadata"]["resourceVersion"] == node_version
    assert (
        cluster.kubectl_json("get", "pod", "trainer", "-n", ns)["metadata"]["resourceVersion"] == pod_version
    )
    assert controllers.metric("gpuguard_remediations_total", action="taint", outcome="would") >= 1

    # The same policy enforced, live (the file is watched): now it acts.
    controllers.write_policy(fast_policy(test_id))
    eventually(
        lambda: TAINT in taints(cluster, name), what="the taint once enforced", processes=[controllers]
    )
    eventually(
        lambda: disruption_target(cluster.kubectl_json("get", "pod", "trainer", "-n", ns)) is not None,
        what="the eviction once enforced",
    )
    kubelet.finish_deletion(ns, "trainer")


def test_a_breaker_tripped_in_audit_holds_nothing_and_opens_where_reset_breaker_sees_it_once_enforced(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str
) -> None:
    audit = fast_policy(test_id, mode="audit", circuitBreaker={"maxNodes": 1})
    controllers = start(audit)
    failing = [kubelet.node(f"{test_id}-{i}", pool=test_id) for i in range(2)]
    for name in failing:
        kubelet.devices(name, capacity=8, allocatable=6)
    eventually(
        lambda: any("WouldOpenCircuitBreaker" in reasons(cluster, kind="Node", name=n) for n in failing),
        what="the breaker said to open",
        processes=[controllers],
    )
    assert breaker_state(cluster) is None and controllers.metric("gpuguard_circuit_breaker_open") == 0
    # Nothing is held, and the reset says so.
    assert "not open" in gpuguard_cli(cluster, "nodes", "reset-breaker").stdout

    # Enforced: the same nodes open it for real before anything is acted on, in its ConfigMap.
    controllers.write_policy(fast_policy(test_id, circuitBreaker={"maxNodes": 1}))
    eventually(lambda: breaker_state(cluster) == "open", what="the breaker open", processes=[controllers])
    eventually(
        lambda: all(own_condition(cluster, name) is not None for name in failing),
        what="the conditions written",
        processes=[controllers],
    )
    assert all(TAINT not in taints(cluster, name) for name in failing)
    reset = gpuguard_cli(cluster, "nodes", "reset-breaker")
    assert reset.returncode == 0 and reset.stdout.strip() == "circuit breaker closed", reset.stderr
    eventually(
        lambda: all(TAINT in taints(cluster, name) for name in failing),
        what="the nodes acted on after the reset",
        processes=[controllers],
    )
    assert breaker_state(cluster) == "closed"


# --- leadership and restarts ---------------------------------------------------------------------------


def test_killing_the_leader_hands_over_to_the_standby_which_neither_repeats_nor_forgets(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str, summary: Callable[[str, str], None]
) -> None:
    policy = fast_policy(test_id, budget={"maxUnhealthy": "25%"})
    leader = start(policy, "a")
    standby = start(policy, "b", lead=False)
    assert not standby.leading()
    first, second, *_ = [kubelet.node(f"{test_id}-{i}", pool=test_id) for i in range(4)]
    kubelet.devices(first, capacity=8, allocatable=7)
    eventually(lambda: TAINT in taints(cluster, first), what="the leader acting", processes=[leader])
    acted = record(cluster, first)
    assert acted is not None

    leader.kill()
    taken_over = standby.wait_leading(timeout=LEASE_SECONDS + 30)
    summary(
        "controllers-failover",
        f"controllers: the standby took the Lease over {taken_over:.1f} s after the leader was killed (lease duration {LEASE_SECONDS:g} s)",
    )
    lease = cluster.kubectl_json("get", "lease", "gpuguard-controllers", "-n", NAMESPACE)["spec"]
    assert lease["holderIdentity"] == "b" and lease["leaseTransitions"] >= 1

    # The new leader knows the first node holds the pool's one place: the second one is held, not acted on.
    kubelet.devices(second, capacity=8, allocatable=7)
    eventually(
        lambda: "RemediationHeld" in reasons(cluster, kind="Node", name=second),
        what="the budget counted from the first node's record",
        processes=[standby],
    )
    assert TAINT not in taints(cluster, second)
    assert record(cluster, first) == acted  # nothing repeated, nothing forgotten
    assert reasons(cluster, kind="Node", name=first).count("NodeTainted") == 1

    # The first node recovers: its place goes to the second.
    kubelet.devices(first, capacity=8, allocatable=8)
    eventually(lambda: TAINT in taints(cluster, second), what="the freed place used", processes=[standby])

    # A clean stop releases the Lease: the restarted replica takes over at once.
    leader = start(policy, "a", lead=False)
    standby.stop()
    assert standby.exit_code() == 0
    leader.wait_leading(timeout=LEASE_SECONDS + 30)


def test_a_restart_keeps_what_gpuguard_saw_and_did(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str
) -> None:
    # A gap must persist 8 s; the controllers restart in between and must not start counting again.
    policy = fast_policy(test_id, signals={"deviceGap": {"forSeconds": 8}})
    controllers = start(policy)
    name = kubelet.node(f"{test_id}-a")
    kubelet.devices(name, capacity=8, allocatable=7)
    eventually(
        lambda: record(cluster, name) is not None, what="the first sighting recorded", processes=[controllers]
    )
    first_seen = (record(cluster, name) or {})["signals"][f"deviceGap/{GPU}"]

    controllers.stop()
    restarted = start(policy, "a-again")
    eventually(
        lambda: TAINT in taints(cluster, name), what="the taint after the restart", processes=[restarted]
    )
    after = record(cluster, name)
    assert after is not None and after["signals"][f"deviceGap/{GPU}"] == first_seen
    explained = gpuguard_cli(cluster, "nodes", "explain", name)
    assert explained.returncode == 0, explained.stderr
    assert f"deviceGap/{GPU}" in explained.stdout and "in the budget since" in explained.stdout


# --- the audit's reports, kept current by the leader ---------------------------------------------------


def test_the_leader_keeps_the_audits_policy_reports_current(
    cluster: ControlPlane, start: Start, test_id: str, ns: str
) -> None:
    crds = install_crds(cluster, CRD_FILE)
    # The audit's rights as deploy/ grants them to the controllers (the ClusterRoleBinding's subjects).
    rendered = render(cluster)
    audit_rbac = [find(rendered, kind, "gpuguard-audit") for kind in ("ClusterRole", "ClusterRoleBinding")]
    assert {"kind": "ServiceAccount", "name": "gpuguard-controllers", "namespace": NAMESPACE} in audit_rbac[
        1
    ]["subjects"]
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": audit_rbac})
    )
    try:
        cluster.kubectl("create", "-f", "-", input=json.dumps(gpu_job("unguarded", ns)))
        controllers = start({**fast_policy(test_id), "audit": {"reportIntervalSeconds": 3600}})

        def report() -> dict[str, Any] | None:
            found = cluster.kubectl("get", "policyreport", "gpuguard", "-n", ns, "-o", "json", check=False)
            return json.loads(found.stdout) if found.returncode == 0 else None

        eventually(lambda: report() is not None, what="the leader's PolicyReport", processes=[controllers])
        written = report()
        assert written is not None and written["summary"]["fail"] >= 1  # the Job lacks gpuguard's protections
        assert controllers.metric("gpuguard_audit_runs_total", result="success") >= 1
    finally:
        cluster.kubectl("delete", "-f", "-", "--ignore-not-found", input=json.dumps(crds), check=False)
