"""The device-failure story end to end on real nodes: gpuguard's webhook, its controllers and a node
agent per node, the real kubelets with their fake GPUs, the real kube-controller-manager (Job,
disruption, taint-eviction controllers) and kube-scheduler.

1. A GPU Job's device fails: the kubelet lowers allocatable and reports the device on the pod; the
   controllers taint the node and evict the pod; the kubelet runs the injected preStop within the
   grace period; the Job controller replaces the pod without counting the failure, and the
   replacement runs on the healthy node.
2. The node agent reads the kubelet's PodResources API: it names the pod holding the failed device
   (and no other) in that pod's condition, and the controllers evict that pod and no other.
3. A GPU fails and its device plugin is restarted, the usual first response: it comes back without
   the failed GPU, so the node reports no gap at all, one device short. The node stays marked.

The controllers and agents (conftest.responders) run as their deploy/ ServiceAccounts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.harness.admission import gpu_job, gpu_pod, submit
from tests.harness.controllers import eventually, own_condition, record, taints
from tests.harness.controlplane import ControlPlane
from tests.harness.device_plugin import UNHEALTHY
from tests.harness.responders import REACTION_SECONDS, Responders, holds_for
from tests.harness.workloads import (
    GPU,
    HOSTNAME_LABEL,
    allocatable,
    capacity,
    container_status,
    get_pod,
    on_node,
    running,
    wait_for_pod,
)
from webhook.policy.health import holdings

from .conftest import (
    DEVICES_PER_NODE,
    GRACE_SECONDS,
    PATIENCE,
    PRE_STOP_SECONDS,
    RECOVERY_SECONDS,
    TAINT,
    NodeCluster,
)
from .test_graceful_termination import HOLD, TERM_RECORDER, uptime

# A training process stopped by SIGTERM exits non-zero (128 + 15, as a shell reports it): with exit 0
# the pod would be Succeeded and the Job complete, whatever became of its device.
TERM_RECORDER_EXIT_143 = TERM_RECORDER.replace("exit 0", "exit 143")


def job_pods(plane: ControlPlane, namespace: str, job: str) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = plane.kubectl_json("get", "pods", "-n", namespace, "-l", f"job-name={job}")[
        "items"
    ]
    return sorted(pods, key=lambda p: p["metadata"]["creationTimestamp"])


def held_device(pod: dict[str, Any] | None) -> str:
    """The one GPU the kubelet reports the pod's container holds."""
    for status in (pod or {}).get("status", {}).get("containerStatuses") or []:
        for allocated in status.get("allocatedResourcesStatus") or []:
            if allocated["name"] == GPU and allocated.get("resources"):
                device: str = allocated["resources"][0]["resourceID"]
                return device
    return ""


def disruption_target(pod: dict[str, Any] | None) -> bool:
    conditions = (pod or {}).get("status", {}).get("conditions") or []
    return any(c["type"] == "DisruptionTarget" and c["status"] == "True" for c in conditions)


def remove_hold(plane: ControlPlane, namespace: str, name: str) -> None:
    """Takes the test's finalizer off the pod, and only it (the Job controller's stays), at the version
    read; read again when the pod changed meanwhile (the kubelet and the Job controller write it too)."""
    for _ in range(20):
        pod = get_pod(plane, namespace, name)
        if pod is None or HOLD not in (pod["metadata"].get("finalizers") or []):
            return
        rest = [f for f in pod["metadata"]["finalizers"] if f != HOLD]
        patch = {"metadata": {"finalizers": rest, "resourceVersion": pod["metadata"]["resourceVersion"]}}
        result = plane.kubectl(
            "patch", "pod", name, "-n", namespace, "--type=merge", "-p", json.dumps(patch), check=False
        )
        if result.returncode == 0:
            return
        if "Conflict" not in result.stderr:
            raise RuntimeError(result.stderr)
    raise RuntimeError(f"pod {namespace}/{name} kept changing: its finalizer {HOLD} could not be removed")


@pytest.fixture
def holds_released(cluster: NodeCluster, namespace: str) -> Iterator[None]:
    """After the test, before its namespace goes: no pod keeps the test's finalizer."""
    yield
    listed = cluster.plane.kubectl_json("get", "pods", "-n", namespace)["items"]
    for pod in listed:
        remove_hold(cluster.plane, namespace, pod["metadata"]["name"])


def test_a_failed_device_is_tainted_evicted_and_replaced_on_the_healthy_node_without_counting(
    cluster: NodeCluster,
    responders: Responders,
    healthy_again: None,
    namespace: str,
    holds_released: None,
    summary: Callable[[str, str], None],
) -> None:
    plane = cluster.plane
    manifest = on_node(gpu_job("train", namespace), next(iter(cluster.nodes)), TERM_RECORDER_EXIT_143)
    template = manifest["spec"]["template"]
    del template["spec"]["nodeSelector"][HOSTNAME_LABEL]  # the scheduler picks the node
    template["metadata"]["finalizers"] = [HOLD]  # the evicted pod stays readable after its containers
    manifest["spec"]["backoffLimit"] = 0  # one counted failure would fail the Job
    submit(plane, "create", manifest)
    rules = plane.kubectl_json("get", "job", "train", "-n", namespace)["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules

    eventually(lambda: len(job_pods(plane, namespace, "train")) == 1, what="the Job's pod")
    first = job_pods(plane, namespace, "train")[0]["metadata"]["name"]
    try:
        pod = wait_for_pod(
            plane, namespace, first, lambda p: running(p) and bool(held_device(p)), what="running"
        )
        assert pod is not None
        failed_node, device = pod["spec"]["nodeName"], held_device(pod)
        (healthy_node,) = set(cluster.nodes) - {failed_node}
        node, plugin = cluster.nodes[failed_node], cluster.plugins[failed_node]

        failed_at = uptime()
        plugin.set_health(device, UNHEALTHY)
        node.wait_for(
            lambda: allocatable(node.node(), GPU) == len(plugin.health()) - 1, what="allocatable lowered"
        )
        eventually(
            lambda: TAINT in taints(plane, failed_node),
            what="gpuguard's taint on the failed node",
            timeout=PATIENCE,
            logs=responders.logs,
        )
        graces: set[int] = set()

        def terminated(pod: dict[str, Any] | None) -> bool:
            assert pod is not None
            if pod["metadata"].get("deletionGracePeriodSeconds") is not None:
                graces.add(pod["metadata"]["deletionGracePeriodSeconds"])
            return disruption_target(pod) and "terminated" in container_status(pod).get("state", {})

        evicted = wait_for_pod(
            plane, namespace, first, terminated, what="evicted and stopped", timeout=PATIENCE
        )
        assert evicted is not None
        state = container_status(evicted)["state"]["terminated"]
    finally:
        remove_hold(plane, namespace, first)
    term_after = float(state["message"]) - failed_at
    assert GRACE_SECONDS in graces  # the eviction gave the pod gpuguard's grace period
    assert term_after >= PRE_STOP_SECONDS  # the preStop sleep ran before SIGTERM reached the container
    assert state["exitCode"] == 143  # its own TERM handler's exit, not SIGKILL's 137: within the grace period

    def replacement() -> dict[str, Any] | None:
        pods = [p for p in job_pods(plane, namespace, "train") if p["metadata"]["name"] != first]
        return pods[0] if pods and running(pods[0]) else None

    eventually(
        lambda: replacement() is not None, what="the Job controller's replacement running", timeout=PATIENCE
    )
    replaced = replacement()
    assert replaced is not None and replaced["spec"]["nodeName"] == healthy_node
    status = plane.kubectl_json("get", "job", "train", "-n", namespace)["status"]
    assert status.get("failed", 0) == 0  # the disruption cost the Job nothing
    assert not any(c["type"] == "Failed" and c["status"] == "True" for c in status.get("conditions") or [])
    summary(
        "device_failure",
        f"device {device} on {failed_node} failed: tainted, evicted, SIGTERM {term_after:.1f} s after the failure "
        f"(preStop {PRE_STOP_SECONDS} s, grace {GRACE_SECONDS} s), replaced on {healthy_node}, 0 failures counted",
    )


def agent_condition(pod: dict[str, Any] | None) -> dict[str, Any] | None:
    conditions = (pod or {}).get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == holdings.CONDITION_TYPE), None)


def test_the_node_agent_names_the_pod_on_the_failed_device_and_only_that_pod_is_evicted(
    cluster: NodeCluster,
    responders: Responders,
    healthy_again: None,
    namespace: str,
    summary: Callable[[str, str], None],
) -> None:
    plane, name = cluster.plane, "node-b"
    plugin, agent = cluster.plugins[name], responders.agents[name]
    for pod_name in ("holder", "neighbour"):
        submit(
            plane,
            "create",
            on_node(gpu_pod(pod_name, namespace, restart_policy="Always"), name, TERM_RECORDER),
        )
    pods = {
        pod_name: wait_for_pod(
            plane, namespace, pod_name, lambda p: running(p) and bool(held_device(p)), what="running"
        )
        for pod_name in ("holder", "neighbour")
    }
    device = held_device(pods["holder"])
    assert device != held_device(pods["neighbour"])

    plugin.set_health(device, UNHEALTHY)
    eventually(
        lambda: (agent_condition(get_pod(plane, namespace, "holder")) or {}).get("status") == "False",
        what="the agent's condition on the pod holding the failed device",
        timeout=PATIENCE,
        logs=responders.logs,
    )
    condition = agent_condition(get_pod(plane, namespace, "holder"))
    assert condition is not None
    assert condition["reason"] == holdings.LOST_REASON
    assert holdings.lost_devices(condition["message"]) == (holdings.LostDevice("main", GPU, device),)
    assert agent.metric("gpuguard_node_agent_lost_devices", resource=GPU) == 1
    eventually(
        lambda: (
            disruption_target(get_pod(plane, namespace, "holder"))
            or get_pod(plane, namespace, "holder") is None
        ),
        what="the holder evicted",
        timeout=PATIENCE,
        logs=responders.logs,
    )
    neighbour = get_pod(plane, namespace, "neighbour")
    assert running(neighbour) and not disruption_target(neighbour)  # the pod on a healthy device stays
    assert agent_condition(neighbour) is None  # and the agent never wrote to it
    summary(
        "node_agent",
        f"node agent: {device} held by {namespace}/holder reported; holder evicted, neighbour kept",
    )


def marks(plane: ControlPlane, name: str) -> str:
    """gpuguard's taint, condition and record on the node, as one line."""
    condition = own_condition(plane, name) or {}
    return (
        f"taints {taints(plane, name)}, condition {condition.get('status')} ({condition.get('message')}), "
        f"record {record(plane, name)}"
    )


def test_a_gpu_gone_after_a_plugin_restart_keeps_the_node_marked(
    cluster: NodeCluster,
    responders: Responders,
    healthy_again: None,
    summary: Callable[[str, str], None],
) -> None:
    plane, name = cluster.plane, "node-a"
    node, plugin = cluster.nodes[name], cluster.plugins[name]
    failed = plugin.device_ids[-1]
    plugin.set_health(failed, UNHEALTHY)
    node.wait_for(lambda: allocatable(node.node(), GPU) == DEVICES_PER_NODE - 1, what="allocatable lowered")

    def marked() -> bool:
        condition = own_condition(plane, name)
        return TAINT in taints(plane, name) and condition is not None and condition["status"] == "False"

    eventually(
        marked,
        what=f"gpuguard's taint and condition on {name}",
        timeout=PATIENCE,
        logs=responders.logs,
    )
    plugin.restart([device for device in plugin.device_ids if device != failed])
    left = DEVICES_PER_NODE - 1
    node.wait_for(
        lambda: (capacity(node.node(), GPU), allocatable(node.node(), GPU)) == (left, left),
        what=f"the plugin back with {left} devices, all healthy: no gap",
    )

    # gpuguard would undo its marks recovery.afterSeconds after it saw the gap close.
    window = RECOVERY_SECONDS + REACTION_SECONDS
    holds_for(
        lambda: "" if marked() else f"gpuguard unmarked {name}, one GPU short: {marks(plane, name)}",
        window,
        logs=responders.logs,
    )
    summary(
        "device_gone",
        f"{failed} on {name} failed and its plugin came back with {left} of {DEVICES_PER_NODE} devices: "
        f"taint and condition kept for {window:.0f} s (recovery.afterSeconds {RECOVERY_SECONDS})",
    )
