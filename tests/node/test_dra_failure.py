"""Device failure in the DRA era on real nodes: a fake DRA driver per node (dra_driver.py) registered
with the real kubelet, preparing the claims the real scheduler allocated from its ResourceSlice;
the real kube-controller-manager's resource-claim and device-taint-eviction controllers; gpuguard's
webhook and controllers.

A GPU Job with a ResourceClaimTemplate runs on a DRA device; the driver taints that device in its
ResourceSlice, as NVIDIA's driver does on XID 79. gpuguard fences that device alone with a
NoExecute DeviceTaintRule, the device-taint-eviction controller removes the pod with
DisruptionTarget, the kubelet runs the injected preStop, the Job replaces the pod on another device
without counting a failure, and a pod holding another device of the same node keeps running. The
driver republishes the device untainted and gpuguard deletes its rule.

The controllers (run as their deploy/ ServiceAccount) watch the tier's nodes with the responders'
policy, plus driver taints as a signal and the device-taint-eviction controller as the evictor."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.harness.admission import submit
from tests.harness.controllers import DRA_DRIVER, NAMESPACE, ControllersProcess, eventually
from tests.harness.controlplane import ControlPlane, wait_until
from tests.harness.dra_driver import HEALTHY, UNHEALTHY, FakeDraDriver, device_class
from tests.harness.images import BUSYBOX_IMAGE
from tests.harness.responders import holds_for
from tests.harness.workloads import HOSTNAME_LABEL, container_status, get_pod, running, wait_for_pod
from webhook.policy.health import fences

from .conftest import (
    DEVICES_PER_NODE,
    GRACE_SECONDS,
    PATIENCE,
    PRE_STOP_SECONDS,
    QUIET_SECONDS,
    SIGNAL_SECONDS,
    Accounts,
    NodeCluster,
    responders_policy,
)
from .test_device_failure import TERM_RECORDER_EXIT_143, disruption_target, job_pods, remove_hold
from .test_graceful_termination import HOLD, TERM_RECORDER, uptime

CLAIM = "gpu"  # the pods' claim, and the request in it
# What NVIDIA's DRA driver puts on a GPU that fell off the bus.
XID_79 = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}


def dra_policy() -> dict[str, Any]:
    """The responders' policy; a driver's taint on a device is a failure, and the device-taint-eviction
    controller removes the pods of a device gpuguard fences."""
    policy = responders_policy()
    policy["health"]["signals"]["deviceTaints"] = {"keys": [], "forSeconds": SIGNAL_SECONDS}
    policy["health"]["dra"] = {"evict": "deviceTaint"}
    return policy


@pytest.fixture(scope="module")
def drivers(cluster: NodeCluster) -> Iterator[dict[str, FakeDraDriver]]:
    """A fake DRA driver on every node, registered with its kubelet, its ResourceSlice published, and
    the driver's DeviceClass."""
    plane = cluster.plane
    plane.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(device_class(DRA_DRIVER)))
    started: dict[str, FakeDraDriver] = {}
    try:
        for name, node in cluster.nodes.items():
            devices = [f"gpu-{name[-1]}{i}" for i in range(DEVICES_PER_NODE)]
            driver = FakeDraDriver(cluster.apis, plane, node.kubelet_dir, DRA_DRIVER, name, devices)
            started[name] = driver
            driver.start()
            driver.publish()
        yield started
    finally:
        try:
            # The last test's pods left the API at once (deleted without grace); the kubelets unprepare
            # their claims after stopping their containers, and need the drivers for it.
            wait_until(
                lambda: not any(driver.prepared() for driver in started.values()),
                timeout=PATIENCE,
                what="every claim unprepared by the kubelets",
            )
        finally:
            for driver in started.values():
                driver.stop()
            plane.kubectl("delete", "deviceclass", DRA_DRIVER, "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def dra_controllers(
    cluster: NodeCluster,
    accounts: Accounts,
    drivers: dict[str, FakeDraDriver],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ControllersProcess]:
    """gpuguard's controllers with dra_policy; afterwards their rules and their record of the nodes go
    (the next module's controllers would otherwise expect the DRA devices these nodes no longer have)."""
    workdir = tmp_path_factory.mktemp("dra-controllers")
    controllers = ControllersProcess(workdir, accounts.controllers, dra_policy(), identity="dra")
    try:
        controllers.start()
        controllers.wait_ready()
        controllers.wait_leading()
        yield controllers
    finally:
        controllers.stop()
        own = f"{fences.MANAGED_BY_LABEL}={fences.MANAGED_BY}"
        cluster.plane.kubectl("delete", "devicetaintrules", "-l", own, "--ignore-not-found", check=False)
        cluster.plane.kubectl(
            "delete", "configmap", "gpuguard-remediation", "-n", NAMESPACE, "--ignore-not-found"
        )


@pytest.fixture
def claims(cluster: NodeCluster, namespace: str) -> str:
    """The test's namespace, with the ResourceClaimTemplate its pods take their claim from."""
    cluster.plane.kubectl("create", "-f", "-", input=json.dumps(claim_template(namespace)))
    return namespace


@pytest.fixture
def untainted_again(drivers: dict[str, FakeDraDriver]) -> Iterator[None]:
    """After the test, every driver's devices published without taints."""
    yield
    for driver in drivers.values():
        driver.publish()


def claim_template(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": CLAIM, "namespace": namespace},
        "spec": {
            "spec": {"devices": {"requests": [{"name": CLAIM, "exactly": {"deviceClassName": DRA_DRIVER}}]}}
        },
    }


def claim_pod_spec(script: str) -> dict[str, Any]:
    """One container running `script` in busybox, holding one device of the driver's class."""
    return {
        "restartPolicy": "Never",
        "resourceClaims": [{"name": CLAIM, "resourceClaimTemplateName": CLAIM}],
        "containers": [
            {
                "name": "main",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", script],
                "resources": {"claims": [{"name": CLAIM}]},
            }
        ],
    }


def held_device(plane: ControlPlane, pod: dict[str, Any] | None) -> tuple[str, str] | None:
    """(pool, device) of the pod's claim as allocated, once the kubelet reports the claim's device on
    the container (the driver prepared it)."""
    if pod is None:
        return None
    reported = [
        allocated
        for status in pod.get("status", {}).get("containerStatuses") or []
        for allocated in status.get("allocatedResourcesStatus") or []
        if allocated["name"].startswith("claim:") and allocated.get("resources")
    ]
    claims = pod.get("status", {}).get("resourceClaimStatuses") or []
    if not reported or not claims:
        return None
    claim = plane.kubectl_json(
        "get", "resourceclaim", claims[0]["resourceClaimName"], "-n", pod["metadata"]["namespace"]
    )
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return result["pool"], result["device"]


def running_on_device(
    plane: ControlPlane, namespace: str, name: str
) -> tuple[dict[str, Any], tuple[str, str]]:
    """Waits until the pod runs on its prepared device; the pod and (pool, device)."""
    seen: list[tuple[str, str]] = []

    def ready(pod: dict[str, Any] | None) -> bool:
        if not running(pod) or (device := held_device(plane, pod)) is None:
            return False
        seen[:] = [device]
        return True

    pod = wait_for_pod(plane, namespace, name, ready, what="running with its DRA device", timeout=PATIENCE)
    assert pod is not None
    return pod, seen[0]


def claim_pod_running(
    plane: ControlPlane, namespace: str, name: str, *, node: str | None = None
) -> tuple[dict[str, Any], tuple[str, str]]:
    """A bare pod holding a device of the driver's (on `node`, or where the scheduler puts it), running
    until SIGTERM (so that it stops once the preStop is done): once it runs, the pod and (pool, device)."""
    spec = claim_pod_spec(TERM_RECORDER)
    if node is not None:
        spec["nodeSelector"] = {HOSTNAME_LABEL: node}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }
    submit(plane, "create", pod)
    return running_on_device(plane, namespace, name)


def rules(plane: ControlPlane) -> dict[str, dict[str, Any]]:
    listed = plane.kubectl_json("get", "devicetaintrules")["items"]
    return {rule["metadata"]["name"]: rule for rule in listed}


def test_a_driver_tainted_device_is_fenced_its_pod_removed_and_replaced_without_counting(
    cluster: NodeCluster,
    drivers: dict[str, FakeDraDriver],
    dra_controllers: ControllersProcess,
    untainted_again: None,
    claims: str,
    summary: Callable[[str, str], None],
) -> None:
    plane, namespace = cluster.plane, claims
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "train", "namespace": namespace},
        # One counted failure would fail the Job.
        "spec": {"backoffLimit": 0, "template": {"spec": claim_pod_spec(TERM_RECORDER_EXIT_143)}},
    }
    submit(plane, "create", job)
    spec = plane.kubectl_json("get", "job", "train", "-n", namespace)["spec"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in spec[
        "podFailurePolicy"
    ]["rules"]

    eventually(lambda: len(job_pods(plane, namespace, "train")) == 1, what="the Job's pod")
    first = job_pods(plane, namespace, "train")[0]["metadata"]["name"]
    pod, (node, device) = running_on_device(plane, namespace, first)
    assert pod["spec"]["nodeName"] == node
    assert pod["spec"]["containers"][0]["lifecycle"]["preStop"] == {"sleep": {"seconds": PRE_STOP_SECONDS}}
    assert pod["spec"]["terminationGracePeriodSeconds"] == GRACE_SECONDS
    driver = drivers[node]
    assert any(device in devices for devices in driver.prepared().values())  # the driver prepared it

    # A pod on another device of the same node: it must not notice.
    _, (_, neighbour_device) = claim_pod_running(plane, namespace, "neighbour", node=node)
    assert neighbour_device != device

    # The removed pod stays readable after its container stopped (the test's finalizer, on it alone).
    hold = [{"op": "add", "path": "/metadata/finalizers/-", "value": HOLD}]
    plane.kubectl("patch", "pod", first, "-n", namespace, "--type=json", "-p", json.dumps(hold))
    graces: set[int] = set()

    def stopped(pod: dict[str, Any] | None) -> bool:
        assert pod is not None
        if pod["metadata"].get("deletionGracePeriodSeconds") is not None:
            graces.add(pod["metadata"]["deletionGracePeriodSeconds"])
        return disruption_target(pod) and "terminated" in container_status(pod).get("state", {})

    try:
        tainted_at, tainted_uptime = time.monotonic(), uptime()
        driver.publish({device: [XID_79]})
        rule_name = fences.rule_name(f"{DRA_DRIVER}/{node}/{device}")
        eventually(
            lambda: (
                rules(plane).get(rule_name, {}).get("spec", {}).get("taint", {}).get("effect") == "NoExecute"
            ),
            what="gpuguard's NoExecute DeviceTaintRule on the device",
            timeout=PATIENCE,
            processes=[dra_controllers],
        )
        rule = rules(plane)[rule_name]
        assert rule["spec"]["deviceSelector"] == {"driver": DRA_DRIVER, "pool": node, "device": device}
        removed = wait_for_pod(
            plane, namespace, first, stopped, what="removed with DisruptionTarget, stopped", timeout=PATIENCE
        )
        assert removed is not None
    finally:
        remove_hold(plane, namespace, first)
    removed_seconds = time.monotonic() - tainted_at
    (target,) = [c for c in removed["status"]["conditions"] if c["type"] == "DisruptionTarget"]
    assert target["reason"] == "DeletionByDeviceTaintManager"
    state = container_status(removed)["state"]["terminated"]
    assert GRACE_SECONDS in graces  # the removal gave the pod gpuguard's grace period
    term_after = float(state["message"]) - tainted_uptime
    assert term_after >= PRE_STOP_SECONDS  # the preStop sleep ran before SIGTERM reached the container
    assert state["exitCode"] == 143  # its own TERM handler's exit, not SIGKILL's 137: within the grace period

    def replacement() -> dict[str, Any] | None:
        """The Job's other pod, once it runs on its device (the removed one may be gone already)."""
        for pod in job_pods(plane, namespace, "train"):
            if pod["metadata"]["name"] != first and running(pod) and held_device(plane, pod) is not None:
                return pod
        return None

    eventually(
        lambda: replacement() is not None,
        what="the Job's replacement running",
        timeout=PATIENCE,
        processes=[dra_controllers],
    )
    replaced_seconds = time.monotonic() - tainted_at
    assert held_device(plane, replacement()) not in (None, (node, device))
    status = plane.kubectl_json("get", "job", "train", "-n", namespace)["status"]
    assert status.get("failed", 0) == 0, status  # the removal was not counted against backoffLimit 0
    assert not [c for c in status.get("conditions") or [] if c["type"] == "Failed"]

    still = get_pod(plane, namespace, "neighbour")
    assert running(still) and still is not None
    assert still["metadata"].get("deletionTimestamp") is None and not disruption_target(still)

    driver.publish()
    eventually(
        lambda: rule_name not in rules(plane),
        what="gpuguard's rule deleted once the device is untainted",
        timeout=PATIENCE,
        processes=[dra_controllers],
    )
    summary(
        "dra_device_taint",
        f"DRA device tainted by its driver on a real node: gpuguard's NoExecute DeviceTaintRule, the pod "
        f"removed by the device-taint-eviction controller (SIGTERM {term_after:.1f} s after the taint, preStop "
        f"{PRE_STOP_SECONDS} s included), stopped {removed_seconds:.1f} s and replaced on another device "
        f"{replaced_seconds:.1f} s after it, 0 failures counted",
    )


def claim_health(pod: dict[str, Any] | None) -> dict[str, str]:
    """The kubelet's word on the pod's claim devices (allocatedResourcesStatus): resource ID -> health."""
    return {
        resource["resourceID"]: resource["health"]
        for status in (pod or {}).get("status", {}).get("containerStatuses") or []
        for allocated in status.get("allocatedResourcesStatus") or []
        if allocated["name"].startswith("claim:")
        for resource in allocated.get("resources") or []
    }


def left_alone(plane: ControlPlane, namespace: str, name: str) -> str:
    """What gpuguard or Kubernetes did to a pod that must keep running ("" for nothing)."""
    pod = get_pod(plane, namespace, name)
    if pod is None or pod["metadata"].get("deletionTimestamp") is not None:
        return f"pod {name} was removed"
    if disruption_target(pod):
        return f"pod {name} was marked DisruptionTarget"
    return "" if running(pod) else f"pod {name} stopped running"


def switch_policy(controllers: ControllersProcess, policy: dict[str, Any]) -> None:
    """The running controllers take `policy` (their file watcher): waits until they serve it."""
    before = controllers.status()["hash"]
    controllers.write_policy(policy)
    eventually(
        lambda: controllers.status().get("hash") not in (None, before),
        what="the controllers on the new policy",
        processes=[controllers],
    )


@pytest.fixture
def audit_mode(dra_controllers: ControllersProcess) -> Iterator[None]:
    """The controllers in audit mode for the test, enforcing again afterwards."""
    policy = dra_policy()
    policy["health"]["mode"] = "audit"
    switch_policy(dra_controllers, policy)
    yield
    switch_policy(dra_controllers, dra_policy())


def test_audit_mode_fences_a_driver_tainted_device_with_a_none_rule_and_evicts_nothing(
    cluster: NodeCluster,
    drivers: dict[str, FakeDraDriver],
    dra_controllers: ControllersProcess,
    audit_mode: None,
    untainted_again: None,
    claims: str,
    summary: Callable[[str, str], None],
) -> None:
    plane, namespace = cluster.plane, claims
    _, (node, device) = claim_pod_running(plane, namespace, "trainer")

    tainted_at = time.monotonic()
    drivers[node].publish({device: [XID_79]})
    rule_name = fences.rule_name(f"{DRA_DRIVER}/{node}/{device}")
    eventually(
        lambda: rule_name in rules(plane),
        what="gpuguard's DeviceTaintRule (the API's own dry run)",
        timeout=PATIENCE,
        processes=[dra_controllers],
    )
    rule_seconds = time.monotonic() - tainted_at
    assert rules(plane)[rule_name]["spec"]["taint"]["effect"] == "None"

    def violation() -> str:
        effect = rules(plane).get(rule_name, {}).get("spec", {}).get("taint", {}).get("effect")
        return left_alone(plane, namespace, "trainer") or (
            "" if effect == "None" else f"the rule's effect is {effect} in audit mode"
        )

    holds_for(violation, QUIET_SECONDS, logs=dra_controllers.log)

    untainted_at = time.monotonic()
    drivers[node].publish()
    eventually(
        lambda: rule_name not in rules(plane),
        what="the None rule deleted once the device is untainted",
        timeout=PATIENCE,
        processes=[dra_controllers],
    )
    summary(
        "dra_audit",
        f"DRA device tainted by its driver, audit mode: gpuguard's None DeviceTaintRule {rule_seconds:.1f} s "
        f"after the taint, nothing evicted in {QUIET_SECONDS} s, the rule deleted "
        f"{time.monotonic() - untainted_at:.1f} s after the untaint",
    )


@pytest.fixture
def healthy_reported(drivers: dict[str, FakeDraDriver]) -> Iterator[list[tuple[str, str]]]:
    """(node, device)s the test has its driver report on: reported healthy again afterwards."""
    reported: list[tuple[str, str]] = []
    yield reported
    for node, device in reported:
        drivers[node].set_health(device, HEALTHY)


def test_the_health_stream_unhealthy_reaches_the_pod_and_gpuguard_while_unknown_is_left_alone(
    cluster: NodeCluster,
    drivers: dict[str, FakeDraDriver],
    dra_controllers: ControllersProcess,
    healthy_reported: list[tuple[str, str]],
    claims: str,
    summary: Callable[[str, str], None],
) -> None:
    """The driver streams nothing for the pod's device: the kubelet says Unknown, gpuguard does
    nothing. It then streams the device Unhealthy: the kubelet writes it into the pod's status and
    gpuguard removes the pod."""
    plane, namespace = cluster.plane, claims
    pod, (node, device) = claim_pod_running(plane, namespace, "trainer")
    resource = f"{DRA_DRIVER}/{node}/{device}"  # the kubelet's name for a device prepared without CDI ids
    assert claim_health(pod) == {resource: "Unknown"}
    holds_for(
        lambda: left_alone(plane, namespace, "trainer") or ("a DeviceTaintRule" if rules(plane) else ""),
        QUIET_SECONDS,
        logs=dra_controllers.log,
    )

    healthy_reported.append((node, device))
    reported_at = time.monotonic()
    drivers[node].set_health(device, UNHEALTHY)
    wait_for_pod(
        plane,
        namespace,
        "trainer",
        lambda p: claim_health(p) == {resource: "Unhealthy"},
        what="the kubelet reporting the device Unhealthy",
        timeout=PATIENCE,
    )
    status_seconds = time.monotonic() - reported_at
    removed = wait_for_pod(
        plane,
        namespace,
        "trainer",
        lambda p: (
            p is not None and disruption_target(p) and p["metadata"].get("deletionTimestamp") is not None
        ),
        what="removed with DisruptionTarget",
        timeout=PATIENCE,
    )
    assert removed is not None
    # A pod whose device went Unhealthy is gpuguard's to evict (PodDisruptionBudgets respected).
    (target,) = [c for c in removed["status"]["conditions"] if c["type"] == "DisruptionTarget"]
    assert target["reason"] == "EvictionByEvictionAPI"
    removed_seconds = time.monotonic() - reported_at
    summary(
        "dra_health_stream",
        f"DRA health stream on a real node: Unhealthy in the pod's status {status_seconds:.1f} s after the "
        f"driver streamed it, pod removed by gpuguard after {removed_seconds:.1f} s",
    )
