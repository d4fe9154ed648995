"""A device the plugin marks unhealthy: the real kubelet lowers the node's allocatable and reports
the device's health on the pod that holds it (`allocatedResourcesStatus`, KEP-4680) — the signals
gpuguard's controllers act on."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.harness.admission import gpu_pod, submit
from tests.harness.device_plugin import HEALTHY, UNHEALTHY, FakeDevicePlugin
from tests.harness.workloads import GPU, allocatable, capacity, get_pod, on_node, running, wait_for_pod

from .conftest import DEVICES_PER_NODE, NodeCluster, restore_health

NODE = "node-a"
LONG_RUNNING = "trap 'exit 0' TERM; while true; do sleep 1; done"


def device_health(pod: dict[str, Any] | None) -> dict[str, str]:
    """resourceID -> health of every GPU the pod's containers hold, as the kubelet reports it."""
    found: dict[str, str] = {}
    for status in (pod or {}).get("status", {}).get("containerStatuses") or []:
        for allocated in status.get("allocatedResourcesStatus") or []:
            if allocated["name"] == GPU:
                found.update({r["resourceID"]: r.get("health", "") for r in allocated.get("resources") or []})
    return found


@pytest.fixture
def plugin(cluster: NodeCluster) -> Iterator[FakeDevicePlugin]:
    """NODE's plugin; every device healthy again afterwards."""
    yield cluster.plugins[NODE]
    restore_health(cluster, NODE)


def test_unhealthy_device_lowers_allocatable_and_marks_the_pod_holding_it(
    cluster: NodeCluster, plugin: FakeDevicePlugin, namespace: str, summary: Callable[[str, str], None]
) -> None:
    plane, node = cluster.plane, cluster.nodes[NODE]
    submit(
        plane, "create", on_node(gpu_pod("trainer", namespace, restart_policy="Always"), NODE, LONG_RUNNING)
    )
    pod = wait_for_pod(
        plane, namespace, "trainer", lambda p: running(p) and bool(device_health(p)), what="running"
    )
    ((device, health),) = device_health(pod).items()
    assert health == HEALTHY
    assert device in plugin.health()

    flipped = time.monotonic()
    plugin.set_health(device, UNHEALTHY)
    pod_seconds = node.wait_for(
        lambda: device_health(get_pod(plane, namespace, "trainer")) == {device: UNHEALTHY},
        what="pod reports its GPU Unhealthy",
    )
    node.wait_for(lambda: allocatable(node.node(), GPU) == DEVICES_PER_NODE - 1, what="allocatable lowered")
    allocatable_seconds = time.monotonic() - flipped

    after = node.node()
    assert capacity(after, GPU) == DEVICES_PER_NODE  # the device is still there, only not usable
    assert running(get_pod(plane, namespace, "trainer"))  # the kubelet reports; it does not act
    summary(
        "device_health",
        f"device {device} Unhealthy: the pod said so after {pod_seconds:.1f} s, "
        f"allocatable {DEVICES_PER_NODE} -> {DEVICES_PER_NODE - 1} after {allocatable_seconds:.1f} s",
    )

    plugin.set_health(device, HEALTHY)
    node.wait_for(
        lambda: device_health(get_pod(plane, namespace, "trainer")) == {device: HEALTHY},
        what="pod reports its GPU Healthy again",
    )
