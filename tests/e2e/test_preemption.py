"""What the PriorityClasses deploy/ ships may preempt, as a real kube-scheduler decides it on a full GPU
node (an API object, scheduling.py): gpuguard's own class (gpuguard-critical) evicts nothing to make room
and waits, while the same value without `preemptionPolicy: Never` would have evicted the GPU workload
there; and a GPU workload of the class gpuguard injects (gpu-workload) does preempt a pod of lower
priority. The classes are the rendered ones under names of this module's own (a PriorityClass is
cluster-scoped and test_install.py installs the real names)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.harness.admission import IMAGE
from tests.harness.controlplane import ControlPlane, wait_until
from tests.harness.install import find, render
from tests.harness.scheduling import SCHEDULER_NAME, bound_node, create_nodes, node, start_scheduler

pytestmark = pytest.mark.usefixtures("gpuguard")

NODE_LABEL = "gpuguard-e2e/preemption"


@dataclass(frozen=True)
class Classes:
    """This module's copies of the shipped classes, by the shipped name."""

    names: dict[str, str]

    def __getitem__(self, shipped: str) -> str:
        return self.names[shipped]


@dataclass(frozen=True)
class Setup:
    tag: str  # the label value of the test's own node, which only its pods select
    node: str
    classes: Classes


@pytest.fixture(scope="module")
def classes(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Classes]:
    tag = secrets.token_hex(3)
    shipped = [doc for doc in render(control_plane) if doc["kind"] == "PriorityClass"]
    copies: list[dict[str, Any]] = []
    for priority_class in shipped:
        copy = json.loads(json.dumps(priority_class))
        copy["metadata"] = {"name": f"e2e-{tag}-{priority_class['metadata']['name']}"}
        copies.append(copy)
    extra = {
        # The control: gpuguard-critical's value with Kubernetes' default preemption policy.
        "preempting": find(shipped, "PriorityClass", "gpuguard-critical")["value"],
        # acceleratorNodeGuard's minPriority: the least a pod on a GPU node has.
        "low": 1000,
    }
    for name, value in extra.items():
        copies.append(
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": f"e2e-{tag}-{name}"},
                "value": value,
            }
        )
    names = {c["metadata"]["name"].removeprefix(f"e2e-{tag}-"): c["metadata"]["name"] for c in copies}
    control_plane.kubectl(
        "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": copies})
    )
    scheduler = start_scheduler(control_plane, tmp_path_factory.mktemp("preemption-scheduler"))
    try:
        yield Classes(names)
    finally:
        scheduler.stop()
        if control_plane.running:
            control_plane.kubectl(
                "delete", "priorityclass", *names.values(), "--ignore-not-found", "--wait=false", check=False
            )


@pytest.fixture
def setup(control_plane: ControlPlane, classes: Classes) -> Iterator[Setup]:
    """A node of the test's own with one GPU (pods bound to it stay: there is no kubelet to end them)."""
    tag = secrets.token_hex(3)
    name = f"preemption-{tag}"
    create_nodes(control_plane, [node(name, {NODE_LABEL: tag}, gpus=1)])
    try:
        yield Setup(tag, name, classes)
    finally:
        if control_plane.running:
            control_plane.kubectl("delete", "node", name, "--ignore-not-found", "--wait=false", check=False)


def gpu_pod(name: str, namespace: str, setup: Setup, priority_class: str) -> dict[str, Any]:
    """A pod wanting the node's one GPU, for this module's scheduler and node only."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "schedulerName": SCHEDULER_NAME,
            "nodeSelector": {NODE_LABEL: setup.tag},
            "priorityClassName": setup.classes[priority_class],
            "terminationGracePeriodSeconds": 3600,  # no kubelet: a deleted pod stays, marked, for the test to see
            "containers": [
                {"name": "main", "image": IMAGE, "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ],
        },
    }


def create(plane: ControlPlane, pod: dict[str, Any]) -> dict[str, Any]:
    stored: dict[str, Any] = plane.kubectl_json("create", "-f", "-", input=json.dumps(pod))
    return stored


def pod_state(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    state: dict[str, Any] = plane.kubectl_json("get", "pod", name, "-n", namespace)
    return state


def unschedulable_message(plane: ControlPlane, namespace: str, name: str) -> str | None:
    conditions = pod_state(plane, namespace, name).get("status", {}).get("conditions") or []
    found = [c for c in conditions if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"]
    return str(found[0].get("message", "")) if found else None


def wait_unschedulable(plane: ControlPlane, namespace: str, name: str) -> str:
    wait_until(
        lambda: unschedulable_message(plane, namespace, name) is not None,
        timeout=60,
        what=f"the scheduler finding no room for {name}",
    )
    return unschedulable_message(plane, namespace, name) or ""


def preempted(plane: ControlPlane, namespace: str, name: str) -> bool:
    return "deletionTimestamp" in pod_state(plane, namespace, name)["metadata"]


def test_gpuguards_class_waits_for_room_and_the_same_value_without_never_would_evict(
    control_plane: ControlPlane, namespace: str, setup: Setup
) -> None:
    workload = create(control_plane, gpu_pod("training", namespace, setup, "gpu-workload"))
    assert workload["spec"]["preemptionPolicy"] == "PreemptLowerPriority"
    assert bound_node(control_plane, namespace, "training") == setup.node

    replica = create(control_plane, gpu_pod("replica", namespace, setup, "gpuguard-critical"))
    assert (replica["spec"]["priority"], replica["spec"]["preemptionPolicy"]) == (1_000_000_000, "Never")
    message = wait_unschedulable(control_plane, namespace, "replica")
    assert "preemptionPolicy=Never" in message, message  # the scheduler did not even try
    assert not preempted(control_plane, namespace, "training")
    assert not pod_state(control_plane, namespace, "replica").get("status", {}).get("nominatedNodeName")

    # The control: gpuguard-critical's value with the default policy evicts the workload at once.
    control_plane.kubectl("delete", "pod", "replica", "-n", namespace, "--wait=false")
    create(control_plane, gpu_pod("preempting", namespace, setup, "preempting"))
    wait_until(
        lambda: preempted(control_plane, namespace, "training"),
        timeout=60,
        what="the workload preempted by a class of the same value without preemptionPolicy Never",
    )


def test_a_gpu_workload_of_the_injected_class_preempts_a_lower_priority_pod(
    control_plane: ControlPlane, namespace: str, setup: Setup
) -> None:
    create(control_plane, gpu_pod("low", namespace, setup, "low"))
    assert bound_node(control_plane, namespace, "low") == setup.node

    create(control_plane, gpu_pod("training", namespace, setup, "gpu-workload"))
    wait_until(
        lambda: preempted(control_plane, namespace, "low"),
        timeout=60,
        what="the lower-priority pod preempted by a gpu-workload pod",
    )
