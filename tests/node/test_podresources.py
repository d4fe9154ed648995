"""The kubelet's PodResources API, read by the client gpuguard's node agent is to use: which pod
holds which device, and which devices are still allocatable. A device the plugin marks unhealthy
stays held by its pod but leaves the allocatable set: exactly the pods on failed devices."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from webhook_harness import gpu_pod, submit

from .conftest import DEVICES_PER_NODE, NodeCluster
from .device_plugin import HEALTHY, UNHEALTHY, FakeDevicePlugin
from .podresources import HeldDevices, PodResourcesClient, held_but_not_allocatable
from .test_device_health import LONG_RUNNING
from .workloads import GPU, allocatable, on_node, running, wait_for_pod

NODE = "node-b"


@pytest.fixture
def plugin(cluster: NodeCluster) -> Iterator[FakeDevicePlugin]:
    plugin = cluster.plugins[NODE]
    yield plugin
    for device in plugin.health():
        plugin.set_health(device, HEALTHY)
    node = cluster.nodes[NODE]
    node.wait_for(
        lambda: allocatable(node.node(), GPU) == DEVICES_PER_NODE, what="all GPUs allocatable again"
    )


@pytest.fixture
def pod_resources(cluster: NodeCluster) -> Iterator[PodResourcesClient]:
    with PodResourcesClient(cluster.apis, cluster.nodes[NODE].pod_resources_socket) as client:
        yield client


def test_list_and_allocatable_find_the_pod_on_a_failed_device(
    cluster: NodeCluster, plugin: FakeDevicePlugin, pod_resources: PodResourcesClient, namespace: str
) -> None:
    plane, node = cluster.plane, cluster.nodes[NODE]
    submit(
        plane,
        "create",
        on_node(gpu_pod("holder", namespace, gpus=2, restart_policy="Always"), NODE, LONG_RUNNING),
    )
    wait_for_pod(plane, namespace, "holder", running, what="running")

    (held,) = [h for h in pod_resources.held_devices() if h.namespace == namespace]
    assert (held.pod, held.container, held.resource) == ("holder", "main", GPU)
    assert len(held.device_ids) == 2
    assert tuple(sorted(held.device_ids)) in {tuple(sorted(a.device_ids)) for a in plugin.allocations}
    assert pod_resources.allocatable_devices()[GPU] == frozenset(plugin.health())
    assert held_but_not_allocatable(pod_resources.held_devices(), pod_resources.allocatable_devices()) == []

    failed = min(held.device_ids)
    plugin.set_health(failed, UNHEALTHY)
    node.wait_for(
        lambda: failed not in pod_resources.allocatable_devices()[GPU], what="device leaves allocatable"
    )

    assert pod_resources.allocatable_devices()[GPU] == frozenset(plugin.health()) - {failed}
    assert held_but_not_allocatable(pod_resources.held_devices(), pod_resources.allocatable_devices()) == [
        HeldDevices(namespace, "holder", "main", GPU, frozenset({failed}))
    ]

    plugin.set_health(failed, HEALTHY)
    node.wait_for(lambda: failed in pod_resources.allocatable_devices()[GPU], what="device allocatable again")
