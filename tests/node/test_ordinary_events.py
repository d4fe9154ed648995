"""Events of an ordinary day on a real node that are not device failures, with gpuguard's controllers
and node agents enforcing every action (conftest.responders). None of them may make gpuguard write
anything: no node condition, taint, cordon or record, no pod condition from the agent, no eviction.
Each test watches the node and its pods from before the event until QUIET_SECONDS (the policy's
longest wait and gpuguard's reaction) after its last transient (responders.GpuguardWrites).

1. The device plugin restarts with every device renamed, as the GPU operator's time-slicing or MPS
   config makes it (`GPU-<uuid>` becomes `GPU-<uuid>::<n>`): the running GPU pods keep the IDs they
   were given, which the node no longer offers, and nothing failed.
2. The kubelet restarts: until the plugin registers again, the node reports 0 GPUs.
3. The kubelet stops: the node-lifecycle controller marks the node Unknown, taints it unreachable and
   marks its pods NotReady, the device plugin's among them. Such a node is the node-lifecycle
   controller's to handle, while it is away and when it comes back.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator

import pytest

from tests.harness.admission import gpu_pod, submit
from tests.harness.controlplane import wait_until
from tests.harness.node import condition
from tests.harness.responders import GpuguardWrites, Responders, plugin_pod, pod_ready
from tests.harness.workloads import GPU, capacity, container_status, get_pod, on_node, running, wait_for_pod
from webhook.agent.podresources import PodResourcesClient

from .conftest import QUIET_SECONDS, NodeCluster, all_devices_allocatable
from .test_device_health import LONG_RUNNING, device_health
from .test_readiness_flakes import UNREACHABLE, no_execute_taints, stop_until_unreachable

NODE = "node-b"
# After each test every node's devices are as its plugin started with them, healthy, and whatever
# gpuguard marked is undone.
pytestmark = pytest.mark.usefixtures("healthy_again")


@pytest.fixture
def watch_writes(
    cluster: NodeCluster, responders: Responders, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[], GpuguardWrites]]:
    """Starts watching NODE and the test's pods for gpuguard's writes (once the pods run)."""
    started: list[GpuguardWrites] = []

    def start() -> GpuguardWrites:
        watch = GpuguardWrites(cluster.plane, responders, tmp_path_factory.mktemp("writes"), NODE, namespace)
        started.append(watch)
        return watch

    yield start
    for watch in started:
        watch.stop()


def gpu_pods_running(cluster: NodeCluster, namespace: str, count: int) -> dict[str, str]:
    """`count` long-running GPU pods on NODE, admitted by gpuguard's webhook: name -> container ID."""
    names = [f"holder-{index}" for index in range(count)]
    for name in names:
        submit(
            cluster.plane,
            "create",
            on_node(gpu_pod(name, namespace, restart_policy="Always"), NODE, LONG_RUNNING),
        )
    containers = {}
    for name in names:
        pod = wait_for_pod(
            cluster.plane, namespace, name, lambda p: running(p) and bool(device_health(p)), what="running"
        )
        assert pod is not None
        containers[name] = container_status(pod)["containerID"]
    return containers


def still_running(cluster: NodeCluster, namespace: str, containers: dict[str, str]) -> None:
    """The pods run on in the containers they had, never restarted."""
    for name, container in containers.items():
        pod = get_pod(cluster.plane, namespace, name)
        assert running(pod) and pod is not None and "deletionTimestamp" not in pod["metadata"], pod
        assert container_status(pod)["containerID"] == container
        assert container_status(pod)["restartCount"] == 0


def test_a_device_plugin_restart_that_renames_every_device_evicts_nothing(
    cluster: NodeCluster,
    namespace: str,
    watch_writes: Callable[[], GpuguardWrites],
    summary: Callable[[str, str], None],
) -> None:
    node, plugin = cluster.nodes[NODE], cluster.plugins[NODE]
    containers = gpu_pods_running(cluster, namespace, 2)
    writes = watch_writes()

    # One replica each: the names change, the count stays (more replicas multiply it, which is not
    # what this test is about).
    renamed = frozenset(f"{device}::0" for device in plugin.device_ids)
    plugin.restart(sorted(renamed))
    with PodResourcesClient(node.pod_resources_socket) as kubelet:
        node.wait_for(
            lambda: kubelet.allocatable().get(GPU) == renamed, what="the kubelet offering the renamed GPUs"
        )
        held = {
            device for holding in kubelet.held() if holding.resource == GPU for device in holding.device_ids
        }
    assert held and not held & renamed  # the pods hold IDs the node no longer offers
    assert all_devices_allocatable(node)

    versions = writes.quiet_for(QUIET_SECONDS, what="the device plugin came back with every GPU renamed")
    still_running(cluster, namespace, containers)
    summary(
        "renamed_devices",
        f"device plugin on {NODE} restarted with every GPU renamed ({', '.join(sorted(renamed))}) under "
        f"{len(containers)} running GPU pods: no gpuguard write in {QUIET_SECONDS:.0f} s ({versions} versions watched)",
    )


def test_a_kubelet_restart_that_reads_no_gpus_until_the_plugin_registers_writes_nothing(
    cluster: NodeCluster,
    namespace: str,
    watch_writes: Callable[[], GpuguardWrites],
    summary: Callable[[str, str], None],
) -> None:
    node, plugin = cluster.nodes[NODE], cluster.plugins[NODE]
    containers = gpu_pods_running(cluster, namespace, 1)
    writes = watch_writes()

    with plugin.registration_held():
        node.stop_kubelet()
        ready = node.start_kubelet()
        node.wait_for(lambda: capacity(node.node(), GPU) == 0, what="0 GPUs until the plugin registers again")
        zero_since = time.monotonic()
    node.wait_for(functools.partial(all_devices_allocatable, node), what="every GPU back")
    zero = time.monotonic() - zero_since

    versions = writes.quiet_for(QUIET_SECONDS, what="the kubelet restarted")
    still_running(cluster, namespace, containers)
    summary(
        "kubelet_restart",
        f"kubelet of {NODE} restarted (Ready in {ready:.1f} s), 0 GPUs for {zero:.1f} s until its plugin "
        f"registered again: no gpuguard write in {QUIET_SECONDS:.0f} s ({versions} versions watched)",
    )


def test_a_node_whose_kubelet_stopped_is_left_to_the_node_lifecycle_controller(
    cluster: NodeCluster,
    kubelets_back: None,
    namespace: str,
    watch_writes: Callable[[], GpuguardWrites],
    summary: Callable[[str, str], None],
) -> None:
    plane, node = cluster.plane, cluster.nodes[NODE]
    containers = gpu_pods_running(cluster, namespace, 1)
    writes = watch_writes()

    stopped = time.monotonic()
    stop_until_unreachable(node)
    wait_until(
        lambda: not pod_ready(plugin_pod(plane, NODE)),
        timeout=60,
        what="the node-lifecycle controller marking the device plugin's pod NotReady",
    )
    unreachable = time.monotonic() - stopped
    ready = condition(node.node(), "Ready")
    assert ready is not None and ready["status"] == "Unknown"
    assert not pod_ready(get_pod(plane, namespace, "holder-0"))
    away = writes.quiet_for(QUIET_SECONDS, what="the node went unreachable and its plugin pod NotReady")

    back = node.start_kubelet()
    node.wait_for(
        lambda: UNREACHABLE not in no_execute_taints(node.node()) and pod_ready(plugin_pod(plane, NODE)),
        what="unreachable taint removed and the device plugin's pod Ready again",
    )
    node.wait_for(functools.partial(all_devices_allocatable, node), what="every GPU allocatable")
    versions = writes.quiet_for(QUIET_SECONDS, what="the kubelet came back")
    still_running(cluster, namespace, containers)
    summary(
        "kubelet_stopped",
        f"kubelet of {NODE} stopped: unreachable, plugin pod NotReady after {unreachable:.1f} s; no gpuguard "
        f"write while away ({QUIET_SECONDS:.0f} s, {away} versions watched) nor after it came back "
        f"(Ready in {back:.1f} s; {versions} versions in all)",
    )
