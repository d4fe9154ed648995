"""The kubelet's PodResources API, read by gpuguard's node agent client (webhook.agent.podresources):
which pod holds which device, and which devices are still allocatable. A device the plugin marks
unhealthy stays held by its pod but leaves the allocatable set: exactly the pods on failed devices.
The client reads the protobuf answers field by field; the kubelet's own answers, decoded by the code
protoc generates from its .proto, are the reference it is held to."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.harness.admission import gpu_pod, submit
from tests.harness.controlplane import wait_until
from tests.harness.device_plugin import HEALTHY, UNHEALTHY, FakeDevicePlugin
from tests.harness.kubelet_api import POD_RESOURCES_SERVICE, KubeletApis
from tests.harness.workloads import GPU, on_node, running, wait_for_pod
from webhook.agent.podresources import PodResourcesClient, decode_allocatable, decode_list
from webhook.policy.health import holdings
from webhook.policy.health.holdings import Holding

from .conftest import NodeCluster, restore_health
from .test_device_health import LONG_RUNNING

NODE = "node-b"


def raw_answer(socket: Path, method: str) -> bytes:
    """The kubelet's answer to an empty request, as the bytes it sent. The kubelet rate-limits this
    API (a burst of 10): a refusal for that is asked again."""
    answers: list[bytes] = []

    def answered() -> bool:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            call = channel.unary_unary(
                f"/{POD_RESOURCES_SERVICE}/{method}", request_serializer=bytes, response_deserializer=bytes
            )
            try:
                answers.append(call(b"", timeout=10))
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                return False
        return True

    wait_until(answered, timeout=30, what=f"the kubelet's answer to {method}")
    return answers[-1]


def reference_holdings(apis: KubeletApis, raw: bytes) -> set[Holding]:
    """`List`'s answer as the generated code reads it."""
    found: defaultdict[tuple[str, str, str, str], set[str]] = defaultdict(set)
    for pod in apis.podresources.ListPodResourcesResponse.FromString(raw).pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                found[pod.namespace, pod.name, container.name, devices.resource_name].update(
                    devices.device_ids
                )
    return {Holding(*key, device_ids=frozenset(ids)) for key, ids in found.items()}


def reference_allocatable(apis: KubeletApis, raw: bytes) -> dict[str, frozenset[str]]:
    found: defaultdict[str, set[str]] = defaultdict(set)
    for devices in apis.podresources.AllocatableResourcesResponse.FromString(raw).devices:
        found[devices.resource_name].update(devices.device_ids)
    return {resource: frozenset(ids) for resource, ids in found.items()}


@pytest.fixture
def plugin(cluster: NodeCluster) -> Iterator[FakeDevicePlugin]:
    """NODE's plugin; every device healthy again afterwards."""
    yield cluster.plugins[NODE]
    restore_health(cluster, NODE)


@pytest.fixture
def pod_resources(cluster: NodeCluster) -> Iterator[PodResourcesClient]:
    with PodResourcesClient(cluster.nodes[NODE].pod_resources_socket) as client:
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

    (held,) = [h for h in pod_resources.held() if h.namespace == namespace]
    assert (held.pod, held.container, held.resource) == ("holder", "main", GPU)
    assert len(held.device_ids) == 2
    assert tuple(sorted(held.device_ids)) in {tuple(sorted(a.device_ids)) for a in plugin.allocations}
    assert pod_resources.allocatable()[GPU] == frozenset(plugin.health())
    before = holdings.loss(pod_resources.held(), pod_resources.allocatable(), {})
    assert before.lost == ()

    failed = min(held.device_ids)
    plugin.set_health(failed, UNHEALTHY)
    socket = node.pod_resources_socket
    node.wait_for(
        lambda: failed not in decode_allocatable(raw_answer(socket, "GetAllocatableResources"))[GPU],
        what="device leaves allocatable",
    )

    listed, offered = raw_answer(socket, "List"), raw_answer(socket, "GetAllocatableResources")
    assert decode_allocatable(offered)[GPU] == frozenset(plugin.health()) - {failed}
    assert holdings.loss(decode_list(listed), decode_allocatable(offered), before.registrations).lost == (
        Holding(namespace, "holder", "main", GPU, frozenset({failed})),
    )
    # The field-by-field reading gives what the kubelet's generated code gives, on its real answers.
    assert set(decode_list(listed)) == reference_holdings(cluster.apis, listed)
    assert decode_allocatable(offered) == reference_allocatable(cluster.apis, offered)

    plugin.set_health(failed, HEALTHY)
    node.wait_for(
        lambda: failed in decode_allocatable(raw_answer(socket, "GetAllocatableResources"))[GPU],
        what="device allocatable again",
    )
